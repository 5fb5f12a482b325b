"""Do the trainers take the exports unchanged? One real run, every export, and the trainers'
own code reading them (docs/outputs.md).

1. A real batch on the embedded llama.cpp engine (swe.jsonl, real bash tools in the sandbox).
2. `run.py export` of it: sft and sft-structured (each with --chat-template chatml-tools),
   verl and skyrl, each also --per-step.
3. bench/consumers/check.py in an environment of its own (TRL, transformers, torch: too heavy
   for the runner's): two TRL SFTTrainer steps per SFT variant on SmolLM2-135M with
   assistant_only_loss; verl's AgentLoopOutput built from every verl row; SkyRL's
   GeneratorOutput from the skyrl rows; classes as released (their wheels' source).

    python -m bench.export_consumers --setup          # once: the environment (PyPI)
    python -m bench.export_consumers [--tasks 4 --steps 3]

Writes bench/results/export-consumers/export-consumers.json and .md. Not part of the test
suite (minutes, and the environment is ~1 GB); tests/runfolder/test_outputs.py checks the same
field names and types (runner/runfolder/export.py's VERL_FIELDS, SKYRL_FIELDS), which this
holds against the releases.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common.paths import EXPORT_CONSUMERS_RESULTS, ROOT
from runner.engines.llama_cpp import native
from runner.runfolder.export import SKYRL_SOURCE, VERL_SOURCE
from runner.runfolder.export import main as export

HERE = Path(__file__).resolve().parent / "consumers"
WHEELS = ("verl==0.9.1", "skyrl==0.3.0")  # the releases export.py's rows were read from


def setup(venv: Path) -> None:
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin/python"), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, "-r", str(HERE / "requirements.txt")], check=True)
    subprocess.run([str(venv / "bin/python"), "-m", "pip", "download", "-q", "--no-deps",
                    *WHEELS, "-d", str(venv / "wheels")], check=True)  # fmt: skip


def real_run(tmp: Path, tasks: int, steps: int) -> Path:
    out = tmp / "run"
    cmd = [sys.executable, str(ROOT / "run.py"), "--tasks", "swe.jsonl", "--limit", str(tasks),
           "--max-steps", str(steps), "--out", str(out), "--n-ctx", "4096"]  # fmt: skip
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"the batch failed ({p.returncode}):\n{p.stderr[-3000:]}")
    print(f"batch: {time.perf_counter() - t0:.0f} s", flush=True)
    return out


def exports(run: Path, dest: Path) -> dict[str, int]:
    jobs = {
        "sft": ["--format", "sft", "--chat-template", "chatml-tools"],
        "sft-structured": ["--format", "sft-structured", "--chat-template", "chatml-tools"],
        "verl": ["--format", "verl"],
        "verl-per-step": ["--format", "verl", "--per-step"],
        "skyrl": ["--format", "skyrl"],
        "skyrl-per-step": ["--format", "skyrl", "--per-step"],
    }
    rows = {}
    for name, args in jobs.items():
        path = dest / f"{name}.jsonl"
        if export([str(run), *args, "--out", str(path)]) != 0:
            raise SystemExit(f"export {name} failed")
        rows[name] = sum(1 for _ in path.open())
    return rows


def report(res: dict, path: Path) -> None:
    c = res["checks"]
    v = res["versions"]
    lines = [
        "# Do the trainers take the exports unchanged? (`python -m bench.export_consumers`)",
        "",
        f"One real batch ({res['run']['agents']} agents of swe.jsonl, up to "
        f"{res['run']['steps']} steps, SmolLM2-135M on llama.cpp, real bash tools), "
        f"exported, then read by the trainers' code: TRL {v['trl']}, transformers "
        f"{v['transformers']}, datasets {v['datasets']}, torch {v['torch']}; verl {v['verl']}'s "
        f"and SkyRL {v['skyrl']}'s classes from their released wheels ({VERL_SOURCE}; "
        f"{SKYRL_SOURCE}). {res['date']}, commit {res['commit']}. Data: export-consumers.json.",
        "",
        "| export | rows | what was done with it | result |",
        "|---|---|---|---|",
    ]
    for name in ("sft", "sft-structured"):
        t = c[name]
        extra = t.get("raw_rows_render_the_text_the_engine_saw")
        lines.append(
            f'| {name} | {t["rows"]} | `load_dataset("json")`; transformers\' '
            "`apply_chat_template` with the exported chatml-tools template; TRL "
            "SFTTrainer, `assistant_only_loss=True`, 2 steps | "
            f"losses {', '.join(f'{x:.3f}' for x in t['losses'])} ({t['steps']} steps, "
            f"{t['train_seconds']} s); tokens per row {min(t['tokens_per_row'])}-"
            f"{max(t['tokens_per_row'])}, assistant tokens per row "
            f"{min(t['assistant_tokens_per_row'])}-{max(t['assistant_tokens_per_row'])}; "
            f"each call rendered once: {t['each_call_rendered_once']}"
            + (f"; raw rows render the text the engine saw: {extra}" if extra else "")
            + " |"
        )
    for name in ("verl", "verl-per-step"):
        t = c[name]
        lines.append(
            f"| {name} | {t['rows']} | `AgentLoopOutput.model_validate(row, strict=True)`, "
            f"then `.as_dict()` | {t['built']} of {t['rows']} built; unknown fields: "
            f"{t['unknown_fields'] or 'none'} |"
        )
    for name in ("skyrl", "skyrl-per-step"):
        t = c[name]
        lines.append(
            f"| {name} | {t['rows']} | the rows column by column as `GeneratorOutput`, every "
            "key strictly validated against its annotation | "
            f"{len(t['keys_checked'])} keys valid (rewards: {t['rewards_type']} per row); "
            f"unknown fields: {t['unknown_fields'] or 'none'} |"
        )
    lines += [
        "",
        "With the grammar on (the default), the model writes exactly "
        "`<tool_call>{...}</tool_call>` "
        "and nothing beside it, so here the structured rows render the same text as the raw "
        "ones (and train alike); they differ where a model writes prose beside its call "
        "(tests/runfolder/test_outputs.py covers that case). verl and SkyRL are read from "
        "their wheels, not installed: their classes are defined from the released source and "
        "validated with pydantic, strict (no coercion).",
    ]
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--venv", type=Path, default=ROOT / "bench/.consumers-venv")
    p.add_argument("--setup", action="store_true", help="create the environment, then stop")
    p.add_argument("--tasks", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", type=Path, default=EXPORT_CONSUMERS_RESULTS / "export-consumers.json")
    a = p.parse_args()
    if a.setup:
        setup(a.venv)
        return
    py = a.venv / "bin/python"
    if not py.exists():
        raise SystemExit(f"{py} missing: run `python -m bench.export_consumers --setup` first")
    with tempfile.TemporaryDirectory(prefix="consumers-") as d:
        tmp = Path(d)
        run = real_run(tmp, a.tasks, a.steps)
        (tmp / "exports").mkdir()
        rows = exports(run, tmp / "exports")
        result = tmp / "check.json"
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip
        subprocess.run([str(py), str(HERE / "check.py"), "--exports", str(tmp / "exports"),
                        "--run", str(run), "--model", str(native.default_model_path()),
                        "--wheels", str(a.venv / "wheels"), "--out", str(result)],
                       check=True, env=env)  # fmt: skip
        res = json.loads(result.read_text())
        summary = json.loads((run / "summary.json").read_text())
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()  # fmt: skip
    res |= {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": commit,
            "run": {"agents": a.tasks, "steps": a.steps, "export_rows": rows,
                    "statuses": summary.get("agents")}}  # fmt: skip
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=1) + "\n")
    report(res, a.out.with_suffix(".md"))
    print(f"wrote {a.out} and {a.out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
