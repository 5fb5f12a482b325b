"""How fast the HTML report opens in headless chromium: 1,000 and 10,000 synthetic
trajectories (10 steps each, a 300-character reply and a 1,500-character observation per
step), side by side in one run.

Measures, per size: writing the page (`write_html`), its size, the time from navigation to
the first rendered list (performance.now() when the page marks itself ready), opening the
last task, a full-text search and a status filter.

    python -m bench.viewer_bench            # writes bench/results/viewer/viewer.json
"""

from __future__ import annotations

import asyncio
import json
import platform
import random
import tempfile
import time
from pathlib import Path

from bench.common.paths import VIEWER_RESULTS
from runner.report.html import write_html
from tests.support.browser import chromium  # the test suite's headless chromium driver

STEPS = 10
REPLY, OBSERVATION = 300, 1500


def synthetic_run(root: Path, n: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    words = ["the", "a", "fix", "test", "file", "error", "assert", "def", "return", "patch"]

    def text(chars: int) -> str:
        out: list[str] = []
        while sum(len(w) + 1 for w in out) < chars:
            out.append(rng.choice(words))
        return " ".join(out)

    root.mkdir(parents=True)
    (root / "run.json").write_text(json.dumps({"format": 1, "source": "bench"}))
    with (root / "trajectories.jsonl").open("w") as f:
        for i in range(n):
            steps, messages = [], [{"role": "user", "content": text(400)}]
            for k in range(STEPS):
                obs = text(OBSERVATION)
                messages += [{"role": "assistant", "content": text(REPLY)},
                             {"role": "user", "content": obs}]  # fmt: skip
                steps.append({"step": k + 1, "prompt_tokens": 1000 * (k + 1), "cached_tokens":
                              900 * (k + 1), "completion_tokens": 80, "gen_seconds": 0.5,
                              "tool": "bash", "arguments": {"command": "pytest -q"},
                              "tool_seconds": 1.0, "observation": obs, "tool_ok": True,
                              "wait_seconds": 0.2, "finish_reason": "stop"})  # fmt: skip
            rec = {"task_id": f"task-{i:05d}", "status": rng.choice(["submitted", "max_steps"]),
                   "eval": {"solved": rng.random() < 0.3, "exit_code": 0}, "steps": STEPS,
                   "messages": messages, "step_log": steps, "prompt_tokens": 55_000,
                   "cached_tokens": 49_500, "completion_tokens": 800, "seconds": 60.0}  # fmt: skip
            f.write(json.dumps(rec) + "\n")


async def measure(page_path: Path) -> dict[str, float]:
    async with chromium() as page:
        t0 = time.monotonic()
        await page.open(page_path.as_uri(), "document.body && document.body.dataset.ready")
        wall = time.monotonic() - t0
        ready_ms = float(await page.eval("Number(document.body.dataset.ready)"))
        timed = "(() => {{ const t = performance.now(); {}; return performance.now() - t; }})()"
        open_ms = await page.eval(timed.format(
            "openTask(INDEX.tasks.length - 1)"))  # fmt: skip
        search_ms = await page.eval(timed.format(
            "document.getElementById('search').value = 'zzz-not-there'; filter()"))  # fmt: skip
        search2_ms = await page.eval(timed.format(
            "document.getElementById('search').value = 'zzz-still-not'; filter()"))  # fmt: skip
        filter_ms = await page.eval(timed.format(
            "document.getElementById('search').value = '';"
            "document.getElementById('status').value = 'submitted'; filter()"))  # fmt: skip
        errors = page.errors()
    if errors:
        raise RuntimeError(f"{page_path}: {errors}")
    return {
        "navigation_to_ready_ms": round(ready_ms, 1),
        "load_wall_s": round(wall, 3),
        "open_last_task_ms": round(open_ms, 1),
        "first_search_ms": round(search_ms, 1),
        "next_search_ms": round(search2_ms, 1),
        "status_filter_ms": round(filter_ms, 1),
    }


def main() -> None:
    results = []
    with tempfile.TemporaryDirectory() as d:
        for n in (1_000, 10_000):
            root = Path(d) / f"run{n}"
            synthetic_run(root, n)
            t0 = time.monotonic()
            write_html(root, Path(d) / f"{n}.html")
            write_s = time.monotonic() - t0
            page = Path(d) / f"{n}.html"
            row = {
                "trajectories": n,
                "trajectories_jsonl_mb": round(
                    (root / "trajectories.jsonl").stat().st_size / 1e6, 1
                ),
                "html_mb": round(page.stat().st_size / 1e6, 1),
                "write_html_s": round(write_s, 2),
                **asyncio.run(measure(page)),
            }
            print(json.dumps(row))
            results.append(row)
    VIEWER_RESULTS.mkdir(parents=True, exist_ok=True)
    out = VIEWER_RESULTS / "viewer.json"
    meta = {
        "machine": platform.machine(),
        "python": platform.python_version(),
        "steps_per_trajectory": STEPS,
        "reply_chars": REPLY,
        "observation_chars": OBSERVATION,
    }
    out.write_text(json.dumps({"setup": meta, "results": results}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
