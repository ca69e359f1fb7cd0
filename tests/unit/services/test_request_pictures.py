"""A vision-language job's pictures on the wire (issue 55): what the services make of a request's image files, and
what the controller puts in its requests. The stack job itself is tests/integration/controller/test_vlm_stack.py."""

from __future__ import annotations

import json
from types import SimpleNamespace

import grpc
import pytest
import torch

from fp8rl.controller.pictures import picture_table, sequence_files, step_pictures
from fp8rl.data.shapes import ShapesDataset
from fp8rl.model.config import ModelConfig
from fp8rl.model.image_inputs import VisionProcessor
from fp8rl.presets import tiny_vl as V
from fp8rl.rpc import rollout_pb2
from services.common.pictures import RequestPictures
from services.common.rpc import Abort
from services.controller.backends import PictureSample, calibrate_request

IMAGE, START, END = 124, 126, 127  # tiny-vl's image, vision-start and vision-end tokens


def _config():
    text = ModelConfig(architecture="qwen2", vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=128)
    return V.tiny_vl_config(text)


@pytest.fixture
def pictures(tmp_path) -> RequestPictures:
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(V.PREPROCESSOR))
    return RequestPictures(_config(), tmp_path)


def _prompt(cells: int = 4) -> list[int]:
    return [1, START, *[IMAGE] * cells, END, 40, 41]


def _refused(fn, *needles: str) -> None:
    with pytest.raises(Abort) as err:
        fn()
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    for needle in needles:
        assert needle in err.value.message, err.value.message


def test_rows_of_one_picture_share_one_batch_equal_to_the_processors(pictures):
    a, b = (p.images[0] for p in ShapesDataset(2).eval_set(2))
    out = pictures.of_rows([a, b], [[0], [1], [0], []], [_prompt(), _prompt(), _prompt(), [1, 40, 41]])
    assert out[0] is out[2] and out[1] is not out[0] and out[3] is None  # encoded once per step by the trainer
    want = VisionProcessor(_config().vision_config, V.PREPROCESSOR)([a])
    assert torch.equal(out[0].pixel_values, want.pixel_values) and out[0].grid_thw.tolist() == [[1, 4, 4]]
    assert pictures.of_prompts([[], []], [[1, 40], [1, 41]]) is None  # a text request of a picture policy


def test_bad_pictures_and_runs_that_do_not_match_are_refused_naming_the_row(pictures):
    good = ShapesDataset(2).eval_set(1)[0].images[0]
    _refused(lambda: pictures.of_prompts([[good], [good[:50]]], [_prompt(), _prompt()]), "prompt 1, image 0",
             "not a decodable image")
    _refused(lambda: pictures.of_prompts([[good]], [_prompt(3)]), "prompt 0", "runs are [3]", "need [4]")
    _refused(lambda: pictures.of_prompts([[good], []], [_prompt(), _prompt()]), "prompt 1", "runs are [4]")
    _refused(lambda: pictures.of_prompts([[good] * 9], [_prompt()]), "prompt 0: 9 images, over the limit of 8")
    _refused(lambda: pictures.of_rows([good], [[0], [2]], [_prompt(), _prompt()]), "row 1: image index 2 is outside")
    _refused(lambda: pictures.of_rows([good], [[]], [[1, 40]]), "1 images that no row names")
    # a prompt and its response (the calibrator's sequences): a run the response sampled is text
    assert pictures.of_prompts([[good]], [_prompt() + [IMAGE]], exact=False)[0] is not None
    _refused(lambda: pictures.of_prompts([[good]], [_prompt() + [IMAGE]]), "runs are [4, 1]")
    text = RequestPictures(ModelConfig(architecture="qwen2", vocab_size=128, hidden_size=64, intermediate_size=128,
                                       num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=64), None)
    _refused(lambda: text.of_prompts([[good]], [_prompt()]), "not a vision-language model")
    assert text.of_prompts([[]], [[1, IMAGE]]) is None  # a text policy's token 124 is text


def test_rows_of_prompts_with_the_same_ids_keep_their_own_pictures_and_each_file_goes_once():
    """The counting task asks every picture the same question: its prompts are the same token ids, so pictures go
    with their samples (training rows) and by position in the step's record (calibration), never by prompt."""
    p, q = ShapesDataset(5).eval_set(2)
    assert p.prompt == q.prompt and p.images != q.images
    samples = [(0, PictureSample(rollout_pb2.Sample(token_ids=[20, 2]), p.images)),
               (0, PictureSample(rollout_pb2.Sample(token_ids=[21, 2]), p.images)),
               (1, PictureSample(rollout_pb2.Sample(token_ids=[20, 2]), q.images))]
    assert samples[0][1].token_ids == [20, 2] and not samples[0][1].HasField("routes")  # the proto's fields
    images, indices = picture_table([s.images for _, s in samples] + [()])
    assert images == [p.images[0], q.images[0]] and indices == [[0], [0], [1], []]
    record = step_pictures([p, q], samples)
    assert len(record["files"]) == 2 and record["of"] == [[0], [0], [1]]
    assert sequence_files(json.loads(json.dumps(record)), 3) == [p.images, p.images, q.images]  # Redis keeps JSON
    with pytest.raises(ValueError, match="pictures are of 3 sequences, calibration has 2"):
        sequence_files(record, 2)
    assert step_pictures([SimpleNamespace(images=())], samples[:1]) is None  # a text step records nothing
    req = calibrate_request(4, [_prompt(), _prompt(), [1, 40]], [p.images, q.images, ()])
    assert [list(x.image_indices) for x in req.sequences] == [[0], [1], []] and len(req.images) == 2
