"""The report: per-task rows, the solve rate with its interval, pass@k over samples, engine
and gate figures, and for two or more runs the tasks that changed outcome. `build` makes
the JSON (`--json`); `render` prints it as text."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from .load import ReportError, Run, base_id, reward, solved
from .stats import ks_for, paired_difference, pass_at_k_mean, wilson


def task_row(rec: dict[str, Any]) -> dict[str, Any]:
    prompt = rec.get("prompt_tokens") or 0
    return {
        "task_id": rec["task_id"],
        "status": rec.get("status"),
        "steps": rec.get("steps") or 0,
        "prompt_tokens": prompt,
        "cached_tokens": rec.get("cached_tokens") or 0,
        "generated_tokens": rec.get("completion_tokens") or 0,
        "seconds": rec.get("seconds"),
        "wait_seconds": rec.get("wait_seconds"),
        "reward": reward(rec),
        "solved": solved(rec),
    }


def outcome(row: dict[str, Any]) -> str:
    """What a task's result is, for comparing runs: solved / failed where it was scored,
    else its status."""
    if row["solved"] is not None:
        return "solved" if row["solved"] else "failed"
    return str(row["status"])


def run_report(run: Run) -> dict[str, Any]:
    rows = [task_row(run.records[t]) for t in sorted(run.records)]
    scored = [r for r in rows if r["solved"] is not None]
    by_status: dict[str, int] = defaultdict(int)
    for r in rows:
        by_status[str(r["status"])] += 1
    rate = None
    if scored:
        k = sum(1 for r in scored if r["solved"])
        rate = {"solved": k, "scored": len(scored), **wilson(k, len(scored)).to_json()}
    rewards = [r["reward"] for r in rows if r["reward"] is not None]
    return {
        "run": run.name,
        "source": run.source,
        "complete": run.summary is not None and not run.summary.get("interrupted"),
        "torn_tail": run.torn_tail,
        "tasks": len(rows),
        "by_status": dict(sorted(by_status.items())),
        "solve_rate": rate,
        "mean_reward": sum(rewards) / len(rewards) if rewards else None,
        "pass_at_k": pass_at(rows),
        "figures": figures(run.summary),
        "rows": rows,
    }


def pass_at(rows: list[dict[str, Any]]) -> dict[str, float] | None:
    """pass@k over tasks run as samples (`<task>#<k>`), from their scored samples."""
    per: dict[str, list[bool]] = defaultdict(list)
    sampled = False
    for r in rows:
        sampled |= "#" in r["task_id"]
        if r["solved"] is not None:
            per[base_id(r["task_id"])].append(bool(r["solved"]))
    if not sampled or not per:
        return None
    counts = [(len(v), sum(v)) for v in per.values()]
    n_min = min(n for n, _ in counts)
    return {f"pass@{k}": round(pass_at_k_mean(counts, k), 4) for k in ks_for(n_min)}


def figures(s: dict[str, Any] | None) -> dict[str, Any] | None:
    """Engine and gate figures from summary.json."""
    if s is None:
        return None
    gate = s.get("gate") or {}
    engine = s.get("engine") or {}
    secs = s.get("batch_seconds") or 0
    gen = (s.get("this_session") or {}).get("generated_tokens", 0)
    return {
        "engine": engine.get("name"),
        "model": engine.get("model"),
        "clock": s.get("clock"),
        "wall_seconds": s.get("wall_seconds"),
        "batch_seconds": secs,
        "steps": s.get("steps"),
        "prompt_tokens": s.get("prompt_tokens"),
        "generated_tokens": s.get("generated_tokens"),
        "hit_rate": s.get("hit_rate"),
        "generated_tokens_per_s": round(gen / secs, 2) if secs else None,
        "policy": gate.get("policy"),
        "policy_params": gate.get("policy_params"),
        "window": gate.get("window"),
        "control_periods": gate.get("control_periods"),
        "pauses": gate.get("pauses"),
        "resumes": gate.get("resumes"),
        "agent_seconds_paused": gate.get("agent_seconds_paused"),
        "agent_seconds_pending": gate.get("agent_seconds_pending"),
    }


def comparison(first: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """`other` against `first` over the tasks both ran."""
    a = {r["task_id"]: r for r in first["rows"]}
    b = {r["task_id"]: r for r in other["rows"]}
    common = sorted(a.keys() & b.keys())
    changed = [
        {"task_id": t, "from": outcome(a[t]), "to": outcome(b[t])}
        for t in common
        if outcome(a[t]) != outcome(b[t])
    ]
    pairs = [
        (bool(a[t]["solved"]), bool(b[t]["solved"]))
        for t in common
        if a[t]["solved"] is not None and b[t]["solved"] is not None
    ]
    diff = paired_difference(pairs).to_json() if pairs else None
    return {
        "run": other["run"],
        "against": first["run"],
        "common_tasks": len(common),
        "only_in_first": len(a.keys() - b.keys()),
        "only_in_this": len(b.keys() - a.keys()),
        "changed": changed,
        "paired_scored": len(pairs),
        "rate_difference": diff,
    }


def build(runs: list[Run]) -> dict[str, Any]:
    check_same_dataset(runs)
    reports = [run_report(r) for r in runs]
    return {
        "runs": reports,
        "comparisons": [comparison(reports[0], r) for r in reports[1:]],
    }


def check_same_dataset(runs: list[Run]) -> None:
    """Runs compare task by task only over one dataset (ids like "0", "1" would match
    across unrelated ones)."""
    first = runs[0]
    for r in runs[1:]:
        if r.source != first.source:
            raise ReportError(
                f"cannot compare runs of different datasets: {first.name} ran "
                f"{first.source or '(unknown)'}, {r.name} ran {r.source or '(unknown)'}"
            )
        if first.dataset_hash and r.dataset_hash and r.dataset_hash != first.dataset_hash:
            raise ReportError(
                f"cannot compare: {first.name} and {r.name} ran {first.source} with different "
                f"contents (dataset hash {first.dataset_hash[:12]} vs {r.dataset_hash[:12]})"
            )


# ---- text ---------------------------------------------------------------------------------


def render(report: dict[str, Any]) -> str:
    parts = [render_run(r) for r in report["runs"]]
    parts += [render_comparison(c) for c in report["comparisons"]]
    return "\n\n".join(parts) + "\n"


def render_run(r: dict[str, Any]) -> str:
    lines = [f"run {r['run']} ({r['source'] or 'unknown dataset'})"]
    if not r["complete"]:
        lines.append("  (unfinished: interrupted, or still running; figures so far)")
    header = ["task", "status", "steps", "prompt tok", "gen tok", "hit", "seconds", "result"]
    body = [
        [
            row["task_id"],
            str(row["status"]),
            str(row["steps"]),
            f"{row['prompt_tokens']:,}",
            f"{row['generated_tokens']:,}",
            _pct(row["cached_tokens"] / row["prompt_tokens"]) if row["prompt_tokens"] else "-",
            "-" if row["seconds"] is None else f"{row['seconds']:.1f}",
            _result(row),
        ]
        for row in r["rows"]
    ]
    lines += ["", *columns([header, *body], right={2, 3, 4, 5, 6}), ""]
    status = ", ".join(f"{k} {v}" for k, v in r["by_status"].items())
    lines.append(f"tasks {r['tasks']}: {status or 'none finished'}")
    rate = r["solve_rate"]
    if rate:
        lines.append(
            f"solve rate {rate['solved']}/{rate['scored']} = {_pct(rate['estimate'])} "
            f"(95% CI {_pct(rate['low'])}-{_pct(rate['high'])}, Wilson)"
        )
    else:
        lines.append("solve rate: no task was evaluated (no `eval` in the dataset)")
    if r["mean_reward"] is not None:
        lines.append(f"mean reward {r['mean_reward']:.3f}")
    if r["pass_at_k"]:
        lines.append("  ".join(f"{k} {v:.3f}" for k, v in r["pass_at_k"].items()))
    if r["figures"]:
        lines += render_figures(r["figures"])
    return "\n".join(lines)


def render_figures(f: dict[str, Any]) -> list[str]:
    w = f.get("window") or {}
    clock = " simulated" if f["clock"] == "virtual" else ""
    rate = f["generated_tokens_per_s"]
    lines = [
        f"engine {f['engine']} ({f['model'] or 'no model'}): "
        f"{_num(f['batch_seconds'], ',.1f')}{clock} s, {_num(f['steps'])} steps, "
        f"{_num(f['prompt_tokens'])} prompt / {_num(f['generated_tokens'])} generated tokens, "
        f"hit rate {_pct(f['hit_rate'])}" + (f", {rate:,.1f} generated tok/s" if rate else "")
    ]
    if f["policy"] is None:
        return lines
    return [
        *lines,
        f"gate {f['policy']}{_params(f['policy_params'])}: window "
        f"{w.get('min')}/{w.get('mean')}/{w.get('max')} (min/mean/max) over "
        f"{f['control_periods']} periods, {f['pauses']} pauses, {f['resumes']} resumes, "
        f"agent-seconds paused {f['agent_seconds_paused']}, pending {f['agent_seconds_pending']}",
    ]


def render_comparison(c: dict[str, Any]) -> str:
    lines = [f"{c['run']} against {c['against']}: {c['common_tasks']} tasks in both"]
    if c["only_in_first"] or c["only_in_this"]:
        lines.append(
            f"  ({c['only_in_first']} only in the first, {c['only_in_this']} only in this one)"
        )
    if c["changed"]:
        lines.append(f"{len(c['changed'])} changed outcome:")
        lines += [
            "  " + line
            for line in columns(
                [[ch["task_id"], ch["from"], "->", ch["to"]] for ch in c["changed"]], set()
            )
        ]
    else:
        lines.append("no task changed outcome")
    d = c["rate_difference"]
    if d:
        lines.append(
            f"solve rate difference {_signed(d['estimate'])} over {c['paired_scored']} tasks "
            f"scored in both (95% CI {_signed(d['low'])} to {_signed(d['high'])}, "
            "Newcombe paired)"
        )
    return "\n".join(lines)


def columns(rows: list[list[str]], right: set[int]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(
            (cell.rjust(w) if i in right else cell.ljust(w))
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in rows
    ]


def _result(row: dict[str, Any]) -> str:
    if row["solved"] is None:
        return "-"
    r = row["reward"]
    if r is not None and r not in (0.0, 1.0):
        return f"{r:.3f}"
    return "solved" if row["solved"] else "failed"


def _params(params: dict[str, Any] | None) -> str:
    set_ = {k: v for k, v in (params or {}).items() if v is not None}
    return (":" + ",".join(f"{k}={v}" for k, v in set_.items())) if set_ else ""


def _num(v: float | None, fmt: str = ",") -> str:
    return "-" if v is None else format(v, fmt)


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def _signed(v: float) -> str:
    return f"{100 * v:+.1f} pp"
