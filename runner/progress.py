"""Progress: a live rich line on a terminal, plain periodic log lines otherwise."""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .batch import Batch

log = logging.getLogger("concur")


def snapshot(batch: Batch, t0: float) -> dict[str, Any]:
    tot = batch.totals
    c = batch.gate.counts()
    last = batch.controller.stats.last
    done = sum(tot.by_status.values())
    total = len(batch.todo)
    elapsed = time.monotonic() - t0
    rate = tot.generated / elapsed if elapsed > 0 else 0.0
    eta = (elapsed / done * (total - done)) if done else None
    return {
        "done": done,
        "total": total,
        "active": c["active"],
        "paused": c["paused"],
        "pending": c["pending"],
        "window": batch.gate.window,
        "steps": tot.requests,  # every step is one generation request
        "tok_s": rate,
        "hit": tot.cached / tot.prompt if tot.prompt else None,
        "u": last.get("u"),
        "h": last.get("h"),
        "eta": eta,
        "elapsed": elapsed,
    }


def render(s: dict[str, Any]) -> str:
    def pct(v: float | None) -> str:
        return "-" if v is None else f"{100 * v:.0f}%"

    eta = "-" if s["eta"] is None else f"{s['eta']:.0f}s"
    return (
        f"agents {s['done']}/{s['total']} | W {s['window']} active {s['active']} "
        f"paused {s['paused']} pending {s['pending']} | "
        f"steps {s['steps']} | "
        f"{s['tok_s']:.1f} tok/s | hit {pct(s['hit'])} | U {pct(s['u'])} H {pct(s['h'])} | "
        f"{s['elapsed']:.0f}s, ETA {eta}"
    )


class Progress:
    def __init__(self, interval: float = 10.0, tty: bool | None = None) -> None:
        self.interval = interval
        self.tty = sys.stderr.isatty() if tty is None else tty

    async def run(self, batch: Batch) -> None:
        """Until cancelled. A display failure is logged once and the display stops; the batch
        goes on."""
        try:
            await self._run(batch)
        except Exception:
            log.exception("progress display failed; the batch goes on without it")

    async def _run(self, batch: Batch) -> None:
        t0 = time.monotonic()
        if not self.tty:
            while True:
                await asyncio.sleep(self.interval)
                log.info(render(snapshot(batch, t0)))
        from rich.console import Console
        from rich.live import Live

        with Live(console=Console(stderr=True), refresh_per_second=4, transient=True) as live:
            try:
                while True:
                    live.update(render(snapshot(batch, t0)))
                    await asyncio.sleep(0.5)
            finally:
                log.info(render(snapshot(batch, t0)))
