"""A trainer step's pictures: each prompt's images encoded once, as the rollout encodes them.

The rows of a vision-language batch carry their prompt's :class:`~fp8rl.model.vision.ImageBatch` (the same object
for a prompt's samples). A frozen encoder's features are computed once per step and serve every pass and row of the
prompt (:meth:`StepImages.of`, cleared by :meth:`StepImages.clear` when the step ends); a trained encoder's, in its
training pass, once per micro-batch with gradient. Either way a prompt's images are encoded alone — the call the
rollout makes — so the features are the rollout's bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fp8rl.model.vision import ImageBatch

__all__ = ["StepImages"]


class StepImages:
    """The encoded images of a step (module docstring)."""

    def __init__(self) -> None:
        # (id of the model, id of the rows' object) -> (the object, it encoded by that model's encoder): a KL
        # reference's pass encodes with its own encoder
        self._held: dict[tuple[int, int], tuple[ImageBatch, ImageBatch]] = {}

    def of(self, model: torch.nn.Module, rows: Sequence[ImageBatch | None] | None, *, grad: bool = False
           ) -> ImageBatch | None:
        """The rows' images as one batch with their encoder outputs (each row's count riding along; None when no
        row has any): from the step's, or with ``grad`` freshly encoded with gradient (kept for this call only)."""
        if rows is None:
            return None
        held_by = self._held if not grad else {}
        encoded: list[ImageBatch | None] = []
        with torch.set_grad_enabled(grad):
            for img in rows:
                key = (id(model), id(img))
                held = None if img is None else held_by.get(key)
                if img is not None and (held is None or held[0] is not img):
                    held = held_by[key] = (img, model.encode_images(img))
                encoded.append(None if held is None else held[1])
        return ImageBatch.concat(encoded)

    def clear(self) -> None:
        """Forget the step's images (the next step brings its own; a trained encoder has moved)."""
        self._held.clear()
