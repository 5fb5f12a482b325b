"""The native engine's safety net without the model: the load choice per CPU and build, the
pool's books under random traffic, and the self-check against a child that really crashes."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from runner.engines.llama_cpp import native
from runner.engines.llama_cpp.pool import Pool, common_prefix, runs
from runner.engines.llama_cpp.selfcheck import NativeEngineCrash, run_selfcheck

ROOT = Path(__file__).resolve().parents[2]
AMX_BUILD = "CPU : SSE3 = 1 | AVX2 = 1 | AVX512 = 1 | AMX_INT8 = 1 | REPACK = 1 |"
PLAIN_BUILD = "CPU : SSE3 = 1 | AVX2 = 1 | FMA = 1 | REPACK = 1 |"


def test_extra_buffer_types_are_off_only_where_amx_meets_an_amx_build():
    amx_cpu = frozenset({"avx2", "avx512f", "amx_tile", "amx_int8"})
    plain_cpu = frozenset({"avx2", "fma"})
    assert not native.load_choice(AMX_BUILD, amx_cpu).use_extra_bufts
    assert "20824" in native.load_choice(AMX_BUILD, amx_cpu).why
    assert native.load_choice(AMX_BUILD, plain_cpu).use_extra_bufts
    assert native.load_choice(PLAIN_BUILD, amx_cpu).use_extra_bufts
    assert native.load_choice(PLAIN_BUILD, plain_cpu).use_extra_bufts
    assert native.build_features(AMX_BUILD)["AMX_INT8"] == "1"


def test_cpu_flags_and_the_rebuild_commands():
    info = "processor : 0\nmodel name : Some Xeon\nflags : fpu avx2 amx_int8\n"
    assert native.cpu_flags(info) == {"fpu", "avx2", "amx_int8"}
    assert native.cpu_model(info) == "Some Xeon"
    assert "-avx512f" in native.features_line(frozenset({"avx2"}))
    pin = f"llama-cpp-python=={native.PINNED_VERSION}"
    assert native.rebuild_command("portable").startswith('CMAKE_ARGS="-DGGML_NATIVE=OFF" pip')
    assert "--no-cache-dir --force-reinstall" in native.rebuild_command("native")
    assert native.rebuild_command("native").endswith(pin)


def test_the_pins_agree():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert f"llama-cpp-python=={native.PINNED_VERSION}" in deps
    lock = (ROOT / "constraints.txt").read_text().splitlines()
    assert f"llama-cpp-python=={native.PINNED_VERSION}" in lock
    assert all("==" in x for x in lock if x and not x.startswith("#"))


def test_common_prefix():
    assert common_prefix([1, 2, 3, 4], [1, 2, 9]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([], [1]) == 0 and common_prefix([5], [6]) == 0
    a = list(range(1000))
    assert common_prefix(a, [*a[:777], -1]) == 777


def test_the_pool_never_over_commits_under_random_traffic():
    """Random arrivals, prefix copies, turns, truncations, evictions and cancellations on a
    tiny pool: after every change the cells in use equal what the slots hold (counted
    afresh), never exceed the capacity or a slot's stream, and a change that would is
    refused without touching the books."""
    rng = random.Random(7)
    pool = Pool(200, 6, 64)
    refused = 0
    for _ in range(3000):
        s = rng.choice(pool.slots)
        op = rng.random()
        before = pool.used
        if op < 0.35:  # decode or prefill some tokens
            k = rng.randint(1, 12)
            try:
                pool.extend(s, [rng.randint(0, 3) for _ in range(k)])
                s.state = "busy"
            except RuntimeError:
                refused += 1
                assert pool.used == before
                assert k > pool.free or len(s.tokens) + k > pool.slot_cells
        elif op < 0.55:  # copy a prefix of another slot
            src = rng.choice(pool.slots)
            if src is not s and src.tokens:
                n = rng.randint(1, len(src.tokens))
                if n <= pool.free + len(s.tokens):
                    pool.copy(src, s, n)
                    assert s.tokens == src.tokens[:n]
                    s.state = "busy"
        elif op < 0.8:  # a turn keeps part of its context
            pool.truncate(s, rng.randint(0, len(s.tokens)))
        else:  # evicted or cancelled: all cells go
            freed = pool.freed_by_clearing(s)
            pool.truncate(s, 0)
            assert before - pool.used == freed
            s.state = "free"
        if s.state != "free" and not s.tokens:
            s.state = "free"
        pool.check()
        assert pool.used == sum(len(x.tokens) for x in pool.slots)
        assert pool.held_by_busy() <= pool.used <= pool.capacity
    assert refused > 0  # the pool was driven full


def test_runs_of_consecutive_sequence_ids():
    assert runs([]) == 0 and runs([3]) == 1
    assert runs([0, 1, 2, 3]) == 1 and runs([0, 2, 3, 7]) == 3


def _fake_llama(tmp_path: Path, body: str) -> dict[str, str]:
    """An importable `llama_cpp` whose import runs `body` (a real crash, in the child)."""
    pkg = tmp_path / "fake" / "llama_cpp"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(body)
    return {"PYTHONPATH": f"{pkg.parent}:{ROOT}", "XDG_CACHE_HOME": str(tmp_path / "cache")}


SEGV = "import ctypes\nctypes.string_at(0)\n"


def test_a_child_that_really_segfaults_is_a_clear_message(tmp_path, monkeypatch):
    for k, v in _fake_llama(tmp_path, SEGV).items():
        monkeypatch.setenv(k, v)
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    with pytest.raises(NativeEngineCrash) as e:
        run_selfcheck(model, 1)
    msg = str(e.value)
    assert "crashed (SIGSEGV)" in msg and "importing llama_cpp" in msg
    assert "CPU:" in msg and "Nothing was written" in msg
    assert native.rebuild_command("portable") in msg


def test_run_py_stops_before_writing_anything_when_the_child_crashes(tmp_path):
    env = {**_fake_llama(tmp_path, SEGV), "PATH": "/usr/bin:/bin"}
    tasks = tmp_path / "t.jsonl"
    tasks.write_text(json.dumps({"id": "a", "prompt": "p"}) + "\n")
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    out = tmp_path / "out"
    p = subprocess.run(
        [sys.executable, str(ROOT / "run.py"), "--tasks", str(tasks), "--out", str(out),
         "--engine", "llama.cpp", "--model", str(model), "--sandbox", "none"],
        capture_output=True, text=True, env=env, timeout=120, check=False,
    )  # fmt: skip
    assert p.returncode == 2, p.stderr
    assert "the native llama.cpp library crashed (SIGSEGV)" in p.stderr
    assert "pip install --no-cache-dir --force-reinstall" in p.stderr
    assert not out.exists()


def test_a_failing_child_says_why(tmp_path, monkeypatch):
    for k, v in _fake_llama(tmp_path, "raise ImportError('no such symbol llama_x')\n").items():
        monkeypatch.setenv(k, v)
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    with pytest.raises(NativeEngineCrash, match=r"failed while importing llama_cpp .*llama_x"):
        run_selfcheck(model, 1)


@pytest.mark.slow
def test_the_real_check_passes_and_is_remembered(tmp_path, monkeypatch):
    pytest.importorskip("llama_cpp")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    model = native.default_model_path()
    first = run_selfcheck(model, 2)
    assert not first.cached and "CPU" in first.system_info
    assert run_selfcheck(model, 2).cached
    m = run_selfcheck(model, 2, measure=True)
    assert m.decode_tok_s and m.decode_batch_tok_s and m.prefill_tok_s
