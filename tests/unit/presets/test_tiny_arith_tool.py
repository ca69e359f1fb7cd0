"""tiny-arith-tool: its tokenizer and chat template, transcripts rendered as a rollout renders them, the
shared-prefix loss equal to the full rows', and the cached preset (an HF checkpoint transformers reads, warm-started
to call the calculator).

The preset comes from the preset cache (``$FP8RL_CACHE`` or ``~/.cache/fp8rl``), prepared on first use. Every test
that needs it is in the slow tier (``make test-slow``): its warm start takes ~10-15 minutes on one thread, and a
default-tier run must not start one. The other tests need no trained model; one runs the whole warm start for a
step per stage into a temporary directory.
"""

from __future__ import annotations

import json
import random
import re

import pytest
import torch

from fp8rl.envs import CalculatorEnv, ChatRenderer, make_calculator_tasks
from fp8rl.model import CausalLM, ModelConfig, load_hf_checkpoint
from fp8rl.model.tokenizer import HFTokenizer, chat_template_of, load_tokenizer
from fp8rl.presets import tiny_arith_tool as T
from fp8rl.presets.chatml import VOCAB_SIZE, build_chatml_tokenizer, chatml_template
from fp8rl.presets.registry import PRESETS, load_policy, prepare_preset

# FP32 both sides: the implementations agree to a few ulps of O(1) logits (as tests/unit/model/test_hf_io.py).
ATOL_HF = 1e-4
# The shared-prefix loss sums the prefix's gradient over the batch in another order than the full rows do.
ATOL_GRAD = 1e-5


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_tokenizer(build_chatml_tokenizer(tmp_path_factory.mktemp("chatml")))


@pytest.fixture(scope="module")
def preset():
    return prepare_preset(T.TINY_ARITH_TOOL, progress=False)


def test_config_is_tiny_arith_with_a_2048_context_and_the_chatml_vocabulary():
    cfg = T.tiny_arith_tool_config()
    assert cfg.max_position_embeddings >= 2048 and cfg.max_position_embeddings == T.CONTEXT
    assert cfg.vocab_size % 128 == 0 and VOCAB_SIZE <= cfg.vocab_size < VOCAB_SIZE + 128
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.head_dim) == (256, 4, 4, 2, 64)


def test_tokenizer_round_trips_and_renders_tools(tok):
    assert isinstance(tok, HFTokenizer) and tok.vocab_size == VOCAB_SIZE
    assert chat_template_of(tok) == chatml_template()
    assert tok.hf_tokenizer.convert_ids_to_tokens(tok.eos_id) == "<|im_end|>" and tok.eos_id in tok.eos_ids
    text = 'What is 347*29?\n<tool_call>\n{"name": "calculator"}\n</tool_call>'
    assert tok.decode(tok.encode(text, add_bos=False)) == text
    env = CalculatorEnv()
    rendered = ChatRenderer(tok).render(env.reset(make_calculator_tasks(1, 0)[0]), env.tools(),
                                        add_generation_prompt=True)
    assert "<tools>\n" + json.dumps(env.tools()[0]) + "\n</tools>" in rendered
    assert rendered.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("call", [True, False])
def test_transcript_is_the_template_rendering_of_the_episode(tok, call):
    renderer = ChatRenderer(tok)
    task = make_calculator_tasks(1, 3)[0]
    ids, mask, messages = T.transcript(renderer, task, call)
    # appending turns and deltas gives the ids of one rendering of the whole conversation (token in, token out)
    whole = renderer.encode(renderer.render(messages, CalculatorEnv().tools(), add_generation_prompt=False))
    assert ids == whole[:len(ids)] and tok.decode(whole[len(ids):]).strip() == ""
    learned = tok.decode([i for i, m in zip(ids, mask, strict=True) if m], skip_special=False)
    call_text = f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{task["question"][8:-1]}"}}}}'
    assert learned == (call_text + "\n</tool_call><|im_end|>" if call else "") + f"Answer: {task['answer']}<|im_end|>"
    assert [m["role"] for m in messages] == ["system", "user", *(["assistant", "tool"] if call else []), "assistant"]


