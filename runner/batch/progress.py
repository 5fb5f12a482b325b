"""Progress: on a terminal, a live rich summary line with a row per task under it (batches of
up to ROWS_MAX agents); otherwise the summary line, logged periodically."""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.console import RenderableType

log = logging.getLogger("concur")
ROWS_MAX = 50  # per-task rows for batches up to this many agents; larger ones: the line only


@dataclass(frozen=True)
class TaskRow:
    """One agent as the display shows it."""

    task_id: str
    # pending, setup, active, paused, idle (between requests under request-cap), in tool,
    # or "done <status>"
    state: str
    step: int  # steps started
    max_steps: int
    context_tokens: int
    generated_tokens: int
    last_tool: str | None
    seconds: float  # since the agent started (its workspace setup), to its end when done


@dataclass(frozen=True)
class BatchStatus:
    """What the batch reports to a display (runner/batch/batch.py `Batch.status`)."""

    done: int
    total: int
    active: int
    paused: int
    pending: int
    window: int
    steps: int  # every step is one generation request
    generated_tokens: int
    hit: float | None  # cached / prompt tokens so far
    u: float | None  # the latest control period's signals
    h: float | None
    step_budget: int = 0  # the steps this session's agents may take at most, all together
    rows: tuple[TaskRow, ...] = ()  # per task, for batches of up to ROWS_MAX agents


def render(s: BatchStatus, elapsed: float) -> str:
    def pct(v: float | None) -> str:
        return "-" if v is None else f"{100 * v:.0f}%"

    rate = s.generated_tokens / elapsed if elapsed > 0 else 0.0
    return (
        f"agents {s.done}/{s.total} | W {s.window} active {s.active} "
        f"paused {s.paused} pending {s.pending} | "
        f"steps {s.steps} | "
        f"{rate:.1f} tok/s | hit {pct(s.hit)} | U {pct(s.u)} H {pct(s.h)} | "
        f"{elapsed:.0f}s, ETA {eta(s, elapsed)}"
    )


def eta(s: BatchStatus, elapsed: float) -> str:
    """From steps done against the step budget, so there is one long before the first agent
    ends; an upper bound (agents that submit early leave budget unused), which falls as they
    finish. Without a budget, from agents finished."""
    if s.step_budget and s.steps:
        left = max(0, s.step_budget - s.steps)
        return f"<={elapsed / s.steps * left:.0f}s"
    return f"{elapsed / s.done * (s.total - s.done):.0f}s" if s.done else "-"


def render_rows(rows: tuple[TaskRow, ...]) -> RenderableType:
    """The per-task table (rich)."""
    from rich.table import Table

    table = Table(box=None, pad_edge=False, header_style="bold")
    for name, justify in [
        ("task", "left"),
        ("state", "left"),
        ("step", "right"),
        ("context", "right"),
        ("gen tok", "right"),
        ("last tool", "left"),
        ("seconds", "right"),
    ]:
        table.add_column(name, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    for r in rows:
        table.add_row(
            r.task_id,
            r.state,
            f"{r.step}/{r.max_steps}",
            f"{r.context_tokens:,}",
            f"{r.generated_tokens:,}",
            r.last_tool or "-",
            f"{r.seconds:.0f}",
        )
    return table


def render_live(s: BatchStatus, elapsed: float) -> RenderableType:
    """What the terminal shows: the summary line, the task rows under it."""
    from rich.console import Group
    from rich.text import Text

    line = Text(render(s, elapsed))
    return Group(line, render_rows(s.rows)) if s.rows else line


class Progress:
    def __init__(self, interval: float = 10.0, tty: bool | None = None) -> None:
        self.interval = interval
        self.tty = sys.stderr.isatty() if tty is None else tty

    async def run(self, status: Callable[[], BatchStatus]) -> None:
        """Until cancelled. A display failure is logged once and the display stops; the batch
        goes on."""
        try:
            await self._run(status)
        except Exception:
            log.exception("progress display failed; the batch goes on without it")

    async def _run(self, status: Callable[[], BatchStatus]) -> None:
        t0 = time.monotonic()

        def line() -> str:
            return render(status(), time.monotonic() - t0)

        if not self.tty:
            while True:
                await asyncio.sleep(self.interval)
                log.info(line())
        from rich.console import Console
        from rich.live import Live

        with Live(console=Console(stderr=True), refresh_per_second=4, transient=True) as live:
            try:
                while True:
                    live.update(render_live(status(), time.monotonic() - t0))
                    await asyncio.sleep(0.5)
            finally:
                log.info(line())
