"""Export memory and rollout size: `python -m bench.export_bench [--n 50000]`.

Writes a synthetic run folder (format-2 trajectories and rollouts built with
runner/runfolder/records.py; SmolLM2-sized token ids, logprobs on generated tokens), then runs
`run.py export` for each format and output kind in a fresh process and reads its peak RSS;
the same at n/10 shows whether memory grows with the run. Also the size of rollouts.jsonl
per 1,000 tokens, against the same rows as Parquet (zstd). Results:
bench/results/export/export.json.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common.paths import EXPORT_RESULTS, ROOT
from runner.runfolder.records import message, rollout_record, tool_call, trajectory

VOCAB = 49152
STEPS = 4
OUT_TOKENS, OBS_TOKENS, PROMPT_TOKENS = 24, 40, 300


def synthetic_run(folder: Path, n: int, seed: int = 0) -> int:
    """-> total tokens in the rollouts."""
    rng = random.Random(seed)
    folder.mkdir(parents=True)
    tools = json.dumps([{"type": "function", "function": {"name": "bash", "parameters": {}}}])
    tokens = 0
    with (
        (folder / "trajectories.jsonl").open("w") as tf,
        (folder / "rollouts.jsonl").open("w") as rf,
    ):
        for i in range(n):
            t = trajectory(task_id=f"t{i}", task=f"t{i}", sample=0, seed=0, engine="x", model="m")
            msgs = [message("system", "You are an agent. " * 10), message("user", "Fix it. " * 20)]
            ids = [rng.randrange(VOCAB) for _ in range(PROMPT_TOKENS)]
            spans, lps = [], []
            for s in range(1, STEPS + 1):
                call = tool_call(f"call_{s}", "bash", {"command": f"cat file{s}.py"})
                msgs.append(message("assistant", "I look. <tool_call>...</tool_call>", [call]))
                msgs.append(message("tool", "x = 1\n" * 30, tool_call_id=f"call_{s}", name="bash"))
                a = len(ids)
                ids += [rng.randrange(VOCAB) for _ in range(OUT_TOKENS)]
                lps += [-rng.random() * 3 for _ in range(OUT_TOKENS)]
                b = len(ids)
                ids += [rng.randrange(VOCAB) for _ in range(OBS_TOKENS)]
                spans.append((a, b, len(ids)))
            solved = i % 3 == 0
            t.update(
                status="submitted",
                messages=msgs,
                tools=tools,
                steps=STEPS,
                reward=float(solved),
                reward_source="eval",
                context_tokens=len(ids),
            )
            t["eval"] = {
                **t["eval"],
                "command": "pytest",
                "exit_code": 0 if solved else 1,
                "solved": solved,
            }
            tf.write(json.dumps(t) + "\n")
            rf.write(json.dumps(rollout_record(t, ids, PROMPT_TOKENS, spans, lps)) + "\n")
            tokens += len(ids)
    return tokens


# run in ROOT: `python -c` imports from the working directory first, so this checkout's runner
PEAK = (
    "import resource, sys; from runner.runfolder.export import main; "
    "rc = main({argv!r}); "
    "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss); sys.exit(rc)"
)


def peak_rss_mb(argv: list[str]) -> tuple[float, float]:
    """Peak RSS (MiB) and seconds of one export in a fresh process."""
    t0 = time.monotonic()
    p = subprocess.run(
        [sys.executable, "-c", PEAK.format(argv=argv)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return int(p.stdout.split()[-1]) / 1024, time.monotonic() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=50_000)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="export-bench-"))
    results: dict = {"n": args.n, "runs": {}}
    try:
        for n in (args.n // 10, args.n):
            run = work / f"run{n}"
            tokens = synthetic_run(run, n)
            size = {f: (run / f).stat().st_size for f in ("trajectories.jsonl", "rollouts.jsonl")}
            rows = {}
            for fmt, suffix in (
                ("sft", ".jsonl"),
                ("sft", ".parquet"),
                ("verl", ".parquet"),
                ("messages", ""),
            ):
                out = work / f"out-{n}-{fmt}{suffix or '-dataset'}"
                rss, secs = peak_rss_mb([str(run), "--format", fmt, "--out", str(out)])
                rows[f"{fmt}{suffix or ' (save_to_disk)'}"] = {
                    "peak_rss_mib": round(rss, 1),
                    "seconds": round(secs, 1),
                }
                print(
                    f"n={n:>6} {fmt:>8} {suffix or 'dataset':>8}: "
                    f"peak RSS {rss:7.1f} MiB, {secs:6.1f} s",
                    flush=True,
                )
                if fmt == "verl":
                    size["verl.parquet"] = out.stat().st_size
                shutil.rmtree(out) if out.is_dir() else out.unlink()
            results["runs"][str(n)] = {
                "tokens": tokens,
                "bytes": size,
                "rollouts_jsonl_bytes_per_1k_tokens": round(size["rollouts.jsonl"] / tokens * 1000),
                "verl_parquet_bytes_per_1k_tokens": round(size["verl.parquet"] / tokens * 1000),
                "exports": rows,
            }
            print(json.dumps(results["runs"][str(n)], indent=1), flush=True)
            shutil.rmtree(run)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    EXPORT_RESULTS.mkdir(parents=True, exist_ok=True)
    out = EXPORT_RESULTS / "export.json"
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
