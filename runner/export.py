"""`python run.py export RUN [RUN ...] --format sft|rl|messages --out PATH`: training data
from run folders (docs/outputs.md).

- sft: TRL's conversational format, `messages` + `tools`, one row per trajectory.
- rl: one row per rollout (rollouts.jsonl), under the names of verl's AgentLoopOutput
  (prompt_ids, response_ids, response_mask, response_logprobs, reward_score) and of SkyRL's
  TrajectoryOutput (prompt_ids, response_ids, loss_mask, rollout_logprobs, reward).
- messages: the structured conversation of every trajectory with its ids, status, reward.

It streams: records are read one line at a time and written in small batches, so memory
stays flat however large the run. Everything is checked before anything is written, the
output goes to a temporary path renamed into place at the end, and an output path that
exists is refused: a failed export leaves nothing behind.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .records import FORMAT, features

BATCH = 256  # rows per Parquet row group write
KINDS = ("jsonl", "parquet", "dataset")


class ExportError(Exception):
    """Bad input or output; the message says what and where."""


@dataclass(frozen=True)
class Selection:
    only: str = "all"  # all | solved | submitted
    min_reward: float | None = None

    def keep(self, status: str, solved: bool | None, reward: float | None) -> bool:
        if self.only == "solved" and not solved:
            return False
        if self.only == "submitted" and status != "submitted":
            return False
        if self.min_reward is not None:
            return reward is not None and reward >= self.min_reward
        return True


# ---- reading ----------------------------------------------------------------------------


def run_file(run: Path, name: str) -> Path:
    if not run.is_dir():
        raise ExportError(f"{run}: no such run folder")
    path = run / name
    if not path.is_file():
        hint = " (the run was made with --no-rollouts, or before rollouts existed)"
        raise ExportError(f"{path} does not exist" + (hint if name == "rollouts.jsonl" else ""))
    return path


def read_records(path: Path) -> Iterator[dict[str, Any]]:
    """The records of one JSONL file, line by line. A torn last line (a killed run) is
    skipped with a warning; any other bad line is an ExportError naming it."""
    with path.open("rb") as f:
        for n, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            if not raw.endswith(b"\n"):
                print(f"run.py export: skipping the torn last line of {path}", file=sys.stderr)
                return
            try:
                rec = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ExportError(f"{path}:{n}: not a JSON record ({e})") from None
            if not isinstance(rec, dict) or "task_id" not in rec:
                raise ExportError(f"{path}:{n}: not a record of this runner")
            if rec.get("format") != FORMAT:
                raise ExportError(
                    f"{path}:{n}: record format {rec.get('format')!r}, this export reads format "
                    f"{FORMAT} (docs/outputs.md); rerun the batch with this version"
                )
            yield rec


# ---- rows -------------------------------------------------------------------------------


def sft_row(rec: dict[str, Any], tools_as_text: bool) -> dict[str, Any]:
    """TRL conversational row. Assistant turns keep the raw text the model wrote (the call in
    its own syntax) and no `tool_calls`: a template that renders both would write the call
    twice, and the raw text is exactly what the model is to learn."""
    messages = [
        {**m, "tool_calls": None} if m["role"] == "assistant" else m for m in rec["messages"]
    ]
    tools = rec["tools"] if tools_as_text else json.loads(rec["tools"])
    return {"messages": messages, "tools": tools}


def messages_row(rec: dict[str, Any]) -> dict[str, Any]:
    keys = ("task_id", "task", "sample", "model", "status", "reward", "messages", "tools")
    return {
        **{k: rec[k] for k in keys},
        "solved": rec["eval"]["solved"],
        "metadata": rec["metadata"],
    }


def rl_row(rec: dict[str, Any]) -> dict[str, Any]:
    return {
        "task_id": rec["task_id"],
        "task": rec["task"],  # the group id for GRPO-style advantages over --samples
        "sample": rec["sample"],
        "status": rec["status"],
        "prompt_ids": rec["prompt_ids"],
        "response_ids": rec["response_ids"],
        # verl AgentLoopOutput
        "response_mask": rec["response_mask"],
        "response_logprobs": rec["response_logprobs"],
        "reward_score": rec["reward"],
        # SkyRL TrajectoryOutput
        "loss_mask": rec["response_mask"],
        "rollout_logprobs": rec["response_logprobs"],
        "reward": rec["reward"],
    }


def row_features(fmt: str) -> Any:
    import datasets

    traj, roll = features("trajectory"), features("rollout")
    if fmt == "sft":
        return datasets.Features({"messages": traj["messages"], "tools": traj["tools"]})
    if fmt == "messages":
        keys = ("task_id", "task", "sample", "model", "status", "reward", "messages", "tools")
        return datasets.Features(
            {**{k: traj[k] for k in keys}, "solved": roll["solved"], "metadata": traj["metadata"]}
        )
    f = {k: roll[k] for k in ("task_id", "task", "sample", "status", "prompt_ids")}
    f |= {"response_ids": roll["response_ids"], "response_mask": roll["response_mask"]}
    f |= {"response_logprobs": roll["response_logprobs"], "reward_score": roll["reward"]}
    f |= {"loss_mask": roll["response_mask"], "rollout_logprobs": roll["response_logprobs"]}
    return datasets.Features({**f, "reward": roll["reward"]})


def rows(runs: list[Path], fmt: str, sel: Selection, kind: str) -> Iterator[dict[str, Any]]:
    name = "rollouts.jsonl" if fmt == "rl" else "trajectories.jsonl"
    build: Callable[[dict[str, Any]], dict[str, Any]]
    if fmt == "sft":
        text = kind != "jsonl"  # Arrow would merge different tools' schemas into one struct

        def build(rec: dict[str, Any]) -> dict[str, Any]:
            return sft_row(rec, text)
    else:
        build = rl_row if fmt == "rl" else messages_row
    for run in runs:
        for rec in read_records(run_file(run, name)):
            solved = rec["solved"] if fmt == "rl" else rec["eval"]["solved"]
            if sel.keep(rec["status"], solved, rec["reward"]):
                yield build(rec)


# ---- writing ----------------------------------------------------------------------------


def output_kind(out: Path, given: str | None) -> str:
    if given:
        return given
    suffix = out.name.lower()
    if suffix.endswith(".jsonl"):
        return "jsonl"
    if suffix.endswith(".parquet"):
        return "parquet"
    if out.suffix == "":
        return "dataset"
    raise ExportError(
        f"--out {out}: cannot tell the output kind from {out.suffix!r}; use a .jsonl or "
        ".parquet name, a folder name without a suffix (save_to_disk), or --as"
    )


def write_jsonl(it: Iterator[dict[str, Any]], tmp: Path) -> int:
    n = 0
    with tmp.open("w", encoding="utf-8") as f:
        for row in it:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
            n += 1
        f.flush()
        os.fsync(f.fileno())
    return n


def write_parquet(it: Iterator[dict[str, Any]], tmp: Path, feats: Any) -> int:
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = feats.arrow_schema
    n = 0
    with pq.ParquetWriter(tmp, schema) as w:
        batch: list[dict[str, Any]] = []
        for row in it:
            batch.append(row)
            if len(batch) == BATCH:
                w.write_table(pa.Table.from_pylist(batch, schema=schema))
                n, batch = n + len(batch), []
        if batch:
            w.write_table(pa.Table.from_pylist(batch, schema=schema))
            n += len(batch)
    return n


def _generate(runs: str, fmt: str, only: str, min_reward: float | None) -> Iterator[dict]:
    sel = Selection(only, min_reward)
    yield from rows([Path(r) for r in json.loads(runs)], fmt, sel, "dataset")


def build_dataset(runs: list[Path], fmt: str, sel: Selection, feats: Any, cache: Path) -> Any:
    """A `datasets.Dataset` written to Arrow files under `cache` as rows come (not in RAM).
    The arguments are plain values: `datasets` hashes them (and pickles the function)."""
    import datasets

    datasets.disable_progress_bars()
    kwargs = {
        "runs": json.dumps([str(r) for r in runs]),
        "fmt": fmt,
        "only": sel.only,
        "min_reward": sel.min_reward,
    }
    return datasets.Dataset.from_generator(
        _generate, features=feats, cache_dir=str(cache), gen_kwargs=kwargs
    )


def export(
    runs: list[Path],
    fmt: str,
    sel: Selection,
    out: Path | None,
    kind: str | None = None,
    push_to_hub: str | None = None,
) -> int:
    """Write the selected rows; -> how many. ExportError on bad input or output."""
    if out is None and push_to_hub is None:
        raise ExportError("--out PATH (or --push-to-hub REPO) is required")
    if out is not None and (out.exists() or out.is_symlink()):
        raise ExportError(f"--out {out} already exists; remove it or choose another path")
    for run in runs:  # every input checked before anything is written
        run_file(run, "rollouts.jsonl" if fmt == "rl" else "trajectories.jsonl")
    how = output_kind(out, kind) if out is not None else "dataset"
    if out is not None and not out.parent.is_dir():
        raise ExportError(f"--out {out}: the folder {out.parent} does not exist")
    first = next(rows(runs, fmt, sel, how), None)
    if first is None:
        raise ExportError(
            f"the selection (--only {sel.only}"
            + (f", --min-reward {sel.min_reward}" if sel.min_reward is not None else "")
            + f") matches no {'rollout' if fmt == 'rl' else 'trajectory'} in "
            + ", ".join(map(str, runs))
        )
    feats = row_features(fmt)
    work = Path(tempfile.mkdtemp(prefix=".export-", dir=out.parent if out else None))
    try:
        it = rows(runs, fmt, sel, how)
        tmp = work / "out"
        if how == "jsonl":
            n = write_jsonl(it, tmp)
        elif how == "parquet":
            n = write_parquet(it, tmp, feats)
        else:
            ds = build_dataset(runs, fmt, sel, feats, work / "cache")
            n = len(ds)
            if push_to_hub:
                _push(ds, push_to_hub)
            if out is not None:
                ds.save_to_disk(str(tmp))
        if out is not None:
            os.replace(tmp, out)
        return n
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _push(ds: Any, repo: str) -> None:
    try:
        ds.push_to_hub(repo)
    except Exception as e:  # the hub client raises many types; all mean "not pushed"
        first = str(e).splitlines()[0] if str(e) else ""
        raise ExportError(
            f"--push-to-hub {repo}: {type(e).__name__}: {first} (is the hub reachable, and "
            "are you logged in: `huggingface-cli login` or HF_TOKEN?)"
        ) from None


# ---- command line -----------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="run.py export",
        description="Export run folders as training data (docs/outputs.md).",
    )
    p.add_argument("runs", nargs="+", type=Path, metavar="RUN", help="run folders")
    p.add_argument(
        "--format",
        required=True,
        choices=["sft", "rl", "messages"],
        help="sft: TRL conversational (messages + tools); rl: token ids, loss mask, logprobs, "
        "reward (verl and SkyRL names); messages: the structured trajectories",
    )
    p.add_argument("--only", default="all", choices=["all", "solved", "submitted"])
    p.add_argument("--min-reward", type=float, help="keep rows whose reward is >= X")
    p.add_argument("--out", type=Path, help="PATH.jsonl, PATH.parquet, or a folder (save_to_disk)")
    p.add_argument("--as", dest="kind", choices=KINDS, help="output kind (default: from --out)")
    p.add_argument("--push-to-hub", metavar="REPO", help="also push the dataset to the hub")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    sel = Selection(args.only, args.min_reward)
    try:
        n = export(args.runs, args.format, sel, args.out, args.kind, args.push_to_hub)
    except ExportError as e:
        print(f"run.py export: error: {e}", file=sys.stderr)
        return 1
    where = [str(args.out)] if args.out else []
    where += [f"hub:{args.push_to_hub}"] if args.push_to_hub else []
    print(f"run.py export: {n} {args.format} rows -> {', '.join(where)}", file=sys.stderr)
    return 0
