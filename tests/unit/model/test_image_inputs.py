"""A prompt's images: decoded under limits (a bad or oversized image refused by name, before its pixels are
decoded), processed as transformers' PIL image processor does, and placed in the prompt in the processor's layout."""

from __future__ import annotations

import io

import pytest
import torch

from fp8rl.data.shapes import render_board
from fp8rl.model.image_inputs import (
    ImageError,
    ImageLimits,
    PromptImages,
    VisionProcessor,
    decode_image,
    expand_prompt,
)

VISION = {"patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2}


def _png(w: int, h: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (w, h), (200, 10, 10)).save(buf, format="PNG")
    return buf.getvalue()


def test_bad_images_are_refused_by_name():
    limits = ImageLimits(max_images=2, max_bytes=10_000, max_side=100, max_pixels=5000)
    with pytest.raises(ImageError, match="row 7, image 0: not a decodable image"):
        decode_image(b"not a picture", limits, where="row 7, image 0")
    with pytest.raises(ImageError, match="120x10 pixels, over the limits"):
        decode_image(_png(120, 10), limits)
    with pytest.raises(ImageError, match="90x90 pixels"):
        decode_image(_png(90, 90), limits)  # each side within 100, 8100 pixels over 5000
    with pytest.raises(ImageError, match="bytes, over the limit"):
        decode_image(b"\x89PNG" + bytes(20_000), limits)
    with pytest.raises(ImageError, match="expected the bytes"):
        decode_image("a path", limits)  # type: ignore[arg-type]
    with pytest.raises(ImageError, match="3 images, over the limit of 2"):
        VisionProcessor(VISION, limits=limits)([_png(20, 20)] * 3)
    truncated = _png(40, 40)[:60]
    with pytest.raises(ImageError, match="not a decodable image"):
        decode_image(truncated, limits)


def test_the_processor_is_transformers_pil_processor():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    files = [_png(60, 90), render_board([(0, 0), (2, 3)], [200, 250])]
    got = VisionProcessor(VISION, {"min_pixels": 28 * 28, "max_pixels": 28 * 28 * 12})(files)
    want = Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=28 * 28 * 12)(
        images=[decode_image(f) for f in files], return_tensors="pt")
    assert torch.equal(got.pixel_values, want["pixel_values"].float())
    assert torch.equal(got.grid_thw, want["image_grid_thw"])


def test_a_prompt_is_expanded_in_the_processors_layout():
    class Cfg:
        image_token_id, vision_start_token_id, vision_end_token_id = 9, 7, 8

    images = PromptImages(VisionProcessor(VISION, {"min_pixels": 56 * 56, "max_pixels": 56 * 56}), Cfg)
    board = render_board([(1, 1)], [255])

    def encode(piece, first):
        return ([1] if first else []) + [ord(c) for c in piece]

    ids = images.prompt("Q: <image>n?", (board,), encode)
    assert ids == [1, ord("Q"), ord(":"), ord(" "), 7, 9, 9, 9, 9, 8, ord("n"), ord("?")]
    assert images.batch((board,)) is images.batch((board,))  # processed once
    with pytest.raises(ImageError, match="2 <image> placeholder\\(s\\) for 1 image"):
        images.prompt("<image><image>", (board,), encode)
    with pytest.raises(ImageError, match="1 <image> placeholder\\(s\\) for 0 image"):
        expand_prompt("<image>", None, encode, merge=2, image_token_id=9, vision_start_token_id=None,
                      vision_end_token_id=None)
