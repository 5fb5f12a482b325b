"""`report RUN --html OUT.html`: one self-contained file (no fetches when it opens) with the
run's summary, its timeline and a trajectory viewer.

The page (viewer.html) embeds an index (one small row per task: what the list and the
filters need) and one inert JSON script element per task, read and parsed only when that
task is opened or searched, so a run of 10,000 trajectories opens quickly and the list
renders only its visible rows.
"""

from __future__ import annotations

import base64
import json
import re
import tempfile
from importlib import resources
from pathlib import Path
from typing import Any

from .load import ReportError, Run, load_run
from .table import render_run, run_report


def write_html(root: Path, out: Path) -> None:
    run = load_run(root, with_messages=True)
    report = run_report(run)
    page = page_html(run, report, *timeline_png(root))
    try:
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(page, encoding="utf-8")
        tmp.replace(out)  # never a half-written page under the asked name
    except OSError as e:
        raise ReportError(f"cannot write {out}: {e}") from None


def page_html(run: Run, report: dict[str, Any], png: bytes | None, note: str = "") -> str:
    template = resources.files(__package__).joinpath("viewer.html").read_text(encoding="utf-8")
    rows = {r["task_id"]: r for r in report["rows"]}
    ids = sorted(run.records)
    index = {
        "run": run.name,
        "source": run.source,
        "summary": render_run({**report, "rows": []}).split("\n", 1)[1].strip(),
        "tasks": [index_row(rows[t]) for t in ids],
    }
    # one inert script element per task: the browser only scans them; a task's JSON is
    # parsed when it is opened (or searched)
    details = "\n".join(
        f'<script type="application/json" id="d{i}">{_script_json(detail(run.records[t]))}</script>'
        for i, t in enumerate(ids)
    )
    index["timeline_note"] = note
    img = f"data:image/png;base64,{base64.b64encode(png).decode()}" if png else ""
    fill = {
        "TITLE": _escape(f"concur-runner report: {run.name}"),
        "TIMELINE": img,
        "INDEX": _script_json(index),
        "DETAILS": details,
    }
    # one pass over the template: text inside the data can never be taken for a placeholder
    return re.sub(r"\{\{([A-Z]+)\}\}", lambda m: fill[m.group(1)], template)


def index_row(row: dict[str, Any]) -> list[Any]:
    """[id, status, steps, reward, prompt tokens, generated tokens, seconds, solved]: a list,
    not an object, so 10,000 rows stay small."""
    return [
        row["task_id"],
        row["status"],
        row["steps"],
        row["reward"],
        row["prompt_tokens"],
        row["generated_tokens"],
        row["seconds"],
        row["solved"],
    ]


def detail(rec: dict[str, Any]) -> dict[str, Any]:
    """One task for the viewer: its opening messages, and per step the assistant's text,
    the tool call, the observation, tokens and times."""
    messages = rec.get("messages") or []
    replies = [m.get("content") or "" for m in messages if m.get("role") == "assistant"]
    first_reply = next((i for i, m in enumerate(messages) if m.get("role") == "assistant"), None)
    steps = []
    for i, s in enumerate(rec.get("step_log") or []):
        steps.append(
            {
                "text": replies[i] if i < len(replies) else "",
                "tool": s.get("tool"),
                "arguments": s.get("arguments"),
                "observation": s.get("observation", ""),
                "ok": s.get("tool_ok"),
                "prompt": s.get("prompt_tokens"),
                "cached": s.get("cached_tokens"),
                "generated": s.get("completion_tokens"),
                "gen_s": s.get("gen_seconds"),
                "tool_s": s.get("tool_seconds"),
                "wait_s": s.get("wait_seconds"),
                "finish": s.get("finish_reason"),
            }
        )
    return {
        "reason": rec.get("reason"),
        "answer": rec.get("answer"),
        "opening": messages[:first_reply] if first_reply is not None else messages,
        "steps": steps,
        "patch": rec.get("patch"),
        "eval": rec.get("eval"),
    }


def timeline_png(root: Path) -> tuple[bytes | None, str]:
    """The timeline drawn afresh from control.jsonl, or None and why not."""
    from .timeline import write_timeline

    with tempfile.TemporaryDirectory() as d:
        try:
            return write_timeline(root, Path(d) / "timeline.png").read_bytes(), ""
        except ReportError as e:  # no or unreadable control.jsonl: the rest is still shown
            return None, f"no timeline: {e}"


def _script_json(obj: Any) -> str:
    # "<" only occurs inside JSON strings, where \u003c means the same: no "</script>" or
    # "<!--" can end or confuse the script element
    return json.dumps(obj, ensure_ascii=False).replace("<", "\\u003c")


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
