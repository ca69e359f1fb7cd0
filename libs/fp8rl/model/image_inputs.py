"""A vision-language model's inputs: a problem's images decoded under limits, turned into the vision encoder's
patches, and placed in the prompt.

A :class:`~fp8rl.data.problem.Problem` carries its images as encoded files (``images``: PNG / JPEG / ... bytes,
what verl's Parquet rows and the synthetic tasks hold) and marks where each goes in its text prompt with
:data:`IMAGE_PLACEHOLDER` (``<image>``), one per image, in order. Here:

* :func:`decode_image` opens one with Pillow, never trusting it beyond :class:`ImageLimits` (file bytes, width and
  height, pixels — checked from the header before any pixel is decoded —, the format Pillow detects), and converts
  it to RGB; a bad image raises :class:`ImageError` naming what is wrong.
* :class:`VisionProcessor` resizes and normalises the decoded images into patches exactly as transformers' PIL
  image processor of the Qwen2-VL family does (it *is* that processor, built from the model's own
  ``preprocessor_config.json`` where there is one, its ``vision_config``'s patch, merge and frame sizes otherwise;
  torchvision is not needed), one :class:`~fp8rl.model.vision.ImageBatch` per prompt.
* :func:`expand_prompt` tokenizes a text prompt around its placeholders and puts each image's tokens in its place:
  ``vision_start``, one ``image_token_id`` per merged patch cell, ``vision_end`` (the processor's layout).
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .vision import ImageBatch

__all__ = ["IMAGE_PLACEHOLDER", "ImageError", "ImageLimits", "PromptImages", "VisionProcessor", "check_image_runs",
           "decode_image", "expand_prompt"]

IMAGE_PLACEHOLDER = "<image>"  # fp8rl.data.problem's (a data row's placeholder; model does not import data)


class ImageError(ValueError):
    """An image that cannot be used: undecodable, over a limit, or not matching its prompt's placeholders."""


@dataclass(frozen=True)
class ImageLimits:
    """What a prompt's images may be (checked before decoding the pixels).

    Attributes:
        max_images: images per prompt.
        max_bytes: bytes of one encoded image.
        max_side: width and height, each, in pixels.
        max_pixels: width × height.
    """

    max_images: int = 8
    max_bytes: int = 8 << 20
    max_side: int = 4096
    max_pixels: int = 16 << 20


def decode_image(data: bytes, limits: ImageLimits = ImageLimits(), *, where: str = "an image"):
    """``data`` (an encoded image file) as an RGB ``PIL.Image``, checked against ``limits`` first.

    Raises:
        ImageError: not bytes, over a limit, or not an image Pillow decodes (the message starts with ``where``).
    """
    from PIL import Image, UnidentifiedImageError

    if not isinstance(data, bytes | bytearray):
        raise ImageError(f"{where}: expected the bytes of an image file, got {type(data).__name__}")
    if len(data) > limits.max_bytes:
        raise ImageError(f"{where}: {len(data)} bytes, over the limit of {limits.max_bytes}")
    try:
        img = Image.open(io.BytesIO(data))  # reads the header only
        w, h = img.size
        if w > limits.max_side or h > limits.max_side or w * h > limits.max_pixels:
            raise ImageError(f"{where}: {w}x{h} pixels, over the limits ({limits.max_side} a side, "
                             f"{limits.max_pixels} in all)")
        img.load()
        return img.convert("RGB")
    except ImageError:
        raise
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
        raise ImageError(f"{where}: not a decodable image ({type(e).__name__}: {e})") from None


class VisionProcessor:
    """Images → patches for a vision-language model (module docstring).

    Args:
        vision_config: the model's ``vision_config`` (``patch_size``, ``spatial_merge_size``,
            ``temporal_patch_size``).
        preprocessor: the model's ``preprocessor_config.json`` as a dict (its ``min_pixels`` / ``max_pixels``,
            ``image_mean`` / ``image_std`` ...), or None for the processor's defaults at those sizes.
        limits: what an image may be.
    """

    def __init__(self, vision_config: dict[str, Any], preprocessor: dict[str, Any] | None = None,
                 limits: ImageLimits = ImageLimits()) -> None:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        keys = ("min_pixels", "max_pixels", "image_mean", "image_std", "do_rescale", "rescale_factor",
                "do_normalize", "do_resize", "do_convert_rgb")
        kw = {k: v for k, v in (preprocessor or {}).items() if k in keys}
        self.merge = int(vision_config.get("spatial_merge_size", 2))
        self._proc = Qwen2VLImageProcessorPil(patch_size=int(vision_config.get("patch_size", 14)),
                                              merge_size=self.merge,
                                              temporal_patch_size=int(vision_config.get("temporal_patch_size", 2)),
                                              **kw)
        self.limits = limits

    @classmethod
    def from_model_dir(cls, path: str | Path, vision_config: dict[str, Any],
                       limits: ImageLimits = ImageLimits()) -> VisionProcessor:
        """The processor of the model at ``path`` (its ``preprocessor_config.json`` when it has one)."""
        pre = Path(path) / "preprocessor_config.json"
        return cls(vision_config, json.loads(pre.read_text()) if pre.is_file() else None, limits)

    def __call__(self, images: Sequence[bytes], *, where: str = "a prompt"):
        """The :class:`~fp8rl.model.vision.ImageBatch` of one prompt's encoded ``images`` (None when there are
        none).

        Raises:
            ImageError: too many images, or one that :func:`decode_image` refuses.
        """
        if not images:
            return None
        out = self._proc(images=self.decode(images, where=where), return_tensors="pt")
        return ImageBatch(out["pixel_values"].float(), out["image_grid_thw"].long())

    def decode(self, images: Sequence[bytes], *, where: str = "a prompt") -> list:
        """One prompt's encoded ``images`` decoded under the limits (RGB ``PIL.Image`` s), not yet processed.

        Raises:
            ImageError: too many images, or one that :func:`decode_image` refuses.
        """
        if len(images) > self.limits.max_images:
            raise ImageError(f"{where}: {len(images)} images, over the limit of {self.limits.max_images}")
        return [decode_image(b, self.limits, where=f"{where}, image {i}") for i, b in enumerate(images)]


