"""The trainer's memory estimate (fp8rl.engines.footprint) against the saved tensors of real forwards, and its
refusal: a micro-batch that cannot fit is refused naming the key and the largest value that fits."""

from __future__ import annotations

import pytest
import torch

import fp8rl.engines.footprint as footprint
from fp8rl import memory
from fp8rl.engines.footprint import MemoryBudgetError, activation_elements_per_token, check_fits, recompute_by_default
from fp8rl.fp8 import convert_model, recipe_for_role
from fp8rl.model import CausalLM, ModelConfig

# the estimate may err high (small tensors it rounds up) but never low, and by at most this factor: above it, refusals
# would turn away batches that fit
MAX_OVERESTIMATE = 1.25
# fp8_e2e: the estimate counts every saved tensor at the activation dtype's 4 bytes, but an FP8 linear keeps its input
# as E4M3 along T (1 byte an element, no padding past the tokens): 1.28-1.31x measured on these shapes; the bound
# allows the saving on a whole linear input per layer more
MAX_OVERESTIMATE_FP8 = 1.4

SHAPES = {
    "qwen2": dict(architecture="qwen2", hidden_size=256, intermediate_size=1024, num_attention_heads=4,
                  num_key_value_heads=2),
    "llama-wide-mlp": dict(architecture="llama", hidden_size=256, intermediate_size=2048, num_attention_heads=4,
                           num_key_value_heads=1),
    "qwen3": dict(architecture="qwen3", hidden_size=384, intermediate_size=1024, num_attention_heads=6,
                  num_key_value_heads=2, head_dim=64),
    "qwen3-moe": dict(architecture="qwen3_moe", hidden_size=256, intermediate_size=512, num_attention_heads=4,
                      num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256),
}


def _saved_bytes(config: ModelConfig, recipe: str, batch_invariant: bool, B: int, T: int) -> int:
    """Distinct storages saved for backward by a forward to full logits (weights and their FP8 cache excluded: the
    trainer holds those anyway)."""
    torch.manual_seed(0)
    model = convert_model(CausalLM(config), recipe_for_role(recipe, "trainer", batch_invariant=batch_invariant))
    ids = torch.randint(0, config.vocab_size, (B, T))
    with torch.no_grad():  # fills the FP8 weight caches
        model(ids, attention_mask=torch.ones(B, T, dtype=torch.long))
    held = list(model.parameters()) + [t for m in model.modules() if getattr(m, "weight_cache", None)
                                       for t in (m.weight_cache.q, m.weight_cache.scale, m.weight_cache.dequantized)]
    with memory.saved_for_backward(exclude=held) as saved:
        model(ids, attention_mask=torch.ones(B, T, dtype=torch.long))
    return sum(saved.values())


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("recipe", ["bf16", "fp8_e2e"])
@pytest.mark.parametrize("batch_invariant", [False, True])
def test_per_layer_estimate_bounds_the_measured_activations(shape, recipe, batch_invariant):
    """Per layer (the difference of a 2- and a 1-layer model's saved bytes, so the output head drops out): the
    estimate is at least what a forward saves and at most MAX_OVERESTIMATE (fp8_e2e: MAX_OVERESTIMATE_FP8) times it."""
    B, T = 2, 96
    cfg = {**SHAPES[shape], "vocab_size": 256}
    one, two = (ModelConfig(**{**cfg, "num_hidden_layers": n}) for n in (1, 2))
    measured = _saved_bytes(two, recipe, batch_invariant, B, T) - _saved_bytes(one, recipe, batch_invariant, B, T)
    est = 4 * B * T * (activation_elements_per_token(two, T, batch_invariant=batch_invariant)
                       - activation_elements_per_token(one, T, batch_invariant=batch_invariant))
    bound = MAX_OVERESTIMATE_FP8 if recipe == "fp8_e2e" else MAX_OVERESTIMATE
    assert measured <= est <= bound * measured, f"estimate {est} vs measured {measured}"


