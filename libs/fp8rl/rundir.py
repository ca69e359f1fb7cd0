"""The in-process loop's run directory (``python -m fp8rl.loop --out DIR``): what a run leaves as it goes.

Layout::

    DIR/job.yaml                  the job the run executes (what ``--resume DIR`` runs again)
    DIR/run.json                  what the run needs beyond its job: ``{"data_root": ABSOLUTE PATH}``, the directory a
                                  ``jsonl`` / ``dataset`` job's data paths were resolved under (a resume uses it again)
    DIR/metrics.jsonl             one flat row per finished step, appended and flushed as the step ends
    DIR/tensorboard/              the same rows as TensorBoard scalars, flushed per step
    DIR/checkpoints/trainer-v<V>.pt   the trainer's checkpoint (weights, AdamW, RNG, version): the trainer
                                  service's own format (``TrainerBackend.save_checkpoint``)
    DIR/checkpoints/loop-v<V>.json    the loop's state beside it (:class:`LoopState`)
    DIR/summary.md, summary.json, plots, policy/   rewritten at each checkpoint, at the end, and when stopped

Invariants:

* The directory exists, with ``job.yaml``, before the first engine is built: a run killed in its first step
  (out of memory, SIGKILL) still says what it was.
* A checkpoint appears whole or not at all: the trainer's file is written first (a temporary file renamed),
  then the loop state (the same); a loop state names its trainer file, so the newest loop state whose file
  exists is a consistent point to resume from. The older ones are removed after the new one is whole
  (:data:`KEEP` are kept).
* A new run never overwrites a directory that holds checkpoints of a run that did not finish (refused, naming
  ``--resume``); a finished run's directory is replaced as before.
* A run that stopped before its first checkpoint kept nothing but its job: resuming it starts it over from step 0
  (:meth:`RunDir.resume` returns None); one that finished without checkpoints (``job.checkpoint_every: 0``; its
  ``summary.json`` does not say ``stopped``) is refused, like one whose final checkpoint says it finished.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

__all__ = ["KEEP", "LoopState", "RunDir", "RunDirError"]

KEEP = 1  # checkpoints kept (each holds the trainer's weights and AdamW state: 16 bytes per parameter)
_STATE = re.compile(r"loop-v(\d+)\.json")


class RunDirError(ValueError):
    """A run directory cannot be started or resumed (the message says why and what to do)."""


@dataclass
class LoopState:
    """Where a synchronous or asynchronous loop run stands after a step (what a checkpoint adds to the trainer's).

    Attributes:
        next_step: the first step the resumed run runs (the data order and every sampler seed are functions of
            the step index: :class:`fp8rl.controller.plan.JobPlan`).
        version: the trainer's weight version in ``checkpoint``.
        checkpoint: the trainer checkpoint's file name (inside ``checkpoints/``).
        history: the rows of the finished steps, as the loop made them (``metrics.jsonl`` is rewritten from them).
        validation: steps done -> the validation metrics measured then.
        qkv_scales: the QKV scales of ``version`` as ``[[q, k, v], ...]`` per layer (FP8 KV), else None.
        finished: the run ran all its steps.
    """

    next_step: int
    version: int
    checkpoint: str
    history: list[dict] = field(default_factory=list)
    validation: dict[int, dict] = field(default_factory=dict)
    qkv_scales: list[list[float]] | None = None
    finished: bool = False

    @classmethod
    def from_json(cls, text: str) -> LoopState:
        d = json.loads(text)
        d["validation"] = {int(k): v for k, v in d.get("validation", {}).items()}
        return cls(**d)


class RunDir:
    """One run's directory (see the module docstring)."""

    JOB = "job.yaml"
    METRICS = "metrics.jsonl"
    RUN = "run.json"

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.checkpoints = self.path / "checkpoints"
        self._tb = None  # the TensorBoard writer, opened with the first row
        # after resume(): the steps the stopped run had begun past its checkpoint (the rows it measured there, and
        # the step it was in), run again from the checkpoint
        self.steps_redone = 0

    # -- starting and resuming ------------------------------------------------------------------------------
    def start(self, job_yaml: str, *, data_root: str | Path | None = None) -> None:
        """A new run: the directory, ``job.yaml`` and ``run.json`` (``data_root``, made absolute; None: the working
        directory) now, an empty ``metrics.jsonl``; refuses a directory holding an unfinished run's checkpoints."""
        state = self.latest()
        if state is not None and not state.finished:
            raise RunDirError(f"{self.path} holds an unfinished run (checkpoint at step {state.next_step}, weight "
                              f"version {state.version}): continue it with `python -m fp8rl.loop --resume "
                              f"{self.path}`, or give another --out")
        self.path.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(self.checkpoints, ignore_errors=True)  # a finished run's, replaced by this one
        shutil.rmtree(self.path / "tensorboard", ignore_errors=True)
        for stale in ("summary.json", "summary.md"):  # a finished run's: never mistaken for this one's
            (self.path / stale).unlink(missing_ok=True)
        self._write(self.path / self.JOB, job_yaml)
        self._write(self.path / self.RUN, json.dumps({"data_root": os.path.abspath(data_root or ".")}))
        (self.path / self.METRICS).write_text("")

    def job_file(self) -> Path:
        f = self.path / self.JOB
        if not f.is_file():
            raise RunDirError(f"{self.path} is not a loop run directory: it has no {self.JOB}")
        return f

    def data_root(self) -> str | None:
        """The absolute data root the run was started with (``run.json``); None where none was recorded (a run
        directory from before ``run.json``: its data paths were relative to the working directory)."""
        try:
            return json.loads((self.path / self.RUN).read_text())["data_root"]
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise RunDirError(f"{self.path / self.RUN} is unreadable ({exc}): give the run's data root with "
                              f"--data-root") from None

    def resume(self) -> LoopState | None:
        """The newest consistent checkpoint's state, the metrics and TensorBoard rewritten to its finished steps
        (rows of steps after it, from the run that died, are dropped: the resumed run measures them again;
        :attr:`steps_redone` counts them and the step the run was in).

        None: the run stopped before its first checkpoint, so nothing but its job was kept; the caller starts the run
        over from step 0 (:meth:`start`, which also empties ``metrics.jsonl``).

        Raises:
            RunDirError: no ``job.yaml`` (not a run directory), or the run finished (its final checkpoint says so,
                or without checkpoints its ``summary.json`` does not say it stopped).
        """
        self.job_file()
        state = self.latest()
        if state is None:
            if self._finished_without_checkpoint():
                raise RunDirError(f"the run in {self.path} finished (its summary.json says so; it kept no checkpoint, "
                                  f"job.checkpoint_every 0): nothing to resume")
            return None
        if state.finished:
            raise RunDirError(f"the run in {self.path} finished all its {state.next_step} steps: nothing to resume")
        try:
            measured = sum(1 for line in (self.path / self.METRICS).read_text().splitlines() if line.strip())
        except OSError:
            measured = len(state.history)
        self.steps_redone = max(0, measured - len(state.history)) + 1
        shutil.rmtree(self.path / "tensorboard", ignore_errors=True)
        (self.path / self.METRICS).write_text("")
        for row in state.history:
            self.append(row)
        return state

    def _finished_without_checkpoint(self) -> bool:
        """``summary.json`` exists and does not say ``stopped``: without a checkpoint only the end of a run writes
        that (a signal writes ``stopped``; a new run removes the old one's)."""
        try:
            summary = json.loads((self.path / "summary.json").read_text())["summary"]
        except (OSError, ValueError, KeyError, TypeError):
            return False  # none (killed before any report was written), or unreadable: not a finished run's
        return not summary.get("stopped", False)

    def latest(self) -> LoopState | None:
        """The newest loop state whose trainer checkpoint exists (None: no checkpoint)."""
        if not self.checkpoints.is_dir():
            return None
        found = sorted(((int(m.group(1)), p) for p in self.checkpoints.iterdir() if (m := _STATE.fullmatch(p.name))),
                       reverse=True)
        for _, p in found:
            try:
                state = LoopState.from_json(p.read_text())
            except (OSError, ValueError, TypeError) as exc:
                log.warning("run directory: skipping %s (%s)", p, exc)
                continue
            if (self.checkpoints / state.checkpoint).exists():
                return state
        return None

    # -- as the run goes ------------------------------------------------------------------------------------
    def append(self, row: dict[str, Any]) -> None:
        """One finished step's row: a line of ``metrics.jsonl`` (flushed to disk) and its TensorBoard scalars."""
        from fp8rl.report import flatten_step  # report's imports only with a directory

        flat = flatten_step(row)
        with open(self.path / self.METRICS, "a") as f:
            f.write(json.dumps(flat) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.scalars(int(flat["step"]), flat)

    def scalars(self, step: int, values: dict[str, Any]) -> None:
        """TensorBoard scalars of ``step`` (the finite numbers of ``values``), flushed."""
        from fp8rl.report import tensorboard_writer

        if self._tb is None:
            self._tb = tensorboard_writer(self.path) or False
        if not self._tb:
            return
        for key, value in values.items():
            if key != "step" and isinstance(value, int | float) and math.isfinite(value):
                self._tb.add_scalar(key, float(value), global_step=step)
        self._tb.flush()

    def save(self, trainer, state: LoopState) -> Path:
        """The trainer's checkpoint, then ``state`` naming it; older checkpoints removed after both are whole."""
        self.checkpoints.mkdir(parents=True, exist_ok=True)
        ckpt = self.checkpoints / state.checkpoint
        trainer.save_checkpoint(str(ckpt))
        self._write(self.checkpoints / f"loop-v{state.version}.json", json.dumps(asdict(state)))
        keep = sorted((int(m.group(1)) for p in self.checkpoints.iterdir() if (m := _STATE.fullmatch(p.name))),
                      reverse=True)[:KEEP]
        for p in list(self.checkpoints.iterdir()):
            m = _STATE.fullmatch(p.name) or re.fullmatch(r"trainer-v(\d+)\.(?:pt|dcp)", p.name)
            if m and int(m.group(1)) not in keep:
                shutil.rmtree(p) if p.is_dir() else p.unlink()
        return ckpt

    def close(self) -> None:
        if self._tb:
            self._tb.close()
        self._tb = None

    @staticmethod
    def _write(path: Path, text: str) -> None:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
