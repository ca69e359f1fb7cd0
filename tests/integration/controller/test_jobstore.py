"""fp8rl.controller.jobstore on a real Redis, and the controller's pure helpers (fp8rl.controller.plan)."""

from __future__ import annotations

import threading

import pytest
import redis

from fp8rl.config import parse_job_config
from fp8rl.controller.jobstore import JOB_STATES, JobExistsError, JobLimitError, JobStore
from fp8rl.controller.plan import deployment_mismatch, new_job_id, sampling_seed, split_evenly
from fp8rl.refit.keys import Keys, validate_job_id

pytestmark = pytest.mark.integration


@pytest.fixture
def jobs(redis_url) -> JobStore:
    return JobStore(redis.Redis.from_url(redis_url))


def test_create_get_list_and_duplicate(jobs, job_id):
    rec = jobs.create(job_id, "job: {steps: 3}\n", 3)
    assert (rec.state, rec.steps_done, rec.total_steps, rec.next_version) == ("pending", 0, 3, None)
    assert jobs.config_text(job_id) == "job: {steps: 3}\n"
    with pytest.raises(JobExistsError, match=job_id):
        jobs.create(job_id, "", 1)
    with pytest.raises(ValueError, match="invalid job id"):
        jobs.create("bad id!", "", 1)
    assert jobs.get("no-such-job") is None and jobs.get("bad:id") is None
    later = jobs.create(job_id + "-b", "", 1)
    listed = [r.job_id for r in jobs.list() if r.job_id.startswith(job_id)]
    assert listed == [later.job_id, job_id]  # newest first
    assert [r.job_id for r in jobs.in_state("pending") if r.job_id.startswith(job_id)] == [job_id, later.job_id]


