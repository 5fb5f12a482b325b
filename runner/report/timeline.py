"""timeline.png from control.jsonl: the window W, the agents active / paused / pending, and
the signals U and H over time, with the batch's phases marked.

Phases, from the data (docs/report.md):
- warmup: from the start to the first control period in which the window did not grow
  (the end of the initial ramp);
- cooldown: from the last moment any agent waited (pending or paused), or from the first
  agent to finish if that is later: after it the gate limits nothing and the batch drains;
- middle: in between (may be empty).
A resumed run appends a second session to control.jsonl whose clock starts at 0 again; the
sessions are drawn one after the other and the phases are those of the last session.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .load import ReportError, control_lines


class TimelineError(ReportError):
    pass


@dataclass
class Series:
    t: list[float] = field(default_factory=list)
    window: list[float] = field(default_factory=list)
    active: list[float] = field(default_factory=list)
    paused: list[float] = field(default_factory=list)
    pending: list[float] = field(default_factory=list)
    finished: list[float] = field(default_factory=list)
    u: list[float | None] = field(default_factory=list)
    h: list[float | None] = field(default_factory=list)
    growing: list[bool] = field(default_factory=list)
    session: list[int] = field(default_factory=list)  # 0, then 1 for the first resume, ...
    sessions: list[float] = field(default_factory=list)  # start time of each resumed session


@dataclass(frozen=True)
class Phases:
    warmup_end: float
    cooldown_start: float
    end: float

    def to_json(self) -> dict[str, float]:
        return {
            "warmup_end": self.warmup_end,
            "cooldown_start": self.cooldown_start,
            "end": self.end,
        }


def series(lines: list[dict[str, Any]]) -> Series:
    """One point per control period; data-parallel ranks summed (W, counts) and averaged
    (U, H over the ranks that measured one)."""
    s = Series()
    periods: dict[tuple[int, float], list[dict[str, Any]]] = defaultdict(list)
    session, offset, last, step = 0, 0.0, -1.0, 0.0
    starts: list[float] = []
    for line in lines:
        t = float(line["t"])
        if t < last:  # a resumed session: its clock started at 0 again; one period apart
            session, offset = session + 1, offset + last + (step or 1.0)
            starts.append(offset)
        elif t > last >= 0:
            step = t - last
        last = t
        periods[(session, offset + t)].append(line)
    for (n, t), group in sorted(periods.items()):
        s.t.append(t)
        s.session.append(n)
        s.window.append(sum(g["w_after"] for g in group))
        s.growing.append(sum(g["w_after"] for g in group) > sum(g["w_before"] for g in group))
        for name in ("active", "paused", "pending", "finished"):
            getattr(s, name).append(sum(g.get(name, 0) for g in group))
        s.u.append(_mean(g.get("u") for g in group))
        s.h.append(_mean(g.get("h") for g in group))
    s.sessions = starts
    return s


def _mean(values: Any) -> float | None:
    vs = [v for v in values if v is not None]
    return sum(vs) / len(vs) if vs else None


def phases(s: Series) -> Phases:
    """The documented rule (module docstring) over the last session."""
    if not s.t:
        raise TimelineError("no control periods")
    idx = [i for i, n in enumerate(s.session) if n == s.session[-1]]
    end = s.t[idx[-1]]
    warm = next((s.t[i] for i in idx if not s.growing[i]), end)
    waited = [i for i in idx if s.pending[i] + s.paused[i] > 0]
    after_wait = s.t[min(waited[-1] + 1, idx[-1])] if waited else s.t[idx[0]]
    first_done = next((s.t[i] for i in idx if s.finished[i] > s.finished[idx[0]]), end)
    cool = min(end, max(warm, after_wait, first_done))
    return Phases(warm, cool, end)


def write_timeline(root: Path, out: Path | None = None) -> Path:
    """Draw `root`/control.jsonl into `out` (default `root`/timeline.png)."""
    lines = control_lines(root)
    if not lines:
        raise TimelineError(f"{root}: no control periods in control.jsonl to plot")
    s = series(lines)
    out = out or root / "timeline.png"
    draw(s, phases(s), out, title=root.name)
    return out


def draw(s: Series, ph: Phases, out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display; also safe inside a batch process
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(
        2, 1, sharex=True, figsize=(10, 5.5), height_ratios=(3, 2), layout="constrained"
    )
    try:
        top.stackplot(
            s.t,
            s.active,
            s.paused,
            s.pending,
            labels=["active", "paused", "pending"],
            colors=["#4c78a8", "#f58518", "#bab0ac"],
            alpha=0.6,
            step="post",
        )
        top.step(s.t, s.window, where="post", color="black", lw=1.5, label="W (window)")
        top.set_ylabel("agents")
        top.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
        fig.suptitle(f"{title}: gate window, agents and signals per control period", fontsize=10)
        bottom.plot(s.t, _nan(s.u), color="#e45756", lw=1.3, label="U (KV usage)")
        bottom.plot(s.t, _nan(s.h), color="#54a24b", lw=1.3, label="H (hit rate)")
        bottom.set_ylim(-0.02, 1.02)
        bottom.set_ylabel("fraction")
        bottom.set_xlabel("seconds")
        bottom.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
        for ax in (top, bottom):
            _mark_phases(ax, s, ph)
        fig.savefig(out, dpi=110)
    finally:
        plt.close(fig)


def _mark_phases(ax: Any, s: Series, ph: Phases) -> None:
    start = s.sessions[-1] if s.sessions else s.t[0]
    ax.axvspan(start, ph.warmup_end, color="#72b7b2", alpha=0.15, lw=0)
    ax.axvspan(ph.cooldown_start, ph.end, color="#b279a2", alpha=0.15, lw=0)
    for t in s.sessions:
        ax.axvline(t, color="grey", ls="--", lw=1)
    ax.axvline(ph.warmup_end, color="#72b7b2", lw=0.8)
    ax.axvline(ph.cooldown_start, color="#b279a2", lw=0.8)
    if ax.get_subplotspec().is_first_row():
        tr = ax.get_xaxis_transform()
        # each label centred on its phase, so a short warmup does not overprint "middle"
        for a, b, label in (
            (start, ph.warmup_end, "warmup"),
            (ph.warmup_end, ph.cooldown_start, "middle"),
            (ph.cooldown_start, ph.end, "cooldown"),
        ):
            if b > a:
                ax.text((a + b) / 2, 0.98, label, transform=tr, ha="center", va="top",
                        fontsize=8, color="#333")  # fmt: skip


def _nan(values: list[float | None]) -> list[float]:
    return [float("nan") if v is None else v for v in values]
