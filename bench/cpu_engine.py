"""The batched CPU engine against the physical limit and against the engine it replaced, side
by side in one run on one machine, model and thread count (issue 28 a-d).

(a) raw `llama_decode` in the engine's configuration (a KV stream per sequence, no flash
    attention): B sequences with --prompt tokens each, then --gen steps of one token per
    sequence; prefill and decode tok/s for B = 1..64, and at 2K-token contexts for B = 1, 8
    (where attention, not the weights, sets the pace).
(b) the engine alone, B concurrent requests of the same shape, grammar off and on: the
    prompts first (each request's cells stay in its slot), then every request continued
    for --gen tokens; its decode tok/s against (a) at the same B. With the grammar, the
    schema's string needs 400+ characters, so no call ends early (EOS does not stop here).
(c) a real agent batch (tasks/swe.jsonl x --samples, real bash tools in the sandbox,
    grammar on) on the batched engine and on the one-at-a-time engine it replaced
    (bench/one_at_a_time.py): batch seconds, generated tok/s, the runner's own CPU time
    (the event-loop thread: gate, agents, bookkeeping, store) against the engine's busy
    time, peak RSS.
(d) the same batch with longer agents whose working set exceeds the pool (--pool-tokens
    32768), under `none`, `aimd` (the paper's law; the default until session 16), and `aimd`
    with a pool that holds everything (the no-contention reference); `--d-runs` adds
    `wset2`: batch seconds, hit rate, evictions, preemptions, recomputed tokens.

    python -m bench.cpu_engine [--parts a,b,c,d] [--out bench/results/cpu-engine/cpu-engine.json]

Every figure is measured here, each (a) and (b) figure in a process of its own; the results
file keeps them with the machine, its load and the commit, by the parts each run measured.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common.paths import CPU_ENGINE_RESULTS, ROOT
from runner.engines.llama_cpp import LlamaCppEngine, default_model_path, native
from runner.engines.llama_cpp.batch import NativeBatch
from runner.engines.protocol import SamplingParams

LONG_CALL = json.dumps({"type": "object", "required": ["name", "arguments"], "properties": {
    "name": {"type": "string", "enum": ["bash"]},
    "arguments": {"type": "object", "required": ["command"], "properties": {
        "command": {"type": "string", "minLength": 400}}}}})  # fmt: skip


def _prompt(s: int, n: int) -> list[int]:
    return [100 + (i * 7 + s * 13) % 500 for i in range(n)]


def raw(b: int, prompt: int, gen: int, threads: int) -> dict[str, float]:
    """(a): the engine's context shape, driven by hand."""
    import llama_cpp as lc

    m = native.load_model(default_model_path(),
                          native.load_choice(native.system_info(), native.cpu_flags()))  # fmt: skip
    seq = -(-(prompt + gen + 1) // 256) * 256
    cp = lc.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = seq * b, 512 + b, 512, b
    cp.kv_unified = False
    cp.flash_attn_type = lc.LLAMA_FLASH_ATTN_TYPE_DISABLED
    cp.n_threads = cp.n_threads_batch = threads
    ctx = lc.llama_init_from_model(m, cp)
    batch = NativeBatch(512 + b)
    t0 = time.perf_counter()
    for s in range(b):
        p = _prompt(s, prompt)
        for c in range(0, prompt, 512):
            part = p[c : c + 512]
            batch.fill([(t, c + i, s, c + i == prompt - 1) for i, t in enumerate(part)])
            assert lc.llama_decode(ctx, batch.struct) == 0
    prefill = b * prompt / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    for k in range(gen):
        batch.fill([(200 + s, prompt + k, s, True) for s in range(b)])
        assert lc.llama_decode(ctx, batch.struct) == 0
    decode = b * gen / (time.perf_counter() - t0)
    batch.close()
    lc.llama_free(ctx)
    lc.llama_model_free(m)
    return {"B": b, "prompt": prompt, "prefill_tok_s": round(prefill, 1),
            "decode_tok_s": round(decode, 1)}  # fmt: skip


async def engine(b: int, prompt: int, gen: int, threads: int, grammar: bool) -> dict:
    """(b): B requests' prompts (max_new_tokens 1), then each continued for `gen` tokens
    from its own cells; the second phase's generated tok/s."""
    e = LlamaCppEngine(n_ctx=prompt + gen + 64, n_threads=threads, max_seqs=b)
    eos = e.tokenizer.eos_ids
    e.tokenizer._eos = frozenset()  # a fixed output length: EOS does not end a request here
    try:
        prompts = [_prompt(s, prompt) for s in range(b)]
        first = SamplingParams(temperature=0.0, max_new_tokens=1)
        t0 = time.perf_counter()
        gs = await asyncio.gather(*[e.generate(p, first, agent=str(i))
                                    for i, p in enumerate(prompts)])  # fmt: skip
        fill = time.perf_counter() - t0
        sp = SamplingParams(temperature=0.7, max_new_tokens=gen, logprobs=True,
                            tool_call_schema=LONG_CALL if grammar else None)  # fmt: skip
        before = e.stats()
        t0 = time.perf_counter()
        again = [p + g.output_ids for p, g in zip(prompts, gs, strict=True)]
        outs = await asyncio.gather(*[e.generate(x, sp, agent=str(i)) for i, x in enumerate(again)])
        wall = time.perf_counter() - t0
        st = e.stats()
    finally:
        e.tokenizer._eos = eos
        await e.aclose()
    n = sum(g.completion_tokens for g in outs)
    assert all(g.cached_tokens == prompt for g in outs), [g.cached_tokens for g in outs]
    return {"decode_tok_s": round(n / wall, 1), "wall_s": round(wall, 3),
            "prefill_tok_s": round(b * prompt / fill, 1),
            "steps": st["steps"] - before["steps"], "ubatches": st["ubatches"] - before["ubatches"],
            "grammar_resamples": st["grammar_resamples"],
            "grammar_passes": st["grammar_passes"]}  # fmt: skip


def fresh(kind: str, args: list) -> dict:
    """(a) or (b) in a process of its own: a context created and freed earlier in the same
    process slowed the engine's decode by a quarter (measured: 130 against 174 tok/s)."""
    out = subprocess.run([sys.executable, "-m", "bench.cpu_engine", "--measure",
                          json.dumps([kind, args])],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout  # fmt: skip
    line = next(x for x in out.splitlines() if x.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


# ---- (c), (d): real batches, each in a child process ----------------------------------------


def one(spec: dict) -> None:
    """In the child: run.py's main in this (the event loop's) thread, with the batched engine
    or the one-at-a-time baseline; then this thread's CPU seconds, less those the engine's
    constructor spent in it (llama.cpp clears the KV it allocates: engine work)."""
    mod: Any
    if spec["engine"] == "one-at-a-time":
        from bench import one_at_a_time

        mod, run_main = one_at_a_time, one_at_a_time.main
    else:
        from runner.cli.main import main as run_main
        from runner.engines.llama_cpp import engine as batched

        mod = batched
    init = mod.LlamaCppEngine.__init__
    spent = [0.0]

    def timed_init(self: object, *args: object, **kw: object) -> None:
        c = time.thread_time()
        init(self, *args, **kw)
        spent[0] += time.thread_time() - c

    mod.LlamaCppEngine.__init__ = timed_init
    c0 = time.thread_time()
    rc = run_main(spec["argv"])
    cpu = time.thread_time() - c0 - spent[0]
    Path(spec["result"]).write_text(json.dumps({"rc": rc, "loop_cpu_s": cpu, "init_s": spent[0]}))


def batch(name: str, engine_kind: str, argv: list[str], tmp: Path) -> dict:
    out = tmp / name
    res = tmp / f"{name}.json"
    spec = {"engine": engine_kind, "argv": [*argv, "--out", str(out), "--quiet"],
            "result": str(res)}  # fmt: skip
    t0 = time.perf_counter()
    p = subprocess.Popen([sys.executable, "-m", "bench.cpu_engine", "--one", json.dumps(spec)],
                         cwd=ROOT)  # fmt: skip
    _, status, usage = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    child = json.loads(res.read_text()) if res.is_file() else {"rc": status}
    s = json.loads((out / "summary.json").read_text())
    st = s["engine"].get("stats") or {}
    busy = st.get("busy_seconds")
    gen = s["generated_tokens"]
    row = {
        "run": name, "engine": engine_kind, "rc": child["rc"], "agents": s["finished"],
        "steps": s["steps"], "batch_s": round(s["batch_seconds"], 1),
        "process_wall_s": round(wall, 1), "generated_tokens": gen,
        "generated_tok_s": round(gen / s["batch_seconds"], 1), "hit_rate": s["hit_rate"],
        "peak_rss_mib": round(usage.ru_maxrss / 1024),
        "loop_cpu_s": round(child.get("loop_cpu_s", float("nan")), 2),
        "engine_init_cpu_s": round(child.get("init_s", float("nan")), 2),
        "engine_busy_s": busy,
        "loop_cpu_over_busy": round(child["loop_cpu_s"] / busy, 4) if busy else None,
        "gate": {k: s["gate"].get(k) for k in ("policy", "window", "pauses", "resumes")},
    }  # fmt: skip
    for k in ("evictions", "evicted_cells", "preemptions", "recomputed_tokens",
              "copied_tokens", "grammar_resamples", "grammar_passes", "pool_tokens", "max_seqs",
              "ubatches", "steps", "prefill_tokens", "decode_tokens", "cached_tokens"):  # fmt: skip
        if k in st:
            row[f"engine_{k}"] = st[k]
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--parts", default="a,b,c,d")
    p.add_argument("--batches", default="1,2,4,8,16,32,64")
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--gen", type=int, default=32)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--samples", type=int, default=7, help="(c), (d): agents per swe.jsonl task")
    p.add_argument("--steps-c", type=int, default=5, help="(c): --max-steps")
    p.add_argument("--steps-d", type=int, default=8, help="(d): --max-steps")
    p.add_argument(
        "--d-runs",
        default="none,aimd,reference",
        help="(d): which runs: none, aimd, wset2 on the small pool, reference (aimd, 4x pool)",
    )
    p.add_argument("--out", type=Path, default=CPU_ENGINE_RESULTS / "cpu-engine.json")
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--measure", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.one:
        return one(json.loads(a.one))
    if a.measure:
        kind, args = json.loads(a.measure)
        r = raw(*args) if kind == "raw" else asyncio.run(engine(*args))
        print("RESULT " + json.dumps(r), flush=True)
        return None
    parts = set(a.parts.split(","))
    res: dict = {"meta": {
        "machine": native.cpu_model(), "threads": a.threads, "cores": os.cpu_count(),
        "llama_cpp_python": native.package_version(),
        "load": native.load_choice(native.system_info(), native.cpu_flags()).why,
        "date": time.strftime("%Y-%m-%d %H:%M"), "load_avg_start": os.getloadavg()}}  # fmt: skip
    if "a" in parts:
        shapes = [(b, a.prompt) for b in map(int, a.batches.split(","))] + [(1, 2048), (8, 2048)]
        rows = [fresh("raw", [b, n, a.gen, a.threads]) for b, n in shapes]
        for r in rows:
            print(json.dumps(r), flush=True)
        res["a_raw"] = rows
    if "b" in parts:
        limit = {r["B"]: r for r in res.get("a_raw", []) if r["prompt"] == a.prompt}
        rows = []
        for b in (8, 16, 32):
            for g in (False, True):
                r = {"B": b, "grammar": g, **fresh("engine", [b, a.prompt, a.gen, a.threads, g])}
                if b in limit:
                    r["raw_decode_tok_s"] = limit[b]["decode_tok_s"]
                    r["ratio"] = round(r["decode_tok_s"] / limit[b]["decode_tok_s"], 3)
                print(json.dumps(r), flush=True)
                rows.append(r)
        res["b_engine"] = rows
    tmp = Path(tempfile.mkdtemp(prefix="cpu-engine-"))
    swe = ["--tasks", "swe.jsonl", "--samples", str(a.samples), "--engine", "llama.cpp",
           "--threads", str(a.threads)]  # fmt: skip
    try:
        if "c" in parts:
            argv = [*swe, "--max-steps", str(a.steps_c)]
            res["c_batch"] = [batch("c-batched", "batched", argv, tmp),
                              batch("c-one-at-a-time", "one-at-a-time", argv, tmp)]  # fmt: skip
        if "d" in parts:
            # 32 slots of 4096 cells allocated (131,072); the pool holds a quarter of it
            argv = [*swe, "--max-steps", str(a.steps_d), "--n-ctx", "4096", "--max-seqs", "32"]
            small = [*argv, "--pool-tokens", "32768"]
            runs = {
                "none": ("d-none", [*small, "--policy", "none"]),
                "aimd": ("d-aimd", [*small, "--policy", "aimd"]),
                # wset2 with the resume rule it is run with everywhere (docs/policies.md)
                "wset2": ("d-wset2", [*small, "--policy", "wset2", "--resume-rule", "newest"]),
                "reference": ("d-reference", [*argv, "--policy", "aimd"]),
            }
            res["d_pool"] = [
                batch(runs[k][0], "batched", runs[k][1], tmp) for k in a.d_runs.split(",")
            ]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    res["meta"]["load_avg_end"] = os.getloadavg()
    res["meta"]["peak_rss_self_mib"] = round(
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    )
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()  # fmt: skip
    res["meta"]["commit"] = commit
    a.out.parent.mkdir(parents=True, exist_ok=True)
    old = json.loads(a.out.read_text()) if a.out.is_file() else {}
    # parts run separately keep the meta of the run that measured them
    meta = {**old.get("meta_by_parts", {}), ",".join(sorted(parts)): res.pop("meta")}
    a.out.write_text(json.dumps({**old, **res, "meta_by_parts": meta}, indent=1) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
