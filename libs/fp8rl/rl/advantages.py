"""Group-relative (GRPO) advantages.

A *group* is the G samples drawn for one prompt. Rewards arrive flat and group-contiguous:
``rewards[p * G + j]`` is sample ``j`` of prompt ``p``. Each sample's advantage is its reward
minus a baseline computed from its group, optionally divided by the group's reward spread:

- leave-one-out (default, as the reference implementation does): for sample ``j`` the baseline
  ``b_j`` is the mean reward of the *other* G-1 samples and the spread is the Bessel-corrected std
  of those G-1 rewards. With G-1 == 1 that std is undefined; it is treated as 0.
- plain: ``b`` is the group mean and the spread the Bessel-corrected group std (torch's default).

``A = (r - b) / (std + eps)`` only where ``std > 0``; elsewhere ``A = r - b`` (so a group whose
rewards are all equal gets exactly zero advantage instead of ``0 / eps`` noise).

Precision: the arithmetic runs in float64 and the result is cast back to the rewards' dtype.
Each group is first shifted by its first reward (baseline and std are shift-invariant); a group of
equal rewards then becomes exact zeros, so its advantages are exactly 0.0, not rounding residue.
"""

from __future__ import annotations

import torch

__all__ = ["grpo_advantages"]


def _validate_rewards(rewards: torch.Tensor, group_size: int, leave_one_out: bool) -> None:
    """Raise ``ValueError`` naming the problem if ``rewards``/``group_size`` cannot form groups."""
    if not isinstance(rewards, torch.Tensor):
        raise ValueError(f"rewards must be a torch.Tensor, got {type(rewards).__name__}")
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D (num_prompts * group_size,), got shape {tuple(rewards.shape)}")
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise ValueError(f"group_size must be an int, got {group_size!r}")
    min_group = 2 if leave_one_out else 1
    if group_size < min_group:
        why = " (leave-one-out needs at least one *other* sample per group)" if leave_one_out else ""
        raise ValueError(f"group_size must be >= {min_group}{why}, got {group_size}")
    n = rewards.numel()
    if n == 0 or n % group_size != 0:
        raise ValueError(
            f"rewards has {n} entries, which is not a positive multiple of group_size={group_size}; "
            "expected num_prompts * group_size group-contiguous rewards"
        )
    if rewards.is_complex():
        raise ValueError(f"rewards must be real, got dtype {rewards.dtype}")
    if not bool(torch.isfinite(rewards).all()):
        bad = int((~torch.isfinite(rewards)).sum())
        raise ValueError(f"rewards hold {bad} non-finite value(s) (NaN/Inf) out of {n}")


def _leave_one_out_stats(r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Baseline and Bessel std of the other G-1 rewards for every sample.

    Args:
        r: ``(P, G)`` float64 rewards, G >= 2.

    Returns:
        ``(baseline, std)``, both ``(P, G)``; ``std`` is 0 where G-1 < 2 (undefined).
    """
    num_prompts, g = r.shape
    # others[p, j, :] = the G-1 rewards of group p without sample j. Built explicitly (P·G·(G-1)
    # values, tiny for any real G) instead of via sum/sum-of-squares, which cancels badly.
    keep = ~torch.eye(g, dtype=torch.bool, device=r.device)  # (G, G), False on the diagonal
    others = r.unsqueeze(1).expand(num_prompts, g, g)[:, keep].view(num_prompts, g, g - 1)  # (P, G, G-1)
    baseline = others.mean(dim=-1)  # (P, G)
    if g - 1 < 2:
        std = torch.zeros_like(baseline)
    else:
        std = others.std(dim=-1, correction=1)  # (P, G)
    return baseline, std


def grpo_advantages(
    rewards: torch.Tensor,
    group_size: int,
    *,
    leave_one_out: bool = True,
    normalize_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """GRPO advantages, one per sample, from group-contiguous rewards.

    Args:
        rewards: ``(N,)`` real rewards, ``N = num_prompts * group_size``, samples of prompt 0
            first. Integer/bool rewards are accepted and promoted to float32.
        group_size: G, samples per prompt. ``>= 2`` with leave-one-out, ``>= 1`` without.
        leave_one_out: baseline (and std) from the other G-1 samples of the group (default) or
            from all G.
        normalize_std: divide by ``std + eps`` where ``std > 0``; if False, ``A = r - b``.
        eps: added to the std before dividing; must be >= 0.

    Returns:
        ``(N,)`` advantages in the rewards' floating dtype (float32 for integer inputs), on the
        rewards' device, with no autograd history (advantages are constants of the loss).

    Raises:
        ValueError: rewards not 1-D, empty, non-finite, or ``N % group_size != 0``;
            ``group_size`` too small for the mode; ``eps < 0``.
    """
    _validate_rewards(rewards, group_size, leave_one_out)
    if not eps >= 0.0:
        raise ValueError(f"eps must be >= 0, got {eps!r}")
    out_dtype = rewards.dtype if rewards.is_floating_point() else torch.float32

    r = rewards.detach().to(torch.float64).view(-1, group_size)  # (P, G)
    r = r - r[:, :1]  # shift each group by its first reward; equal rewards become exact zeros

    if leave_one_out:
        baseline, std = _leave_one_out_stats(r)  # (P, G), (P, G)
    else:
        baseline = r.mean(dim=-1, keepdim=True).expand_as(r)  # (P, G)
        if group_size < 2:
            std = torch.zeros_like(r)  # Bessel std of one sample is undefined → 0
        else:
            std = r.std(dim=-1, correction=1, keepdim=True).expand_as(r)  # (P, G)

    adv = r - baseline  # (P, G)
    if normalize_std:
        adv = torch.where(std > 0, adv / (std + eps), adv)
    return adv.reshape(-1).to(out_dtype)  # (N,)
