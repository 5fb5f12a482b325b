"""`python -m bench.bound_gap --unbounded`: the deployment change that makes memory never bind."""

import pytest

from bench import bound_gap as gap
from runner.policies.registry import make_policy
from runner.sim.engine import CostModel
from runner.sim.engine import deployment as sim_deployment
from runner.sim.simulate import simulate
from runner.sim.workload import synthetic

# a small pool the tiny workload overflows (the oracle tests' pressured case)
CAP = {"max_total_tokens": 4000}


def test_the_unbounded_pool_holds_every_context_and_costs_what_the_preset_does():
    w = synthetic("tiny", seed=3, agents=6, steps=(4, 8), final=(1500, 2500))
    base = sim_deployment("tiny-cpu", **CAP)
    changes = gap._unbounded_gpu(w, "tiny-cpu")
    big = sim_deployment("tiny-cpu", **{**CAP, **changes})
    need = sum(w.system_tokens + a.total_tokens() for a in w.agents)
    assert big.pool_tokens >= need > base.pool_tokens
    # only the pool's size changes: every iteration costs what it did
    a, b = CostModel(base), CostModel(big)
    assert a.prefill([(0, 700), (100, 900)]).seconds == b.prefill([(0, 700), (100, 900)]).seconds
    assert a.decode(7, 9000) == b.decode(7, 9000)


def test_on_the_unbounded_pool_nothing_is_evicted_where_the_small_pool_evicts(tmp_path):
    w = synthetic("tiny", seed=3, agents=6, steps=(4, 8), final=(1500, 2500))
    small = simulate(w, "tiny-cpu", make_policy("none"), tmp_path / "s", engine_options=CAP)
    changes = {**CAP, **gap._unbounded_gpu(w, "tiny-cpu")}
    big = simulate(w, "tiny-cpu", make_policy("none"), tmp_path / "b", engine_options=changes)
    assert small.to_json()["engine"]["evicted_tokens"] > 0
    assert big.to_json()["engine"]["evicted_tokens"] == 0
    assert big.sim_seconds < small.sim_seconds


def test_the_tail_runs_from_the_last_period_with_an_agent_waiting():
    lines = [
        {"t": 0.0, "paused": 0, "pending": 3, "u": 0.2},
        {"t": 1.0, "paused": 2, "pending": 0, "u": 0.8},
        {"t": 2.0, "paused": 0, "pending": 0, "u": 0.9},  # a gap: not yet the tail
        {"t": 3.0, "paused": 1, "pending": 0, "u": 0.9},
        {"t": 4.0, "paused": 0, "pending": 0, "u": 0.4},
        {"t": 5.0, "paused": 0, "pending": 0, "u": 0.2},
    ]
    tail = gap._tail(lines, 6.5)
    assert tail["tail_seconds"] == 3.5
    assert tail["u_before_tail"] == (0.2 + 0.8 + 0.9 + 0.9) / 4
    assert tail["u_in_tail"] == (0.4 + 0.2) / 2
    # nobody waited after the start: the whole run is tail
    alone = gap._tail(lines[4:], 6.5)
    assert alone == {"tail_seconds": 6.5, "u_before_tail": None, "u_in_tail": pytest.approx(0.3)}
    assert gap._tail(lines[:1], 6.5)["u_before_tail"] is None


def test_the_logged_policy_decides_the_same_and_logs_the_holders_share(tmp_path):
    w = synthetic("tiny", seed=3, agents=6, steps=(4, 8), final=(1500, 2500))
    plain = simulate(w, "tiny-cpu", make_policy("wset2"), tmp_path / "p", engine_options=CAP)
    log: list[tuple[float, float]] = []
    policy = gap._logging(make_policy("wset2"), log)
    logged = simulate(w, "tiny-cpu", policy, tmp_path / "l", engine_options=CAP)
    assert logged.sim_seconds == plain.sim_seconds
    control = [(tmp_path / d / "control.jsonl").read_text() for d in ("p", "l")]
    assert control[0] == control[1]
    assert len(log) == len(control[0].splitlines())  # one entry a period
    shares = [share for _, share in log]
    assert all(x > 0 for x in shares[:-1]) and shares[-1] == 0  # the last period: all done
