"""Check the SGLang adapter against a real SGLang engine on a GPU machine.

    python -m bench.sglang_check --model /path/to/Qwen2.5-0.5B-Instruct [--agents 16 --steps 4]

Runs a small synthetic batch through runner.engines.sglang.SGLangEngine, no sandbox and no
tools: N agents chat concurrently for S steps, each turn appending the engine's output ids
and a synthetic observation (token in, token out, as the agent loop does), so every prompt
extends the previous one. It prints and saves U (sampled cache_stats().usage, per DP rank),
H (cached / prompt tokens, per step), the reuse of each agent's previous prompt+reply on
steps >= 2, and throughput; then a few requests with constrained tool calls (the runner's
tool-call schema as an xgrammar structural tag) must each reply with one parseable call.
Exit status: 0 all checks passed, 1 a check failed, 2 SGLang or
a CUDA GPU is not available here (nothing was run).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench.common.paths import SGLANG_RESULTS
from runner.chat.template import turn_delta
from runner.chat.toolcall import ParseError, parse_tool_call
from runner.engines.protocol import SamplingParams
from runner.engines.sglang import SGLangEngine, parse_engine_args, sglang_available
from tools.core import call_schema, schema
from tools.registry import get_tools

SYSTEM = (
    "You are a careful software engineering agent working in a repository. "
    "Read the observations, think briefly and answer with one short next action. "
) * 8  # a shared system prompt every agent starts with (a cross-agent prefix hit)


def observation(agent: int, step: int, chars: int) -> str:
    """A deterministic, agent-specific tool output of about `chars` characters."""
    lines, i = [], 0
    while sum(len(x) + 1 for x in lines) < chars:
        lines.append(f"src/module_{agent}_{step}_{i}.py: {(agent * 7919 + step * 31 + i) % 997} ok")
        i += 1
    return "\n".join(lines)


async def run_agent(
    engine: SGLangEngine, index: int, steps: int, obs_chars: int, sp: SamplingParams
) -> list[dict[str, Any]]:
    tok = engine.tokenizer
    key = f"agent-{index}"
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"Task {index}: list the files and fix the failing test."},
    ]
    ids = tok.encode(tok.render(messages, None, add_generation_prompt=True))
    records: list[dict[str, Any]] = []
    reusable = 0  # tokens of this agent's previous prompt + reply, all in `ids`
    try:
        for step in range(1, steps + 1):
            gen = await engine.generate(ids, sp, agent=key)
            records.append(
                {
                    "agent": key,
                    "step": step,
                    "prompt": gen.prompt_tokens,
                    "sent": len(ids),
                    "cached": gen.cached_tokens,
                    "cached_host": gen.cached_host_tokens,
                    "reusable": reusable,
                    "completion": gen.completion_tokens,
                    "seconds": gen.seconds,
                    "finish": gen.finish_reason,
                    "stopped_on_eos": gen.stopped_on_eos,
                    "rank": engine.rank_of(key),
                }
            )
            ids = ids + gen.output_ids
            reusable = len(ids)
            eos_text = tok.token_text(gen.output_ids[-1]) if gen.stopped_on_eos else ""
            delta = turn_delta(
                lambda m, g: tok.render(m, None, add_generation_prompt=g),
                "user",
                observation(index, step, obs_chars),
                eos_text,
            )
            ids = ids + tok.encode(delta)
    finally:
        await engine.end_agent(key)
    return records


async def sample_usage(engine: SGLangEngine, out: list[dict[str, Any]], period: float) -> None:
    t0 = time.monotonic()
    while True:
        s = engine.cache_stats()
        out.append(
            {
                "t": round(time.monotonic() - t0, 3),
                "usage": s.usage,
                "rank_usage": s.extra.get("rank_usage"),
            }
        )
        await asyncio.sleep(period)


async def main_async(engine: SGLangEngine, args: argparse.Namespace) -> dict[str, Any]:
    sp = SamplingParams(temperature=0.0, top_p=1.0, max_new_tokens=args.max_new_tokens)
    samples: list[dict[str, Any]] = []
    sampler = asyncio.create_task(sample_usage(engine, samples, args.sample_period))
    t0 = time.monotonic()
    try:
        per_agent = await asyncio.gather(
            *(run_agent(engine, i, args.steps, args.obs_chars, sp) for i in range(args.agents))
        )
        wall = time.monotonic() - t0
        sampler.cancel()
        constrained = await constrained_calls(engine, args.constrained)
    finally:
        sampler.cancel()
        final = engine.cache_stats()
        await engine.aclose()  # no tool processes here: shutdown() may kill the tree
    recs = [r for agent in per_agent for r in agent]
    report = summarize(recs, samples, final.extra, wall, args)
    report["constrained_calls"] = constrained
    # a reply cut by max_new_tokens is not a format failure: the grammar leaves strings free
    ok = all(c["parsed"] or c["finish"] == "length" for c in constrained)
    ok = ok and any(c["parsed"] for c in constrained)
    report["checks"]["constrained_replies_are_one_valid_call"] = ok
    report["ok"] = report["ok"] and ok
    return report


async def constrained_calls(engine: SGLangEngine, n: int) -> list[dict[str, Any]]:
    """n requests under the runner's tool-call constraint; each reply must parse as exactly
    one call of a known tool (temperature 1.0, so the grammar, not the model, does it). A
    request that fails (e.g. SGLang refuses the structural tag) is recorded, not raised, so
    the measurements above are still written."""
    tools = get_tools(["bash", "submit"])
    tok = engine.tokenizer
    sp = SamplingParams(
        temperature=1.0,
        max_new_tokens=512,
        seed=0,
        tool_call_schema=json.dumps(call_schema(tools)),
    )
    out = []
    for i in range(n):
        messages = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Request {i}: list the repository's files."},
        ]
        text = tok.render(messages, [schema(t) for t in tools.values()], True)
        try:
            gen = await engine.generate(tok.encode(text), sp)
        except Exception as e:  # reported in the check; the measurements above are kept
            out.append({"text": "", "finish": "error", "parsed": False, "call": repr(e)})
            continue
        try:
            call = parse_tool_call(gen.text, set(tools))
            parsed, detail = True, call.name
        except ParseError as e:
            parsed, detail = False, str(e)
        out.append(
            {"text": gen.text, "finish": gen.finish_reason, "parsed": parsed, "call": detail}
        )
    return out


def summarize(
    recs: list[dict[str, Any]],
    samples: list[dict[str, Any]],
    extra: dict[str, Any],
    wall: float,
    args: argparse.Namespace,
) -> dict[str, Any]:
    prompt = sum(r["prompt"] for r in recs)
    cached = sum(r["cached"] for r in recs)
    gen_tokens = sum(r["completion"] for r in recs)
    by_step = {}
    for step in range(1, args.steps + 1):
        rs = [r for r in recs if r["step"] == step]
        p = sum(r["prompt"] for r in rs)
        by_step[step] = round(sum(r["cached"] for r in rs) / p, 4) if p else None
    later = [r for r in recs if r["step"] >= 2 and r["reusable"]]
    reuse = [min(r["cached"], r["reusable"]) / r["reusable"] for r in later]
    usages = [s["usage"] for s in samples if s["usage"] is not None]
    ranks: dict[int, float] = {}
    for s in samples:
        for i, u in enumerate(s["rank_usage"] or []):
            if u is not None:
                ranks[i] = max(ranks.get(i, 0.0), u)
    checks = {
        "all_requests_finished": len(recs) == args.agents * args.steps,
        "prompt_tokens_match_ids_sent": all(r["prompt"] == r["sent"] for r in recs),
        "usage_was_read": bool(usages) or extra.get("usage_source") == "unavailable",
        f"reuse_on_steps_2plus>={args.min_reuse}": (
            bool(reuse) and statistics.mean(reuse) >= args.min_reuse
        ),
        "dp_ranks_respected": extra.get("dp_rank_mismatch", 0) == 0,
        "sessions_all_closed": extra.get("sessions_open", 0) == 0,
    }
    return {
        "agents": args.agents,
        "steps": args.steps,
        "requests": len(recs),
        "wall_seconds": round(wall, 3),
        "throughput": {
            "generated_tokens_per_s": round(gen_tokens / wall, 2) if wall else None,
            "prompt_tokens_per_s": round(prompt / wall, 2) if wall else None,
            "requests_per_s": round(len(recs) / wall, 3) if wall else None,
        },
        "H": {
            "overall": round(cached / prompt, 4) if prompt else None,
            "by_step": by_step,
            "reuse_steps_2plus_mean": round(statistics.mean(reuse), 4) if reuse else None,
            "reuse_steps_2plus_min": round(min(reuse), 4) if reuse else None,
            "host_cached_tokens": sum(r["cached_host"] for r in recs),
        },
        "U": {
            "samples": len(samples),
            "read": len(usages),
            "max": max(usages) if usages else None,
            "mean": round(statistics.mean(usages), 4) if usages else None,
            "per_rank_max": ranks,
        },
        "finish": {
            "stop": sum(r["finish"] == "stop" for r in recs),
            "length": sum(r["finish"] == "length" for r in recs),
            "stopped_on_eos": sum(r["stopped_on_eos"] for r in recs),
        },
        "engine_extra": extra,
        "checks": checks,
        "ok": all(checks.values()),
        "requests_detail": recs,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="Hugging Face model name or local path (required)")
    p.add_argument("--agents", type=int, default=16)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--obs-chars", type=int, default=1200, help="observation size per turn")
    p.add_argument("--tp-size", type=int)
    p.add_argument("--dp-size", type=int)
    p.add_argument("--mem-fraction-static", type=float)
    p.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--sessions", action="store_true", help="one session per agent")
    p.add_argument("--priority", help="'fifo' or an int")
    p.add_argument("--min-reuse", type=float, default=0.9)
    p.add_argument("--constrained", type=int, default=4, help="constrained tool-call requests")
    p.add_argument("--sample-period", type=float, default=0.25)
    p.add_argument("--out", type=Path, default=SGLANG_RESULTS / "sglang_check.json")
    args = p.parse_args(argv)

    ok, why = sglang_available()
    if not ok:
        print(f"sglang_check: not run: {why}. It needs a CUDA GPU with SGLang.", file=sys.stderr)
        return 2
    if not args.model:
        p.error("--model is required")
    priority: int | str | None = args.priority
    if priority not in (None, "fifo"):
        priority = int(priority)
    t0 = time.monotonic()
    engine = SGLangEngine(
        args.model,
        tp_size=args.tp_size,
        dp_size=args.dp_size,
        mem_fraction_static=args.mem_fraction_static,
        engine_args=parse_engine_args(args.engine_arg),
        sessions=args.sessions,
        priority=priority,
    )
    startup = time.monotonic() - t0
    report = asyncio.run(main_async(engine, args))
    report["startup_seconds"] = round(startup, 1)
    report["model"] = args.model
    report["server_args"] = engine.server_kwargs
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    t, h, u = report["throughput"], report["H"], report["U"]
    print(f"model {args.model}: {report['requests']} requests in {report['wall_seconds']}s")
    print(f"throughput: {t['generated_tokens_per_s']} generated tok/s, {t['requests_per_s']} req/s")
    print(
        f"H: overall {h['overall']}, by step {h['by_step']}, reuse of the previous turn "
        f"(steps >= 2) mean {h['reuse_steps_2plus_mean']} min {h['reuse_steps_2plus_min']}"
    )
    print(f"U: max {u['max']}, mean {u['mean']}, per rank max {u['per_rank_max']}")
    for name, passed in report["checks"].items():
        print(f"  {'ok  ' if passed else 'FAIL'} {name}")
    print(f"report: {args.out}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
