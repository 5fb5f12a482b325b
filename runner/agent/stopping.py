"""Stopping a batch on a signal (SIGTERM from a cluster scheduler, SIGINT from a terminal).

The first signal starts a drain: no agent gets a slot any more; the agents that hold one (or
are between two of their own steps) go on for up to `grace` seconds and are recorded if they
finish; every other agent is cancelled at once (not recorded: it runs again on resume). When
the grace period ends, or on a second signal, everything still running is cancelled: the
batch's teardown kills the tool processes and removes the workspaces either way.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable
from dataclasses import dataclass, field

from ..gate.gate import AdmissionGate, Unit

log = logging.getLogger("concur")

DEFAULT_GRACE_SECONDS = 30.0
SIGNALS = (signal.SIGINT, signal.SIGTERM)


class DrainingGate:
    """An AdmissionGate in front of the batch's gate that can stop admitting: after
    `stop_admitting()`, only agents that were already admitted (and not waiting) may go on."""

    def __init__(self, gate: AdmissionGate) -> None:
        self.inner = gate
        self.unit: Unit = gate.unit
        self._admitted: set[str] = set()  # got a slot at least once, not finished
        self._waiting: set[str] = set()  # inside acquire right now
        self._continuing: set[str] | None = None  # None: not draining

    @property
    def draining(self) -> bool:
        return self._continuing is not None

    def stop_admitting(self) -> set[str]:
        """-> the keys that may go on (admitted, not waiting at the gate)."""
        self._continuing = self._admitted - self._waiting
        return set(self._continuing)

    def register(self, key: str) -> None:
        self.inner.register(key)

    async def acquire(self, key: str, context_tokens: int = 0) -> None:
        if self._continuing is not None and key not in self._continuing:
            raise asyncio.CancelledError  # not admitted before the stop: it runs on resume
        self._waiting.add(key)
        try:
            await self.inner.acquire(key, context_tokens)
        finally:
            self._waiting.discard(key)
        self._admitted.add(key)

    def done_request(self, key: str) -> None:
        self.inner.done_request(key)

    def finish(self, key: str) -> None:
        self._admitted.discard(key)
        self.inner.finish(key)

    @property
    def window(self) -> int:
        return self.inner.window

    def counts(self) -> dict[str, int]:
        return self.inner.counts()

    def state(self, key: str) -> str:
        return self.inner.state(key)


@dataclass
class SignalStop:
    """What the signal handlers saw, and the hooks they act through."""

    grace: float = DEFAULT_GRACE_SECONDS
    received: signal.Signals | None = None  # the first signal
    hard: bool = False  # stopped at once: a second signal, or the grace period ran out
    _drain: Callable[[], int] | None = None  # -> agents allowed to finish
    _cancel: Callable[[], object] | None = None
    _timer: asyncio.TimerHandle | None = field(default=None, repr=False)

    @property
    def exit_code(self) -> int:
        return 128 + int(self.received) if self.received is not None else 0

    def install(
        self,
        loop: asyncio.AbstractEventLoop,
        drain: Callable[[], int],
        cancel: Callable[[], object],
    ) -> None:
        self._drain, self._cancel = drain, cancel
        for sig in SIGNALS:
            loop.add_signal_handler(sig, self._received, sig, loop)

    def uninstall(self, loop: asyncio.AbstractEventLoop) -> None:
        for sig in SIGNALS:
            loop.remove_signal_handler(sig)
        if self._timer is not None:
            self._timer.cancel()

    def _received(self, sig: signal.Signals, loop: asyncio.AbstractEventLoop) -> None:
        assert self._drain is not None and self._cancel is not None
        if self.received is not None:
            log.warning("%s again: stopping now", sig.name)
            self._stop_now()
            return
        self.received = sig
        going_on = self._drain()
        log.warning(
            "%s: stopping; no agent is admitted any more; %d agents in flight get up to %gs "
            "to finish (a second signal stops at once); finished agents are saved, the others "
            "run again when you rerun the command",
            sig.name,
            going_on,
            self.grace,
        )
        if self.grace <= 0 or going_on == 0:
            self._stop_now()
        else:
            self._timer = loop.call_later(self.grace, self._grace_over)

    def _grace_over(self) -> None:
        log.warning("grace period of %gs over: stopping the agents still running", self.grace)
        self._stop_now()

    def _stop_now(self) -> None:
        assert self._cancel is not None
        self.hard = True
        self._cancel()
