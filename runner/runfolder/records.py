"""The record formats of a run folder (format 2): every key in every record, one type per key.

The JSON Schemas in schemas/ beside it are the source of truth (docs/outputs.md explains every
field); this module builds records that follow them and derives the `datasets.Features`
that load any number of runs together. Why Features: Arrow infers a column's type from the
values it sees, so a key that is null in every line of one run (`answer` where nobody
submitted) is typed `null` there and cannot be cast to the string it is in another run; with
the schema's Features every run loads as the same types. Free-form objects whose keys depend
on the task or the tool (`metadata`, tool `arguments`, the `tools` schemas) are JSON text for
the same reason, as OpenAI does for `arguments`.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

FORMAT = 2
SCHEMAS = Path(__file__).resolve().parent / "schemas"


@cache
def schema(name: str) -> dict[str, Any]:
    """The JSON Schema of "trajectory" or "rollout" records."""
    return json.loads((SCHEMAS / f"{name}.schema.json").read_text(encoding="utf-8"))


def features(name: str) -> Any:
    """`datasets.Features` of "trajectory" or "rollout" records, for
    `load_dataset("json", data_files=[...], features=features("trajectory"))`."""
    import datasets

    s = schema(name)
    return datasets.Features({k: _feature(v) for k, v in s["properties"].items()})


_SCALARS = {"string": "string", "integer": "int64", "number": "float64", "boolean": "bool"}


def _feature(s: dict[str, Any]) -> Any:
    import datasets

    if "const" in s:
        types = [_json_type(s["const"])]
    elif "enum" in s:
        types = [_json_type(v) for v in s["enum"]]
    else:
        types = s["type"] if isinstance(s["type"], list) else [s["type"]]
    kinds = {t for t in types if t != "null"}
    if len(kinds) != 1:
        raise ValueError(f"schema node has {sorted(kinds)} types; one is needed: {s}")
    kind = kinds.pop()
    if kind == "object":
        return {k: _feature(v) for k, v in s["properties"].items()}
    if kind == "array":
        return datasets.List(_feature(s["items"]))
    return datasets.Value(_SCALARS[kind])


def _json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    if isinstance(v, float):
        return "number"
    return "string"


# ---- building records -------------------------------------------------------------------


def message(
    role: str,
    content: str,
    tool_calls: list[dict[str, Any]] | None = None,
    tool_call_id: str | None = None,
    name: str | None = None,
) -> dict[str, Any]:
    """One chat message with every key of the schema."""
    return {
        "role": role,
        "content": content,
        "tool_calls": tool_calls,
        "tool_call_id": tool_call_id,
        "name": name,
    }


def tool_call(call_id: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI-form tool call (arguments as JSON text)."""
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


def as_message(m: dict[str, Any]) -> dict[str, Any]:
    return message(
        m["role"], m["content"], m.get("tool_calls"), m.get("tool_call_id"), m.get("name")
    )


NO_EVAL: dict[str, Any] = {
    "command": None,
    "exit_code": None,
    "solved": None,
    "timed_out": None,
    "seconds": None,
    "output_tail": None,
    "error": None,
    "tests": None,  # SWE-bench-style tasks: the test patch and the tests' outcomes
}
_PATCH_KEYS = ("base", "diff", "files", "truncated", "summary", "error")


def eval_field(ev: dict[str, Any] | None) -> dict[str, Any]:
    """The `eval` object with every key (all null when no eval ran)."""
    out = {**NO_EVAL, **(ev or {})}
    if out["seconds"] is not None:
        out["seconds"] = float(out["seconds"])
    return out


def setup_field(setup: dict[str, Any] | None) -> dict[str, Any]:
    s = setup or {}
    git = s.get("git") or {}
    return {
        "commands": [
            {"command": c["command"], "exit_code": c.get("exit_code"), "output": c["output"]}
            for c in s.get("commands") or []
        ],
        "git": {k: git.get(k) for k in ("base", "kind", "error")},
        "failed": s.get("failed"),
    }


def patch_field(patch: dict[str, Any] | None) -> dict[str, Any] | None:
    return None if patch is None else {k: patch.get(k) for k in _PATCH_KEYS}


def trajectory(
    *, task_id: str, task: str, sample: int, seed: int, engine: str, model: str
) -> dict[str, Any]:
    """A trajectory record with every key at its empty value; the batch fills it in."""
    return {
        "format": FORMAT,
        "task_id": task_id,
        "task": task,
        "sample": sample,
        "seed": seed,
        "engine": engine,
        "model": model,
        "status": "error",
        "reason": "",
        "answer": None,
        "reward": None,
        "reward_source": None,
        "reward_error": None,
        "reward_output": None,
        "messages": [],
        "tools": "[]",
        "metadata": "{}",
        "steps": 0,
        "step_log": [],
        "context_tokens": 0,
        "prompt_tokens": 0,
        "cached_tokens": 0,
        "completion_tokens": 0,
        "gen_seconds": 0.0,
        "tool_seconds": 0.0,
        "wait_seconds": 0.0,
        "seconds": 0.0,
        "setup": setup_field(None),
        "patch": None,
        "eval": eval_field(None),
        "rescored_at": None,
        "worker": None,  # --ray: set by the driver
        "attempt": None,
    }


def evaluated(rec: dict[str, Any]) -> bool:
    """Whether an eval ran for this record (eval.command set)."""
    ev = rec.get("eval")
    return isinstance(ev, dict) and ev.get("command") is not None


def eval_reward(ev: dict[str, Any]) -> float | None:
    """The default reward: 1.0 when eval exited 0 (solved), 0.0 otherwise, None without eval."""
    if ev.get("command") is None:
        return None
    return 1.0 if ev.get("solved") else 0.0


def rollout_record(
    traj: dict[str, Any],
    ids: list[int],
    prompt_len: int,
    spans: list[tuple[int, int, int]],
    logprobs: list[float] | None,
) -> dict[str, Any]:
    """The rollouts.jsonl line of an agent: its token stream split at the opening prompt,
    the mask of what the model generated, and the step boundaries (offsets into
    response_ids). `spans`: per step (output start, output end, observation end) in `ids`."""
    response = ids[prompt_len:]
    mask = [0] * len(response)
    lps: list[float] | None = None if logprobs is None else [0.0] * len(response)
    generated = iter(logprobs or ())
    for start, end, _ in spans:
        for i in range(start - prompt_len, end - prompt_len):
            mask[i] = 1
            if lps is not None:
                lps[i] = float(next(generated))
    ev = traj["eval"]
    return {
        "format": FORMAT,
        "task_id": traj["task_id"],
        "task": traj["task"],
        "sample": traj["sample"],
        "model": traj["model"],
        "status": traj["status"],
        "reward": traj["reward"],
        "solved": ev["solved"],
        "prompt_ids": ids[:prompt_len],
        "response_ids": response,
        "response_mask": mask,
        "response_logprobs": lps,
        "steps": [
            {
                "step": n,
                "output_start": a - prompt_len,
                "output_end": b - prompt_len,
                "observation_end": c - prompt_len,
            }
            for n, (a, b, c) in enumerate(spans, start=1)
        ],
        "worker": None,  # --ray: set by the driver
        "attempt": None,
    }
