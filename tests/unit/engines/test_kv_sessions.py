"""KV sessions: a multi-turn trajectory's K/V kept between its turns, bitwise the re-prefill (issue 48).

Each case runs the same 3-turn conversations twice — with session keys (turns 1 and 2 prefill only the new
suffix) and without (every turn re-prefills the whole history) — from the same seeds, and compares every sampled
token, logprob and MoE route with ``torch.equal``: the claim is bitwise under batch invariance. The
conversations are ragged (prompts of 2..40 tokens, different numbers of environment tokens per row and turn),
cross the 32-key attention chunk, and run 3 rows per batch so a call spans several batches. The boundary cases
(a history that does not extend the cache, a refit, a byte bound that evicts) must stay bitwise and be counted as
misses / evictions.
"""

import copy
import dataclasses

import pytest
import torch

from fp8rl.engines.base import Sample, SamplingParams
from fp8rl.engines.batch import build_train_batch
from fp8rl.engines.calibrator import QKVCalibrator
from fp8rl.engines.torch_rollout import TorchRolloutEngine
from fp8rl.engines.torch_trainer import TorchTrainer, TrainerConfig
from fp8rl.fp8 import recipe_for_role
from fp8rl.model import CausalLM

from .conftest import tiny_config

PARAMS = SamplingParams(temperature=1.0, max_tokens=8)
TURNS = 3


@pytest.fixture(scope="module")
def dense(awkward):
    """The engine tests' awkward dense model (conftest)."""
    return awkward


@pytest.fixture(scope="module")
def moe():
    torch.manual_seed(0)
    cfg = tiny_config(architecture="qwen3_moe", vocab_size=97, hidden_size=192, intermediate_size=320,
                      num_attention_heads=6, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True,
                      initializer_range=0.08, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=160,
                      norm_topk_prob=True, mlp_only_layers=[1])
    return CausalLM(cfg).eval()


@pytest.fixture(scope="module")
def openings():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 97, (n,), generator=g).tolist() for n in (2, 19, 7, 40)]


def _engine(model, recipe="fp8_e2e", kv="auto", *, invariant=True, openings=None, **kw):
    rr = recipe_for_role(recipe, "rollout", kv_cache_dtype=kv, batch_invariant=invariant)
    engine = TorchRolloutEngine(model, rr, eos_token_ids=[2], max_batch_size=3, **kw)
    if kv == "fp8":
        engine.load_scales(QKVCalibrator(model, pad_token_id=0).calibrate(0, openings))
    return engine


def _weights(model) -> dict[str, torch.Tensor]:
    """A refit payload of ``model``'s own weights (a tied head is not a tensor of its own)."""
    return {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}


def _env_tokens(row: int, turn: int) -> list[int]:
    """The environment's reply: 1-4 tokens, different per row and turn (ragged suffixes)."""
    return [3 + (7 * row + 5 * turn) % 90] * (1 + (row + turn) % 4)


def _converse(engine, openings, *, sessions: bool, turns: int = TURNS, prefix: str = "traj"):
    """Run the conversations; per turn the samples. Turn k's prompt = turn k-1's prompt + its tokens + env."""
    histories = [list(p) for p in openings]
    per_turn = []
    for turn in range(turns):
        keys = [f"{prefix}{i}" for i in range(len(histories))] if sessions else None
        samples = engine.generate(histories, dataclasses.replace(PARAMS, seed=10 + turn), sessions=keys)
        per_turn.append(samples)
        histories = [h + list(s.token_ids) + _env_tokens(i, turn)
                     for i, (h, s) in enumerate(zip(histories, samples, strict=True))]
    return per_turn


def _assert_bitwise(got, want):
    assert len(got) == len(want)
    for turn, (a_turn, b_turn) in enumerate(zip(got, want, strict=True)):
        for a, b in zip(a_turn, b_turn, strict=True):
            assert a.prompt_ids == b.prompt_ids, turn
            assert a.token_ids == b.token_ids, turn
            assert torch.equal(torch.tensor(a.logprobs, dtype=torch.float64),
                               torch.tensor(b.logprobs, dtype=torch.float64)), turn
            assert (a.routes is None) == (b.routes is None)
            if a.routes is not None:
                assert a.routes.shape[0] == len(a.prompt_ids) + len(a.token_ids) - 1
                assert torch.equal(a.routes, b.routes), turn


@pytest.mark.parametrize("recipe,kv", [("bf16", "auto"), ("fp8_e2e", "auto"), ("fp8_e2e", "fp8")])
def test_session_turns_are_bitwise_the_reprefill(dense, openings, recipe, kv):
    reuse = _engine(dense, recipe, kv, openings=openings)
    ref = _engine(dense, recipe, kv, openings=openings)
    _assert_bitwise(_converse(reuse, openings, sessions=True), _converse(ref, openings, sessions=False))
    got, base = reuse.session_stats(), ref.session_stats()
    n = len(openings)
    assert (got["hits"], got["misses"], got["evictions"]) == (n * (TURNS - 1), n, 0)
    assert got["reused_tokens"] > 0 and base["reused_tokens"] == 0 and got["entries"] == n
    # every prompt token is either fed or reused, never both
    assert got["prefill_tokens"] + got["reused_tokens"] == base["prefill_tokens"]


