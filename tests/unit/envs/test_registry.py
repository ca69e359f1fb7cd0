"""Environments by name and by import path; the service stack's allow-list."""

from __future__ import annotations

import textwrap

import pytest

from fp8rl.envs import CalculatorEnv, Environment, GuessNumberEnv, allowed, env_names, make_env, register

USER_MODULE = textwrap.dedent('''
    from fp8rl.envs import EnvStep, Environment

    class EchoEnv(Environment):
        def __init__(self, greeting="hi"):
            self.greeting = greeting

        def reset(self, task):
            return [{"role": "user", "content": self.greeting}]

        def step(self, assistant_text):
            return EnvStep([], float(assistant_text == self.greeting), True)

    class Half(Environment):  # abstract: no step
        def reset(self, task):
            return []

    NOT_AN_ENV = 3
''')


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A user's environment module, importable as ``fp8rl_test_user_envs``."""
    (tmp_path / "fp8rl_test_user_envs.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "fp8rl_test_user_envs"


def test_builtins_are_registered():
    assert {"calculator", "guess_number"} <= set(env_names())
    assert isinstance(make_env("calculator"), CalculatorEnv)
    assert isinstance(make_env("guess_number"), GuessNumberEnv)
    assert make_env("calculator", tools_enabled=False).tools_enabled is False


def test_import_path(user_module):
    env = make_env(f"{user_module}:EchoEnv", greeting="hello")
    assert env.reset({}) == [{"role": "user", "content": "hello"}]
    assert env.step("hello").reward == 1.0


@pytest.mark.parametrize("path, match", [
    ("no_such_module_xyz:Env", "not importable"),
    ("{m}:Missing", "no attribute 'Missing'"),
    ("{m}:NOT_AN_ENV", "not an Environment subclass"),
    ("{m}:Half", "abstract"),
    ("unknown_env", "unknown environment 'unknown_env'.*calculator"),
    ("a.b:c:d", "unknown environment"),
])
def test_bad_paths_name_the_path(user_module, path, match):
    path = path.format(m=user_module)
    with pytest.raises(ValueError, match=match) as e:
        make_env(path)
    assert path in str(e.value)


def test_bad_kwargs_are_named():
    with pytest.raises(ValueError, match="colour"):
        make_env("calculator", colour="red")


def test_allowed_is_by_exact_module_and_imports_nothing():
    mods = {"my_envs.chess"}
    assert allowed("calculator", [])
    assert allowed("my_envs.chess:ChessEnv", mods)  # not importable here, and no attempt is made
    assert not allowed("my_envs:ChessEnv", mods)
    assert not allowed("my_envs.chess.sub:ChessEnv", mods)
    assert not allowed("os:system", mods)
    assert not allowed("not a path", mods)


def test_register_refuses_a_taken_name_and_non_environments():
    with pytest.raises(ValueError, match="taken"):
        @register("calculator")
        class Other(Environment):
            def reset(self, task):
                return []

            def step(self, assistant_text):
                raise NotImplementedError
    with pytest.raises(ValueError, match="not an Environment"):
        register("thing")(int)
    with pytest.raises(ValueError, match="without ':'"):
        register("a:b")
