"""The images of a service's requests: a vision-language policy's prompts carry their pictures as encoded files.

A Generate prompt names its images itself (``Prompt.images``); a TrainStep, ComputeLogprobs or Calibrate request
sends each image file once (its ``images``) and each row names its prompt's by index (``image_indices``), so a
prompt's G rows do not carry G copies. :class:`RequestPictures` turns them into the engines' per-row
:class:`~fp8rl.model.vision.ImageBatch` es: decoded under the service's :class:`~fp8rl.model.image_inputs.ImageLimits`
(nothing from the network is trusted beyond them), processed by the policy's own image processor — the same
bytes give the same patches in every service, so rollout and trainer see one input — and checked against the
row's image-token runs. Rows of one prompt get one object (the trainer encodes it once per step). Anything wrong
is INVALID_ARGUMENT naming the row and the image.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import grpc

from fp8rl.model.image_inputs import ImageError, PromptImages, VisionProcessor, check_image_runs
from fp8rl.model.vision import ImageBatch

from .rpc import Abort, require

__all__ = ["RequestPictures"]


class RequestPictures:
    """A service's view of its requests' images (module docstring).

    Args:
        config: the policy's :class:`~fp8rl.model.config.ModelConfig` (a vision-language family's has images).
        path: the policy's directory (its ``preprocessor_config.json``).
    """

    def __init__(self, config, path: str | Path | None) -> None:
        self.config = config
        self.images: PromptImages | None = None
        if config.family.vision and path is not None:
            self.images = PromptImages(VisionProcessor.from_model_dir(path, config.vision_config), config)

    def of_prompts(self, groups: Sequence[Sequence[bytes]], ids: Sequence[Sequence[int]], *, what: str = "prompt",
                   exact: bool = True) -> list[ImageBatch | None] | None:
        """Per row its :class:`ImageBatch` (None for a text row) from each row's own image files ``groups[i]``;
        None when no row has images. ``ids``: each row's prompt, whose image-token runs must be its images'
        (``exact=False``: a prompt and its response, whose runs begin so)."""
        if not any(len(g) for g in groups):
            if self.images is not None:  # a text row of a vision-language policy holds no image-token run
                for i, row in enumerate(ids):
                    self._check(row, None, f"{what} {i}", exact)
            return None
        require(self.images is not None, f"{what}s carry images, but the policy ({self.config.architecture}) is not "
                                         f"a vision-language model")
        out = []
        for i, (files, row) in enumerate(zip(groups, ids, strict=True)):
            try:
                batch = self.images.batch(tuple(bytes(b) for b in files), where=f"{what} {i}")
            except ImageError as exc:
                raise Abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
            self._check(row, batch, f"{what} {i}", exact)
            out.append(batch)
        return out

    def of_rows(self, table: Sequence[bytes], indices: Sequence[Sequence[int]], ids: Sequence[Sequence[int]], *,
                what: str = "row", exact: bool = True) -> list[ImageBatch | None] | None:
        """As :meth:`of_prompts`, each row naming its image files by index into the request's ``table``."""
        for i, idx in enumerate(indices):
            bad = next((j for j in idx if not 0 <= j < len(table)), None)
            require(bad is None, f"{what} {i}: image index {bad} is outside the request's {len(table)} images")
        require(len(table) == 0 or any(len(x) for x in indices),
                f"the request carries {len(table)} images that no {what} names")
        return self.of_prompts([[table[j] for j in idx] for idx in indices], ids, what=what, exact=exact)

    def _check(self, row: Sequence[int], batch: ImageBatch | None, where: str, exact: bool) -> None:
        try:
            check_image_runs(row, None if batch is None else batch.grid_thw, merge=self.images.processor.merge,
                             image_token_id=self.config.image_token_id, where=where, exact=exact)
        except ImageError as exc:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None

