"""The batched CPU engine against the physical limit, side by side in one run (issue 28 a, b).

(a) raw `llama_decode` on the same model, threads and context shape as the engine (one
unified KV pool of --pool cells, n_seq_max 64): B sequences prefilled with --prompt tokens,
then steps of one token per sequence; decode and prefill tok/s.
(b) the engine alone: B concurrent synthetic requests (a --prompt-token prompt, exactly --out
generated tokens: EOS is not a stop here), grammar off and on; generated tok/s and its ratio
to (a) at the same B.

    python bench/cpu_engine.py [--batches 1,8,16,32] [--out bench/results/cpu-engine.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path

from runner.engine import SamplingParams
from runner.engines.llama_cpp import LlamaCppEngine, default_model_path, native
from runner.engines.llama_cpp.batch import NativeBatch

SCHEMA = json.dumps({"type": "object", "required": ["name", "arguments"], "properties": {
    "name": {"type": "string", "enum": ["bash", "submit"]},
    "arguments": {"type": "object", "properties": {"command": {"type": "string"}}}}})  # fmt: skip


def raw(b: int, prompt: int, out: int, pool: int, threads: int) -> dict[str, float]:
    import llama_cpp as lc

    m = native.load_model(default_model_path(),
                          native.load_choice(native.system_info(), native.cpu_flags()))  # fmt: skip
    cp = lc.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = pool, 576, 512, 64
    cp.kv_unified = True
    cp.n_threads = cp.n_threads_batch = threads
    ctx = lc.llama_init_from_model(m, cp)
    batch = NativeBatch(576)
    t0 = time.perf_counter()
    for s in range(b):
        batch.fill([(100 + (i * 7 + s) % 500, i, s, i == prompt - 1) for i in range(prompt)])
        assert lc.llama_decode(ctx, batch.struct) == 0
    prefill = b * prompt / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    for k in range(out):
        batch.fill([(200 + s, prompt + k, s, True) for s in range(b)])
        assert lc.llama_decode(ctx, batch.struct) == 0
    decode = b * out / (time.perf_counter() - t0)
    batch.close()
    lc.llama_free(ctx)
    lc.llama_model_free(m)
    return {"prefill_tok_s": round(prefill, 1), "decode_tok_s": round(decode, 1)}


async def engine(b: int, prompt: int, out: int, pool: int, threads: int, grammar: bool):
    e = LlamaCppEngine(n_ctx=4096, n_threads=threads, pool_tokens=pool, max_seqs=16)
    eos = e.tokenizer.eos_ids
    e.tokenizer._eos = frozenset()  # a fixed output length: EOS does not end a request here
    try:
        prompts = [[100 + (i * 7 + s) % 500 for i in range(prompt)] for s in range(b)]
        sp = SamplingParams(temperature=0.7, max_new_tokens=out, logprobs=True,
                            tool_call_schema=SCHEMA if grammar else None)  # fmt: skip
        t0 = time.perf_counter()
        gs = await asyncio.gather(*[e.generate(p, sp, agent=str(i)) for i, p in enumerate(prompts)])
        wall = time.perf_counter() - t0
        st = e.stats()
    finally:
        e.tokenizer._eos = eos
        await e.aclose()
    gen = sum(g.completion_tokens for g in gs)
    return {"generated_tok_s": round(gen / wall, 1), "wall_s": round(wall, 3),
            "steps": st["steps"], "busy_s": st["busy_seconds"]}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,8,16,32")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--gen", type=int, default=32)
    p.add_argument("--pool", type=int, default=16384)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--out", type=Path, default=Path("bench/results/cpu-engine.json"))
    a = p.parse_args()
    rows = []
    for b in [int(x) for x in a.batches.split(",")]:
        r = raw(b, a.prompt, a.gen, a.pool, a.threads)
        free = asyncio.run(engine(b, a.prompt, a.gen, a.pool, a.threads, False))
        gram = asyncio.run(engine(b, a.prompt, a.gen, a.pool, a.threads, True))
        # the engine's tok/s includes its prefill; the limit for the same work is the raw
        # prefill and decode times added
        limit = b * a.gen / (b * a.prompt / r["prefill_tok_s"] + b * a.gen / r["decode_tok_s"])
        row = {"B": b, "raw": r, "raw_same_work_tok_s": round(limit, 1), "engine": free,
               "engine_grammar": gram,
               "ratio": round(free["generated_tok_s"] / limit, 3),
               "ratio_grammar": round(gram["generated_tok_s"] / limit, 3)}  # fmt: skip
        print(json.dumps(row), flush=True)
        rows.append(row)
    meta = {"machine": native.cpu_model(), "threads": a.threads, "prompt": a.prompt,
            "gen": a.gen, "pool": a.pool, "llama_cpp_python": native.package_version(),
            "load": native.load_choice(native.system_info(), native.cpu_flags()).why,
            "date": time.strftime("%Y-%m-%d %H:%M"), "load_avg": os.getloadavg()}  # fmt: skip
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
