"""Shared references of the FP8 format tests: E4M3 rounding from the format's bit layout (independent of any cast
or of fp8rl's quantizers)."""

import pytest
import torch


def _e4m3_values() -> torch.Tensor:
    """Every finite non-negative E4M3 value from the bit layout (1 sign, 4 exponent bits biased 7, 3 mantissa)."""
    vals = [m / 8 * 2.0 ** -6 for m in range(8)]  # subnormals
    vals += [(1 + m / 8) * 2.0 ** (e - 7) for e in range(1, 16) for m in range(8) if not (e == 15 and m == 7)]
    return torch.tensor(sorted(vals), dtype=torch.float64)


def _round_e4m3(y: torch.Tensor) -> torch.Tensor:
    """Round to the nearest E4M3 value, ties to the even mantissa (the table's even index), saturating at 448."""
    table = _e4m3_values()
    a = y.abs().double().clamp(max=448.0).contiguous()
    hi = torch.searchsorted(table, a).clamp(max=len(table) - 1)
    lo = (hi - 1).clamp(min=0)
    dlo, dhi = a - table[lo], table[hi] - a
    pick = torch.where(dlo < dhi, lo, torch.where(dhi < dlo, hi, torch.where(lo % 2 == 0, lo, hi)))
    return torch.sign(y.double()) * table[pick]


@pytest.fixture
def round_e4m3():
    """Round a float64 tensor to the nearest E4M3 value (ties to even, saturating at ±448)."""
    return _round_e4m3
