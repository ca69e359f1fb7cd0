"""A user's own data through the real service stack (``deploy.launcher up``, conftest.py): ``data.task: dataset``
on a Parquet file in verl's shape (the answer under ``reward_model.ground_truth``), validated on a held-out JSON-lines
file whose answers are GSM8K worked solutions (``... #### 7``), with ``data.max_prompt_tokens`` dropping a long
prompt — submitted with the SDK, run for 2 steps with a validation after each (greedy accuracy, pass@1/2/3 and
mean@3 of eval.k = 3 samples per problem, into the reports and the controller's Prometheus gauges), and DAPO's
dynamic sampling and Dr. GRPO's loss keys on. A file of no known format is refused at SubmitJob
(INVALID_ARGUMENT naming data.path) and nothing is enqueued."""

from __future__ import annotations

import json
import uuid

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from fp8rl.metrics import scrape
from fp8rl.sdk import Fp8rlClient, InvalidArgument

pytestmark = pytest.mark.integration

WATCH_S = 120.0


def _rows(pairs, long_prompt: str | None = None) -> list[dict]:
    rows = [{"data_source": "user", "prompt": f"{a} + {b} =", "reward_model": {"style": "rule", "ground_truth": s},
             "extra_info": {"index": i}} for i, (a, b, s) in enumerate(pairs)]
    if long_prompt is not None:  # over data.max_prompt_tokens: dropped, never sampled
        rows.insert(1, {**rows[0], "prompt": long_prompt})
    return rows


def test_a_parquet_job_with_a_validation_file_runs_on_the_stack(stack):
    root = stack.job_file.parent  # the launcher's controller takes the directory of its --config as data root
    name = f"ds-{uuid.uuid4().hex[:8]}"
    train = _rows([(a, b, str(a + b)) for a in range(1, 4) for b in range(1, 4)], long_prompt="9 + 9 = " * 8)
    pq.write_table(pa.Table.from_pylist(train), root / f"{name}-train.parquet")
    val = _rows([(2, 2, "2 + 2 = <<2+2=4>>4\n#### 4"), (3, 4, "3 + 4 = <<3+4=7>>7\n#### 7")])
    (root / f"{name}-val.jsonl").write_text("".join(json.dumps(r) + "\n" for r in val))

    job = yaml.safe_load(stack.job_yaml(steps=2, eval_every=1, eval_size=2, checkpoint_every=0))
    job["job"]["name"] = name
    job["data"] = {"task": "dataset", "path": f"{name}-train.parquet", "validation_path": f"{name}-val.jsonl",
                   "answer_key": "reward_model.ground_truth", "max_prompt_tokens": 16}
    job["eval"] = {"k": 3, "temperature": 1.0}
    job.setdefault("grpo", {}).update({"use_dynamic_sampling": True, "dynamic_sampling_max_gen_batches": 2,
                                       "normalize_rewards": False, "overlong_filtering": True})
    with Fp8rlClient(stack.target, token=stack.client_token, tls_ca="", timeout_s=30) as c:
        bad = {**job, "data": {**job["data"], "path": f"{name}-train.csv"}}
        (root / f"{name}-train.csv").write_text("prompt,answer\n")
        before = c.list_jobs()
        with pytest.raises(InvalidArgument, match=r"data.path: cannot tell the format of .*-train.csv"):
            c.submit_job(yaml.safe_dump(bad))
        assert c.list_jobs() == before

        job_id = c.submit_job(yaml.safe_dump(job))
        reports = list(c.watch(job_id, timeout_s=WATCH_S))
        info = c.get_job(job_id)
    assert (info.state, info.error) == ("succeeded", ""), info.error
    assert [r.step for r in reports] == [0, 1]
    for r in reports:
        m = r.metrics
        assert 0.0 <= r.reward_mean <= 1.0 and 0.0 <= m["val_accuracy"] <= 1.0
        # pass@j rises with j; pass@1 is mean@k (the same estimate); every value a share of the 2 problems
        assert 0.0 <= m["val/pass@1"] <= m["val/pass@2"] <= m["val/pass@3"] <= 1.0
        assert m["val/pass@1"] == pytest.approx(m["val/mean@3"]) and m["val/pass@3"] in (0.0, 0.5, 1.0)
        assert 1 <= m["dynamic_sampling/rounds"] <= 2 and m["data/dropped_prompts/train"] == 1.0
        assert m["train/entropy"] > 0
    port = next(p["metrics_port"] for p in stack.info["processes"] if p["role"] == "controller")
    gauges = scrape(port)
    assert gauges[("fp8rl_validation", (("metric", "pass@3"),))] == reports[-1].metrics["val/pass@3"]