def test_long_rows_are_conversations_up_to_the_context(tok):
    renderer = ChatRenderer(tok)
    prefix = T.shared_prefix(renderer)
    rows = T._rows(renderer, make_calculator_tasks(40, 1), random.Random(0), T.CONTEXT, 2)
    assert len(rows) == 2
    for ids, mask in rows:
        assert ids[:len(prefix)] == prefix and not any(mask[:len(prefix)])
        assert T.CONTEXT - 200 < len(ids) <= T.CONTEXT  # filled until the next exchange would not fit
        assert tok.decode(ids).count("What is") >= 5


def test_the_shared_prefix_loss_is_the_loss_of_the_full_rows(tok):
    renderer = ChatRenderer(tok)
    prefix = T.shared_prefix(renderer)
    rows = T._rows(renderer, make_calculator_tasks(5, 2), random.Random(1))
    torch.manual_seed(0)
    model = CausalLM(ModelConfig("llama", vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048))
    ids = torch.zeros(len(rows), max(len(r) for r, _ in rows), dtype=torch.long)
    weights = torch.zeros(ids.shape)
    for b, (row, mask) in enumerate(rows):
        ids[b, :len(row)], weights[b, :len(row)] = torch.tensor(row), torch.tensor(mask, dtype=torch.float32)
    logits = model(ids)[:, :-1]
    per_token = torch.nn.functional.cross_entropy(logits.reshape(-1, 128), ids[:, 1:].reshape(-1), reduction="none")
    want = (per_token * weights[:, 1:].reshape(-1)).sum() / weights[:, 1:].sum()
    got = T.prefix_loss(model, prefix, rows, tok.pad_id)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    g_want = torch.autograd.grad(want, list(model.parameters()))
    g_got = torch.autograd.grad(got, list(model.parameters()))
    for a, b in zip(g_got, g_want, strict=True):
        torch.testing.assert_close(a, b, atol=ATOL_GRAD, rtol=0)
    with pytest.raises(ValueError, match="shared prefix"):  # a row that does not open with the prefix
        T.prefix_loss(model, prefix, [(rows[0][0][1:], rows[0][1][1:])], tok.pad_id)


def test_copy_rows_learn_exactly_the_copied_digits(tok):
    rng = random.Random(0)
    kinds = set()
    for _ in range(20):
        ids, mask = T.copy_row(tok, rng)
        context = tok.decode([i for i, m in zip(ids, mask, strict=True) if not m], skip_special=False)
        learned = tok.decode([i for i, m in zip(ids, mask, strict=True) if m], skip_special=False)
        copied = learned.removeprefix("Answer: ").removesuffix("<|im_end|>")
        # the question's copy: 3-8 digits or a product of two 1-4 digit numbers (what a tool call's arguments
        # copy); the tool result's: digits (a product's digits run together: 2-8)
        form = r"\d{2,8}" if learned.startswith("Answer: ") else r"\d{3,8}|\d{1,4}\*\d{1,4}"
        assert re.fullmatch(form, copied) and copied in context, (context, learned)
        assert context.endswith("<|im_start|>assistant\n") and mask[-1] == 1
        kinds.add(learned.startswith("Answer: "))
    assert kinds == {True, False}  # both the question's copy and the tool result's


def test_short_rows_are_episodes_without_the_system_turn(tok):
    renderer = ChatRenderer(tok)
    prefix = T.shared_prefix(renderer)
    task = make_calculator_tasks(1, 5)[0]
    ids, mask = T.short_row(renderer, prefix, task)
    full, full_mask, _ = T.transcript(renderer, task, True)
    assert full[-len(ids):] == ids and full_mask[-len(mask):] == mask
    assert tok.decode(ids, skip_special=False).startswith(f"<|im_start|>user\n{task['question']}<|im_end|>")


