"""``tiny-arith-python``: tiny-arith-tool fine-tuned to write Python for the ``python`` environment (issue 50).

The task is :class:`fp8rl.envs.python_env.PythonEnv`'s answer tasks (:func:`~fp8rl.envs.python_env.make_python_tasks`:
``What is 4071*283+517?``, beyond a 4-layer model's head). The warm start starts from ``tiny-arith-tool``'s weights,
which already copy digits into a ``<tool_call>`` and out of a ``<tool_response>``, and runs the same curriculum
(:func:`~fp8rl.presets.tiny_arith_tool.warm_start_tool`) with the python tool's format
(:data:`~fp8rl.presets.tool_formats.PYTHON`): on :data:`~fp8rl.presets.tiny_arith_tool.TOOL_RATE` of its episodes
the model calls ``{"code": "print(<the question's expression>)"}``, the sandbox runs it, and the model copies the
printed result (``Answer: 1152710``); on the others it answers at once. Every warm-start transcript's call runs in
the real sandbox (:mod:`fp8rl.envs.sandbox`), so preparing this preset needs bubblewrap.

So a GRPO job on ``python`` that raises the call rate raises the pass rate, and its tools-disabled control
(``env.kwargs.tools_enabled: false``) has nothing to gain. Cached like every preset; ``fp8rl_preset.json`` written
last records the stages and the sampled tool-use stats.
"""

from __future__ import annotations

import logging
from pathlib import Path

from fp8rl.envs.sandbox import sandbox_problem
from fp8rl.model.hf_io import load_hf_checkpoint

from .cache import preset_dir
from .catalog import register_preset
from .chatml import build_chatml_tokenizer
from .tiny_arith import META_FILE
from .tiny_arith_tool import TARGET_TOOL_ACCURACY, TINY_ARITH_TOOL, Stage, prepare_tiny_arith_tool, warm_start_tool
from .tool_formats import PYTHON

log = logging.getLogger(__name__)

__all__ = ["STAGES", "TINY_ARITH_PYTHON", "prepare_tiny_arith_python"]

TINY_ARITH_PYTHON = "tiny-arith-python"
# Shorter than tiny-arith-tool's: its copying heads exist; the new reply format ("exit status: 0 / stdout:") and the
# longer expressions (three numbers, two operators) are what is learned.
STAGES = (Stage("copy", 100, 32, 1e-3, 10), Stage("short", 80, 32, 1e-3, 10),
          Stage("episodes", 300, 32, 1e-3, 10, lr_end=1e-4))


def prepare_tiny_arith_python(
    directory: str | Path | None = None,
    *,
    seed: int = 0,
    stages: tuple[Stage, ...] = STAGES,
    target_tool_accuracy: float = TARGET_TOOL_ACCURACY,
    eval_every: int = 20,
    eval_size: int = 64,
    eval_seed: int = 10**6,
    progress: bool = True,
    force: bool = False,
    base: str | Path | None = None,
) -> Path:
    """Create (or reuse) the cached tiny-arith-python checkpoint and return its directory (module docstring).

    ``base``: the checkpoint to start from (default: the ``tiny-arith-tool`` preset, prepared if needed).

    Raises:
        RuntimeError: no sandbox can run here (the warm start's transcripts run their calls in it); says why.
    """
    out = Path(directory) if directory is not None else preset_dir(TINY_ARITH_PYTHON)
    if (out / META_FILE).exists() and not force:
        return out
    problem = sandbox_problem()
    if problem is not None:
        raise RuntimeError(f"{TINY_ARITH_PYTHON}: its warm start runs the python tool in the code sandbox: {problem}")
    start = Path(base) if base is not None else prepare_tiny_arith_tool(progress=progress)
    model, cfg = load_hf_checkpoint(start)
    out.mkdir(parents=True, exist_ok=True)
    build_chatml_tokenizer(out)  # the same tokenizer and chat template as tiny-arith-tool's
    return warm_start_tool(model, cfg, out, TINY_ARITH_PYTHON, PYTHON, seed=seed, stages=stages,
                           target_tool_accuracy=target_tool_accuracy, eval_every=eval_every, eval_size=eval_size,
                           eval_seed=eval_seed, progress=progress, task_meta={"env": "python", "kind": "answer"},
                           meta={"base": TINY_ARITH_TOOL if base is None else str(base)})


register_preset(TINY_ARITH_PYTHON, lambda progress: prepare_tiny_arith_python(progress=progress))
