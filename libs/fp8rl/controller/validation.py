"""Validation of one weight version: greedy accuracy, and ``k`` samples per problem → pass@j and mean@k.

One function for every caller — the in-process loop, the controller service, ``python -m fp8rl.eval`` — over
the same :class:`~fp8rl.controller.step.StepBackends` a step uses, so a validation measures the deployed
rollout numerics (what a refit delivered), not the trainer's copy.

pass@j is the unbiased estimator of Chen et al. (2021, "Evaluating Large Language Models Trained on Code"):
with ``n`` samples of a problem of which ``c`` are correct, ``pass@j = 1 - C(n - c, j) / C(n, j)`` — the chance
that ``j`` of the ``n`` drawn without replacement hold a correct one — averaged over problems. mean@k is the
mean share of correct samples (pass@1's estimate, reported under its own name as the field does). A sample is
correct when its reward exceeds :data:`~fp8rl.controller.plan.CORRECT_REWARD`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from fp8rl import limits
from fp8rl.data import Problem

from .plan import CORRECT_REWARD

__all__ = ["EVAL_STEP_BASE", "ValidationResult", "pass_at_k", "pass_ks", "validate"]

# the sampling step index of a validation at version v (part p of one split in parts) is EVAL_STEP_BASE + v +
# p * (MAX_JOB_STEPS + 1): past every training step's and refill's index (fp8rl.controller.plan.refill_index; the
# seed also mixes in the replica's first prompt, fp8rl.controller.plan.sampling_seed), the same every time
EVAL_STEP_BASE = 4 * limits.MAX_JOB_STEPS * 64


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem with ``c`` correct among ``n`` samples: ``1 - C(n-c, k) / C(n, k)``.

    Raises:
        ValueError: not ``0 <= c <= n`` and ``1 <= k <= n``.
    """
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def pass_ks(k: int) -> list[int]:
    """The j pass@j is reported for with ``k`` samples: 1, 2, 4, ... below k, and k."""
    out, j = [], 1
    while j < k:
        out.append(j)
        j *= 2
    return [*out, k] if k else []


@dataclass(frozen=True)
class ValidationResult:
    """One validation of one version.

    Attributes:
        version: the weight version the samples came from (the newest, where asynchronous GRPO let a replica
            serve a newer one than asked).
        problems: how many validation problems.
        greedy_accuracy: share answered right by greedy decoding (``greedy_right / problems``).
        k: samples per problem at ``temperature`` (0: none drawn).
        temperature: their sampling temperature.
        pass_at: ``{j: pass@j}`` for j in :func:`pass_ks` (k).
        mean_at_k: mean share of correct samples (nan when k is 0).
        correct: per problem, how many of the k samples were right.
        greedy_right: how many problems greedy decoding answered right.
    """

    version: int
    problems: int
    greedy_accuracy: float
    k: int
    temperature: float
    pass_at: dict[int, float] = field(default_factory=dict)
    mean_at_k: float = math.nan
    correct: tuple[int, ...] = ()
    greedy_right: int = 0

    @classmethod
    def combine(cls, parts: Sequence[ValidationResult]) -> ValidationResult:
        """One result of validations of disjoint problem sets of one version (same ``k`` and temperature)."""
        if not parts or len({(p.version, p.k, p.temperature) for p in parts}) != 1:
            raise ValueError("ValidationResult.combine needs at least one part, all of one version, k and temperature")
        n, k = sum(p.problems for p in parts), parts[0].k
        right = tuple(c for p in parts for c in p.correct)
        out = dict(version=parts[0].version, problems=n, k=k, temperature=parts[0].temperature,
                   greedy_right=sum(p.greedy_right for p in parts))
        out["greedy_accuracy"] = out["greedy_right"] / n
        if k:
            out.update(pass_at={j: sum(pass_at_k(k, c, j) for c in right) / n for j in pass_ks(k)},
                       mean_at_k=sum(right) / (k * n), correct=right)
        return cls(**out)

    def metrics(self) -> dict[str, float]:
        """As report metrics: ``val_accuracy`` (greedy), ``val/pass@j``, ``val/mean@k``, ``val_weight_version``."""
        out = {"val_accuracy": self.greedy_accuracy, "val_weight_version": float(self.version)}
        if self.k:
            out.update({f"val/pass@{j}": v for j, v in self.pass_at.items()})
            out[f"val/mean@{self.k}"] = self.mean_at_k
        return out


def validate(backends, problems: Sequence[Problem], prompts: Sequence[Sequence[int]], version: int, *, k: int,
             temperature: float, part: int = 0) -> ValidationResult:
    """Validate ``version`` on ``problems`` (tokenized as ``prompts``) through ``backends`` (a
    :class:`~fp8rl.controller.step.StepBackends`): one greedy sample each, then (``k > 0``) ``k`` samples each at
    ``temperature``, every one graded by ``backends.score``. The samples' seed is a function of ``version`` and
    ``part`` (:data:`EVAL_STEP_BASE`; a validation split into parts gives each its own), so validating the same
    version again draws the same samples.

    Raises:
        ValueError: no problems, ``len(prompts) != len(problems)``, or ``k < 0``.
    """
    if not problems or len(prompts) != len(problems):
        raise ValueError(f"validate needs one prompt per problem and at least one, got {len(problems)} problems "
                         f"and {len(prompts)} prompts")
    if k < 0:
        raise ValueError(f"validate needs k >= 0, got {k}")
    step = EVAL_STEP_BASE + version + part * (limits.MAX_JOB_STEPS + 1)

    served: set[int] = set()

    def correct_counts(n: int, temp: float) -> list[int]:
        more = {"problems": problems} if getattr(backends, "wants_problems", False) else {}  # multi-turn: tasks
        samples = backends.generate([list(p) for p in prompts], version, step=step, n=n, temperature=temp, **more)
        served.update(getattr(s, "weight_version", version) for _, s in samples)
        rewards = backends.score([(problems[i], s) for i, s in samples])
        right = [0] * len(problems)
        for (i, _), r in zip(samples, rewards, strict=True):
            right[i] += r is not None and r > CORRECT_REWARD  # ungraded (an environment failed): not right
        return right

    greedy = correct_counts(1, 0.0)
    right = correct_counts(k, temperature) if k else []
    # asynchronous GRPO serves "at least" the asked version: the newest a replica held is what was measured
    result = dict(version=max(served, default=version), problems=len(problems), k=k,
                  greedy_accuracy=sum(greedy) / len(problems), temperature=temperature if k else 0.0,
                  greedy_right=sum(greedy))
    if k:
        result.update(pass_at={j: sum(pass_at_k(k, c, j) for c in right) / len(right) for j in pass_ks(k)},
                      mean_at_k=sum(right) / (k * len(right)), correct=tuple(right))
    return ValidationResult(**result)
