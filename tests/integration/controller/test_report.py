"""fp8rl.report: the report directory from controller step reports and from fp8rl.loop rows."""

from __future__ import annotations

import json
import math

import pytest

from fp8rl.report import flatten_step, summarize, write_report

pytestmark = pytest.mark.integration

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PHASES = {"rollout": 0.5, "reward": 0.01, "logprobs": 0.2, "train": 1.0, "publish": 0.05, "calibrate": 0.02,
          "refit": 0.1}


def controller_reports(n: int = 4) -> list[dict]:
    return [{"job_id": "j", "step": i, "weight_version": i, "reward_mean": 0.1 * (i + 1), "accuracy": 0.05 * (i + 1),
             "metrics": {"token_mult_prob_error": 1.01 + 0.001 * i, "train/loss": 0.3},
             "phase_times": {**PHASES, "total": 2.0}, "state": "running"} for i in range(n)]


def test_report_directory_from_controller_reports(tmp_path):
    reports = controller_reports()
    reports[1]["reward_mean"] = math.nan  # a step recovered without rollout data
    out = write_report(reports, tmp_path / "report", title="demo")
    names = {p.name for p in out.iterdir()}
    assert {"metrics.jsonl", "summary.md", "reward.png", "accuracy.png", "token_mult_prob_error.png",
            "phase_times.png", "tensorboard"} <= names
    for png in ("reward.png", "accuracy.png", "token_mult_prob_error.png", "phase_times.png"):
        data = (out / png).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 2000
    events = list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1 and events[0].stat().st_size > 0

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert rows[0]["time/calibrate"] == 0.02 and rows[0]["token_mult_prob_error"] == 1.01 and "metrics" not in rows[0]

    md = (out / "summary.md").read_text()
    assert md.startswith("# demo") and "0.100 → 0.400" in md  # first/last reward
    assert "1.01150" in md  # mean token_mult_prob_error
    assert "1.00 %" in md  # calibrate share: 0.02 s of 2 s
    assert "| train | 1.000 | 50.0 % |" in md


def test_loop_rows_are_understood():
    row = flatten_step({"step": 3, "reward_mean": 0.5, "time/rollout": 1.0, "time/calibrate": 0.5, "time/step": 4.0})
    assert row["time/total"] == 4.0 and "time/step" not in row
    s = summarize([row])
    assert s["calibrate_share"] == pytest.approx(0.125) and s["reward_first"] == s["reward_last"] == 0.5
    assert math.isnan(s["phase_seconds/publish"])  # the loop has no publish phase


def test_the_report_says_whether_the_job_ran_exact_counting_only_same_version_rows(tmp_path):
    """The first row: exact when every step's same-version rows were bitwise (max |Δlogprob| 0); asynchronous steps
    with only older-version rows measure no numerics and are named apart; one differing step makes it "not exact",
    even one whose token_mult_prob_error rounded to 1.0 (issue 47)."""
    from fp8rl.report import MAX_ABS_LOGPROB_DIFF as key
    from fp8rl.report import _exactness
    from fp8rl.rl import MAX_ABS_LOGPROB_DIFF

    assert key == MAX_ABS_LOGPROB_DIFF == "mismatch/max_abs_logprob_diff"  # the report spells the metrics' name

    def row(err, diff, numeric=None, stale=None):
        r = {"token_mult_prob_error": err, key: diff}
        if numeric is not None:
            r.update({"numeric/token_mult_prob_error": numeric[0], f"numeric/{key}": numeric[1],
                      "stale_fraction": stale})
        return r

    exact = summarize([row(1.0, 0.0), row(1.0, 0.0), row(1.3, 0.4, numeric=(1.0, 0.0), stale=0.5),
                       row(1.2, 0.3, numeric=(1.0, 0.0), stale=1.0)])
    line = _exactness(exact)
    assert line.startswith("**exact**") and "all 3 steps" in line and "1 steps trained only on rows of older" in line
    differs = _exactness(summarize([row(1.0, 0.0), row(1.02, 0.05)]))
    assert differs.startswith("**not exact**") and "on 1 of 2 steps" in differs and "1.020000" in differs
    assert "5.000e-02" in differs and "older versions" not in differs
    rounded = _exactness(summarize([row(1.0, 0.0), row(1.0, 1e-8)]))  # exp(|Δ|) rounded to 1, the max did not
    assert rounded.startswith("**not exact**") and "on 1 of 2 steps" in rounded and "1.000e-08" in rounded
    broken = summarize([row(1.0, 0.0), row(math.nan, math.nan)])  # NaN is measured, and never exact
    assert (broken["measured_steps"], broken["exact_steps"]) == (2.0, 1.0)
    write_report([{"step": 0, "metrics": {"token_mult_prob_error": 1.0, key: 0.0}, "phase_times": {"total": 1.0}}],
                 tmp_path, facts=[("batch-invariant numerics", "on by default")])
    md = (tmp_path / "summary.md").read_text()
    assert "| train/rollout numerics | **exact**" in md and "| batch-invariant numerics | on by default |" in md
    assert "| max abs Δlogprob over steps (0 = bitwise) | 0.000e+00 |" in md
