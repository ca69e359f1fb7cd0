"""The order a job visits a data file's problems in: epoch by epoch, each epoch a seeded permutation.

Batch ``b`` of ``n`` problems takes positions ``b*n ... b*n + n-1`` of the endless sequence
``epoch 0's order, epoch 1's order, ...`` (a batch may straddle two epochs). With ``shuffle`` an epoch's order is
:func:`epoch_permutation` of ``(seed, epoch)``; without it, file order. Invariant: a batch is a pure function of
(problems, n, seed, shuffle, b) — the same on every machine, Python version and controller restart — because the
permutation is a Fisher-Yates shuffle driven by :meth:`random.Random.random` seeded with a string, the two parts
of :mod:`random` whose output Python guarantees across versions.
"""

from __future__ import annotations

import functools
import random
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from .problem import Problem

__all__ = ["EpochBatches", "epoch_permutation"]


@functools.lru_cache(maxsize=4)  # a batch straddles at most two epochs; pipelined steps touch the same ones
def epoch_permutation(n: int, seed: int, epoch: int) -> array:
    """A permutation of ``range(n)`` (as an ``array('L')``), a pure function of ``(n, seed, epoch)``."""
    if n < 1 or seed < 0 or epoch < 0:
        raise ValueError(f"epoch_permutation needs n >= 1, seed >= 0 and epoch >= 0, got {n}, {seed}, {epoch}")
    rng = random.Random()
    rng.seed(f"fp8rl-data-order/{seed}/{epoch}", version=2)  # a str seed: sha512 of it, the same everywhere
    order = array("L", range(n))
    for i in range(n - 1, 0, -1):  # Fisher-Yates on random(): its bias is below 2**-53 * n, far under any use
        j = int(rng.random() * (i + 1))
        order[i], order[j] = order[j], order[i]
    return order


@dataclass(frozen=True, eq=False)
class EpochBatches:
    """``batches(b)`` → batch ``b``'s ``per_batch`` problems (see the module docstring).

    Attributes:
        problems: the data file's problems, in file order (at least one).
        per_batch: problems per batch (``grpo.num_prompts_per_step``).
        seed: ``job.seed``.
        shuffle: a fresh seeded permutation every epoch (else file order, epoch after epoch).
    """

    problems: Sequence[Problem]
    per_batch: int
    seed: int = 0
    shuffle: bool = True

    def __post_init__(self) -> None:
        if not self.problems:
            raise ValueError("EpochBatches: no problems")
        if self.per_batch < 1:
            raise ValueError(f"EpochBatches: per_batch must be >= 1, got {self.per_batch}")

    def __call__(self, batch: int) -> list[Problem]:
        if batch < 0:
            raise ValueError(f"batch index must be >= 0, got {batch}")
        n = len(self.problems)
        out = []
        for k in range(batch * self.per_batch, (batch + 1) * self.per_batch):
            epoch, i = divmod(k, n)
            out.append(self.problems[epoch_permutation(n, self.seed, epoch)[i] if self.shuffle else i])
        return out

    def refill(self, step: int, round_: int) -> list[Problem]:
        """``per_batch`` problems for round ``round_`` of dynamic sampling at ``step``: a seeded draw without
        replacement from the problems not in ``step``'s own batch (from all of them when the file is that small), a
        pure function of (seed, step, round) — never the step's own batch again, whatever the file order."""
        own = {id(p) for p in self(step)}
        pool = [p for p in self.problems if id(p) not in own] or list(self.problems)
        rng = random.Random()
        rng.seed(f"fp8rl-refill/{self.seed}/{step}/{round_}", version=2)  # as epoch_permutation: the same everywhere
        take = min(self.per_batch, len(pool))
        for i in range(take):  # the first `take` places of a Fisher-Yates shuffle on random()
            j = i + int(rng.random() * (len(pool) - i))
            pool[i], pool[j] = pool[j], pool[i]
        return pool[:take]

    def epoch(self, batch: int) -> int:
        """The epoch batch ``batch`` starts in (0-based)."""
        return batch * self.per_batch // len(self.problems)
