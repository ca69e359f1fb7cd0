"""The endpoint's request → prompt ids rules (fp8rl.endpoint.chat) without a server or a model: splicing of returned
token ids, the session continuation rule, a history-rewriting template, cut turns, stop strings and the field
checks. The expected ids come from the renderer's own rules (one rendering of the conversation), not from the
code under test."""

from __future__ import annotations

import pytest

from fp8rl.endpoint.chat import EndpointError, EndpointLimits, SessionView, parse_chat
from fp8rl.endpoint.choices import cut_at_stop
from fp8rl.envs import ChatRenderer
from fp8rl.model.tokenizer import load_tokenizer
from tests.unit.envs.chatml_tokenizer import build_chatml_tokenizer, chatml_template

LIM = EndpointLimits()
V, L = 128, 4096


@pytest.fixture(scope="module")
def stable(tmp_path_factory):
    return ChatRenderer(load_tokenizer(build_chatml_tokenizer(tmp_path_factory.mktemp("chatml"))))


@pytest.fixture(scope="module")
def rewriting(tmp_path_factory):
    d = tmp_path_factory.mktemp("chatml_rewrite")
    return ChatRenderer(load_tokenizer(build_chatml_tokenizer(d, chat_template=chatml_template(rewrite_history=True))))


def _parse(r, messages, session=None, **body):
    req, _ = parse_chat({"messages": messages, **body}, r, vocab_size=V, max_len=L, lim=LIM, session=session)
    return req


def _assistant(r, prompt, text):
    """What the endpoint returns for a turn whose text is ``text`` (the model's ids: the text + end of turn)."""
    gen = r.encode(text) + [r.end_of_turn_id]
    return {"role": "assistant", "content": text, "prompt_token_ids": prompt, "generation_token_ids": gen}, gen


def test_a_first_call_is_the_whole_rendering(stable):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    assert _parse(stable, msgs).prompts == [stable.opening(msgs)]
    # OpenAI's developer role and text content parts are the same request
    same = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": [
        {"type": "text", "text": "2+"}, {"type": "text", "text": "2?"}]}]
    assert _parse(stable, same).prompts == [stable.opening(msgs)]


def test_returned_ids_are_spliced_whatever_the_text_now_says(stable):
    first = [{"role": "user", "content": "2+2?"}]
    p0 = stable.opening(first)
    a, gen = _assistant(stable, p0, "four")
    nxt = {"role": "user", "content": "sure?"}
    want = p0 + gen + stable.delta(first + [{"role": "assistant", "content": "four"}], [nxt])[0]
    assert _parse(stable, first + [a, nxt]).prompts == [want]
    rewritten = dict(a, content="<think>…</think> 4")  # the client changed the text: the tokens stand
    assert _parse(stable, first + [rewritten, nxt]).prompts[0][:len(p0) + len(gen)] == p0 + gen
    # one rendering of the whole conversation is the same ids (this template is prefix-stable)
    whole = stable.opening(first + [{"role": "assistant", "content": "four"}, nxt])
    assert want == whole


def test_a_history_rewriting_template_keeps_the_ids_the_model_saw(rewriting):
    first = [{"role": "user", "content": "hi"}]
    p0 = rewriting.opening(first)
    a, gen = _assistant(rewriting, p0, "hello there")
    prompt = _parse(rewriting, first + [a, {"role": "user", "content": "and?"}]).prompts[0]
    assert prompt[:len(p0) + len(gen)] == p0 + gen  # a re-rendering would have dropped "hello there"
    rerendered = rewriting.opening(first + [{"role": "assistant", "content": "hello there"},
                                            {"role": "user", "content": "and?"}])
    assert rerendered[:len(p0) + len(gen)] != p0 + gen


def test_a_turn_cut_by_its_budget_gets_its_end_of_turn_as_context(stable):
    first = [{"role": "user", "content": "count"}]
    p0 = stable.opening(first)
    cut = stable.encode("1 2 3")  # no end-of-turn token: max_tokens ran out
    a = {"role": "assistant", "content": "1 2 3", "prompt_token_ids": p0, "generation_token_ids": cut}
    prompt = _parse(stable, first + [a, {"role": "user", "content": "go on"}]).prompts[0]
    assert prompt[:len(p0) + len(cut) + 1] == p0 + cut + [stable.end_of_turn_id]


