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
