"""A real headless Debian chromium driven over the DevTools protocol (a local websocket):
open a page, run JavaScript in it, and collect every console error, uncaught exception and
network request. Used by the viewer's test and its benchmark."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import websockets

FLAGS = [
    "--headless",
    "--no-sandbox",  # as root
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--remote-debugging-address=127.0.0.1",
    "--remote-debugging-port=0",  # chromium picks a free port and writes DevToolsActivePort
]


class BrowserError(RuntimeError):
    pass


class Page:
    def __init__(self, ws: Any) -> None:
        self.ws = ws
        self._id = 0
        self._waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.events: list[dict[str, Any]] = []
        self._event_seen = asyncio.Event()

    async def _read(self) -> None:
        async for raw in self.ws:
            msg = json.loads(raw)
            if "id" in msg and msg["id"] in self._waiting:
                self._waiting.pop(msg["id"]).set_result(msg)
            elif "method" in msg:
                self.events.append(msg)
                self._event_seen.set()

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        self._id += 1
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._waiting[self._id] = fut
        await self.ws.send(json.dumps({"id": self._id, "method": method, "params": params}))
        msg = await asyncio.wait_for(fut, 120)
        if "error" in msg:
            raise BrowserError(f"{method}: {msg['error']}")
        return msg["result"]

    async def eval(self, expression: str) -> Any:
        """The value of a JavaScript expression (awaited if it is a promise)."""
        r = await self.call(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in r:
            raise BrowserError(f"{expression[:80]}: {r['exceptionDetails']}")
        return r["result"].get("value")

    async def wait_for(self, method: str, timeout: float = 120) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            for e in self.events:
                if e["method"] == method:
                    return e
            self._event_seen.clear()
            left = deadline - time.monotonic()
            if left <= 0:
                raise BrowserError(f"no {method} within {timeout}s")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._event_seen.wait(), left)

    async def open(self, url: str, ready: str, timeout: float = 120) -> None:
        """Navigate and wait until the JavaScript expression `ready` is truthy. The events
        seen so far (errors included) are dropped: each page is judged on its own."""
        self.events.clear()
        await self.call("Page.navigate", url=url)
        await self.wait_for("Page.loadEventFired", timeout)
        deadline = time.monotonic() + timeout
        while not await self.eval(ready):
            if time.monotonic() > deadline:
                raise BrowserError(f"{url}: {ready} still false after {timeout}s")
            await asyncio.sleep(0.05)

    def errors(self) -> list[str]:
        """Console errors, uncaught exceptions and error log entries seen so far."""
        out = []
        for e in self.events:
            p = e["params"]
            if e["method"] == "Runtime.consoleAPICalled" and p["type"] in ("error", "assert"):
                out.append("console: " + " ".join(str(a.get("value")) for a in p["args"]))
            elif e["method"] == "Runtime.exceptionThrown":
                d = p["exceptionDetails"]
                out.append(f"exception: {d.get('exception', {}).get('description') or d['text']}")
            elif e["method"] == "Log.entryAdded" and p["entry"]["level"] == "error":
                out.append(f"log: {p['entry']['text']}")
        return out

    def requests(self) -> list[str]:
        """URLs the page asked for (data: URLs are inline, not fetches)."""
        return [
            url
            for e in self.events
            if e["method"] == "Network.requestWillBeSent"
            and not (url := e["params"]["request"]["url"]).startswith("data:")
        ]


@contextlib.asynccontextmanager
async def chromium() -> AsyncIterator[Page]:
    """A fresh headless chromium (its own profile) and its first page, with the Runtime,
    Log, Network and Page domains on."""
    exe = shutil.which("chromium")
    if exe is None:
        raise BrowserError("chromium not found: apt-get install -y chromium")
    profile = Path(tempfile.mkdtemp(prefix="concur-chromium-"))
    proc = subprocess.Popen(
        [exe, *FLAGS, f"--user-data-dir={profile}", "about:blank"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        ws_url = await _page_socket(profile, proc)
        async with websockets.connect(ws_url, max_size=None) as ws:
            page = Page(ws)
            reader = asyncio.create_task(page._read())
            try:
                for domain in ("Runtime", "Log", "Network", "Page"):
                    await page.call(f"{domain}.enable")
                yield page
            finally:
                reader.cancel()
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(profile, ignore_errors=True)


async def _page_socket(profile: Path, proc: subprocess.Popen[bytes]) -> str:
    port_file = profile / "DevToolsActivePort"
    deadline = time.monotonic() + 60
    while not port_file.exists() or not port_file.read_text().strip():
        if proc.poll() is not None:
            raise BrowserError(f"chromium exited with {proc.returncode} before it listened")
        if time.monotonic() > deadline:
            raise BrowserError("chromium did not open its DevTools port within 60 s")
        await asyncio.sleep(0.05)
    port = int(port_file.read_text().split()[0])
    while True:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as r:
            pages = [t for t in json.load(r) if t["type"] == "page"]
        if pages:
            return str(pages[0]["webSocketDebuggerUrl"])
        await asyncio.sleep(0.05)
