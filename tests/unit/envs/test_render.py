"""Token-in / token-out rendering: appending deltas after the model's exact ids equals one rendering of the whole
conversation when the template is prefix-stable, and keeps every earlier token when it is not."""

from __future__ import annotations

import pytest

from fp8rl.envs import ChatRenderer, make_env
from fp8rl.envs.tools import format_tool_call
from fp8rl.model.tokenizer import CharTokenizer, load_tokenizer
from tests.unit.envs.chatml_tokenizer import build_chatml_tokenizer, chatml_template

CALC_TASK = {"question": "What is 347*29?", "answer": "10063"}
CALC_TURNS = [  # tool call; two tool calls (one bad); the answer
    format_tool_call("calculator", {"expression": "347*29"}),
    "Check: " + format_tool_call("calculator", {"expression": "29*347"}) + format_tool_call("calculator", {}),
    "The product is 10063.\nAnswer: 10063",
]
GUESS_TASK = {"low": 1, "high": 100, "secret": 37}
GUESS_TURNS = ["50", "I go lower: 25", "37"]


@pytest.fixture(scope="module")
def stable(tmp_path_factory):
    return load_tokenizer(build_chatml_tokenizer(tmp_path_factory.mktemp("chatml")))


@pytest.fixture(scope="module")
def rewriting(tmp_path_factory):
    directory = tmp_path_factory.mktemp("chatml_rewrite")
    return load_tokenizer(build_chatml_tokenizer(directory, chat_template=chatml_template(rewrite_history=True)))


def run_episode(tok, env_name, task, turns):
    """Plays ``turns`` as the model; returns (ids built by appending, all messages, prefix_ok per delta)."""
    env, renderer = make_env(env_name), ChatRenderer(tok)
    messages = env.reset(task)
    tools = env.tools()
    ids = renderer.opening(messages, tools)
    oks = []
    for text in turns:
        ids += tok.encode(text, add_bos=False) + [tok.eos_id]  # the model's sampled ids, stop token included
        messages.append({"role": "assistant", "content": text})
        out = env.step(text)
        if out.done:
            assert out.reward == 1.0
            return ids, messages, oks
        delta, ok = renderer.delta(messages, out.messages, tools)
        ids += delta
        oks.append(ok)
        messages += out.messages
    raise AssertionError("episode did not end")


@pytest.mark.parametrize("env_name, task, turns", [("calculator", CALC_TASK, CALC_TURNS),
                                                   ("guess_number", GUESS_TASK, GUESS_TURNS)])
def test_appended_ids_equal_one_rendering(stable, env_name, task, turns):
    ids, messages, oks = run_episode(stable, env_name, task, turns)
    assert oks == [True, True]
    renderer = ChatRenderer(stable)
    tools = make_env(env_name).tools()
    whole = stable.encode(renderer.render(messages, tools, add_generation_prompt=False), add_bos=False)
    assert ids + stable.encode("\n", add_bos=False) == whole  # the template's "\n" after the last <|im_end|>


def test_delta_starts_after_the_end_of_turn_token(stable):
    renderer = ChatRenderer(stable)
    history = [{"role": "user", "content": "q"}, {"role": "assistant", "content": CALC_TURNS[0]}]
    delta, ok = renderer.delta(history, [{"role": "tool", "content": "10063"}, {"role": "tool", "content": "7"}])
    assert ok
    assert stable.decode(delta, skip_special=False) == ("\n<|im_start|>user\n<tool_response>\n10063\n</tool_response>"
                                                        "\n<tool_response>\n7\n</tool_response><|im_end|>\n"
                                                        "<|im_start|>assistant\n")


@pytest.mark.parametrize("env_name, task, turns", [("calculator", CALC_TASK, CALC_TURNS),
                                                   ("guess_number", GUESS_TASK, GUESS_TURNS)])
def test_history_rewriting_template_keeps_the_tokens_already_seen(stable, rewriting, env_name, task, turns):
    kept, messages, oks = run_episode(rewriting, env_name, task, turns)
    assert oks == [False, False]
    # the same ids a prefix-stable rendering gives: no earlier token was changed, the new messages render alike
    assert kept == run_episode(stable, env_name, task, turns)[0]
    # ... while the template's own rendering of the conversation has dropped the earlier turns' content
    tools = make_env(env_name).tools()
    own = rewriting.encode(ChatRenderer(rewriting).render(messages, tools, add_generation_prompt=False), add_bos=False)
    assert own[: len(kept)] != kept


def test_neutral_turns_may_be_rewritten_too(stable, tmp_path):
    """Qwen3's shape: the last assistant turn gets an empty think block, earlier ones lose their content, so even
    the neutral history renders differently once a message follows; the delta is found by counting turns."""
    dropped = "(message.content if (message.role != 'assistant' or loop.last) else '')"
    qwen3ish = chatml_template(rewrite_history=True).replace(
        dropped, f"(('<think></think>' if message.role == 'assistant' else '') + {dropped})")
    assert qwen3ish != chatml_template(rewrite_history=True)
    tok = load_tokenizer(build_chatml_tokenizer(tmp_path / "qwen3ish", chat_template=qwen3ish))
    history = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
               {"role": "assistant", "content": "50"}]
    delta, ok = ChatRenderer(tok).delta(history, [{"role": "user", "content": "lower"}])
    assert not ok
    assert tok.decode(delta, skip_special=False) == "\n<|im_start|>user\nlower<|im_end|>\n<|im_start|>assistant\n"


def test_opening_is_the_template_prompt_without_an_extra_bos(stable):
    renderer = ChatRenderer(stable)
    env = make_env("calculator")
    messages = env.reset(CALC_TASK)
    ids = renderer.opening(messages, env.tools())
    text = stable.hf_tokenizer.apply_chat_template(messages, tools=env.tools(), add_generation_prompt=True,
                                                   tokenize=False)
    assert ids == stable.encode(text, add_bos=False)
    assert stable.decode(ids, skip_special=False).endswith("<|im_start|>assistant\n")
    assert '"name": "calculator"' in text  # the tools block is rendered into the system turn


def test_history_must_end_with_the_model_turn(stable):
    with pytest.raises(ValueError, match="assistant"):
        ChatRenderer(stable).delta([{"role": "user", "content": "q"}], [{"role": "user", "content": "x"}])


def test_tokenizers_without_a_chat_template_are_refused(tmp_path):
    directory = build_chatml_tokenizer(tmp_path / "plain")
    (directory / "chat_template.jinja").unlink()
    with pytest.raises(ValueError, match="plain.*no chat template"):
        ChatRenderer(load_tokenizer(directory))
    with pytest.raises(ValueError, match="CharTokenizer.*no chat template"):
        ChatRenderer(CharTokenizer())
