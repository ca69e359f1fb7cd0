"""Mixture-of-experts models in the embedded engines: the rollout's routes, replay in the trainer, bitwise-zero MoE
mismatch under batch invariance without replay (issue 27), and the trainer's routing metrics and checkpoints.

Equalities are ``torch.equal`` (no tolerance): the claim is bitwise. The negative control runs without batch
invariance and must see a difference, so the comparison can fail.
"""

import pytest
import torch

from fp8rl.engines.base import SamplingParams
from fp8rl.engines.batch import build_train_batch, train_on_batch
from fp8rl.engines.calibrator import QKVCalibrator
from fp8rl.engines.torch_rollout import TorchRolloutEngine
from fp8rl.engines.torch_trainer import TorchTrainer, TrainerConfig
from fp8rl.fp8 import recipe_for_role
from fp8rl.model import CausalLM
from fp8rl.model.router import TopKRouter

from .conftest import tiny_config

EXPERTS, TOP_K = 8, 2


@pytest.fixture(scope="module")
def moe():
    """Dims that are not multiples of 128 (FP8 blocks padded), GQA 3:1, tied embeddings, a dense layer among MoE."""
    torch.manual_seed(0)
    cfg = tiny_config(architecture="qwen3_moe", vocab_size=97, hidden_size=192, intermediate_size=320,
                      num_attention_heads=6, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True,
                      initializer_range=0.08, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
                      moe_intermediate_size=160, norm_topk_prob=True, mlp_only_layers=[1])
    return CausalLM(cfg).eval()


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 97, (n,), generator=g).tolist() for n in (2, 19, 7, 40, 11, 3, 31)]


def _run(model, prompts, recipe, kv, *, invariant, replay, rollout_rows=3, trainer_rows=5, unreplayed=False):
    rr = recipe_for_role(recipe, "rollout", kv_cache_dtype=kv, batch_invariant=invariant)
    tr = recipe_for_role(recipe, "trainer", kv_cache_dtype=kv, batch_invariant=invariant)
    engine = TorchRolloutEngine(model, rr, eos_token_ids=[2], max_batch_size=rollout_rows, record_routes=True)
    trainer = TorchTrainer(model, tr, TrainerConfig(micro_batch_size=trainer_rows, router_replay=replay,
                                                          measure_unreplayed=unreplayed))
    if kv == "fp8":
        scales = QKVCalibrator(model, pad_token_id=0).calibrate(0, prompts)
        engine.load_scales(scales)
        if trainer.needs_qkv_scales:
            trainer.load_qkv_scales(scales)
    samples = engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=20, n=2, seed=3))
    rewards = (torch.arange(len(samples)) % 3).float()  # advantages not all 0: the steps below move the weights
    batch = build_train_batch(samples, rewards, 2, 0, route_shape=model.config.route_shape)
    return samples, batch, trainer


@pytest.mark.parametrize("recipe,kv", [("bf16", "auto"), ("fp8_e2e", "auto"), ("fp8_e2e", "fp8")])
@pytest.mark.parametrize("rollout_rows,trainer_rows", [(1, 14), (16, 3)])
def test_batch_invariance_makes_moe_logprobs_bitwise_equal_without_replay(moe, prompts, recipe, kv, rollout_rows,
                                                                          trainer_rows):
    samples, batch, trainer = _run(moe, prompts, recipe, kv, invariant=True, replay=False,
                                   rollout_rows=rollout_rows, trainer_rows=trainer_rows)
    mask = batch.loss_mask.bool()
    lp = trainer.compute_logprobs(batch)
    assert mask.sum() > 100 and torch.equal(lp[mask], batch.gen_logprobs[mask])


def test_negative_control_without_invariance_routes_or_logprobs_differ(moe, prompts):
    _, batch, trainer = _run(moe, prompts, "fp8_e2e", "fp8", invariant=False, replay=False)
    mask = batch.loss_mask.bool()
    assert not torch.equal(trainer.compute_logprobs(batch)[mask], batch.gen_logprobs[mask])


def test_the_rollouts_routes_cover_every_fed_token(moe, prompts):
    samples, batch, _ = _run(moe, prompts, "fp8_e2e", "auto", invariant=True, replay=False)
    for s in samples:
        assert s.routes.dtype == torch.uint8  # <= 256 experts
        assert tuple(s.routes.shape) == (len(s.prompt_ids) + len(s.token_ids) - 1, moe.num_moe_layers, TOP_K)
    assert batch.routes.shape[2:] == (moe.num_moe_layers, TOP_K)