def test_transition_is_compare_and_set(jobs, job_id):
    jobs.create(job_id, "", 1)
    wins = []
    barrier = threading.Barrier(8)

    def race(to: str) -> None:
        barrier.wait()
        wins.append((to, jobs.transition(job_id, to, ("pending",))))

    threads = [threading.Thread(target=race, args=("running" if i % 2 else "cancelled",)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [to for to, won in wins if won]
    assert len(winners) == 1 and jobs.get(job_id).state == winners[0]
    assert not jobs.transition(job_id, "failed", ("pending",))


def test_reports_are_appended_in_order_with_the_state(jobs, job_id):
    jobs.create(job_id, "", 3)
    jobs.set_inflight(job_id, {"step": 0, "sequences": [[1, 2]]})
    assert jobs.inflight(job_id)["sequences"] == [[1, 2]]
    jobs.append_report(job_id, {"step": 0, "reward_mean": 0.5}, "running", next_version=8)
    assert jobs.inflight(job_id) is None  # a recorded step is no longer in flight
    assert jobs.get(job_id).next_version == 8  # written with the report
    with pytest.raises(ValueError, match="step 2 cannot be recorded after 1"):
        jobs.append_report(job_id, {"step": 2}, "running", next_version=9)
    assert jobs.get(job_id).next_version == 8  # a refused report moves nothing
    jobs.append_report(job_id, {"step": 1, "reward_mean": float("nan")}, "succeeded", next_version=9)
    rec = jobs.get(job_id)
    assert (rec.state, rec.steps_done, rec.terminal, rec.next_version) == ("succeeded", 2, True, 9)
    assert [r["state"] for r in jobs.reports(job_id)] == ["running", "succeeded"]
    assert [r["step"] for r in jobs.reports(job_id, from_step=1)] == [1]
    jobs.truncate_reports(job_id, 1)
    assert jobs.get(job_id).steps_done == 1


def test_cancel_request_and_bookkeeping(jobs, job_id):
    jobs.create(job_id, "", 3)
    assert not jobs.get(job_id).cancel_requested
    jobs.request_cancel(job_id, "because")
    jobs.update(job_id, start_version=4, checkpoint_path="/x", checkpoint_version=6)
    rec = jobs.get(job_id)
    got = (rec.cancel_reason, rec.start_version, rec.checkpoint_path, rec.checkpoint_version)
    assert got == ("because", 4, "/x", 6)


def test_split_seed_and_ids():
    assert split_evenly(10, 3) == [(0, 3), (3, 6), (6, 10)]
    assert split_evenly(2, 5) == [(0, 1), (1, 2)]
    assert split_evenly(0, 2) == []
    assert sampling_seed(0, 7, 0) == 7  # one replica: the in-process loop's per-step seed
    assert len({sampling_seed(1, 2, a) for a in (0, 4, 8)}) == 3
    for name in ("my job!", "___", "a" * 100, "tiny-arith-fp8"):
        validate_job_id(new_job_id(name))
    assert new_job_id("x") != new_job_id("x")


def test_deployment_mismatch_names_the_key():
    deployed = parse_job_config({"policy": {"model": "/m"}})
    assert deployment_mismatch(parse_job_config({"policy": {"model": "/m"}, "job": {"steps": 3},
                                                 "grpo": {"num_prompts_per_step": 2}}), deployed) is None
    why = deployment_mismatch(parse_job_config({"policy": {"model": "/m", "training": {"lr": 0.1}}}), deployed)
    assert why.startswith("policy.training.lr:")
    why = deployment_mismatch(parse_job_config({"policy": {"model": "/m", "generation": {
        "vllm_cfg": {"kv_cache_dtype": "auto"}}}}), deployed)
    assert "kv_cache_dtype=auto" in why and "kv_cache_dtype=fp8" in why
    # calibration.site is the job's (the controller passes it per TrainStep); the other calibration keys are not
    assert deployment_mismatch(parse_job_config({"policy": {"model": "/m"}, "calibration": {"site": "calibrator"}}),
                               deployed) is None
    why = deployment_mismatch(parse_job_config({"policy": {"model": "/m"}, "calibration": {"margin": 1.2}}), deployed)
    assert why.startswith("calibration.margin:")
    # the reward model is the reward services' (loaded at start): a job asking another one is refused, naming it
    judge = {"reward": {"model": {"kind": "judge", "model": "tiny-arith"}}}
    why = deployment_mismatch(parse_job_config({"policy": {"model": "/m"}, **judge}), deployed)
    assert why.startswith("reward.model.kind:")
    assert deployment_mismatch(parse_job_config({"policy": {"model": "/m"}, "reward": {"grader": "math_verify"}}),
                               deployed) is None  # the rule grader is the job's
    served = parse_job_config({"policy": {"model": "/m"}, **judge})  # services deployed with a judge serve it, and
    assert deployment_mismatch(parse_job_config({"policy": {"model": "/m"}}), served) is None  # rule-only jobs
    follow = {"reward": {"model": {"kind": "judge", "follow_policy": True}}}
    assert deployment_mismatch(parse_job_config({"policy": {"model": "/m"}, **follow}), served) is None
    other = {"reward": {"model": {"kind": "judge", "model": "tiny-arith", "precision": "bf16"}}}
    assert deployment_mismatch(parse_job_config({"policy": {"model": "/m"}, **other}), served).startswith(
        "reward.model.precision:")


def test_a_long_model_name_is_not_echoed_whole():
    deployed = parse_job_config({"policy": {"model": "/m"}})
    why = deployment_mismatch(parse_job_config({"policy": {"model": "/" + "x" * 20_000}}), deployed)
    assert why.startswith("policy.model:") and len(why) < 600 and "20003 characters" in why  # the repr: 20001 + quotes


# -- the indexes, bounds and retention (a database of their own: the global indexes hold only these jobs) -------

@pytest.fixture
def store(redis_url):
    client = redis.Redis.from_url(redis_url, db=7)
    client.flushdb()
    yield lambda **caps: JobStore(client, **caps)
    client.flushdb()


def _finish(jobs: JobStore, job_id: str, state: str = "succeeded") -> None:
    assert jobs.transition(job_id, "running", ("pending",))
    assert jobs.transition(job_id, state, ("running",))


def test_pages_walk_every_job_once_newest_first_even_with_equal_times(store, monkeypatch):
    jobs = store()
    clock = iter([100.0] * 5 + [float(t) for t in range(101, 200)])  # five jobs share one submission time
    monkeypatch.setattr("fp8rl.controller.jobstore.time.time", lambda: next(clock))
    ids = [f"j{i:02d}" for i in range(12)]
    for j in ids:
        jobs.create(j, "", 1)
    seen, token, pages = [], "", 0
    while True:
        page, token = jobs.page("", 5, token)
        seen += [r.job_id for r in page]
        pages += 1
        if not token:
            break
    assert sorted(seen) == ids and len(seen) == len(set(seen)) and pages == 3
    created = [jobs.get(j).created_unix for j in seen]
    assert created == sorted(created, reverse=True)  # newest first, ties in a fixed order
    assert [r.job_id for r in jobs.page("pending", 3)[0]] == seen[:3]
    with pytest.raises(ValueError, match="page_token"):
        jobs.page("", 5, "not-a-token")


def test_state_indexes_follow_every_change_and_the_queue_head_is_the_oldest(store):
    jobs = store()
    for j in ("a", "b", "c"):
        jobs.create(j, "", 2)
    assert jobs.first_in_state("pending").job_id == "a" and jobs.first_in_state("running") is None
    _finish(jobs, "a", "failed")
    assert jobs.transition("b", "running", ("pending",))
    jobs.append_report("b", {"step": 0}, "running", next_version=1)
    jobs.append_report("b", {"step": 1}, "succeeded", next_version=2)
    assert [jobs.count(s) for s in ("pending", "running", "succeeded", "failed")] == [1, 0, 1, 1]
    assert jobs.first_in_state("pending").job_id == "c" and jobs.count() == 3


def test_caps_refuse_new_jobs_and_create_nothing(store):
    jobs = store(max_jobs=3, max_queued=2)
    jobs.create("a", "", 1)
    jobs.create("b", "", 1)
    with pytest.raises(JobLimitError, match="2 jobs are pending"):
        jobs.create("c", "", 1)
    assert jobs.get("c") is None
    _finish(jobs, "a")
    jobs.create("c", "", 1)
    with pytest.raises(JobLimitError, match="3 jobs are stored"):
        jobs.create("d", "", 1)
    assert jobs.get("d") is None and jobs.count() == 3


def test_retention_deletes_old_and_surplus_finished_jobs_with_every_key(store):
    jobs = store()
    for j in ("old", "mid", "new", "live"):
        jobs.create(j, "job: {}\n", 1)
    for j in ("old", "mid", "new"):
        _finish(jobs, j, "cancelled" if j == "mid" else "succeeded")
    assert jobs.delete("live") is False and jobs.get("live") is not None  # a live job is never deleted
    client = jobs.client
    finished = {j: client.zscore(Keys.jobs_finished(), j) for j in ("old", "mid", "new")}
    now = max(finished.values())
    assert jobs.prune(max_age_s=1e9, max_finished=2, now=now) == 1  # the oldest beyond 2
    assert jobs.get("old") is None and not client.keys("fp8rl:old:*")
    assert jobs.prune(max_age_s=0.0, max_finished=10, now=now + 1) == 2  # every finished job is past 0 s
    assert [r.job_id for r in jobs.list()] == ["live"]
    assert client.scard(Keys.jobs_index()) == 1 and client.zcard(Keys.jobs_finished()) == 0
    jobs.create("old", "", 1)  # a deleted job's id is free again


def test_jobs_of_an_older_controller_are_indexed_once(store):
    jobs = store()
    jobs.create("a", "", 1)
    _finish(jobs, "a")
    client = jobs.client
    for key in (Keys.jobs_created(), Keys.jobs_finished(), *(Keys.jobs_in_state(s) for s in JOB_STATES)):
        client.delete(key)  # what a controller before the indexes left: the set and the job's own keys
    assert jobs.list() == [] and jobs.ensure_indexes() == 1 and jobs.ensure_indexes() == 0
    assert [r.job_id for r in jobs.list("succeeded")] == ["a"] and jobs.prune(0.0, 10) == 1