def expand_prompt(text: str, grids: torch.Tensor | None, encode: Callable[[str, bool], list[int]], *,
                  merge: int, image_token_id: int, vision_start_token_id: int | None,
                  vision_end_token_id: int | None, where: str = "a prompt") -> list[int]:
    """Token ids of text prompt ``text`` with each :data:`IMAGE_PLACEHOLDER` replaced by its image's tokens
    (``grids`` row ``i`` for the ``i``-th placeholder; ``t · h · w / merge²`` image tokens between the start and
    end tokens). ``encode(piece, first)`` tokenizes a piece of text (the first with the tokenizer's BOS).

    Raises:
        ImageError: the placeholders and the images are not as many.
    """
    pieces = text.split(IMAGE_PLACEHOLDER)
    n = 0 if grids is None else int(grids.shape[0])
    if len(pieces) - 1 != n:
        raise ImageError(f"{where}: {len(pieces) - 1} {IMAGE_PLACEHOLDER} placeholder(s) for {n} image(s)")
    ids = encode(pieces[0], True)
    for i, piece in enumerate(pieces[1:]):
        t, h, w = (int(v) for v in grids[i])
        run = [image_token_id] * (t * h * w // merge**2)
        ids += ([vision_start_token_id] if vision_start_token_id is not None else []) + run + \
            ([vision_end_token_id] if vision_end_token_id is not None else [])
        ids += encode(piece, False) if piece else []
    return ids


def check_image_runs(ids: Sequence[int], grids: torch.Tensor | None, *, merge: int, image_token_id: int,
                     where: str = "a prompt", exact: bool = True) -> None:
    """That prompt ``ids`` holds one run of ``image_token_id`` per image of ``grids`` (none when None), in order,
    each as long as its image's merged cells ``t · h · w / merge²`` — the layout :func:`expand_prompt` writes.
    ``exact=False`` (a prompt and its response): the runs *begin* so; later ones are sampled text.

    Raises:
        ImageError: the runs and the images do not match (the message names the first difference).
    """
    runs, n = [], 0
    for t in ids:
        if t == image_token_id:
            n += 1
        elif n:
            runs.append(n)
            n = 0
    if n:
        runs.append(n)
    want = [] if grids is None else [int(t) * int(h) * int(w) // merge**2 for t, h, w in grids.tolist()]
    if (runs if exact else runs[:len(want)]) != want:
        raise ImageError(f"{where}: its image-token runs are {runs or 'none'} tokens long, its images need "
                         f"{want or 'none'} (one run per image, as long as its merged patch cells)")


class PromptImages:
    """A vision-language job's prompts with images: each prompt's images processed once (kept for the prompt's
    later uses, up to ``keep`` prompts), its text expanded around them.

    Args:
        processor: the model's :class:`VisionProcessor`.
        config: the model's config (``image_token_id``, ``vision_start_token_id``, ``vision_end_token_id``).
        keep: prompts whose processed images are kept (the oldest are processed again when needed).
    """

    def __init__(self, processor: VisionProcessor, config: Any, keep: int = 256) -> None:
        self.processor, self.config, self.keep = processor, config, keep
        self._held: dict[tuple[bytes, ...], ImageBatch | None] = {}

    def batch(self, images: tuple[bytes, ...], *, where: str = "a prompt") -> ImageBatch | None:
        """The :class:`ImageBatch` of one prompt's encoded ``images`` (None for none), processed once."""
        if not images:
            return None
        held = self._held.get(images)
        if held is None:
            held = self.processor(images, where=where)
            if len(self._held) >= self.keep:
                self._held.pop(next(iter(self._held)))
            self._held[images] = held
        return held

    def prompt(self, text: str, images: tuple[bytes, ...], encode: Callable[[str, bool], list[int]], *,
               where: str = "a prompt") -> list[int]:
        """Token ids of text prompt ``text`` with its ``images`` in place of its placeholders (:func:`expand_prompt`).

        Raises:
            ImageError: a refused image, or placeholders and images that are not as many.
        """
        batch = self.batch(images, where=where)
        c = self.config
        return expand_prompt(text, None if batch is None else batch.grid_thw, encode, merge=self.processor.merge,
                             image_token_id=c.image_token_id, vision_start_token_id=c.vision_start_token_id,
                             vision_end_token_id=c.vision_end_token_id, where=where)
