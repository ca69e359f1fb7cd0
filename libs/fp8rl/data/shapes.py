"""A visual task a CPU can learn: count the squares in a small rendered picture (``data.task: shapes``).

Each problem is one PNG image — a ``GRID × GRID`` board of ``CELL``-pixel cells on a dark background, ``n`` of
them (1 … ``MAX_COUNT``) holding a light square of a random shade, at random cells — and the text prompt
``"Q: <image>How many squares?\\nA: "`` (:data:`~fp8rl.model.image_inputs.IMAGE_PLACEHOLDER` where the picture goes);
the answer is ``n``, graded by ``exact_match``. With a 14-pixel cell and a 2 × 2 patch merge, a cell is one patch
and a board of 4 × 4 cells is 4 image tokens.

Like :mod:`.arith`, a pure function of the seed: the same problems, and the same image bytes, on every machine
(Pillow's PNG writer at a fixed compression level).
"""

from __future__ import annotations

import io
import random

from .arith import make_prompt
from .problem import Problem

__all__ = ["CELL", "GRID", "MAX_COUNT", "ShapesDataset", "render_board"]

CELL = 14  # pixels per cell: one vision patch
GRID = 4  # cells per side: a 56 x 56 picture
MAX_COUNT = 4
QUESTION = "<image>How many squares?"


def render_board(cells: list[tuple[int, int]], shades: list[int], *, grid: int = GRID, cell: int = CELL) -> bytes:
    """The PNG bytes of a board with a square of grey level ``shades[i]`` at each of ``cells`` ``(row, col)``."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (grid * cell, grid * cell), (16, 16, 16))
    draw = ImageDraw.Draw(img)
    pad = cell // 5
    for (r, c), s in zip(cells, shades, strict=True):
        draw.rectangle([c * cell + pad, r * cell + pad, (c + 1) * cell - pad - 1, (r + 1) * cell - pad - 1],
                       fill=(s, s, s))
    buf = io.BytesIO()
    img.save(buf, format="PNG", compress_level=6)
    return buf.getvalue()


class ShapesDataset:
    """Seeded counting problems (module docstring): ``batch(step, size)`` for training, ``eval_set(n)`` apart."""

    def __init__(self, seed: int = 0, *, max_count: int = MAX_COUNT) -> None:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"ShapesDataset seed must be an int, got {seed!r}")
        if not 1 <= max_count <= GRID * GRID:
            raise ValueError(f"max_count must be in [1, {GRID * GRID}], got {max_count}")
        self.seed, self.max_count = seed, max_count

    def _draw(self, rng: random.Random) -> Problem:
        n = rng.randint(1, self.max_count)
        cells = rng.sample([(r, c) for r in range(GRID) for c in range(GRID)], n)
        shades = [rng.randint(160, 255) for _ in cells]
        return Problem(make_prompt(QUESTION), str(n), images=(render_board(cells, shades),))

    def batch(self, step: int, size: int) -> list[Problem]:
        """The training problems of ``step``: ``size`` of them, identical on every call."""
        rng = random.Random(f"fp8rl.shapes:train:{self.seed}:{step}")
        return [self._draw(rng) for _ in range(size)]

    def eval_set(self, n: int) -> list[Problem]:
        """``n`` validation problems from a stream of their own; the same list on every call."""
        rng = random.Random(f"fp8rl.shapes:eval:{self.seed}")
        return [self._draw(rng) for _ in range(n)]
