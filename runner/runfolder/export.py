"""`python run.py export RUN [RUN ...] --format FORMAT --out PATH`: training data from run
folders, in the shapes trainers take unchanged (docs/outputs.md).

- sft: TRL's conversational format, `messages` + `tools`, one row per trajectory; assistant
  turns hold the raw text the model wrote (its call in the runner's syntax), for training
  the same model family on its own syntax.
- sft-structured: the same conversations with each call once, structured: assistant
  `content` without the call's text, `tool_calls` with `arguments` as objects, `tools` as a
  list; for a student whose chat template writes calls in its own syntax.
- messages: the trajectory's own messages (raw content and the parsed calls, arguments as
  JSON text), `tools` and `metadata` as JSON text, with ids, status and reward: the record,
  not a chat-template input.
- verl: one row per rollout, the fields of verl's `AgentLoopOutput`; `AgentLoopOutput(**row)`
  builds one.
- skyrl: one row per rollout, the per-trajectory entries of SkyRL's `GeneratorOutput`
  (a batch of rows, column by column, is one).
`--per-step` makes verl and skyrl rows per generation step instead.

It streams: records are read one line at a time and written in small batches, so memory
stays flat however large the run. Everything is checked before anything is written, the
output goes to a temporary path renamed into place at the end, and an output path that
exists is refused: a failed export leaves nothing behind.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..chat import toolcall
from ..chat.template import ChatTemplate, shipped
from .records import FORMAT, features

BATCH = 256  # rows per Parquet row group write
KINDS = ("jsonl", "parquet", "dataset")
FORMATS = ("sft", "sft-structured", "messages", "verl", "skyrl")
SFT, RL = ("sft", "sft-structured"), ("verl", "skyrl")
# the trainers' definitions these rows were read from (docs/outputs.md)
VERL_SOURCE = "verl 0.9.1, verl/experimental/agent_loop/agent_loop.py, class AgentLoopOutput"
SKYRL_SOURCE = "skyrl 0.3.0, skyrl/train/generators/base.py, class GeneratorOutput"
# field -> the type of one row's value: what verl's AgentLoopOutput takes per trajectory
VERL_FIELDS: dict[str, str] = {
    "prompt_ids": "list[int]",
    "response_ids": "list[int]",
    "response_mask": "list[int]",
    "response_logprobs": "list[float] | None",
    "reward_score": "float | None",
    "num_turns": "int",
    "metrics": "dict",  # AgentLoopMetrics: generate_sequences, tool_calls, compute_score, ...
    "extra_fields": "dict",
}
VERL_METRICS = {"generate_sequences": "float", "tool_calls": "float", "compute_score": "float",
                "num_preempted": "int"}  # fmt: skip
# field -> one trajectory's entry of SkyRL's GeneratorOutput (whose values are lists, one
# entry per trajectory); `rewards` is a float, or a float per response token with --per-step
SKYRL_FIELDS: dict[str, str] = {
    "prompt_token_ids": "list[int]",
    "response_ids": "list[int]",
    "rewards": "float | list[float]",
    "loss_masks": "list[int]",
    "stop_reasons": "str",
    "rollout_logprobs": "list[float] | None",
    "trajectory_ids": "dict",  # TrajectoryID: instance_id, repetition_id
    "trajectory_generation_times": "float",
    "is_last_step": "bool",
    "env_metrics": "dict",
}


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


@dataclass(frozen=True)
class Options:
    """What some formats need beyond the selection."""

    per_step: bool = False  # verl, skyrl: a row per generation step
    # verl, skyrl: a rollout whose reward is null: "error" (the default), "drop" the row,
    # "keep" it null (verl only: its reward loop then scores it), or a number to put there
    null_reward: str = "error"
    chat_template: str | None = None  # sft formats: a shipped template's name or a path

    def null_value(self) -> float | None:
        try:
            return float(self.null_reward)
        except ValueError:
            return None


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


def sft_row(rec: dict[str, Any]) -> dict[str, Any]:
    """TRL conversational row, raw: assistant turns keep the text the model wrote (the call
    in its own syntax) and no `tool_calls`, so a template writes each call once."""
    messages = [
        {**m, "tool_calls": None} if m["role"] == "assistant" else m for m in rec["messages"]
    ]
    return {"messages": messages, "tools": json.loads(rec["tools"])}


def sft_structured_row(rec: dict[str, Any]) -> dict[str, Any]:
    """TRL conversational row, structured: each call once, in `tool_calls` with its
    arguments as an object; the assistant's content is its text without the call. A reply
    that held no valid call keeps its raw text (the next turn is the runner's correction)."""
    out = []
    for m in rec["messages"]:
        if m["role"] == "assistant" and m["tool_calls"]:
            calls = []
            for c in m["tool_calls"]:
                fn = {**c["function"], "arguments": json.loads(c["function"]["arguments"])}
                calls.append({**c, "function": fn})
            m = {**m, "content": toolcall.prose(m["content"]), "tool_calls": calls}
        out.append(m)
    return {"messages": out, "tools": json.loads(rec["tools"])}


# the trajectory's own keys a `messages` row carries (then `solved` and `metadata`)
MESSAGES_KEYS = ("task_id", "task", "sample", "model", "status", "reward", "messages", "tools")


def messages_row(rec: dict[str, Any]) -> dict[str, Any]:
    return {
        **{k: rec[k] for k in MESSAGES_KEYS},
        "solved": rec["eval"]["solved"],
        "metadata": rec["metadata"],
    }


@dataclass(frozen=True)
class Facts:
    """What an RL row needs from the agent's trajectory line (rollouts do not carry it)."""

    gen_seconds: float
    tool_seconds: float
    score_seconds: float  # eval's time (0.0 without eval)
    seconds: float
    finish: tuple[str, ...]  # each step's finish_reason


def trajectory_facts(path: Path) -> dict[str, Facts]:
    """task_id -> Facts for every trajectory in `path` (a few numbers per agent)."""
    out = {}
    for rec in read_records(path):
        out[rec["task_id"]] = Facts(
            float(rec["gen_seconds"]),
            float(rec["tool_seconds"]),
            float(rec["eval"]["seconds"] or 0.0),
            float(rec["seconds"]),
            tuple(s["finish_reason"] for s in rec["step_log"]),
        )
    return out


@dataclass(frozen=True)
class Piece:
    """One RL row's tokens: the whole rollout, or one step of it (--per-step)."""

    prompt: list[int]
    response: list[int]
    mask: list[int]
    logprobs: list[float] | None
    step: int | None  # None: the whole rollout
    last: bool
    turns: int  # chat turns in prompt + response: the user's, each reply, each observation
    end: int  # index in `response` of the last generated token


def pieces(roll: dict[str, Any], per_step: bool) -> Iterator[Piece]:
    prompt, resp, mask = roll["prompt_ids"], roll["response_ids"], roll["response_mask"]
    lps, steps = roll["response_logprobs"], roll["steps"]
    turns = [1]  # the opening user turn, then per step its reply and its observation
    for st in steps:
        turns.append(turns[-1] + 1 + (st["observation_end"] > st["output_end"]))
    last_out = steps[-1]["output_end"] - 1 if steps else -1
    if not per_step:
        yield Piece(prompt, resp, mask, lps, None, True, turns[-1], last_out)
        return
    for k, st in enumerate(steps):
        a, b, c = st["output_start"], st["output_end"], st["observation_end"]
        yield Piece(prompt + resp[:a], resp[a:c], mask[a:c], None if lps is None else lps[a:c],
                    k, k == len(steps) - 1, turns[k + 1], b - 1 - a)  # fmt: skip


def stop_reason(roll: dict[str, Any], facts: Facts, step: int | None) -> str:
    """SkyRL's stop reason: "length" where the generation (or the context) ran out,
    else "stop"."""
    if step is None:
        if roll["status"] == "context_limit":
            return "length"
        return facts.finish[-1] if facts.finish else "stop"
    return facts.finish[step] if step < len(facts.finish) else "stop"


def verl_row(roll: dict[str, Any], facts: Facts, p: Piece, reward: float | None) -> dict:
    return {
        "prompt_ids": p.prompt,
        "response_ids": p.response,
        "response_mask": p.mask,
        "response_logprobs": p.logprobs,
        "reward_score": reward if p.last else 0.0,
        "num_turns": p.turns,
        "metrics": {
            "generate_sequences": facts.gen_seconds,
            "tool_calls": facts.tool_seconds,
            "compute_score": facts.score_seconds,
            "num_preempted": -1,  # not counted per agent (the engine's stats have it)
        },
        "extra_fields": _ids(roll, p),
    }


def skyrl_row(roll: dict[str, Any], facts: Facts, p: Piece, reward: float | None) -> dict:
    assert reward is not None  # check_options refuses --null-reward keep for SkyRL
    if p.step is None:
        rewards: float | list[float] = float(reward)
    else:  # SkyRL's step-wise rewards: per token, the reward on the last step's final token
        rewards = [0.0] * len(p.response)
        if p.last and p.end >= 0:
            rewards[p.end] = float(reward)
    return {
        "prompt_token_ids": p.prompt,
        "response_ids": p.response,
        "rewards": rewards,
        "loss_masks": p.mask,
        "stop_reasons": stop_reason(roll, facts, p.step),
        "rollout_logprobs": p.logprobs,
        "trajectory_ids": {"instance_id": roll["task"], "repetition_id": roll["sample"]},
        "trajectory_generation_times": facts.seconds,
        "is_last_step": p.last,
        "env_metrics": _ids(roll, p),
    }


def _ids(roll: dict[str, Any], p: Piece) -> dict[str, Any]:
    keys = ("task_id", "task", "sample", "status")
    return {**{k: roll[k] for k in keys}, "step": p.step, "is_last_step": p.last}


def rl_rows(
    path: Path, facts: dict[str, Facts], fmt: str, sel: Selection, opt: Options
) -> Iterator[dict[str, Any]]:
    build = verl_row if fmt == "verl" else skyrl_row
    for roll in read_records(path):
        if not sel.keep(roll["status"], roll["solved"], roll["reward"]):
            continue
        f = facts.get(roll["task_id"])
        if f is None:
            raise ExportError(
                f"{path}: agent {roll['task_id']!r} has a rollout but no line in "
                f"{path.parent / 'trajectories.jsonl'}"
            )
        reward = roll["reward"]
        if reward is None:
            if opt.null_reward == "drop":
                continue
            if opt.null_reward == "error":
                raise ExportError(
                    f"{path}: agent {roll['task_id']!r} has no reward (null: no eval and no "
                    f"reward command, or the command failed); {fmt} needs a number. Map it "
                    "with --null-reward 0, leave such rows out with --null-reward drop, or "
                    "select with --min-reward / --only solved"
                    + (" (verl alone also takes --null-reward keep)" if fmt == "verl" else "")
                )
            reward = opt.null_value()  # None for "keep" (verl's reward loop scores it)
        for piece in pieces(roll, opt.per_step):
            yield build(roll, f, piece, reward)


def row_features(fmt: str, opt: Options = Options()) -> Any:
    """The rows' `datasets.Features`. Objects whose keys vary (tool schemas, call
    arguments) are `datasets.Json`, kept as they are, not merged into one struct."""
    import datasets

    Json, List, V = datasets.Json, datasets.List, datasets.Value
    traj, roll = features("trajectory"), features("rollout")
    ints, floats = List(V("int64")), List(V("float64"))
    if fmt in SFT:
        m = traj["messages"].feature
        if fmt == "sft-structured":
            call = {"id": V("string"), "type": V("string"),
                    "function": {"name": V("string"), "arguments": Json()}}  # fmt: skip
            m = {**m, "tool_calls": List(call)}
        return datasets.Features({"messages": List(m), "tools": List(Json())})
    if fmt == "messages":
        own = {k: traj[k] for k in MESSAGES_KEYS}
        return datasets.Features({**own, "solved": roll["solved"], "metadata": traj["metadata"]})
    ids = {"task_id": V("string"), "task": V("string"), "sample": V("int64"),
           "status": V("string"), "step": V("int64"), "is_last_step": V("bool")}  # fmt: skip
    if fmt == "verl":
        return datasets.Features({
            "prompt_ids": ints, "response_ids": ints, "response_mask": ints,
            "response_logprobs": floats, "reward_score": V("float64"), "num_turns": V("int64"),
            "metrics": {k: V("int64" if t == "int" else "float64")
                        for k, t in VERL_METRICS.items()},
            "extra_fields": ids,
        })  # fmt: skip
    return datasets.Features({
        "prompt_token_ids": ints, "response_ids": ints,
        "rewards": floats if opt.per_step else V("float64"),
        "loss_masks": ints, "stop_reasons": V("string"), "rollout_logprobs": floats,
        "trajectory_ids": {"instance_id": V("string"), "repetition_id": V("int64")},
        "trajectory_generation_times": V("float64"), "is_last_step": V("bool"),
        "env_metrics": ids,
    })  # fmt: skip


def source_file(fmt: str) -> str:
    return "rollouts.jsonl" if fmt in RL else "trajectories.jsonl"


def rows(
    runs: list[Path],
    fmt: str,
    sel: Selection,
    opt: Options,
    facts: dict[Path, dict[str, Facts]] | None = None,
) -> Iterator[dict[str, Any]]:
    """The selected rows of `runs`. RL formats read each run's trajectories for their
    facts first; `facts` keeps them between passes (the empty-selection check, then the
    writing) so a large trajectories.jsonl is read once."""
    facts = {} if facts is None else facts
    for run in runs:
        path = run_file(run, source_file(fmt))
        if fmt in RL:
            if run not in facts:
                facts[run] = trajectory_facts(run_file(run, "trajectories.jsonl"))
            yield from rl_rows(path, facts[run], fmt, sel, opt)
            continue
        build = {"sft": sft_row, "sft-structured": sft_structured_row}.get(fmt, messages_row)
        for rec in read_records(path):
            if sel.keep(rec["status"], rec["eval"]["solved"], rec["reward"]):
                yield build(rec)


def chat_template(opt: Options, first: dict[str, Any]) -> str | None:
    """The --chat-template's text, checked: it marks the assistant's text ({% generation %},
    for TRL's assistant_only_loss) and renders the first row with its tools."""
    if opt.chat_template is None:
        return None
    name = opt.chat_template
    try:
        path = Path(name) if "/" in name or name.endswith(".jinja") else shipped(name)
        source = path.read_text(encoding="utf-8")
        tmpl = ChatTemplate(source)
    except (ValueError, OSError) as e:
        raise ExportError(f"--chat-template {name}: {e}") from None
    except Exception as e:  # jinja2's syntax errors
        raise ExportError(f"--chat-template {name}: not a chat template ({e})") from None
    if not tmpl.marks_generation:
        raise ExportError(
            f"--chat-template {name}: no {{% generation %}} marks around the assistant's "
            "text, which TRL's assistant_only_loss needs"
        )
    try:
        tmpl.render(first["messages"], first["tools"], add_generation_prompt=False)
    except Exception as e:
        raise ExportError(f"--chat-template {name}: cannot render a row ({e})") from None
    return source


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
    from datasets.arrow_writer import ParquetWriter

    w = ParquetWriter(features=feats, path=str(tmp), writer_batch_size=BATCH)
    try:
        for row in it:
            w.write(row)
        n, _ = w.finalize()
    finally:
        w.close()
    return n


def _generate(runs: str, fmt: str, only: str, min_reward: float | None, opt: str) -> Iterator:
    sel = Selection(only, min_reward)
    yield from rows([Path(r) for r in json.loads(runs)], fmt, sel, Options(**json.loads(opt)))


def build_dataset(
    runs: list[Path], fmt: str, sel: Selection, opt: Options, feats: Any, cache: Path
) -> Any:
    """A `datasets.Dataset` written to Arrow files under `cache` as rows come (not in RAM).
    The arguments are plain values: `datasets` hashes them (and pickles the function)."""
    import datasets

    datasets.disable_progress_bars()
    kwargs = {
        "runs": json.dumps([str(r) for r in runs]),
        "fmt": fmt,
        "only": sel.only,
        "min_reward": sel.min_reward,
        "opt": json.dumps(opt.__dict__),
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
    opt: Options = Options(),
) -> int:
    """Write the selected rows; -> how many. ExportError on bad input or output."""
    check_options(fmt, opt)
    if out is None and push_to_hub is None:
        raise ExportError("--out PATH (or --push-to-hub REPO) is required")
    if out is not None and (out.exists() or out.is_symlink()):
        raise ExportError(f"--out {out} already exists; remove it or choose another path")
    for run in runs:  # every input checked before anything is written
        run_file(run, source_file(fmt))
        if fmt in RL:
            run_file(run, "trajectories.jsonl")
    how = output_kind(out, kind) if out is not None else "dataset"
    if out is not None and not out.parent.is_dir():
        raise ExportError(f"--out {out}: the folder {out.parent} does not exist")
    facts: dict[Path, dict[str, Facts]] = {}
    first = next(rows(runs, fmt, sel, opt, facts), None)
    if first is None:
        dropped = " (rollouts with a null reward left out: --null-reward drop)"
        raise ExportError(
            f"the selection (--only {sel.only}"
            + (f", --min-reward {sel.min_reward}" if sel.min_reward is not None else "")
            + f") matches no {'rollout' if fmt in RL else 'trajectory'} in "
            + ", ".join(map(str, runs))
            + (dropped if opt.null_reward == "drop" else "")
        )
    template = chat_template(opt, first)
    if template is not None and out is not None and template_path(out).exists():
        raise ExportError(f"{template_path(out)} already exists; remove it or choose another --out")
    feats = row_features(fmt, opt)
    work = Path(tempfile.mkdtemp(prefix=".export-", dir=out.parent if out else None))
    try:
        it = rows(runs, fmt, sel, opt, facts)
        tmp = work / "out"
        if how == "jsonl":
            n = write_jsonl(it, tmp)
        elif how == "parquet":
            n = write_parquet(it, tmp, feats)
        else:
            ds = build_dataset(runs, fmt, sel, opt, feats, work / "cache")
            n = len(ds)
            if push_to_hub:
                _push(ds, push_to_hub)
            if out is not None:
                ds.save_to_disk(str(tmp))
        if out is not None:
            if template is not None:
                template_path(out).write_text(template, encoding="utf-8")
            os.replace(tmp, out)
        return n
    finally:
        shutil.rmtree(work, ignore_errors=True)


def template_path(out: Path) -> Path:
    """Where --chat-template is written: beside the output, for TRL's chat_template_path."""
    stem = out.name.removesuffix(".jsonl").removesuffix(".parquet")
    return out.with_name(f"{stem}.chat_template.jinja")


def check_options(fmt: str, opt: Options) -> None:
    if fmt == "rl":
        raise ExportError(
            "--format rl is now two formats, one per trainer: --format verl (verl's "
            "AgentLoopOutput fields) and --format skyrl (SkyRL's GeneratorOutput fields)"
        )
    if fmt not in FORMATS:
        raise ExportError(f"--format {fmt}: unknown (formats: {', '.join(FORMATS)})")
    if opt.per_step and fmt not in RL:
        raise ExportError(f"--per-step is for --format verl or skyrl, not {fmt}")
    if opt.chat_template is not None and fmt not in SFT:
        raise ExportError(f"--chat-template is for --format sft or sft-structured, not {fmt}")
    nr = opt.null_reward
    if nr not in ("error", "drop", "keep") and opt.null_value() is None:
        raise ExportError(f"--null-reward {nr}: use error, drop, keep (verl) or a number")
    if nr != "error" and fmt not in RL:
        raise ExportError(f"--null-reward is for --format verl or skyrl, not {fmt}")
    if nr == "keep" and fmt != "verl":
        raise ExportError(
            "--null-reward keep: SkyRL's rewards are floats; use a number or drop "
            "(verl takes a null reward_score and scores it in its reward loop)"
        )
    v = opt.null_value()
    if v is not None and not math.isfinite(v):
        raise ExportError(f"--null-reward {nr}: not a finite number")


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
        metavar="{" + ",".join(FORMATS) + "}",
        help="sft: TRL conversational, the model's raw text; sft-structured: the same with "
        "each call structured (tool_calls, arguments as objects); messages: the trajectory "
        "records' messages; verl: AgentLoopOutput rows; skyrl: GeneratorOutput entries",
    )
    p.add_argument("--only", default="all", choices=["all", "solved", "submitted"])
    p.add_argument("--min-reward", type=float, help="keep rows whose reward is >= X")
    p.add_argument("--per-step", action="store_true", help="verl, skyrl: a row per step")
    p.add_argument(
        "--null-reward",
        default="error",
        metavar="error|drop|keep|X",
        help="verl, skyrl: a rollout with no reward is an error (default), left out (drop), "
        "kept null (keep: verl only) or given reward X",
    )
    p.add_argument(
        "--chat-template",
        metavar="NAME|PATH",
        help="sft formats: check a generation-marked chat template against the rows and "
        "write it beside --out as STEM.chat_template.jinja (shipped: chatml-tools)",
    )
    p.add_argument("--out", type=Path, help="PATH.jsonl, PATH.parquet, or a folder (save_to_disk)")
    p.add_argument("--as", dest="kind", choices=KINDS, help="output kind (default: from --out)")
    p.add_argument("--push-to-hub", metavar="REPO", help="also push the dataset to the hub")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    sel = Selection(args.only, args.min_reward)
    opt = Options(args.per_step, args.null_reward, args.chat_template)
    try:
        n = export(args.runs, args.format, sel, args.out, args.kind, args.push_to_hub, opt)
    except ExportError as e:
        print(f"run.py export: error: {e}", file=sys.stderr)
        return 1
    where = [str(args.out)] if args.out else []
    where += [f"hub:{args.push_to_hub}"] if args.push_to_hub else []
    print(f"run.py export: {n} {args.format} rows -> {', '.join(where)}", file=sys.stderr)
    if args.chat_template and args.out:
        print(f"run.py export: chat template -> {template_path(args.out)} (TRL: SFTConfig("
              "chat_template_path=..., assistant_only_loss=True))", file=sys.stderr)  # fmt: skip
    return 0
