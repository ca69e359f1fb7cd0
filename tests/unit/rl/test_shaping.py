"""DAPO's overlong penalty against its formula's hand-computed values."""

from __future__ import annotations

import pytest

from fp8rl.rl.shaping import overlong_penalty, truncated


@pytest.mark.parametrize(("length", "want"), [
    (0, 0.0), (12, 0.0),  # at or below max - buffer (16 - 4 = 12): untouched
    (13, -0.25), (14, -0.5), (15, -0.75), (16, -1.0),  # ramps to the whole penalty at the budget
    (20, -1.0),  # longer than the budget cannot happen; clamped there
])
def test_penalty_ramps_linearly_over_the_buffer(length: int, want: float) -> None:
    assert overlong_penalty(length, 16, 4, 1.0) == want


def test_penalty_scales_and_bad_arguments_are_refused() -> None:
    assert overlong_penalty(14, 16, 4, 0.5) == -0.25
    for args in ((4, 16, 0, 1.0), (4, 16, 16, 1.0), (4, 16, 4, -1.0), (-1, 16, 4, 1.0)):
        with pytest.raises(ValueError):
            overlong_penalty(*args)
    assert truncated("length") and not truncated("stop")
