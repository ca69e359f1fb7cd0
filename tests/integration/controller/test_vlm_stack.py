"""Vision-language jobs through the service stack (issue 55): pictures on the wire.

A stack launched for a 3-step job on the ``tiny-vl`` preset (a small Qwen2.5-VL; the counting pictures of
``data.task: shapes``) in fp8_e2e with an FP8 KV cache and batch invariance. The controller expands each prompt
around its picture and sends the picture's file with it: the rollout replica decodes and encodes it once per
prompt (``Prompt.images``), TrainStep gets each picture once with the rows naming theirs (``image_indices``), and
the calibrator calibrates on the multimodal sequences. Every step's trainer logprobs are the rollout's bitwise
(``mismatch/max_abs_logprob_diff`` exactly 0: the rollout and the trainer processed the same bytes into the same
patches and the vision encoder ran the same kernels), and the step reports carry a few pictures with their
sampled answers (the launcher's ``pictures.md``). The in-process loop on the same job samples the same answers
step by step (every prompt asks the same question, so a picture that went with another prompt's samples would
show up in the rewards).

On the same stack, requests with bad pictures are refused with INVALID_ARGUMENT naming the prompt, row or
sequence and the image, and nothing is trained: a corrupt file, image-token runs that do not match the images, an
image index outside the request's images, images no row names.
"""

from __future__ import annotations

import grpc
import pytest
import yaml

from fp8rl.config import parse_job_config
from fp8rl.data import exact_match_grader
from fp8rl.data.shapes import ShapesDataset
from fp8rl.loop import LoopConfig, run
from fp8rl.presets import prepare_preset
from fp8rl.rpc import (
    calibrator_pb2,
    calibrator_pb2_grpc,
    common_pb2,
    rollout_pb2,
    rollout_pb2_grpc,
    trainer_pb2,
    trainer_pb2_grpc,
)
from fp8rl.rpc.channel import make_channel

from .conftest import assert_zero_mismatch, down, run_stack_job, tiny_job
from .test_controller import WATCH_S

pytestmark = [pytest.mark.integration, pytest.mark.invariant]

STEPS = 3
IMAGE, START, END = 124, 126, 127  # tiny-vl's image, vision-start and vision-end tokens
CELLS = 4  # a 56 x 56 picture: 4 x 4 patches of 14 pixels, merged 2 x 2


def test_a_picture_job_has_zero_mismatch_through_the_stack_and_bad_pictures_are_refused(tmp_path):
    model_dir = prepare_preset("tiny-vl", progress=False)
    job = tiny_job(model_dir, max_new_tokens=4, calibration_site="calibrator")  # Calibrate calls carry pictures
    job["job"]["steps"] = STEPS
    job["policy"]["model"] = "tiny-vl"
    job["policy"]["numerics"] = {"batch_invariant": True}
    job["data"] = {"task": "shapes"}
    job["reward"] = {"grader": "exact_match"}
    reports, info, stack = run_stack_job(tmp_path, job, model_dir, watch_s=WATCH_S * 3)
    try:
        assert_zero_mismatch(info, reports, STEPS)
        pictures = reports[-1].pictures
        assert 1 <= len(pictures) <= 4
        files, prompt, reference, sampled, right = pictures[0]
        assert len(files) == 1 and files[0].startswith(b"\x89PNG") and prompt.count("<image>") == 1
        assert reference.isdigit() and right == bool(exact_match_grader(sampled, reference))
        _bad_pictures_are_refused(stack)
    finally:
        down(stack)
    # the in-process loop on the same job samples the same answers: every prompt asks the same question, so a
    # picture sent with another prompt's samples (or trained on with another's rows) shows up as other rewards
    loop = run(LoopConfig.from_flags(job=parse_job_config(yaml.safe_dump(job)), out_dir=str(tmp_path / "loop")),
               progress=False)["steps"]
    assert [h["mismatch/max_abs_logprob_diff"] for h in loop] == [0.0] * STEPS
    for r, h in zip(reports, loop, strict=True):
        assert (r.reward_mean, r.metrics["response_len"]) == (h["reward_mean"], h["response_len"])


def _stub(stack, name: str, stub_class):
    return stub_class(make_channel(f"127.0.0.1:{stack.process(name)['port']}", token=stack.service_token, tls_ca=""))


def _refused(call, request, *needles: str) -> None:
    with pytest.raises(grpc.RpcError) as err:
        out = call(request, timeout=60)
        if not hasattr(out, "DESCRIPTOR"):  # a stream: read to its status
            list(out)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    for needle in needles:
        assert needle in err.value.details(), err.value.details()


def _bad_pictures_are_refused(stack) -> None:
    picture = ShapesDataset(1).eval_set(1)[0].images[0]
    prompt = [1, START, *[IMAGE] * CELLS, END, *range(40, 46)]
    rollout = _stub(stack, "rollout-0", rollout_pb2_grpc.RolloutServiceStub)
    version = rollout.Status(rollout_pb2.RolloutStatusRequest(), timeout=10).weight_version

    def generate(*prompts):
        return rollout_pb2.GenerateRequest(request_id="bad", weight_version=version, prompts=list(prompts),
                                           sampling=rollout_pb2.SamplingParams(max_tokens=2, n=1, seed=0))

    good = rollout_pb2.Prompt(token_ids=prompt, images=[picture])
    samples = [r.sample for r in rollout.Generate(generate(good), timeout=60)]  # the good one is served
    assert len(samples) == 1 and samples[0].weight_version == version
    _refused(rollout.Generate, generate(good, rollout_pb2.Prompt(token_ids=prompt, images=[picture[:40]])),
             "prompt 1, image 0", "not a decodable image")
    _refused(rollout.Generate, generate(rollout_pb2.Prompt(token_ids=prompt[:3] + prompt[5:], images=[picture])),
             "prompt 0", "image-token runs are [2]", "need [4]")
    _refused(rollout.Generate, generate(rollout_pb2.Prompt(token_ids=prompt)), "prompt 0", "image-token runs")

    trainer = _stub(stack, "trainer", trainer_pb2_grpc.TrainerServiceStub)
    held = trainer.Status(trainer_pb2.TrainerStatusRequest(), timeout=10).version
    row = trainer_pb2.Sequence(prompt_ids=prompt, response_ids=[20, 2], gen_logprobs=[-1.0, -1.0], advantage=1.0,
                               image_indices=[0])
    outside = trainer_pb2.Sequence(prompt_ids=prompt, response_ids=[20, 2], gen_logprobs=[-1.0, -1.0],
                                   advantage=-1.0, image_indices=[1])
    _refused(trainer.TrainStep, trainer_pb2.TrainStepRequest(expected_version=held, rows=[row, outside],
                                                             images=[picture]),
             "row 1: image index 1 is outside the request's 1 images")
    _refused(trainer.ComputeLogprobs, trainer_pb2.ComputeLogprobsRequest(rows=[row], images=[b"\x89PNG broken"]),
             "row 0, image 0", "not a decodable image")
    assert trainer.Status(trainer_pb2.TrainerStatusRequest(), timeout=10).version == held  # nothing trained

    calibrator = _stub(stack, "calibrator", calibrator_pb2_grpc.CalibratorServiceStub)
    _refused(calibrator.Calibrate, calibrator_pb2.CalibrateRequest(
        version=held, sequences=[common_pb2.TokenSequence(token_ids=prompt[:3])], images=[picture]),
        "the request carries 1 images that no sequence names")
