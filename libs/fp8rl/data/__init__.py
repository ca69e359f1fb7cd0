"""Tasks and datasets: where prompts and reference answers come from, and how responses score.

* :mod:`.problem` — :class:`Problem`, the ``(prompt, answer)`` record every source yields.
* :mod:`.arith` — synthetic arithmetic word problems for the tiny embedded preset.
* :mod:`.jsonl` — problems from JSON-lines files (own shape or OpenMathInstruct-2).
* :mod:`.files` — :class:`DataRoot`: data files confined to a root, regular files only, read within limits.
* :mod:`.grading` — graders ``(response, answer) -> reward in [0, 1]`` that never raise.

Invariant: a data source is a pure function of its config and seed (the same problems in the same order on
every machine), and nothing here imports torch or another fp8rl package but ``fp8rl.limits``.
"""

from .arith import ArithConfig, ArithDataset, format_sft_example, generate_problems, make_prompt
from .files import DataFileError, DataRoot
from .grading import (
    GRADERS,
    Grader,
    exact_match_grader,
    extract_boxed,
    extract_final_number,
    get_grader,
    register_grader,
)
from .jsonl import load_jsonl, wrap_math_prompt
from .math_verify_grader import math_verify_grader  # noqa: F401  (registers the "math_verify" grader)
from .problem import Problem

__all__ = [
    "GRADERS",
    "ArithConfig",
    "ArithDataset",
    "DataFileError",
    "DataRoot",
    "Grader",
    "Problem",
    "exact_match_grader",
    "extract_boxed",
    "extract_final_number",
    "format_sft_example",
    "generate_problems",
    "get_grader",
    "load_jsonl",
    "make_prompt",
    "register_grader",
    "wrap_math_prompt",
]
