"""aimd-fs: the CONCUR law with a fast start while U is far below U_low."""

import pytest

from runner.policies.aimd import AIMD
from runner.policies.experimental.aimd_fs import FastStartAIMD
from runner.policies.registry import make_policy
from tests.policies.test_policies import sig


def test_grows_by_a_fraction_of_w_while_usage_is_far_below_u_low():
    p = FastStartAIMD()  # growth 0.5 while U < 0.2 * 0.5
    assert p.update(sig(100, 0.05, None)).window == 150
    assert p.update(sig(100, 0.05, None)).branch == "increase:fast"
    assert p.update(sig(2, 0.0, None)).window == 4  # never less than alpha


@pytest.mark.parametrize(
    ("u", "h"), [(0.15, None), (0.3, 0.1), (0.6, 0.1), (0.6, 0.5), (None, None), (0.1, 0.9)]
)
def test_is_the_paper_law_once_usage_nears_u_low(u, h):
    assert FastStartAIMD().update(sig(64, u, h)) == AIMD().update(sig(64, u, h))


def test_parameters_are_checked_and_reach_it_through_policy():
    p = make_policy("aimd-fs:growth=1.0,room=0.25")
    assert isinstance(p, FastStartAIMD) and p.growth == 1.0 and p.room == 0.25
    with pytest.raises(ValueError, match="room must be in"):
        FastStartAIMD(room=1.5)
    with pytest.raises(ValueError, match="beta"):
        FastStartAIMD(beta=1.5)
