"""The start-up self-check of the native engine: one tiny decode in a child process.

A native crash (SIGSEGV in a kernel, SIGILL from a wheel built for another CPU) kills the
process it happens in, so the batch cannot catch it. The runner first loads the model and
decodes a few tokens in a child, the same way the engine will (the same load choice, a KV
stream per sequence, no flash attention, eight sequences in one batch); if the child dies of
a signal, the run stops before it writes anything, with what crashed, the build, the CPU
and the command that fixes it. A check that passed is remembered (keyed by the native
library's files, the model file and the interpreter), so a rerun on the same install costs
nothing.

Run as `python -m runner.engines.llama_cpp.selfcheck --model PATH [--measure]`: the child
prints one JSON line per stage (import, load, decode, ok); the parent reads the last one.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..protocol import EngineError
from . import native


class NativeEngineCrash(EngineError):
    """The native llama.cpp library crashed (or failed) in the self-check."""


@dataclass(frozen=True)
class SelfCheck:
    version: str
    system_info: str
    load: str  # the load choice and why
    seconds: float
    cached: bool
    prefill_tok_s: float | None = None  # with --measure
    decode_tok_s: float | None = None  # one sequence
    decode_batch_tok_s: float | None = None  # eight sequences in one batch


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "concur-runner"


def _fingerprint(model: Path, threads: int) -> str | None:
    """What a passed check depends on: the native library's files, the model file, the
    interpreter. None where the library cannot be found (the check then always runs)."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        return None
    pkg = Path(next(iter(spec.submodule_search_locations)))
    parts = [sys.executable, str(threads), native.features_line(native.cpu_flags())]
    for f in sorted([*pkg.glob("lib/*"), *pkg.glob("*.so*"), model]):
        try:
            st = f.stat()
        except OSError:
            continue
        parts.append(f"{f}:{st.st_size}:{st.st_mtime_ns}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:24]


def run_selfcheck(
    model: Path, threads: int, *, measure: bool = False, timeout: float = 300.0,
    use_cache: bool = True, python: str | None = None,
) -> SelfCheck:  # fmt: skip
    """Load `model` and decode in a child process; NativeEngineCrash with the whole story
    if the child dies or fails. `measure`: also time prefill and decode (doctor)."""
    key = _fingerprint(model, threads) if use_cache and not measure else None
    memo = cache_dir() / f"selfcheck-{key}.json" if key else None
    if memo is not None and memo.is_file():
        try:
            return SelfCheck(**{**json.loads(memo.read_text()), "cached": True})
        except (ValueError, TypeError):
            pass  # an unreadable memo: check again
    cmd = [python or sys.executable, "-m", __name__, "--model", str(model)]
    cmd += ["--threads", str(threads), *(["--measure"] if measure else [])]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as e:
        raise NativeEngineCrash(
            f"the llama.cpp self-check did not finish in {timeout:.0f} s (a hung native "
            f"library?); stage reached: {_last(_out(e.stdout)).get('stage', 'start')}"
        ) from None
    lines = _lines(p.stdout)
    last = lines[-1] if lines else {}
    info = next((x for x in lines if "system_info" in x), {})
    if p.returncode != 0 or last.get("stage") != "ok":
        raise NativeEngineCrash(crash_message(p.returncode, last, info, p.stderr, model))
    check = SelfCheck(
        version=str(info.get("version")),
        system_info=str(info.get("system_info")),
        load=str(info.get("load")),
        seconds=round(time.perf_counter() - t0, 3),
        cached=False,
        prefill_tok_s=last.get("prefill_tok_s"),
        decode_tok_s=last.get("decode_tok_s"),
        decode_batch_tok_s=last.get("decode_batch_tok_s"),
    )
    if memo is not None:
        try:
            memo.parent.mkdir(parents=True, exist_ok=True)
            tmp = memo.with_suffix(".tmp")
            tmp.write_text(json.dumps({**check.__dict__, "cached": False}))
            tmp.replace(memo)
        except OSError:
            pass  # a read-only home: the check runs again next time
    return check


def _out(data: Any) -> str:
    return data.decode("utf-8", "replace") if isinstance(data, bytes) else (data or "")


def _lines(stdout: str) -> list[dict[str, Any]]:
    out = []
    for line in stdout.splitlines():
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict):
            out.append(obj)
    return out


def _last(stdout: str) -> dict[str, Any]:
    lines = _lines(stdout)
    return lines[-1] if lines else {}