def test_refusal_names_the_key_and_what_fits():
    cfg = ModelConfig(**{**SHAPES["qwen2"], "vocab_size": 256, "num_hidden_layers": 4})
    kw = dict(rows=64, seq_len=128, batch_invariant=False, state_to_come=0)
    one = check_fits(cfg, micro_batch_size=1, available=1 << 60, **kw).total
    with pytest.raises(MemoryBudgetError, match=r"micro_batch_size: 8 does not fit .* micro_batch_size: 3 fits"):
        check_fits(cfg, micro_batch_size=8, available=3 * one + one // 2, **kw)
    with pytest.raises(MemoryBudgetError, match="even micro_batch_size: 1 does not fit: shorter sequences"):
        check_fits(cfg, micro_batch_size=8, available=one // 2, **kw)
    assert check_fits(cfg, micro_batch_size=8, available=8 * one, **kw).total <= 8 * one


@pytest.mark.parametrize("recipe", ["bf16", "fp8_e2e"])
@pytest.mark.parametrize("batch_invariant", [False, True])
def test_activation_checkpointing_gives_bitwise_the_same_gradients(recipe, batch_invariant):
    """The recomputed forward is the same computation: every parameter's gradient is bitwise the one without."""
    import copy

    cfg = ModelConfig(**{**SHAPES["qwen2"], "vocab_size": 256, "num_hidden_layers": 3})
    torch.manual_seed(0)
    plain = convert_model(CausalLM(cfg), recipe_for_role(recipe, "trainer", batch_invariant=batch_invariant))
    ckpt = copy.deepcopy(plain)
    ckpt.set_activation_checkpointing(True)
    ids = torch.randint(0, 256, (3, 40))
    mask = torch.ones(3, 40, dtype=torch.long)
    mask[1, 30:] = 0
    for model in (plain, ckpt):
        lp, _ = model(ids, attention_mask=mask, token_logprobs=True, temperature=0.7)
        (lp * mask).sum().backward()
    for (name, a), b in zip(plain.named_parameters(), ckpt.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad), name


def test_activation_checkpointing_refuses_a_mixture_of_experts_model():
    cfg = ModelConfig(**{**SHAPES["qwen3-moe"], "vocab_size": 256, "num_hidden_layers": 2})
    with pytest.raises(ValueError, match="mixture-of-experts"):
        CausalLM(cfg).set_activation_checkpointing(True)


def test_checkpointing_estimate_keeps_one_layer_and_every_layer_input():
    cfg = ModelConfig(**{**SHAPES["qwen2"], "vocab_size": 256, "num_hidden_layers": 4})
    full = activation_elements_per_token(cfg, 64)
    per_layer = (full - 3 * cfg.hidden_size) // 4
    assert activation_elements_per_token(cfg, 64, checkpointing=True) == 4 * cfg.hidden_size + per_layer \
        + 3 * cfg.hidden_size


def test_the_loop_refuses_a_batch_that_cannot_fit_before_running_it(monkeypatch, capsys):
    """The in-process loop checks at build (longest prompt + max_new_tokens, the step's rows) and exits 2 with the
    key and what fits; nothing is trained."""
    import fp8rl.engines.footprint as footprint
    from fp8rl.loop import main

    monkeypatch.setattr(footprint, "available_bytes", lambda: 1 << 20)  # 1 MiB left
    assert main(["--model", "tiny-arith", "--steps", "1", "--micro-batch-size", "4"]) == 2
    err = capsys.readouterr().err
    assert "policy.training.micro_batch_size: 4 does not fit in the in-process loop's memory" in err
    assert "nothing was run" in err
    assert "the loop's flag: --micro-batch-size" in err  # the flag that fixes it, not only the key


def test_auto_recomputes_past_a_quarter_of_the_floor_and_a_gibibyte():
    """Unset checkpointing recomputes a micro-batch whose saved activations (rows x tokens x elements per token x 4
    bytes) pass both max(0.25 x 16 bytes per parameter, 1 GiB); the row count where it turns on, computed here
    from that rule, is where it does; never for a mixture-of-experts model."""
    cfg = ModelConfig(**{**SHAPES["qwen2"], "vocab_size": 32000, "num_hidden_layers": 8})
    T, per_token = 512, activation_elements_per_token(cfg, 512)
    for params in (10**8, 10**9):  # the 1 GiB minimum binds for the first, the floor's share for the second
        bar = max(0.25 * 16 * params, 2**30)
        first_on = int(bar // (T * per_token * 4)) + 1  # the fewest rows whose activations pass the bar
        kw = dict(trained_params=params, batch_invariant=False)
        assert not recompute_by_default(cfg, first_on - 1, T, **kw)
        assert recompute_by_default(cfg, first_on, T, **kw)
    moe = ModelConfig(**{**SHAPES["qwen3-moe"], "vocab_size": 256, "num_hidden_layers": 2})
    assert not recompute_by_default(moe, 10**6, 4096, trained_params=1, batch_invariant=False)


def test_trainer_left_on_auto_recomputes_only_the_micro_batches_past_the_bar(monkeypatch, policy, prompts):
    """Unset: the 4-row micro-batches of a 10-row step recompute and its 2-row one does not (bar set between
    them); train/recomputed says 2 of 3, and the step's weights are bitwise those of a trainer that never
    recomputes and of one that always does."""
    import copy

    from fp8rl.engines import SamplingParams, TorchRolloutEngine, TorchTrainer, TrainerConfig, build_train_batch

    eng = TorchRolloutEngine(policy, recipe_for_role("bf16", "rollout"), eos_token_ids=[], pad_token_id=0)
    samples = eng.generate(prompts[:2], SamplingParams(max_tokens=6, n=5, seed=0))
    batch = build_train_batch(samples, torch.rand(len(samples), dtype=torch.float64), 5, pad_id=0)
    rows, T = batch.input_ids.shape
    assert rows == 10
    params = sum(p.numel() for p in policy.parameters())
    three_rows = 3 * T * 4 * activation_elements_per_token(policy.config, T)
    monkeypatch.setattr(footprint, "AUTO_RECOMPUTE_MIN_BYTES", 0)
    monkeypatch.setattr(footprint, "AUTO_RECOMPUTE_FLOOR_SHARE", three_rows / (16 * params))
    out = {}
    for ckpt in (None, False, True):
        tr = TorchTrainer(copy.deepcopy(policy), recipe_for_role("bf16", "trainer"),
                          TrainerConfig(lr=1e-2, micro_batch_size=4, activation_checkpointing=ckpt))
        m = tr.train_step(copy.deepcopy(batch))
        out[ckpt] = (m["recomputed"], tr.state_dict())
    assert out[None][0] == pytest.approx(2 / 3) and out[False][0] == 0.0 and out[True][0] == 1.0
    for ckpt in (False, True):
        assert all(torch.equal(v, out[ckpt][1][k]) for k, v in out[None][1].items()), ckpt
