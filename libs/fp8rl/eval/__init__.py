"""Score a policy on a data file: ``python -m fp8rl.eval MODEL --data FILE`` (and ``fp8rl eval``).

``MODEL`` is anything a user has before or after a run — a preset name, an HF model directory (one
``python -m fp8rl.export`` wrote included) or a trainer checkpoint (``.pt``, sharded ``.dcp``, Megatron) — so
the same command compares a policy before and after training. The validation is the jobs' own
(:func:`fp8rl.controller.validation.validate`: greedy accuracy, pass@j, mean@k) on the embedded rollout engine
with the job's rollout numerics, over the first ``job.eval_size`` problems of the file read as a job reads
``data.validation_path`` (formats, key paths, chat prompts, ``data.max_prompt_tokens``).
"""

from .run import EvalReport, evaluate_policy

__all__ = ["EvalReport", "evaluate_policy"]
