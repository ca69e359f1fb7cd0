"""tiny-arith-python (issue 50): the python tool's transcripts rendered as a rollout renders them (their calls run
in the real sandbox), its copy rows, and the warm start writing a loadable preset — one step per stage, from a
random-init base, so no trained model is needed (the trained preset is measured by ``bench/agent_learning.py
--config deploy/python-job-tiny.yaml``)."""

from __future__ import annotations

import json
import os
import random
import re

import pytest
import torch

from fp8rl.envs import ChatRenderer
from fp8rl.envs.sandbox import sandbox_problem
from fp8rl.model import CausalLM, load_hf_checkpoint, save_hf_checkpoint
from fp8rl.model.tokenizer import load_tokenizer
from fp8rl.presets import tiny_arith_python as P
from fp8rl.presets import tiny_arith_tool as T
from fp8rl.presets.chatml import build_chatml_tokenizer
from fp8rl.presets.registry import PRESETS
from fp8rl.presets.tool_formats import CALCULATOR, PYTHON

_PROBLEM = sandbox_problem()
if _PROBLEM is not None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI needs the code sandbox: {_PROBLEM}", pytrace=False)
    pytestmark = pytest.mark.skip(reason=f"no code sandbox here: {_PROBLEM}")


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_tokenizer(build_chatml_tokenizer(tmp_path_factory.mktemp("chatml")))


def test_a_python_transcript_calls_print_of_the_expression_and_copies_stdout(tok):
    renderer = ChatRenderer(tok)
    task = PYTHON.tasks(1, 3)[0]
    expr = re.fullmatch(r"What is (\d+\*\d+\+\d+)\?", task["question"]).group(1)
    ids, mask, messages = T.transcript(renderer, task, True, fmt=PYTHON)  # asserts the episode is rewarded 1.0
    call, reply, answer = messages[-3:]
    assert json.loads(call["content"].split("<tool_call>\n")[1].split("\n</tool_call>")[0]) == {
        "name": "python", "arguments": {"code": f"print({expr})"}}
    assert reply["role"] == "tool" and reply["content"] == f"exit status: 0\nstdout:\n{eval(expr)}\n"  # noqa: S307
    assert answer["content"] == f"Answer: {task['answer']}" and task["answer"] == str(eval(expr))  # noqa: S307
    assert tok.decode([i for i, m in zip(ids, mask, strict=True) if m], skip_special=False).count("<|im_end|>") == 2
    prefix = T.shared_prefix(renderer, PYTHON)
    assert ids[:len(prefix)] == prefix and prefix != T.shared_prefix(renderer, CALCULATOR)


def test_python_copy_rows_copy_the_printed_result(tok):
    rng = random.Random(0)
    kinds = set()
    for _ in range(20):
        ids, mask = T.copy_row(tok, rng, PYTHON)
        context = tok.decode([i for i, m in zip(ids, mask, strict=True) if not m], skip_special=False)
        learned = tok.decode([i for i, m in zip(ids, mask, strict=True) if m], skip_special=False)
        copied = learned.removeprefix("Answer: ").removesuffix("<|im_end|>")
        if learned.startswith("Answer: "):
            # as the sandbox's reply renders: print's newline, then the template's
            assert f"exit status: 0\nstdout:\n{copied}\n\n</tool_response>" in context, context
        else:
            assert re.fullmatch(r"\d{3,8}|\d{1,4}\*\d{1,3}\+\d{1,3}", copied) and copied in context
        kinds.add(learned.startswith("Answer: "))
    assert kinds == {True, False}


@pytest.mark.agents  # a training stage per step (~10-20 s): the agents tier (make test-agents)
def test_a_step_per_stage_writes_a_loadable_preset(tmp_path, tok):
    base = tmp_path / "base"
    torch.manual_seed(0)
    cfg = T.tiny_arith_tool_config()
    save_hf_checkpoint(CausalLM(cfg), cfg, base)
    stages = tuple(T.Stage(s.name, 1, 2, s.lr, 1) for s in P.STAGES)
    out = P.prepare_tiny_arith_python(tmp_path / "p", stages=stages, eval_every=1, eval_size=2, progress=False,
                                      base=base)
    meta = json.loads((out / T.META_FILE).read_text())
    assert meta["preset"] == P.TINY_ARITH_PYTHON and meta["task"]["env"] == "python" and meta["base"] == str(base)
    assert meta["stage_steps"] == {"copy": 1, "short": 1, "episodes": 1} and meta["tool_use_stats"]["episodes"] == 2
    model, got = load_hf_checkpoint(out)
    assert got.max_position_embeddings == T.CONTEXT and P.TINY_ARITH_PYTHON in PRESETS
    before, _ = load_hf_checkpoint(base)
    assert not torch.equal(model.state_dict()["lm_head.weight"], before.state_dict()["lm_head.weight"])  # trained