def crash_message(
    returncode: int, last: dict[str, Any], info: dict[str, Any], stderr: str, model: Path
) -> str:
    """What crashed, where, the library and its build, the CPU, and the fix."""
    stage = {"import": "importing llama_cpp", "load": f"loading {model.name}",
             "decode": "decoding"}.get(str(last.get("stage")), "starting")  # fmt: skip
    flags = native.cpu_flags()
    version = info.get("version") or native.package_version() or "not installed"
    build = info.get("system_info") or "unknown (the child died before it could print it)"
    cpu = f"{native.cpu_model()} ({native.features_line(flags)})"
    if returncode < 0:
        sig = -returncode
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        fix = native.rebuild_command("native" if sig == signal.SIGILL else "portable")
        why = (
            "an instruction this CPU does not have: the wheel was built for another CPU"
            if sig == signal.SIGILL
            else "a fault inside llama.cpp's CPU kernels"
        )
        head = f"the native llama.cpp library crashed ({name}) while {stage}: {why}"
    else:
        tail = " | ".join(stderr.strip().splitlines()[-3:]) or "no message"
        head = f"the llama.cpp self-check failed while {stage} (exit {returncode}): {tail}"
        fix = native.rebuild_command("native")
    return (
        f"{head}. llama-cpp-python {version}; build: {build}; load: "
        f"{info.get('load', 'n/a')}; CPU: {cpu}. Nothing was written. Fix: {fix} (about 5 "
        "minutes on 2 cores), then `python run.py doctor`"
    )


# ---- the child ------------------------------------------------------------------------------


def _say(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def _child(model: Path, threads: int, measure: bool) -> None:
    _say(stage="import")
    import llama_cpp  # the first native code that runs: a SIGILL in it happens here

    from .batch import NativeBatch

    info = native.system_info()
    choice = native.load_choice(info, native.cpu_flags())
    _say(stage="load", version=llama_cpp.__version__, system_info=info, load=choice.why)
    m = native.load_model(model, choice)
    cp = llama_cpp.llama_context_default_params()
    # as the engine builds its context: a KV stream per sequence, no flash attention
    cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = 8 * 256, 512, 512, 8
    cp.kv_unified = False
    cp.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
    cp.n_threads = cp.n_threads_batch = threads
    ctx = llama_cpp.llama_init_from_model(m, cp)
    if not ctx:
        raise RuntimeError("llama.cpp could not create a context")
    _say(stage="decode")
    batch = NativeBatch(512)
    n_prompt = 128 if measure else 16
    prompt = [(10 + i % 90) for i in range(n_prompt)]
    t0 = time.perf_counter()
    batch.fill([(t, i, 0, i == n_prompt - 1) for i, t in enumerate(prompt)])
    _decode(llama_cpp, ctx, batch)
    prefill = n_prompt / (time.perf_counter() - t0)
    # the shape every engine step has: several sequences, one token each, in one batch
    mem = llama_cpp.llama_get_memory(ctx)
    for s in range(1, 8):  # between streams llama.cpp copies whole streams
        llama_cpp.llama_memory_seq_cp(mem, 0, s, -1, -1)
    steps = 16 if measure else 2
    t0 = time.perf_counter()
    for k in range(steps):
        batch.fill([(42, n_prompt + k, 0, True)])
        _decode(llama_cpp, ctx, batch)
    single = steps / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    for k in range(steps):
        batch.fill([(42, n_prompt + (steps if s == 0 else 0) + k, s, True) for s in range(8)])
        _decode(llama_cpp, ctx, batch)
    batched = 8 * steps / (time.perf_counter() - t0)
    llama_cpp.llama_free(ctx)
    llama_cpp.llama_model_free(m)
    if measure:
        _say(stage="ok", prefill_tok_s=round(prefill, 1), decode_tok_s=round(single, 1),
             decode_batch_tok_s=round(batched, 1))  # fmt: skip
    else:
        _say(stage="ok")


def _decode(llama_cpp: Any, ctx: Any, batch: Any) -> None:
    rc = llama_cpp.llama_decode(ctx, batch.struct)
    if rc != 0:
        raise RuntimeError(f"llama_decode returned {rc}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m runner.engines.llama_cpp.selfcheck")
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--threads", type=int, default=max(1, os.cpu_count() or 1))
    p.add_argument("--measure", action="store_true")
    a = p.parse_args(argv)
    _child(a.model, a.threads, a.measure)
    return 0


if __name__ == "__main__":
    sys.exit(main())
