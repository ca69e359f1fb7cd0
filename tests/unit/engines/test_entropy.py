"""The trainer's policy entropy (token_logprobs_and_entropy) against torch.distributions' own, and its place in
a train step's metrics."""

from __future__ import annotations

import torch

from fp8rl.engines.torch_trainer import token_logprobs, token_logprobs_and_entropy

# float32: each of the 50 terms p·log p is off by a few ulps of its |log p| (<= ~30 here), summed: well under 1e-5
ATOL = 1e-5


def test_entropy_equals_torch_distributions_at_the_sampling_temperature() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 6, 50, generator=g) * 3
    ids = torch.randint(0, 50, (3, 6), generator=g)
    for temperature in (1.0, 0.7):
        lp, ent = token_logprobs_and_entropy(logits, ids, temperature, entropy=True)
        ref = torch.distributions.Categorical(logits=logits[:, :-1] / temperature).entropy()  # (3, 5)
        assert torch.allclose(ent[:, 1:], ref, rtol=0, atol=ATOL) and bool((ent[:, 0] == 0).all())
        assert torch.equal(lp, token_logprobs(logits, ids, temperature))  # the logprobs are unchanged
    assert token_logprobs_and_entropy(logits, ids, 1.0)[1] is None
