"""The HTML report in a real headless chromium: the page loads with no console error and no
fetch, lists the tasks, shows every step of a task, filters by status and reward, searches,
shows model text as text, and renders only the visible rows of 10,000."""

import asyncio
import json
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from runner.report.html import write_html
from tests.conftest import run_cli, write_jsonl
from tests.support.browser import Page, chromium

ROOT = Path(__file__).resolve().parents[2]
READY = "document.body && document.body.dataset.ready"


class Browser:
    """One chromium for the module; its page lives on the module's event loop."""

    def __init__(self, page: Page) -> None:
        self.page = page

    async def open(self, path: Path) -> None:
        await self.page.open(path.resolve().as_uri(), READY)

    async def js(self, expression: str):
        return await self.page.eval(expression)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def browser() -> AsyncIterator[Browser]:
    async with chromium() as page:
        yield Browser(page)


def step(n: int, tool: str | None, obs: str) -> dict:
    return {
        "step": n, "prompt_tokens": 100 * n, "cached_tokens": 90 * n, "completion_tokens": 7 + n,
        "gen_seconds": 0.25, "finish_reason": "stop", "tool": tool,
        "arguments": {"command": f"ls -{n}"} if tool else None, "tool_seconds": 0.25 * n,
        "observation": obs, "tool_ok": tool is not None, "wait_seconds": 1.5 * n,
    }  # fmt: skip


def trajectory(task_id: str, status: str, solved: bool | None, steps: list[dict], **extra) -> dict:
    replies = [f"reply {s['step']} of {task_id}" for s in steps]
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "fix it"}]
    for text, s in zip(replies, steps, strict=True):
        messages += [{"role": "assistant", "content": text},
                     {"role": "user", "content": s["observation"]}]  # fmt: skip
    ev = None if solved is None else {"command": "pytest -q", "exit_code": 0 if solved else 1,
                                      "solved": solved, "output_tail": "1 passed"}  # fmt: skip
    return {
        "format": 1, "task_id": task_id, "status": status, "reason": f"{status} reason",
        "answer": None, "eval": ev, "steps": len(steps), "messages": messages,
        "step_log": steps, "prompt_tokens": sum(s["prompt_tokens"] for s in steps),
        "cached_tokens": sum(s["cached_tokens"] for s in steps),
        "completion_tokens": sum(s["completion_tokens"] for s in steps), "seconds": 3.0, **extra,
    }  # fmt: skip


def run_folder(root: Path, records: list[dict]) -> Path:
    root.mkdir(parents=True)
    (root / "run.json").write_text(json.dumps({"format": 1, "source": "tasks/t.jsonl"}))
    write_jsonl(root / "trajectories.jsonl", records)
    return root


RECORDS = [
    trajectory("alpha", "submitted", True,
               [step(1, "bash", "file.py"), step(2, "submit", "needle-in-a-haystack")]),
    trajectory("beta", "max_steps", False,
               [step(1, None, "no tool call: <img src=x onerror=\"console.error('xss')\">"),
                step(2, "bash", "</script><script>console.error('broke out')</script>{{DETAILS}}"),
                step(3, "bash", "ok")]),
    trajectory("gamma", "error", None, [step(1, "bash", "boom")]),
    trajectory("delta#0", "submitted", True, [step(1, "bash", "x")], reward=0.5),
]  # fmt: skip


