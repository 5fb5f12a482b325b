"""Contracts of the architecture (docs/architecture.md) that a test can hold the code to."""

import json
import time

from runner.sim.tools import SIM_TOOLS
from tests.conftest import read_jsonl, run_cli
from tools.registry import REGISTRY


def test_the_production_registry_does_not_know_the_simulated_tool():
    assert "sim_tool" not in REGISTRY and "sim_tool" in SIM_TOOLS


def test_a_real_task_naming_sim_tool_gets_unknown_tool_within_the_tool_timeout(
    tmp_path, needs_bwrap
):
    """Once, the simulated tool sat in the production registry: a real task calling it
    slept forever, past --tool-timeout. Now it is an unknown tool like any other name."""
    call = {"name": "sim_tool", "arguments": {"seconds": 600, "tokens": 5, "seed": 1}}
    tasks = tmp_path / "t.jsonl"
    with tasks.open("w") as f:
        replay = [f"<tool_call>{json.dumps(call)}</tool_call>"]
        f.write(json.dumps({"id": "calls-it", "prompt": "go", "replay": replay}) + "\n")
        f.write(json.dumps({"id": "offers-it", "prompt": "go", "tools": ["sim_tool"]}) + "\n")
    out = tmp_path / "out"
    t0 = time.monotonic()
    run_cli("--tasks", str(tasks), "--out", str(out), "--engine", "replay", "--tool-timeout", "5")
    assert time.monotonic() - t0 < 120  # a hang would be 600 s (the call's own seconds)
    recs = {r["task_id"]: r for r in read_jsonl(out / "trajectories.jsonl")}
    first = recs["calls-it"]["step_log"][0]
    assert first["tool"] is None and first["tool_ok"] is False
    assert "Unknown tool 'sim_tool'" in first["observation"]
    assert first["tool_seconds"] == 0
    # a task asking for it is a bad record (reported, skipped), as for any unknown name
    assert "offers-it" not in recs
    errors = read_jsonl(out / "errors.jsonl")
    assert any(e.get("task_id") == "offers-it" and "sim_tool" in e["reason"] for e in errors)


class _PlainEngineDouble:
    """Test double: an engine with no capability beyond the protocol's name."""

    name = "plain"


class _ConstrainingEngineDouble(_PlainEngineDouble):
    """Test double: an engine with the ConstrainedDecoding capability."""

    def __init__(self, by_default: bool) -> None:
        self.name = "constraining"
        self._by_default = by_default

    @property
    def constrain_by_default(self) -> bool:
        return self._by_default


def test_constrain_choice_follows_the_capability_not_the_engine_name(caplog):
    from runner.cli.main import constrain_tool_calls

    small = _ConstrainingEngineDouble(by_default=True)  # like llama.cpp
    reasoning = _ConstrainingEngineDouble(by_default=False)  # like SGLang
    assert [constrain_tool_calls(c, small) for c in ("auto", "on", "off")] == [True, True, False]
    assert [constrain_tool_calls(c, reasoning) for c in ("auto", "on", "off")] == [
        False,
        True,
        False,
    ]
    with caplog.at_level("WARNING", logger="concur"):
        assert constrain_tool_calls("on", _PlainEngineDouble()) is False
    assert "plain cannot constrain decoding" in caplog.text
