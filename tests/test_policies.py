import pytest

from runner.policies import AIMD, AgentCap, NoGate, RequestCap, Signals, make_policy


def sig(window, usage, hit, unfinished=100, **kw):
    base = dict(
        now=0.0,
        window=window,
        usage=usage,
        hit_rate=hit,
        active=window,
        paused=0,
        pending=0,
        finished=0,
        unfinished=unfinished,
        requests=1,
        peak_in_use=window,
    )
    base.update(kw)
    return Signals(**base)


def test_paper_worked_example():
    p = AIMD()
    d1 = p.update(sig(4, 0.65, 0.15))
    assert (d1.window, d1.branch) == (2, "decrease")
    d2 = p.update(sig(d1.window, 0.45, 0.82))
    assert (d2.window, d2.branch) == (2, "hold")
    d3 = p.update(sig(d2.window, 0.18, 0.9))
    assert (d3.window, d3.branch) == (4, "increase")


@pytest.mark.parametrize(
    "u,h,expected",
    [
        (0.1, 0.0, 12),  # U < U_low: grow by alpha whatever H is
        (0.3, 0.0, 10),  # between the thresholds: hold
        (0.6, 0.5, 10),  # above U_high but H healthy: hold
        (0.6, 0.1, 5),  # above U_high and H low: floor(10 * 0.5)
        (0.5, 0.1, 10),  # U == U_high is not above it
        (0.2, 0.1, 10),  # U == U_low is not below it
        (0.9, None, 10),  # no request finished: no evidence, no cut
    ],
)
def test_each_branch(u, h, expected):
    assert AIMD().update(sig(10, u, h)).window == expected


def test_floor_and_lower_bound():
    p = AIMD(beta=0.5)
    assert p.update(sig(3, 0.9, 0.0)).window == 1  # floor(1.5)
    assert p.update(sig(1, 0.9, 0.0)).window == 1  # never below 1
    assert AIMD(beta=0.1).update(sig(5, 0.9, 0.0)).window == 1  # floor(0.5) -> 1


def test_unknown_usage_holds():
    d = AIMD().update(sig(7, None, 0.0))
    assert d.window == 7 and d.branch.startswith("hold")


def test_initial_window():
    assert AIMD().initial_window(100) == 4
    assert AIMD(initial=9).initial_window(100) == 9
    assert AIMD(initial=9).initial_window(3) == 3
    assert AIMD().initial_window(0) == 1


@pytest.mark.parametrize(
    "kw,msg",
    [
        ({"beta": 1.0}, "beta"),
        ({"beta": 0.0}, "beta"),
        ({"beta": -0.5}, "beta"),
        ({"u_low": 0.5, "u_high": 0.5}, "u-low"),
        ({"u_low": 0.6, "u_high": 0.5}, "u-low"),
        ({"alpha": 0}, "alpha"),
        ({"h_thresh": 1.5}, "h-thresh"),
        ({"initial": 0}, "initial-window"),
    ],
)
def test_bad_values_rejected(kw, msg):
    with pytest.raises(ValueError, match=msg):
        AIMD(**kw)


def test_registry():
    assert isinstance(make_policy("aimd", alpha=3), AIMD)
    assert make_policy("aimd", alpha=3).alpha == 3
    assert isinstance(make_policy("none"), NoGate)
    cap = make_policy("agent-cap:32")
    assert isinstance(cap, AgentCap) and cap.n == 32 and cap.unit == "agent"
    rc = make_policy("request-cap:8")
    assert isinstance(rc, RequestCap) and rc.n == 8 and rc.unit == "request"
    with pytest.raises(ValueError, match="unknown policy 'lru'"):
        make_policy("lru")
    with pytest.raises(ValueError, match="agent-cap:N"):
        make_policy("agent-cap")
    with pytest.raises(ValueError, match="N >= 1"):
        make_policy("request-cap:0")


def test_fixed_policies():
    assert NoGate().update(sig(5, 0.9, 0.0, unfinished=42)).window == 42
    assert AgentCap(30).update(sig(5, 0.9, 0.0)).window == 30
    assert RequestCap(4).update(sig(9, 0.0, 1.0)).window == 4