@pytest.mark.agents  # a training stage per step (~10-20 s): the agents tier (make test-agents)
def test_a_step_per_stage_writes_a_loadable_preset(tmp_path):
    """The whole warm start, one step per stage (no target can be met): the checkpoint and its record."""
    stages = tuple(T.Stage(s.name, 1, 2, s.lr, 1) for s in T.STAGES)
    out = T.prepare_tiny_arith_tool(tmp_path / "p", stages=stages, eval_every=1, eval_size=2, progress=False)
    meta = json.loads((out / T.META_FILE).read_text())
    assert meta["stage_steps"] == {"copy": 1, "short": 1, "episodes": 1} and meta["met_target"] is False
    assert meta["tool_use_stats"]["episodes"] == 2 and meta["context"] == T.CONTEXT
    model, cfg = load_hf_checkpoint(out)
    assert cfg.max_position_embeddings == T.CONTEXT and chat_template_of(load_tokenizer(out)) == chatml_template()
    with pytest.raises(ValueError, match="unknown warm-start stage"):
        T.prepare_tiny_arith_tool(tmp_path / "q", stages=(T.Stage("sft", 1, 2, 1e-3, 1),), progress=False)


# ------------------------------------------------------------------------------------------ the cached preset
@pytest.mark.slow
def test_preset_is_registered_and_holds_a_chat_checkpoint(preset):
    assert T.TINY_ARITH_TOOL in PRESETS
    meta = json.loads((preset / T.META_FILE).read_text())
    assert meta["preset"] == T.TINY_ARITH_TOOL and meta["context"] == 2048
    model, tok, path = load_policy(T.TINY_ARITH_TOOL)
    assert path == preset and model.config.max_position_embeddings >= 2048
    assert chat_template_of(tok) == chatml_template() and tok.eos_id == model.config.eos_token_id
    assert json.loads((preset / "generation_config.json").read_text())["eos_token_id"][0] == tok.eos_id


@pytest.mark.slow
def test_preset_logits_equal_transformers_llama(preset):
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(preset, attn_implementation="eager", dtype=torch.float32).eval()
    ours, _ = load_hf_checkpoint(preset)
    tok = load_tokenizer(preset)
    rows = T._rows(ChatRenderer(tok), make_calculator_tasks(12, 4), random.Random(2), T.CONTEXT, 1)
    ids = torch.tensor([rows[0][0]])  # a conversation of ~2000 tokens: positions far past tiny-arith's 256
    with torch.no_grad():
        want, got = hf(ids).logits.float(), ours(ids)
    assert want.abs().max() > 1.0
    torch.testing.assert_close(got, want, atol=ATOL_HF, rtol=0)


@pytest.mark.slow
def test_warm_start_met_its_targets(preset):
    """The recorded sampled check met the stop rule; a teacher-forced check on other problems agrees."""
    meta = json.loads((preset / T.META_FILE).read_text())
    assert T.meets_target(meta["tool_use_stats"]), meta["tool_use_stats"]
    model, _ = load_hf_checkpoint(preset)
    renderer = ChatRenderer(load_tokenizer(preset))
    forced = T.forced_tool_stats(model, renderer, T.shared_prefix(renderer), make_calculator_tasks(16, 7))
    lo, hi = T.TARGET_TOOL_RATE
    assert lo <= forced["tool_call_rate"] <= hi and forced["accuracy_with_tool"] >= 0.7, forced


@pytest.mark.slow
def test_sampled_episodes_call_the_tool_and_copy_its_result(preset):
    """The warm-start criteria on fresh problems at temperature 1, and the tools-disabled control's floor."""
    model, _ = load_hf_checkpoint(preset)
    tok = load_tokenizer(preset)
    stats = T.tool_use_stats(model, tok, n=64, seed=11, temperature=1.0)
    assert T.meets_target(stats), stats
    assert stats["tool_error_rate"] <= 0.05 and (stats["accuracy_without_tool"] or 0.0) <= 0.1, stats
    control = T.tool_use_stats(model, tok, n=32, seed=11, temperature=1.0, tools_enabled=False)
    assert control["accuracy"] <= 0.1 and control["tool_error_rate"] == 1.0, control
