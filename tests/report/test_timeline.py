"""timeline.png: the series and phases read from control.jsonl, the PNG every run writes, and
a plot that fails without losing the summary."""

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from runner.report.timeline import phases, series, write_timeline
from tests.conftest import run_cli

ROOT = Path(__file__).resolve().parents[2]
PNG = b"\x89PNG\r\n\x1a\n"


def line(t, w0, w1, active, paused=0, pending=0, finished=0, u=0.1, h=0.9, **extra):
    return {"t": t, "w_before": w0, "w_after": w1, "u": u, "h": h, "active": active,
            "paused": paused, "pending": pending, "finished": finished, **extra}  # fmt: skip


def batch_lines():
    """Ramp (W 2->6 over 0..4 s), hold with agents waiting until 8 s, then drain."""
    out = [line(t, 2 + 2 * t // 2, 4 + 2 * t // 2, 4 + t, pending=10 - t) for t in (0, 2, 4)]
    out += [line(t, 8, 8, 8, pending=2, paused=1, finished=t - 4) for t in (6, 8)]
    out += [line(t, 8, 8, 8 - t + 10, finished=t - 2) for t in (10, 12, 14)]
    return out


def test_phases_follow_the_documented_rule():
    s = series(batch_lines())
    ph = phases(s)
    assert ph.warmup_end == 6  # the first period the window did not grow
    assert ph.cooldown_start == 10  # after the last period with a waiting agent
    assert ph.end == 14
    assert s.window == [4, 6, 8, 8, 8, 8, 8, 8]


def test_nothing_ever_waits_cooldown_starts_at_the_first_finish():
    lines = [line(0, 4, 6, 6), line(2, 6, 6, 6), line(4, 6, 6, 5, finished=1), line(6, 6, 6, 0)]
    ph = phases(series(lines))
    assert (ph.warmup_end, ph.cooldown_start, ph.end) == (2, 4, 6)


def test_resumed_session_is_drawn_after_the_first():
    lines = [*batch_lines(), line(0, 2, 4, 2), line(2, 4, 4, 2, finished=1), line(4, 4, 4, 0)]
    s = series(lines)
    assert s.sessions == [16] and s.t[-3:] == [16, 18, 20]  # one period after the first
    assert phases(s).warmup_end == 18  # the phases of the last session


def test_data_parallel_ranks_are_summed():
    lines = [
        line(0, 2, 4, 4, u=0.2, h=None, rank=0),
        line(0, 2, 4, 3, u=0.4, h=0.5, rank=1),
        line(2, 4, 4, 4, u=0.2, h=0.9, rank=0),
        line(2, 4, 4, 4, u=0.4, h=0.7, rank=1),
    ]
    s = series(lines)
    assert s.window == [8, 8] and s.active == [7, 8]
    assert s.u == pytest.approx([0.3, 0.3]) and s.h == pytest.approx([0.5, 0.8])


def test_write_timeline(tmp_path):
    with (tmp_path / "control.jsonl").open("w") as f:
        for rec in batch_lines():
            f.write(json.dumps(rec) + "\n")
        f.write('{"t": 16, "w_bef')  # torn last line of a killed run: skipped
    out = write_timeline(tmp_path)
    assert out == tmp_path / "timeline.png" and out.read_bytes()[:8] == PNG


def test_every_run_writes_a_timeline_and_report_plot_redraws_it(tmp_path):
    out = tmp_path / "sim"
    run_cli("--engine", "sim", "--workload", "tiny", "--sim-deployment", "tiny-cpu", "--out",
            str(out), "-q", timeout=300)  # fmt: skip
    png = out / "timeline.png"
    assert png.read_bytes()[:8] == PNG
    png.unlink()
    p = subprocess.run(
        [sys.executable, str(ROOT / "run.py"), "report", str(out), "--plot"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert f"wrote {png}" in p.stderr and png.read_bytes()[:8] == PNG


def test_a_failing_plot_keeps_the_summary(tmp_path, caplog):
    """A control.jsonl that cannot be read (here a corrupt line left in the folder) fails the
    plot; the batch's summary.json is still written and the failure is logged."""
    from runner.batch.batch import Batch
    from runner.batch.session import execute
    from runner.policies.registry import make_policy
    from runner.runfolder.store import RunStore
    from runner.sim.simulate import load_workload, sim_config, sim_parts
    from runner.sim.tools import NullSandbox
    from runner.sim.vclock import run_virtual

    store = RunStore(tmp_path)
    store.control.write_text("not json\n")
    parts = sim_parts(load_workload("tiny"), "tiny-cpu")
    batch = Batch(
        parts.tasks, parts.engine, NullSandbox(), make_policy("aimd"), store, sim_config(parts)
    )
    with caplog.at_level(logging.WARNING, logger="concur"):
        outcome = execute(
            batch, parts.engine, "test", task_ids=[t.id for t in parts.tasks],
            invalid_records=0, config={}, run_loop=run_virtual,
        )  # fmt: skip
    assert outcome.exit_code == 0
    assert json.loads(store.summary.read_text())["finished"] == len(parts.tasks)
    assert not (tmp_path / "timeline.png").exists()
    assert "could not draw" in caplog.text and "control.jsonl:1" in caplog.text