@pytest.fixture(scope="module")
def page_file(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("viewer")
    root = run_folder(d / "run", RECORDS)
    write_html(root, d / "report.html")
    return d / "report.html"


async def rows(b: Browser) -> list[str]:
    return await b.js(
        "[...document.querySelectorAll('#spacer .row')].map(r => r.children[0].textContent)"
    )


async def set_value(b: Browser, element: str, value: str) -> None:
    await b.js(f"(() => {{ const e = document.getElementById({element!r}); e.value = {value!r};"
         "e.dispatchEvent(new Event('input')); })()")  # fmt: skip
    if element == "search":  # debounced
        await asyncio.sleep(0.3)


@pytest.mark.asyncio(loop_scope="module")
async def test_page_loads_with_no_error_and_no_fetch(browser, page_file):
    await browser.open(page_file)
    assert await rows(browser) == ["alpha", "beta", "delta#0", "gamma"]
    assert await browser.js("document.getElementById('count').textContent") == "4 of 4 tasks"
    assert "solve rate 2/3" in await browser.js("document.getElementById('summary').textContent")
    assert browser.page.errors() == []
    assert browser.page.requests() == [page_file.resolve().as_uri()]


@pytest.mark.asyncio(loop_scope="module")
async def test_a_task_shows_every_step(browser, page_file):
    await browser.open(page_file)
    await browser.js("document.querySelector('#spacer .row[data-index=\"1\"]').click()")
    steps = await browser.js(
        "[...document.querySelectorAll('#detail .step')].map(s => s.innerText)"
    )
    assert len(steps) == 3
    for n, text in enumerate(steps, 1):
        assert f"reply {n} of beta" in text  # the assistant's text
        assert f"prompt {100 * n} (cached {90 * n})" in text and f"generated {7 + n}" in text
        assert f"gate wait {1.5 * n:.2f} s" in text and f"tool {0.25 * n:.2f} s" in text
    assert "(no tool call)" in steps[0] and "bash" in steps[1] and '"ls -2"' in steps[1]
    # model and tool text is shown as text: nothing it holds runs or becomes an element
    assert "<img src=x onerror=" in steps[0] and "</script><script>" in steps[1]
    assert "{{DETAILS}}" in steps[1]
    assert await browser.js("document.querySelectorAll('#detail img, #detail script').length") == 0
    assert "eval: failed" in await browser.js("document.getElementById('detail').innerText")
    assert browser.page.errors() == []


@pytest.mark.asyncio(loop_scope="module")
async def test_filters_and_search(browser, page_file):
    await browser.open(page_file)
    await set_value(browser, "status", "submitted")
    assert await rows(browser) == ["alpha", "delta#0"]
    await set_value(browser, "status", "")
    await set_value(browser, "result", "failed")
    assert await rows(browser) == ["beta"]
    await set_value(browser, "result", "unscored")
    assert await rows(browser) == ["gamma"]
    await set_value(browser, "result", "")
    await set_value(browser, "minreward", "0.4")
    assert await rows(browser) == ["alpha", "delta#0"]
    await set_value(browser, "minreward", "0.9")
    assert await rows(browser) == ["alpha"]
    await set_value(browser, "minreward", "")
    await set_value(browser, "search", "NEEDLE-in")  # in alpha's observation only, any case
    assert await rows(browser) == ["alpha"]
    await set_value(browser, "search", "gam")
    assert await rows(browser) == ["gamma"]
    assert await browser.js("document.getElementById('count').textContent") == "1 of 4 tasks"
    assert browser.page.errors() == []


@pytest.mark.asyncio(loop_scope="module")
async def test_ten_thousand_trajectories_render_lazily(browser, tmp_path):
    records = [trajectory(f"t{i:05d}", "submitted", i % 3 == 0, [step(1, "bash", f"out {i}")])
               for i in range(10_000)]  # fmt: skip
    root = run_folder(tmp_path / "big", records)
    write_html(root, tmp_path / "big.html")
    await browser.open(tmp_path / "big.html")
    count = await browser.js("document.getElementById('count').textContent")
    assert count == "10000 of 10000 tasks"
    shown = await rows(browser)
    assert 10 < len(shown) < 100 and shown[0] == "t00000"
    await browser.js(
        "(() => { const l = document.getElementById('list'); l.scrollTop = l.scrollHeight;"
        "l.dispatchEvent(new Event('scroll')); })()"
    )
    await asyncio.sleep(0.2)  # the redraw runs on the next animation frame
    assert "t09999" in await rows(browser) and len(await rows(browser)) < 100
    await browser.js("document.querySelector('#spacer .row:last-child').click()")
    assert "out 9999" in await browser.js("document.getElementById('detail').innerText")
    assert browser.page.errors() == []


@pytest.mark.asyncio(loop_scope="module")
async def test_report_html_of_a_real_run(browser, tmp_path):
    out = tmp_path / "sim"
    run_cli("--engine", "sim", "--workload", "tiny", "--sim-deployment", "tiny-cpu", "--out",
            str(out), "-q", timeout=300)  # fmt: skip
    html = tmp_path / "sim.html"
    p = subprocess.run(
        [sys.executable, str(ROOT / "run.py"), "report", str(out), "--html", str(html)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    await browser.open(html)
    ids = sorted(json.loads(line)["task_id"] for line in (out / "trajectories.jsonl").open())
    assert await rows(browser) == ids
    assert await browser.js("document.querySelector('#timeline img').naturalWidth") > 500
    await browser.js("document.querySelector('#spacer .row').click()")
    first = json.loads((out / "trajectories.jsonl").read_text().splitlines()[0])
    n = {json.loads(line)["task_id"]: json.loads(line)["steps"] for line in
         (out / "trajectories.jsonl").open()}[ids[0]]  # fmt: skip
    assert await browser.js("document.querySelectorAll('#detail .step').length") == n
    assert first["step_log"]  # the run logged its steps
    assert browser.page.errors() == []


@pytest.mark.asyncio(loop_scope="module")
async def test_the_browser_catches_console_errors_and_exceptions(browser, tmp_path):
    """The checks above can fail: a page that logs an error and throws is caught."""
    bad = tmp_path / "bad.html"
    bad.write_text(
        "<body><script>console.error('logged'); document.body.dataset.ready = '1';"
        "setTimeout(() => { throw new Error('thrown'); });</script></body>"
    )
    await browser.open(bad)
    await asyncio.sleep(0.3)
    errors = browser.page.errors()
    assert any("logged" in e for e in errors) and any("thrown" in e for e in errors)
