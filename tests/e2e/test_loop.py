"""The in-process GRPO loop really learns, FP8 end to end with an FP8 KV cache, on the tiny-arith preset."""

import json

import pytest

from fp8rl.loop import LoopConfig, main, run
from fp8rl.model.presets import prepare_tiny_arith

# The warm start is cached (~1 min on 2 cores the first time); the loop itself takes ~1 min.
REWARD_GAIN_MIN = 0.05  # mean reward of the last steps must beat the first steps by this much


@pytest.fixture(scope="module")
def preset():
    return prepare_tiny_arith(progress=False)


def test_fp8_e2e_kv_fp8_loop_learns_and_reports(preset, tmp_path):
    cfg = LoopConfig(recipe="fp8_e2e", kv_cache_dtype="fp8", steps=16, prompts_per_step=16, group_size=8,
                     lr=2e-4, num_minibatches=4, eval_size=64, seed=0, out_dir=str(tmp_path),
                     arith={"max_operand": 9, "num_terms": 2, "ops": ("+", "-"), "word_problems": False})
    res = run(cfg, progress=False)
    s = res["summary"]
    first = sum(h["reward_mean"] for h in res["steps"][:4]) / 4
    last = sum(h["reward_mean"] for h in res["steps"][-4:]) / 4
    assert last > first + REWARD_GAIN_MIN, (first, last)
    # every step refitted the rollout to the trainer's new version with scales of that version
    assert [h["weight_version"] for h in res["steps"]] == list(range(1, 17))
    assert all(h["time/calibrate"] > 0 for h in res["steps"])
    assert 1.0 <= s["token_mult_prob_error_mean"] < 1.5
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 16 and "token_mult_prob_error" in json.loads(lines[0])


def test_cli_rejects_bad_arguments(capsys):
    with pytest.raises(SystemExit):
        main(["--recipe", "fp4"])
    assert "invalid choice" in capsys.readouterr().err
    with pytest.raises(ValueError, match="group_size"):
        LoopConfig(group_size=1)