def test_the_session_rule_without_token_ids(stable):
    first = [{"role": "user", "content": "2+2?"}]
    p0 = stable.opening(first)
    gen = stable.encode("four") + [stable.end_of_turn_id]
    view = SessionView(tuple(p0 + gen), 2, {"role": "assistant", "content": "four"})
    nxt = {"role": "user", "content": "sure?"}
    prompt = _parse(stable, first + [{"role": "assistant", "content": "four"}, nxt], session=view).prompts[0]
    assert prompt[:len(p0) + len(gen)] == p0 + gen
    with pytest.raises(EndpointError, match="does not continue this session") as ei:
        _parse(stable, first + [{"role": "assistant", "content": "five"}, nxt], session=view)
    assert ei.value.code == "session_history_mismatch"
    with pytest.raises(EndpointError, match="n must be in"):  # one sample per call in a session
        _parse(stable, first + [{"role": "assistant", "content": "four"}, nxt], session=view, n=2)


@pytest.mark.parametrize("body,fragment", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop must be"),
    ({"logit_bias": {"5": 1}}, "not supported"),
    ({"messages_extra": 1}, "unknown field"),
    ({"n": 0}, "n must be in"),
    ({"temperature": float("nan")}, "finite"),
    ({"seed": -1}, "seed must be in"),
    ({"max_tokens": 5000}, "max_tokens must be in"),
    ({"tools": [{"type": "function", "function": {}}]}, "tools[0]"),
])
def test_bad_fields_are_named(stable, body, fragment):
    with pytest.raises(EndpointError) as ei:
        _parse(stable, [{"role": "user", "content": "x"}], **body)
    assert fragment in str(ei.value) and ei.value.status == 400


def test_messages_are_checked(stable):
    for msgs, fragment in (([{"role": "user", "content": 5}], "content must be"),
                           ([{"role": "user", "content": [{"type": "image_url"}]}], "only text parts"),
                           ([{"role": "user", "content": "x", "extra": 1}], "unknown field"),
                           ([{"role": "user", "content": "x", "generation_token_ids": [1]}], "assistant messages only"),
                           ([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y",
                                                                  "generation_token_ids": [5]}],
                            "without prompt_token_ids"),
                           ([{"role": "user", "content": "x"}, {"role": "system", "content": "late"}],
                            "chat template refused")):
        with pytest.raises(EndpointError, match=fragment):
            _parse(stable, msgs)


def test_a_pinned_temperature_is_enforced():
    lim = EndpointLimits(temperature=0.7, top_p=0.9)
    from fp8rl.endpoint.chat import _sampling

    assert (_sampling({}, lim, 10, 100, n_cap=1).temperature, _sampling({}, lim, 10, 100, n_cap=1).top_p) == (0.7, 0.9)
    with pytest.raises(EndpointError, match="samples the policy being trained at temperature=0.7"):
        _sampling({"temperature": 1.0}, lim, 10, 100, n_cap=1)


def test_a_stop_string_cuts_text_and_tokens():
    text_of = "".join  # a token per character
    ids = list("abcXYdef")
    kept, lps, text, why = cut_at_stop(ids, [0.0] * 8, "length", text_of, ["XY"])
    assert (kept, text, why) == (list("abcXY"), "abc", "stop")
    assert cut_at_stop(ids, [0.0] * 8, "length", text_of, ["zz"])[2:] == ("abcXYdef", "length")


def test_a_completions_call_is_bounded_in_tokens():
    from fp8rl.endpoint.chat import parse_completion

    lim = EndpointLimits(max_generated_tokens=1000)
    enc = list  # never called: token-id prompts
    req = parse_completion({"prompt": [[5, 6]] * 10, "n": 5, "max_tokens": 20}, enc, vocab_size=V, max_len=L,
                           lim=lim, session=None)
    assert len(req.prompts) == 10 and req.sampling.n == 5
    with pytest.raises(EndpointError, match="10 x 5 x 21 = 1050 tokens; the limit of one call is 1000"):
        parse_completion({"prompt": [[5, 6]] * 10, "n": 5, "max_tokens": 21}, enc, vocab_size=V, max_len=L,
                         lim=lim, session=None)


def test_an_ended_session_is_not_reopened():
    from fp8rl.endpoint.sessions import SessionBook

    book = SessionBook(max_sessions=2)
    view = book.begin("a")
    assert view.ids == () and len(book) == 1
    book.record("a", [1, 2], [3], [-0.5], 0, n_messages=1, reply={"role": "assistant", "content": "x"})
    assert book.get("a").to_json()["loss_mask"] == [0, 0, 1]
    assert book.drop("a") is not None
    with pytest.raises(EndpointError, match="has ended") as ei:
        book.begin("a")  # an agent past its time calls again: refused, nothing recorded
    assert ei.value.status == 410 and len(book) == 0
    book.begin("b")
    with pytest.raises(EndpointError, match="call in flight"):
        book.begin("b")
