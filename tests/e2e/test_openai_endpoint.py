"""The OpenAI-compatible, token-carrying endpoint (issue 51) driven by the real ``openai`` client over real HTTP.

The policy is :mod:`tests.e2e.test_trajectories`' (a seeded random 2-layer Llama, the ChatML character tokenizer,
fp8_e2e with an FP8 KV cache and batch invariance on). A random policy writes noise: what is tested is the
contract — token ids in and out, splicing, sessions, bounds — and that a trajectory driven through the endpoint
is bitwise the trainer's one forward over it (max |dlogprob| exactly 0).
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import openai
import pytest
import torch

from fp8rl.config import parse_job_config
from fp8rl.endpoint import EndpointConfig, OpenAIEndpoint
from fp8rl.endpoint.choices import tool_calls_of
from fp8rl.engines.batch import build_train_batch
from fp8rl.envs.trajectory import Trajectory
from fp8rl.loop import GRPOLoop, LoopConfig

from .test_trajectories import _chat_model, _job

SESSION = "X-Session-Id"
TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "evaluates arithmetic",
                                           "parameters": {"type": "object",
                                                          "properties": {"expression": {"type": "string"}}}}}]


def _endpoint(s: SimpleNamespace, **cfg) -> OpenAIEndpoint:
    eng = s.engine
    return OpenAIEndpoint(lambda p, params, keys: eng.generate(p, params, sessions=keys), s.loop.tok,
                          vocab_size=eng.model.config.vocab_size, max_len=eng.max_len,
                          config=EndpointConfig(model_name="tiny-chat", **cfg),
                          weight_version=lambda: eng.weight_version, drop_session=eng.drop_session)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = _chat_model(tmp_path_factory.mktemp("chat-model-endpoint"), max_position_embeddings=2048)
    job = parse_job_config(_job(path))
    loop = GRPOLoop(LoopConfig(job))
    s = SimpleNamespace(path=path, job=job, loop=loop, engine=loop.rollout)
    s.ep = _endpoint(s, body_timeout_s=1.0, max_body_bytes=256 * 1024)
    s.port = s.ep.start()
    s.client = openai.OpenAI(base_url=f"http://127.0.0.1:{s.port}/v1", api_key="unused", max_retries=0, timeout=60)
    yield s
    s.ep.stop()


def _turn(client, messages, sid, **kw):
    r = client.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=kw.pop("max_tokens", 6),
                                       extra_headers={SESSION: sid}, **kw)
    return r, r.choices[0].message.model_dump(exclude_none=True)


def test_a_trajectory_through_the_endpoint_is_bitwise_the_trainers_forward(served):
    """Three turns of one session through the openai client — the client rewrites the assistant's text each time
    (as frameworks that strip <think> or re-serialise tool calls do) but sends the token ids back — then the
    session's record: the spliced turns are exactly the sampled tokens, the caller's messages are masked, the K/V
    of earlier turns were reused, and the trainer's forward over the whole trajectory gives the logprobs the
    endpoint sampled with, bitwise."""
    c, sid = served.client, "bitwise-1"
    before = served.engine.session_stats()
    messages = [{"role": "system", "content": "You add."}, {"role": "user", "content": "2+3?"}]
    sampled = []
    for turn, follow in enumerate([{"role": "tool", "content": "5"}, {"role": "user", "content": "and 4+4?"}, None]):
        r, msg = _turn(c, messages, sid, tools=TOOLS, temperature=1.0)
        assert msg["weight_version"] == served.engine.weight_version == r.choices[0].model_extra["weight_version"]
        assert len(msg["generation_token_ids"]) == len(msg["generation_log_probs"]) >= 1
        sampled.append((msg["prompt_token_ids"], msg["generation_token_ids"], msg["generation_log_probs"]))
        if turn:  # each prompt extends the previous turn's tokens exactly: nothing was re-rendered
            p, g, _ = sampled[turn - 1]
            assert msg["prompt_token_ids"][:len(p) + len(g)] == p + g
        if follow is None:
            break
        msg["content"] = f"<rewritten by the client {turn}>"
        messages += [msg, follow]
    rec = json.loads(_get(served.port, f"/v1/fp8rl/sessions/{sid}"))
    assert rec["turns"] == 3
    ids, mask = rec["token_ids"], rec["loss_mask"]
    for p, g, lps in sampled:  # every sampled turn sits in the record at its place, as sampled
        assert ids[len(p):len(p) + len(g)] == g and mask[len(p):len(p) + len(g)] == [1] * len(g)
        assert rec["logprobs"][len(p):len(p) + len(g)] == lps
    assert set(rec["weight_versions"][i] for i in range(len(ids)) if mask[i]) == {served.engine.weight_version}
    after = served.engine.session_stats()
    assert after["hits"] - before["hits"] == 2 and after["reused_tokens"] > before["reused_tokens"]

    first = mask.index(1)
    traj = Trajectory(0, tuple(ids[:first]), ids[first:], rec["logprobs"][first:], mask[first:],
                      rec["weight_versions"][first:])
    batch = build_train_batch([traj], None, 1, served.loop.tok.pad_id, advantages=torch.zeros(1))
    trainer = served.loop.trainer  # version 0, the rollout's weights; with the QKV scales the rollout holds
    trainer.load_qkv_scales(served.loop.backends.scales_of(served.engine.weight_version))
    lp = trainer.compute_logprobs(batch)
    trained = batch.loss_mask.bool()
    assert int(trained.sum()) == sum(len(g) for _, g, _ in sampled)
    assert (lp[trained] - batch.gen_logprobs[trained]).abs().max().item() == 0.0  # bitwise, every turn

    gone = json.loads(_request(served.port, "DELETE", f"/v1/fp8rl/sessions/{sid}")[1])
    assert gone["deleted"] and served.engine.session_stats()["entries"] == before["entries"]


def test_a_history_that_does_not_continue_the_session_is_refused(served):
    c, sid = served.client, "mismatch-1"
    messages = [{"role": "user", "content": "hello"}]
    _, msg = _turn(c, messages, sid)
    forged = dict(msg, generation_token_ids=[(t + 1) % 100 + 4 for t in msg["generation_token_ids"]])
    with pytest.raises(openai.BadRequestError) as ei:
        _turn(c, messages + [forged, {"role": "user", "content": "more"}], sid)
    err = ei.value.body
    assert err["code"] == "session_history_mismatch" and "token" in err["message"]
    # the client dropped the token ids and changed the text: not the returned reply, refused as well
    with pytest.raises(openai.BadRequestError, match="does not continue this session"):
        _turn(c, messages + [{"role": "assistant", "content": "something else"}, {"role": "user", "content": "x"}],
              sid)
    # the returned reply without its token fields (same text): the session's tokens are spliced
    plain = {"role": "assistant", "content": msg.get("content") or ""}
    _, msg2 = _turn(c, messages + [plain, {"role": "user", "content": "more"}], sid)
    p, g = msg["prompt_token_ids"], msg["generation_token_ids"]
    assert msg2["prompt_token_ids"][:len(p) + len(g)] == p + g
    assert json.loads(_get(served.port, f"/v1/fp8rl/sessions/{sid}"))["turns"] == 2  # the refusals recorded nothing


def test_streaming_n_seed_stop_logprobs_and_completions(served):
    c = served.client
    msgs = [{"role": "user", "content": "count"}]
    whole = c.chat.completions.create(model="m", messages=msgs, max_tokens=10, seed=7, logprobs=True)
    chunks = list(c.chat.completions.create(model="m", messages=msgs, max_tokens=10, seed=7, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    last = [ch for ch in chunks if ch.choices][-1]
    w = whole.choices[0]
    assert text == (w.message.content or "")  # seeded: the same tokens, streamed
    assert last.choices[0].delta.model_extra["generation_token_ids"] == w.message.model_extra["generation_token_ids"]
    assert last.choices[0].finish_reason == w.finish_reason and chunks[-1].usage.completion_tokens >= 1
    assert [t.logprob for t in w.logprobs.content] == w.message.model_extra["generation_log_probs"]

    many = c.chat.completions.create(model="m", messages=msgs, max_tokens=4, n=3)
    assert [ch.index for ch in many.choices] == [0, 1, 2]
    assert many.usage.completion_tokens == sum(len(ch.message.model_extra["generation_token_ids"])
                                               for ch in many.choices)

    # a stop string: the text ends before it, the tokens end with the one that completed it
    probe = c.chat.completions.create(model="m", messages=msgs, max_tokens=12, seed=11, temperature=0.0)
    full = probe.choices[0].message.content or ""
    if len(full) >= 3:
        stop = full[1:3]
        cut = c.chat.completions.create(model="m", messages=msgs, max_tokens=12, seed=11, temperature=0.0, stop=stop)
        ch = cut.choices[0]
        assert (ch.message.content, ch.finish_reason) == (full[:full.find(stop)], "stop")
        assert len(ch.message.model_extra["generation_token_ids"]) < len(
            probe.choices[0].message.model_extra["generation_token_ids"]) or full.endswith(stop)

    comp = c.completions.create(model="m", prompt=[[5, 6, 7], "ab"], max_tokens=3, n=2, logprobs=1)
    assert len(comp.choices) == 4 and comp.choices[0].model_extra["prompt_token_ids"] == [5, 6, 7]
    assert all(len(ch.logprobs.token_logprobs) == len(ch.model_extra["generation_token_ids"]) for ch in comp.choices)
    assert [m.id for m in c.models.list().data] == ["tiny-chat"]


def test_tools_are_rendered_and_tool_calls_come_back_in_openais_shape(served):
    r = served.client.chat.completions.create(model="m", messages=[{"role": "user", "content": "1+1"}],
                                              tools=TOOLS, max_tokens=2)
    prompt = served.loop.tok.decode(r.choices[0].message.model_extra["prompt_token_ids"], skip_special=False)
    assert '"name": "calculator"' in prompt and "<tools>" in prompt  # the template rendered the tools
    # what the endpoint turns a model's text into (the random policy does not write tool calls itself)
    text = 'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+1"}}\n</tool_call>'
    content, calls = tool_calls_of(text, frozenset({"calculator"}))
    assert content == "Let me compute." and len(calls) == 1
    assert calls[0]["type"] == "function" and calls[0]["function"]["name"] == "calculator"
    assert json.loads(calls[0]["function"]["arguments"]) == {"expression": "1+1"} and calls[0]["id"].startswith("call_")
    assert tool_calls_of(text, frozenset({"other"}))[1] == []  # a tool the request did not offer stays text
    assert tool_calls_of("<tool_call>{bad json</tool_call>", frozenset())[1] == []  # malformed: left as text


@pytest.mark.parametrize("body,code,fragment", [
    ({"model": "m", "messages": [], "max_tokens": 2}, 400, "messages must be a non-empty list"),
    ({"model": "m", "messages": [{"role": "robot", "content": "x"}]}, 400, "role must be one of"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, 400, "temperature"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "frequency_penalty": 0.5}, 400, "not supported"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "made_up": 1}, 400, "unknown field 'made_up'"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 10**6}, 400, "max_tokens"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"},
                                 {"role": "assistant", "content": "", "prompt_token_ids": [1],
                                  "generation_token_ids": [10**6]}, {"role": "user", "content": "y"}]},
     400, "outside the model's vocabulary"),
])
def test_bad_requests_get_openais_error_shape_and_cost_nothing(served, body, code, fragment):
    calls = served.ep.stats["engine_calls"]
    status, raw = _request(served.port, "POST", "/v1/chat/completions", json.dumps(body).encode())
    err = json.loads(raw)["error"]
    assert status == code and fragment in err["message"] and err["type"] == "invalid_request_error", err
    assert served.ep.stats["engine_calls"] == calls  # refused before the engine


def test_hostile_http_input(served):
    port = served.port
    status, raw = _request(port, "POST", "/v1/chat/completions", b"{not json")
    assert status == 400 and "not JSON" in json.loads(raw)["error"]["message"]
    status, raw = _request(port, "POST", "/v1/completions", json.dumps({"prompt": [[1, 2, 999]]}).encode())
    assert status == 400 and "outside the model's vocabulary" in json.loads(raw)["error"]["message"]
    status, raw = _request(port, "POST", "/v1/chat/completions", b"x" * (300 * 1024))  # over max_body_bytes
    assert status == 413 and "larger than" in json.loads(raw)["error"]["message"]
    status, raw = _request(port, "GET", "/v1/nowhere")
    assert status == 404 and "error" in json.loads(raw)
    status, raw = _request(port, "POST", "/v1/chat/completions", b"{}", headers={SESSION: "bad id!"})
    assert status == 400 and SESSION in json.loads(raw)["error"]["message"]
    # a slow body: the headers promise 100 bytes, 10 arrive, the rest never does
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"model\": ")
        reply = sock.recv(4096).decode()
    assert " 408 " in reply.splitlines()[0] and time.monotonic() - t0 < 5
    assert _request(port, "GET", "/health")[0] == 200  # still serving


def test_every_route_wants_the_token_when_one_is_set(served):
    ep = _endpoint(served, token="s3cret-token")
    port = ep.start()
    try:
        routes = [("GET", "/health"), ("GET", "/v1/models"), ("POST", "/v1/chat/completions"),
                  ("POST", "/v1/completions"), ("GET", "/v1/fp8rl/sessions/a"), ("DELETE", "/v1/fp8rl/sessions/a"),
                  ("GET", "/v1/nowhere")]
        for method, route in routes:
            for auth in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret-token"}):
                status, raw = _request(port, method, route, b"{}" if method == "POST" else None, headers=auth)
                assert status == 401 and json.loads(raw)["error"]["code"] == "invalid_api_key", (method, route, auth)
        # 32 callers without the token that promise a 1 MiB body and never send it: each refused at its headers (the
        # body is never waited for), and the token holder's health call meanwhile answers at once
        stalled = []
        for _ in range(32):
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1048576\r\n\r\n{")
            stalled.append(sock)
        try:
            t0 = time.monotonic()
            assert _request(port, "GET", "/health", headers={"Authorization": "Bearer s3cret-token"})[0] == 200
            assert time.monotonic() - t0 < 2.0
            assert all(" 401 " in sock.recv(4096).decode().splitlines()[0] for sock in stalled)
        finally:
            for sock in stalled:
                sock.close()
        good = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="s3cret-token", max_retries=0)
        assert good.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], max_tokens=2)
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="nope", max_retries=0).models.list()
    finally:
        ep.stop()


def test_64_concurrent_sessions_are_batched_and_the_queue_is_bounded(served):
    """64 agents, two turns each, at once: every call answered, the calls batched into far fewer engine calls, every
    session recorded. Then an endpoint whose queue holds 8: the calls beyond it are refused 429 (nothing recorded
    for them), the rest answered."""
    c = served.client
    calls0, engine0 = served.ep.stats["calls"], served.ep.stats["engine_calls"]

    def agent(i: int) -> int:
        sid = f"agent-{i}"
        msgs = [{"role": "user", "content": f"task {i}"}]
        _, msg = _turn(c, msgs, sid, max_tokens=4)
        _turn(c, msgs + [msg, {"role": "user", "content": "go on"}], sid, max_tokens=4)
        return json.loads(_request(served.port, "DELETE", f"/v1/fp8rl/sessions/{sid}")[1])["turns"]

    with ThreadPoolExecutor(64) as ex:
        turns = list(ex.map(agent, range(64)))
    assert turns == [2] * 64
    calls = served.ep.stats["calls"] - calls0
    engine_calls = served.ep.stats["engine_calls"] - engine0
    print(f"\n64 sessions x 2 turns: {calls} calls in {engine_calls} engine calls")
    assert calls == 128 and engine_calls < calls / 2

    small = _endpoint(served, max_queue=8)
    port = small.start()
    try:
        cl = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=60)
        gate = threading.Barrier(32)

        def one(i: int) -> str:
            gate.wait()
            try:
                cl.chat.completions.create(model="m", messages=[{"role": "user", "content": "q"}], max_tokens=24,
                                           extra_headers={SESSION: f"q-{i}"})
                return "ok"
            except openai.RateLimitError as exc:
                assert exc.body["code"] == "queue_full"
                return "429"

        with ThreadPoolExecutor(32) as ex:
            got = list(ex.map(one, range(32)))
        assert got.count("ok") >= 8 and got.count("429") >= 1, got
        assert len(small.sessions) == got.count("ok")  # a refused call left no session behind
    finally:
        small.stop()


# -- plain HTTP (the hostile cases need what a well-behaved client never sends) ------------------------------------
def _request(port: int, method: str, path: str, body: bytes | None = None, headers: dict | None = None
             ) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        return resp.status, resp.read().decode()
    finally:
        conn.close()


def _get(port: int, path: str) -> str:
    status, raw = _request(port, "GET", path)
    assert status == 200, raw
    return raw


# -- agent jobs in the loop ------------------------------------------------------------------------------------------
def _agent_job(path, entrypoint: str, **agent) -> dict:
    job = _job(path, data={"task": "arith"})
    del job["env"]
    job["agent"] = {"entrypoint": f"tests.e2e.byo_agents:{entrypoint}", "concurrency": 4, "max_tokens_per_call": 8,
                    **agent}
    return job


@pytest.mark.agents  # whole GRPO steps in the loop: the agents tier (make test-agents)
def test_an_agent_job_trains_its_sessions_bitwise(served):
    """A GRPO step whose trajectories are a user's agent function driving the policy through the endpoint (two calls
    each, the assistant message sent back as returned): every session becomes a trajectory of two model turns with
    the agent's messages masked, graded from the agent's text, and the trainer's logprobs are the endpoint's,
    bitwise."""
    loop = GRPOLoop(LoopConfig(parse_job_config(_agent_job(served.path, "two_turns"))))
    m = loop.step(0)
    assert m["mismatch/max_abs_logprob_diff"] == 0.0 and m["token_mult_prob_error"] == 1.0
    assert m["env/turns_mean"] == 2.0 and m["env/ungraded"] == 0.0 and m["env/end/done"] == 4.0
    assert m["env/masked_tokens"] > 0 and m["env/model_tokens"] > 0
    assert loop.rollout.session_stats()["entries"] == 0  # every session's K/V released


@pytest.mark.agents  # whole GRPO steps in the loop: the agents tier (make test-agents)
def test_an_agents_failures_are_ungraded_and_counted(served):
    loop = GRPOLoop(LoopConfig(parse_job_config(_agent_job(served.path, "flaky", timeout_s=60))))
    m = loop.step(0)
    assert m["env/ungraded"] >= 1 and m["env/end/env_error"] == m["env/ungraded"]
    assert m["mismatch/max_abs_logprob_diff"] == 0.0  # the graded ones trained, exactly
    hot = GRPOLoop(LoopConfig(parse_job_config(_agent_job(served.path, "hot"))))
    assert hot.step(0)["env/ungraded"] == 4.0  # every call refused: the agents failed, nothing trained on them


@pytest.mark.agents  # whole GRPO steps in the loop: the agents tier (make test-agents)
def test_eval_runs_an_agent_jobs_agent(served, tmp_path):
    """``python -m fp8rl.eval MODEL --config agent-job.yaml``: the policy is scored through the job's agent (its
    reward), greedy and with k samples — here an agent whose reward is the parity of the task's answer, so the
    accuracy is known exactly."""
    import yaml

    from fp8rl.eval.__main__ import main as eval_main

    rows = [{"question": f"{a}+{b}=", "answer": str(a + b)} for a, b in ((1, 2), (2, 2), (3, 3), (4, 1), (5, 5))]
    data = tmp_path / "val.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    job = _agent_job(served.path, "parity")
    job["data"] = {"task": "jsonl", "path": str(data)}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    out = tmp_path / "r.json"
    assert eval_main([str(served.path), "--data", str(data), "--config", str(tmp_path / "job.yaml"), "--k", "2",
                      "--out", str(out), "--no-progress"]) == 0
    r = json.loads(out.read_text())
    even = sum(int(x["answer"]) % 2 == 0 for x in rows) / len(rows)
    assert r["problems"] == 5 and r["val_accuracy"] == even and r["val/pass@2"] == even == r["val/mean@2"]


@pytest.mark.agents  # whole GRPO steps in the loop: the agents tier (make test-agents)
def test_an_asynchronous_agent_job_stays_within_its_lag_and_exact(served):
    """Asynchronous GRPO (k = 1) with an agent: step s+1's agents run while step s trains, their calls pinned to the
    version the rollout holds; every row within the lag bound, and the rows of the trainer's version bitwise
    (``numeric/``: a row one version behind differs by the update, as it should — ``stale/``)."""
    job = _agent_job(served.path, "two_turns")
    job["job"]["steps"] = 2
    job["grpo"]["async_grpo"] = {"enabled": True, "max_weight_lag": 1}
    rows = []
    GRPOLoop(LoopConfig(parse_job_config(job))).run_async(2, rows.append)
    assert len(rows) == 2 and all(r["weight_lag_max"] <= 1 and r["env/turns_mean"] == 2.0 for r in rows)
    assert rows[0]["weight_lag_max"] == 0.0 and rows[0]["mismatch/max_abs_logprob_diff"] == 0.0  # at its version
    # step 1's agents ran while step 0 trained (on version 0, one behind: their logprobs differ by that update), or
    # on version 1 if the refit came first; rows of the trainer's own version are exact either way
    r = rows[1]
    assert r["numeric/mismatch/max_abs_logprob_diff"] == 0.0
    assert r["weight_lag_mean"] == 0.0 or r["stale/mismatch/max_abs_logprob_diff"] > 0.0


def test_the_stack_refuses_asynchronous_agent_jobs_naming_why(served):
    from fp8rl.config import ConfigError

    parse_job_config(_agent_job(served.path, "two_turns")).check_services()  # synchronous: runs on the stack
    job = _agent_job(served.path, "two_turns")
    job["grpo"]["async_grpo"] = {"enabled": True, "max_weight_lag": 1}
    with pytest.raises(ConfigError, match="asynchronous agent jobs run in the in-process loop"):
        parse_job_config(job).check_services()
