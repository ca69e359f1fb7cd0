"""The trainer's policy entropy (token_logprobs_and_entropy) against torch.distributions' own, and its place in
a train step's metrics."""

from __future__ import annotations

import torch

from fp8rl.engines.logprob_pass import token_logprobs, token_logprobs_and_entropy

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


def test_the_chunked_entropy_equals_the_whole_computation(monkeypatch):
    """Positions split into chunks of a few logits each give the same entropy as one pass over all of them."""
    import fp8rl.engines.logprob_pass as tt

    g = torch.Generator().manual_seed(1)
    logits, ids = torch.randn(2, 7, 50, generator=g), torch.randint(0, 50, (2, 7), generator=g)
    whole = token_logprobs_and_entropy(logits, ids, 1.0, entropy=True)[1]
    monkeypatch.setattr(tt, "ENTROPY_CHUNK_ELEMENTS", 120)  # 2 positions of 50 logits per chunk
    assert torch.equal(tt.token_logprobs_and_entropy(logits, ids, 1.0, entropy=True)[1], whole)
