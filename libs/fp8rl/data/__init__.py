"""Tasks and datasets: where prompts and reference answers come from, and how responses score.

* :mod:`.problem` — :class:`Problem`, the ``(prompt, answer)`` record every source yields (a text or chat prompt).
* :mod:`.arith` — synthetic arithmetic word problems for the tiny embedded preset.
* :mod:`.keys` — dotted key paths into nested rows (``reward_model.ground_truth``).
* :mod:`.rows` — one row → one problem: the known row shapes, text or chat-message prompts.
* :mod:`.jsonl` — problems from JSON-lines files.
* :mod:`.dataset` — problems from a user's data: JSON lines, Parquet, Arrow (``save_to_disk``) directories.
* :mod:`.order` — the seeded per-epoch order a job visits a file's problems in.
* :mod:`.files` — :class:`DataRoot`: data files confined to a root, regular files only, read within limits.
* :mod:`.grading` — graders ``(response, answer) -> reward in [0, 1]`` that never raise.

Invariant: a data source is a pure function of its config and seed (the same problems in the same order on
every machine), and nothing here imports torch or another fp8rl package but ``fp8rl.limits``.
"""

from .arith import ArithConfig, ArithDataset, format_sft_example, generate_problems, make_prompt
from .dataset import check_data_path, detect_format, load_problems, read_problems
from .files import DataFileError, DataRoot
from .grading import (
    GRADERS,
    Grader,
    exact_match_grader,
    extract_boxed,
    extract_final_number,
    extract_hash_answer,
    get_grader,
    reference_answer,
    register_grader,
)
from .jsonl import load_jsonl, wrap_math_prompt
from .math_verify_grader import math_verify_grader  # noqa: F401  (registers the "math_verify" grader)
from .order import EpochBatches, epoch_permutation
from .problem import Messages, Problem

__all__ = [
    "GRADERS",
    "ArithConfig",
    "ArithDataset",
    "DataFileError",
    "DataRoot",
    "EpochBatches",
    "Grader",
    "Messages",
    "Problem",
    "check_data_path",
    "detect_format",
    "epoch_permutation",
    "exact_match_grader",
    "extract_boxed",
    "extract_final_number",
    "extract_hash_answer",
    "format_sft_example",
    "generate_problems",
    "get_grader",
    "load_jsonl",
    "load_problems",
    "make_prompt",
    "read_problems",
    "reference_answer",
    "register_grader",
    "wrap_math_prompt",
]