def test_negative_control_misplaced_reused_keys_change_the_logprobs(dense, openings, monkeypatch):
    """The comparison can fail: reused K/V seeded one position off (positions 0 and 1 swapped in layer 0) must
    change the logprobs of the turns that reuse them."""
    from fp8rl.engines import torch_rollout

    real = torch_rollout.seed_cache

    def misplaced(cache, firsts, found, reuse, length, row_aligned):
        real(cache, firsts, found, reuse, length, row_aligned)
        for b, (f, r) in enumerate(zip(firsts, reuse, strict=True)):
            lo = 0 if row_aligned else f
            if r >= 2:
                cache.k[0][b, :, [lo, lo + 1]] = cache.k[0][b, :, [lo + 1, lo]]

    monkeypatch.setattr(torch_rollout, "seed_cache", misplaced)
    got = _converse(_engine(dense), openings, sessions=True, turns=2)
    want = _converse(_engine(dense), openings, sessions=False, turns=2)
    assert [s.logprobs for s in got[0]] == [s.logprobs for s in want[0]]  # turn 0 reuses nothing
    assert [(s.token_ids, s.logprobs) for s in got[1]] != [(s.token_ids, s.logprobs) for s in want[1]]


def test_moe_routes_are_stitched_from_the_turns_that_fed_them(moe, openings):
    reuse = _engine(moe, "fp8_e2e", "fp8", openings=openings, record_routes=True)
    ref = _engine(moe, "fp8_e2e", "fp8", openings=openings, record_routes=True)
    got = _converse(reuse, openings, sessions=True)
    _assert_bitwise(got, _converse(ref, openings, sessions=False))
    assert reuse.session_stats()["reused_tokens"] > 0
    assert all(s.routes is not None for s in got[-1])


def test_the_trainers_forward_over_the_trajectory_is_bitwise_the_session_rollout(dense, openings):
    """The headline: fp8_e2e + FP8 KV, the trainer's one forward over each whole 3-turn trajectory gives every
    model token the logprob the session rollout sampled it with."""
    engine = _engine(dense, "fp8_e2e", "fp8", openings=openings)
    scales = QKVCalibrator(dense, pad_token_id=0).calibrate(0, openings)
    trainer = TorchTrainer(dense, recipe_for_role("fp8_e2e", "trainer", kv_cache_dtype="fp8", batch_invariant=True),
                           TrainerConfig(micro_batch_size=4))
    trainer.load_qkv_scales(scales)
    turns = _converse(engine, openings, sessions=True)
    trajectories = []
    for i, opening in enumerate(openings):
        tokens, logprobs, mask = [], [], []
        for turn, samples in enumerate(turns):
            s = samples[i]
            env = _env_tokens(i, turn) if turn < TURNS - 1 else []
            tokens += [*s.token_ids, *env]
            logprobs += [*s.logprobs, *[0.0] * len(env)]
            mask += [1] * len(s.token_ids) + [0] * len(env)
        trajectories.append(Sample(i, tuple(opening), tuple(tokens), tuple(logprobs), "stop", 0,
                                   token_mask=tuple(mask)))
    batch = build_train_batch(trajectories, None, 1, 0, advantages=torch.zeros(len(trajectories)))
    keep = batch.loss_mask.bool()
    assert int(keep.sum()) == sum(len(s.token_ids) for samples in turns for s in samples)
    assert torch.equal(trainer.compute_logprobs(batch)[keep], batch.gen_logprobs[keep])


def test_a_mixed_batch_of_hits_misses_and_keyless_rows_is_bitwise(dense, openings):
    """Ragged reuse: rows with long cached prefixes share a batch with a new long trajectory (miss), a keyless row
    and a short one; the prefill window is the longest uncovered suffix, the rest is copied."""
    reuse, ref = _engine(dense), _engine(dense)
    _converse(reuse, openings, sessions=True, turns=2)
    turn1 = _converse(ref, openings, sessions=False, turns=2)[1]
    histories = [s.prompt_ids + s.token_ids + tuple(_env_tokens(i, 1)) for i, s in enumerate(turn1)]
    stats0 = reuse.session_stats()
    # the turn-2 prompts of trajectories 1..3 (hits), a new long one, a keyless one, and trajectory 0 again
    prompts = [list(histories[1]), list(histories[2]), openings[3] * 2, list(histories[3]), [5, 6, 7],
               list(histories[0])]
    keys = ["traj1", "traj2", "new", "traj3", None, "traj0"]
    params = dataclasses.replace(PARAMS, seed=99)
    _assert_bitwise([reuse.generate(prompts, params, sessions=keys)], [ref.generate(prompts, params)])
    stats = reuse.session_stats()
    assert stats["hits"] - stats0["hits"] == 4 and stats["misses"] - stats0["misses"] == 1