def test_replay_uses_the_rollouts_experts_and_lowers_the_mismatch(moe, prompts):
    """FP8 KV without invariance: the trainer's attention is high precision, its routers flip near-tied experts.
    Replay makes every (token, layer) use the rollout's experts and lowers token_mult_prob_error."""
    _, batch, trainer = _run(moe, prompts, "fp8_e2e", "fp8", invariant=False, replay=True, unreplayed=True)
    out = train_on_batch(trainer, batch)
    m = out.metrics
    assert m["moe/router_agreement"] < 1.0  # the trainer's own routing disagreed somewhere ...
    assert m["token_mult_prob_error"] < m["moe/unreplayed/token_mult_prob_error"]  # ... and replay removed that part
    assert 1.0 <= m["moe/load_max_over_mean"] <= EXPERTS
    assert m["moe/aux_loss"] > 0 and "moe/load/0/0" in m
    grads = [r.weight.grad for r in trainer.model.modules() if isinstance(r, TopKRouter)]
    assert all(g is not None and bool(g.abs().sum() > 0) for g in grads)  # the router still learns under replay


def test_replay_refuses_a_batch_without_routes(moe, prompts):
    _, batch, trainer = _run(moe, prompts, "bf16", "auto", invariant=False, replay=True)
    batch.routes = None
    with pytest.raises(ValueError, match="routing replay is on .* carries no routes"):
        trainer.train_step(batch)


def test_aux_loss_coefficient_changes_the_router_gradient(moe, prompts):
    _, batch, plain = _run(moe, prompts, "bf16", "auto", invariant=False, replay=False, trainer_rows=16)
    aux = TorchTrainer(moe, recipe_for_role("bf16", "trainer"), TrainerConfig(micro_batch_size=16,
                                                                              router_aux_loss_coef=10.0))
    for t in (plain, aux):
        t.train_step(build_train_batch(batch_samples(batch), torch.arange(len(batch.advantages)).float(), 2, 0))
    a = next(m for m in plain.model.modules() if isinstance(m, TopKRouter)).weight
    b = next(m for m in aux.model.modules() if isinstance(m, TopKRouter)).weight
    assert not torch.equal(a, b)


def batch_samples(batch):
    from fp8rl.engines.base import Sample

    out = []
    for b in range(batch.input_ids.shape[0]):
        n_tok = int(batch.attention_mask[b].sum())
        resp = batch.loss_mask[b].nonzero().flatten()
        p = int(resp[0])
        ids = batch.input_ids[b, :n_tok].tolist()
        out.append(Sample(0, tuple(ids[:p]), tuple(ids[p:]), tuple(batch.gen_logprobs[b, p:n_tok].tolist()), "stop", 0))
    return out


def test_a_moe_trainer_checkpoint_resumes_bit_identically(moe, prompts, tmp_path):
    _, batch, trainer = _run(moe, prompts, "fp8_e2e", "auto", invariant=False, replay=True, trainer_rows=16)
    trainer.train_step(batch)
    trainer.save_checkpoint(str(tmp_path / "ck.pt"))
    again = TorchTrainer(moe, recipe_for_role("fp8_e2e", "trainer"), TrainerConfig(micro_batch_size=16,
                                                                                   router_replay=True))
    again.load_checkpoint(str(tmp_path / "ck.pt"))
    assert again.version == 1
    for (n, a), b in zip(trainer.model.state_dict().items(), again.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), n
    batch.prev_logprobs = None
    assert torch.equal(trainer.compute_logprobs(batch), again.compute_logprobs(batch))


def test_replay_needs_the_torch_rollout():
    from fp8rl.config import ConfigError, parse_job_config

    with pytest.raises(ConfigError, match="router_replay.enabled=true needs policy.generation.backend=torch .*vllm"):
        parse_job_config({"policy": {"generation": {"backend": "vllm"}, "router_replay": {"enabled": True}}})
    job = parse_job_config({"policy": {"training": {"backend": "megatron"}, "router_replay": {"enabled": True}}})
    assert job.trainer_config().router_replay  # the megatron trainer replays through Megatron's RouterReplay hook


def test_routes_ride_with_the_samples_through_the_asynchronous_loop(tmp_path):
    """The in-process loop at max_weight_lag 1 (rollouts of step s+1 generated while step s trains): every step
    trains with the rollout's routes replayed and reports the routing metrics."""
    from fp8rl.loop import LoopConfig, run
    from fp8rl.model import save_hf_checkpoint
    from fp8rl.model.tokenizer import CharTokenizer

    tok = CharTokenizer()
    torch.manual_seed(0)
    cfg = tiny_config(architecture="qwen3_moe", vocab_size=128, hidden_size=128, intermediate_size=256,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=64, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=128, bos_token_id=tok.bos_id, eos_token_id=tok.eos_id,
                      pad_token_id=tok.pad_id, initializer_range=0.05)
    save_hf_checkpoint(CausalLM(cfg), cfg, tmp_path)
    tok.save(tmp_path)
    steps = run(LoopConfig.from_flags(model=str(tmp_path), recipe="fp8_e2e", kv_cache_dtype="fp8", router_replay=True,
                                      max_weight_lag=1, steps=3, prompts_per_step=4, group_size=2, max_tokens=6,
                                      micro_batch_size=8, calibration_max_sequences=4, eval_size=2, seed=0),
                progress=False)["steps"]
    assert len(steps) == 3
    for h in steps:
        assert 0.0 <= h["moe/router_agreement"] <= 1.0
        assert not any(k.startswith("moe/unreplayed/") for k in h)  # the extra forward only when asked
