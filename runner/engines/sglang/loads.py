"""Reading U: SGLang's per-rank load snapshots.

Releases since 0.5.13 publish them in shared memory (`tokenizer_manager.load_snapshot_reader
.read_all()`: a few mmap'd bytes under a shared flock, cheap enough to read synchronously on
every control period). Older releases only answer `await tokenizer_manager.get_loads()` over
ZMQ, which a synchronous `cache_stats()` cannot await: there a background task polls it and
the latest answer is kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

# The snapshot fields the adapter reports (LoadSnapshot in srt/managers/load_snapshot.py;
# GetLoadsReqOutput in older releases).
SNAPSHOT_FIELDS = (
    "dp_rank",
    "token_usage",
    "num_used_tokens",
    "max_total_num_tokens",
    "num_running_reqs",
    "num_waiting_reqs",
    "timestamp",
)


def snapshot_field(obj: Any, name: str) -> Any:
    """A field of a load snapshot: msgspec Struct / dataclass attribute, or dict key."""
    if isinstance(obj, dict):
        return obj.get(name)
    return getattr(obj, name, None)


def number(x: Any) -> float | None:
    return float(x) if isinstance(x, int | float) and not isinstance(x, bool) else None


class LoadSnapshots:
    """The latest load snapshots of one engine, and how they are obtained (`source`:
    "load_snapshot_reader", "get_loads" or "unavailable")."""

    def __init__(self, tokenizer_manager: Any, refresh_s: float) -> None:
        self._tm = tokenizer_manager
        self._refresh_s = refresh_s
        reader = getattr(tokenizer_manager, "load_snapshot_reader", None)
        self._reader = reader if callable(getattr(reader, "read_all", None)) else None
        if self._reader is not None:
            self.source = "load_snapshot_reader"
        elif callable(getattr(tokenizer_manager, "get_loads", None)):
            self.source = "get_loads"
        else:
            self.source = "unavailable"
        self.snapshots: list[Any] = []
        self.read_at: float | None = None
        self.error: str | None = None
        self._poller: asyncio.Task[None] | None = None
        self._closed = False

    def read(self) -> None:
        """Read the shared-memory snapshots now (reader path only); raises what it raises."""
        if self._reader is not None:
            self.snapshots = list(self._reader.read_all())
            self.read_at = time.monotonic()

    def refresh(self) -> None:
        """What a control period does: read now (reader path, failures kept in `error`) or
        make sure the poller runs (get_loads path)."""
        if self._reader is not None:
            try:
                self.read()
                self.error = None
            except Exception as e:
                self.error = f"{type(e).__name__}: {e}"
        else:
            self.ensure_polling()

    def ensure_polling(self) -> None:
        """Start the get_loads poller once, inside a running event loop."""
        if self.source != "get_loads" or self._poller is not None or self._closed:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop (e.g. the final summary): keep the last value
        self._poller = loop.create_task(self._poll(), name="sglang-get-loads")

    async def _poll(self) -> None:
        while not self._closed:
            try:
                self.snapshots = list(await self._tm.get_loads())
                self.read_at = time.monotonic()
                self.error = None
            except asyncio.CancelledError:
                raise
            except Exception as e:
                self.error = f"{type(e).__name__}: {e}"
            await asyncio.sleep(self._refresh_s)

    async def aclose(self) -> None:
        self._closed = True
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._poller
            self._poller = None

    def age_s(self) -> float | None:
        return round(time.monotonic() - self.read_at, 3) if self.read_at is not None else None

    def rank_usage(self, dp_size: int) -> list[float | None]:
        """token_usage per rank (snapshots without a usable dp_rank count by position)."""
        usage: list[float | None] = [None] * dp_size
        for i, snap in enumerate(self.snapshots):
            r = snapshot_field(snap, "dp_rank")
            r = r if isinstance(r, int) and 0 <= r < dp_size else i
            if r < dp_size:
                usage[r] = number(snapshot_field(snap, "token_usage"))
        return usage

    def rank_capacity(self, rank: int) -> int | None:
        """max_total_num_tokens of one rank's snapshot."""
        cap = None
        for i, snap in enumerate(self.snapshots):
            r = snapshot_field(snap, "dp_rank")
            if (r if isinstance(r, int) else i) == rank:
                v = number(snapshot_field(snap, "max_total_num_tokens"))
                cap = int(v) if v is not None else None
        return cap

    def rows(self) -> list[dict[str, Any]]:
        """One dict of SNAPSHOT_FIELDS per snapshot."""
        return [{k: snapshot_field(s, k) for k in SNAPSHOT_FIELDS} for s in self.snapshots]