def test_a_prompt_that_does_not_extend_the_cached_tokens_is_a_miss(dense, openings):
    reuse, ref = _engine(dense), _engine(dense)
    first = _converse(reuse, openings[:2], sessions=True, turns=1)[0]
    edited = list(first[1].prompt_ids) + list(first[1].token_ids)
    edited[3] = 3 if edited[3] != 3 else 4  # the history changed before the cached end
    shorter = list(first[0].prompt_ids[:1])  # a prefix of the cached tokens, not an extension
    params = dataclasses.replace(PARAMS, seed=5)
    before = reuse.session_stats()
    got = reuse.generate([shorter, edited], params, sessions=["traj0", "traj1"])
    _assert_bitwise([got], [ref.generate([shorter, edited], params)])
    after = reuse.session_stats()
    assert (after["hits"] - before["hits"], after["misses"] - before["misses"]) == (0, 2)
    assert after["reused_tokens"] == before["reused_tokens"]
    # the entries were replaced by the new histories: extending those is a hit
    again = [list(s.prompt_ids) + list(s.token_ids) for s in got]
    reuse.generate(again, params, sessions=["traj0", "traj1"])
    assert reuse.session_stats()["hits"] - after["hits"] == 2


def test_a_refit_drops_every_session(dense, openings):
    engine = _engine(dense, "bf16")
    _converse(engine, openings, sessions=True, turns=1)
    assert engine.session_stats()["entries"] == len(openings)
    engine.load_weights(1, _weights(dense))
    assert engine.session_stats()["entries"] == 0
    shared = TorchRolloutEngine(dense, recipe_for_role("bf16", "rollout", batch_invariant=True), eos_token_ids=[2],
                                shared_with=dense)
    _converse(shared, openings, sessions=True, turns=1)
    shared.follow(1)
    assert shared.session_stats()["entries"] == 0
    stale = _engine(dense, "fp8_e2e", "fp8", openings=openings)
    _converse(stale, openings, sessions=True, turns=1)
    stale.load_scales(QKVCalibrator(dense, pad_token_id=0).calibrate(0, openings))
    assert stale.session_stats()["entries"] == 0
    # the next turn after the refit misses and is still the re-prefill's
    ref = _engine(dense, "bf16")
    ref.load_weights(1, _weights(dense))
    _converse(engine, openings, sessions=True, turns=1)  # refill at version 1
    engine.load_weights(2, _weights(dense))
    ref.load_weights(2, _weights(dense))
    _assert_bitwise(_converse(engine, openings, sessions=True, turns=2),
                    _converse(ref, openings, sessions=False, turns=2))
    stats = engine.session_stats()
    assert stats["misses"] == 3 * len(openings) and stats["hits"] == len(openings)


def test_lru_eviction_under_a_tiny_byte_bound_stays_bitwise(dense, openings):
    probe = _engine(dense)
    _converse(probe, openings[:1], sessions=True, turns=1)
    one = probe.session_stats()["bytes"]  # an entry of the shortest trajectory after one turn
    tight = _engine(dense, session_cache_bytes=3 * one)
    _assert_bitwise(_converse(tight, openings, sessions=True), _converse(_engine(dense), openings, sessions=False))
    stats = tight.session_stats()
    assert stats["evictions"] > 0 and stats["misses"] > len(openings) and stats["bytes"] <= 3 * one
    nothing = _engine(dense, session_cache_bytes=0)
    _converse(nothing, openings, sessions=True, turns=2)
    assert nothing.session_stats()["entries"] == 0 and nothing.session_stats()["hits"] == 0


def test_without_batch_invariance_sessions_are_close_not_bitwise(dense, openings):
    """Invariance off: the cache is slot-ordered and reused K/V carry the rounding of the decode GEMMs that made
    them; tokens match and logprobs agree to FP32 noise (the layout is right), bits need not."""
    reuse, ref = _engine(dense, "bf16", invariant=False), _engine(dense, "bf16", invariant=False)
    got, want = _converse(reuse, openings, sessions=True), _converse(ref, openings, sessions=False)
    assert reuse.session_stats()["reused_tokens"] > 0
    for a_turn, b_turn in zip(got, want, strict=True):
        for a, b in zip(a_turn, b_turn, strict=True):
            assert a.token_ids == b.token_ids
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0)


def test_drop_session_and_refusals(dense, openings):
    engine = _engine(dense, "bf16")
    _converse(engine, openings[:2], sessions=True, turns=1)
    assert engine.drop_session("traj0") and not engine.drop_session("traj0")
    assert engine.session_stats()["entries"] == 1
    with pytest.raises(ValueError, match="n = 2"):
        engine.generate(openings[:1], dataclasses.replace(PARAMS, n=2), sessions=["a"])
    with pytest.raises(ValueError, match="1 keys for 2 prompts"):
        engine.generate(openings[:2], PARAMS, sessions=["a"])
    with pytest.raises(ValueError, match="twice"):
        engine.generate(openings[:2], PARAMS, sessions=["a", "a"])
    with pytest.raises(ValueError, match=">= 0"):
        _engine(copy.deepcopy(dense), session_cache_bytes=-1)
