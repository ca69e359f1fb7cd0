"""The ecosystem adapters (fp8rl.envs.adapters) against the real packages: SkyRL-Gym (its shipped gsm8k environment
and a user BaseTextEnv), gymnasium (a user text Env), and a TRL environment_factory class — each run through the
fp8rl environment contract, and gated on the service stack like a user environment."""

from __future__ import annotations

import json

import pytest

from fp8rl.envs import EnvError, allowed, import_paths, make_env

HERE = "tests.unit.envs.ecosystem_envs"


def test_skyrl_gsm8k_as_shipped():
    env = make_env("skyrl", env_id="gsm8k", system_prompt="Answer after ####.")
    msgs = env.reset({"question": "What is 6 x 7?", "answer": "42"})
    assert msgs == [{"role": "system", "content": "Answer after ####."}, {"role": "user", "content": "What is 6 x 7?"}]
    out = env.step("6 x 7 = 42 #### 42")
    assert (out.done, out.reward, out.messages) == (True, 1.0, [])
    env.reset({"question": "What is 6 x 7?", "answer": "42"})
    assert env.step("#### 41").reward == 0.0


def test_a_users_skyrl_env_runs_its_turns():
    env = make_env("skyrl", entry_point=f"{HERE}:GuessWordSkyRL")
    env.reset({"question": "Which fruit?", "answer": "pear"})
    first = env.step("apple")
    assert not first.done and first.reward is None and "starts with 'p'" in first.messages[0]["content"]
    assert env.step("a pear").reward == 1.0


def test_a_users_gymnasium_text_env():
    env = make_env("gymnasium", entry_point=f"{HERE}:EchoWordGym", env_kwargs={"max_misses": 2})
    msgs = env.reset({"question": "Play along.", "answer": "plum"})
    assert msgs[-1]["content"] == "Play along.\n\nSay the word plum."
    miss = env.step("banana")
    assert not miss.done and miss.messages == [{"role": "user", "content": "Not yet: say plum."}]
    assert env.step("cherry").done  # truncated after two misses: the return so far
    env.reset({"question": "Again.", "answer": "fig"})
    out = env.step("fig!")
    assert (out.done, out.reward) == (True, 1.0)


def test_a_trl_environment_factory_class():
    env = make_env("trl", factory=f"{HERE}:CounterTRL")
    msgs = env.reset({"question": "Count to 3.", "answer": "3"})
    assert msgs[-1]["content"] == "Count to 3.\n\nThe counter is at 0."
    (schema,) = env.tools()  # get_json_schema of the public method, as TRL's chat template path builds it
    assert schema["function"]["name"] == "increment"
    assert schema["function"]["parameters"]["properties"]["by"]["type"] == "integer"
    call = '<tool_call>\n{"name": "increment", "arguments": {"by": 2}}\n</tool_call>'
    out = env.step(call)
    assert not out.done and out.messages == [{"role": "tool", "name": "increment", "content": "2"}]
    bad = env.step('<tool_call>\n{"name": "increment", "arguments": {"by": -1}}\n</tool_call>'
                   '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>')
    assert [json.loads(m["content"])["error"] for m in bad.messages][0] == "by must be >= 0"
    assert "no tool 'nope'" in json.loads(bad.messages[1]["content"])["error"]
    env.step('<tool_call>\n{"name": "increment", "arguments": {"by": 1}}\n</tool_call>')
    done = env.step("The counter is at 3.")
    assert (done.done, done.reward, done.info["tool_calls"]) == (True, 1.0, 4.0)


@pytest.mark.parametrize("name,kwargs,fragment", [
    ("skyrl", {}, "exactly one of env_id"),
    ("skyrl", {"env_id": "gsm8k", "entry_point": "a:b"}, "exactly one of env_id"),
    ("gymnasium", {"entry_point": "no_such_module_xyz:Env"}, "cannot import"),
    ("trl", {"factory": f"{HERE}:NoRewardTRL"}, "needs reset(**row) and get_reward()"),
    ("trl", {"factory": "not a path"}, "expected an import path"),
])
def test_bad_adapter_settings_are_clear_errors(name, kwargs, fragment):
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(").replace(")", r"\)").replace("*", r"\*")):
        make_env(name, **kwargs).reset({"question": "q", "answer": "1"})


def test_a_failing_foreign_env_is_an_env_error():
    env = make_env("skyrl", entry_point=f"{HERE}:GuessWordSkyRL")
    with pytest.raises(KeyError):  # its constructor needs the task's answer (a ValueError-free user bug surfaces)
        env.reset({"question": "q"})
    env2 = make_env("gymnasium", entry_point=f"{HERE}:EchoWordGym")
    env2.reset({"question": "q", "answer": "x"})
    with pytest.raises(EnvError, match="gymnasium environment failed"):
        env2.step(None)  # type: ignore[arg-type]  # the env's own failure (it cannot read the action)


def test_adapters_import_only_what_the_stacks_workers_were_started_with():
    kw = {"factory": f"{HERE}:CounterTRL"}
    assert import_paths("trl", kw) == [f"{HERE}:CounterTRL"] and import_paths("calculator", {}) == []
    assert not allowed("trl", [], kw) and allowed("trl", [HERE], kw)
    assert allowed("skyrl", [], {"env_id": "gsm8k"})  # the package's own registry: nothing of the user's imported
    assert not allowed("gymnasium", ["tests.unit"], {"entry_point": f"{HERE}:EchoWordGym"})  # exact modules only
