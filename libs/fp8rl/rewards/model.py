"""A reward model served in-process: a judge (GenRM) or a sequence classifier on the embedded engine, in FP8 or bf16,
with the items of concurrent callers gathered into shared forward batches.

:class:`RewardModel` is what the reward service (``RewardService.ScoreModel``) and the in-process loop hold. One
worker thread owns the model: :meth:`RewardModel.score` queues a caller's items and waits for them; the worker takes
whatever is queued — several callers' items — up to ``reward.model.max_batch`` per batch. Rule grading runs
elsewhere (the service's process pool), so a busy model never holds a rule grade back.

An item the model cannot score is *unscored* (:attr:`ModelScore.score` None, :attr:`ModelScore.error` saying why):
its input past ``max_input_tokens``, a judge whose every sample fails to parse, the model raising, the caller's
wait past ``timeout_s``. Callers leave unscored items out of the step — never a placeholder 0.

The judge generates with the torch rollout engine (``precision: fp8``: block-scaled E4M3 linears; ``kv_cache_dtype:
fp8``: per-tensor Q/K/V scales calibrated once, on the first batch's prompts); its weights are fixed for the job.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

import torch

from fp8rl.config.schema import RewardModelConfig
from fp8rl.engines.base import SamplingParams
from fp8rl.engines.calibrator import QKVCalibrator
from fp8rl.engines.torch_rollout import TorchRolloutEngine
from fp8rl.fp8 import recipe_for_role
from fp8rl.fp8.convert import convert_model
from fp8rl.fp8.formats import DEFAULT_SCALING
from fp8rl.model.tokenizer import chat_template_of, load_tokenizer, stop_token_ids
from fp8rl.presets import PRESETS, load_policy, prepare_preset

from .classifier import classify, label_scores, left_padded, load_classifier
from .items import ModelItem, ModelScore
from .judge import render_judge_prompt, scores_of_outputs, verdict_first_tokens, verdict_prob_scores

__all__ = ["ModelItem", "ModelScore", "RewardModel"]

log = logging.getLogger(__name__)

_POLL_S = 0.2  # how often a waiting caller checks should_stop


@dataclass
class _Waiting:
    item: ModelItem
    future: Future


class RewardModel:
    """``cfg`` (``reward.model``, kind set) loaded and served by one worker thread.

    Args:
        cfg: the job's ``reward.model``.
        scaling: the FP8 scaling of its linears (the job's ``fp8_recipe``).
        seed: seeds the judge's sampling (n > 1 or temperature > 0).
        serve: start the worker thread (:meth:`score`); False: :meth:`compute` only (the bf16 reference of
            ``reward.model.agreement``).

    Raises:
        ValueError / FileNotFoundError: no kind, a model that does not load (a classifier that is not a
            ``*ForSequenceClassification`` checkpoint, verdict words that share a first token, ...), named.
    """

    def __init__(self, cfg: RewardModelConfig, *, scaling: str = DEFAULT_SCALING, seed: int = 0,
                 serve: bool = True) -> None:
        if cfg.kind is None or not cfg.model or cfg.follow_policy:
            raise ValueError("reward.model.kind and reward.model.model must be set to serve a reward model (with "
                             "follow_policy the policy judges on the rollout side: fp8rl.rewards.policy_judge)")
        self.cfg = cfg
        recipe = recipe_for_role("fp8_e2e" if cfg.precision == "fp8" else "bf16", "rollout",
                                 kv_cache_dtype=cfg.kv_cache_dtype, scaling=scaling)
        self._master: torch.nn.Module | None = None  # the unquantized judge, until its Q/K/V scales are calibrated
        if cfg.kind == "judge" and cfg.backend == "vllm":  # vLLM on the checkpoint directory (optional install)
            from fp8rl.engines.vllm.rollout import VllmRolloutEngine

            path = prepare_preset(cfg.model) if cfg.model in PRESETS else cfg.model
            self.tok = load_tokenizer(path)
            self.engine = VllmRolloutEngine(path, recipe, eos_token_ids=stop_token_ids(self.tok), initial_version=0,
                                            max_batch_size=cfg.max_batch * cfg.n, seed=seed)
            self.max_len, self._verdict_tokens, self.net = self.engine.max_len, None, None
        elif cfg.kind == "judge":
            model, self.tok, _ = load_policy(cfg.model)
            self.engine = TorchRolloutEngine(model, recipe, eos_token_ids=stop_token_ids(self.tok),
                                             pad_token_id=self.tok.pad_id, max_batch_size=cfg.max_batch * cfg.n,
                                             seed=seed, take_model=cfg.kv_cache_dtype == "auto")
            self._master = model if cfg.kv_cache_dtype == "fp8" else None
            self.max_len = model.config.max_position_embeddings
            self._verdict_tokens = verdict_first_tokens(self.tok, cfg.verdict_scores) \
                if cfg.parse == "verdict_prob" else None
            self.net: torch.nn.Module = self.engine.model
        else:
            path = prepare_preset(cfg.model) if cfg.model in PRESETS else cfg.model
            clf = load_classifier(path)
            self.tok = load_tokenizer(path)
            convert_model(clf.lm, recipe, mode="inference")
            for p in clf.parameters():
                p.requires_grad_(False)
            self.net, self.engine = clf, None
            self.max_len = clf.config.max_position_embeddings
        # reward.model.agreement: the same model in bf16, scoring every batch too (its scores are only compared)
        self.reference = RewardModel(dataclasses.replace(cfg, precision="bf16", kv_cache_dtype="auto",
                                                         agreement=False), scaling=scaling, seed=seed, serve=False) \
            if cfg.agreement else None
        self.batch_sizes: list[int] = []  # every forward batch's item count, in order (the last 1000)
        self._seed = seed
        self._queue: queue.SimpleQueue[_Waiting | None] = queue.SimpleQueue()
        self._closed = False
        self._worker = threading.Thread(target=self._serve, name="reward-model", daemon=True) if serve else None
        if self._worker is not None:
            self._worker.start()

    # ------------------------------------------------------------------ callers
    def score(self, items: Sequence[ModelItem], *, timeout_s: float | None = None,
              should_stop: Callable[[], bool] | None = None) -> list[ModelScore]:
        """One :class:`ModelScore` per item, in order; items still unscored after ``timeout_s`` (default the config's)
        or once ``should_stop`` says so come back unscored (those not yet begun are withdrawn)."""
        if self._closed or self._worker is None:
            raise RuntimeError("the reward model is closed" if self._closed else "this reward model serves no callers "
                               "(serve=False): call compute")
        waiting = [_Waiting(item, Future()) for item in items]
        for w in waiting:
            self._queue.put(w)
        bound = self.cfg.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + bound
        out = []
        for w in waiting:
            while True:
                left = deadline - time.monotonic()
                stop = should_stop is not None and should_stop()
                if left <= 0 or stop:
                    w.future.cancel()  # not begun: the worker skips it; begun: its result is dropped
                    out.append(w.future.result() if w.future.done() and not w.future.cancelled() else
                               ModelScore(None, "the caller stopped waiting" if stop else
                                          f"timeout: not scored within {bound:g} s"))
                    break
                try:
                    out.append(w.future.result(timeout=min(left, _POLL_S)))
                    break
                except FutureTimeout:
                    continue
        return out

    def close(self) -> None:
        """Stop the worker (after the batch it is on); queued items come back unscored. A vLLM judge's engine is
        shut down."""
        if not self._closed:
            self._closed = True
            if self._worker is not None:
                self._queue.put(None)
                self._worker.join(timeout=60)
            if hasattr(self.engine, "close"):
                self.engine.close()

    # ------------------------------------------------------------------ the worker
    def _serve(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                break
            batch, closing = [first], False
            while len(batch) < self.cfg.max_batch:  # whatever else is queued, from any caller
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    closing = True
                    break
                batch.append(nxt)
            batch = [w for w in batch if w.future.set_running_or_notify_cancel()]
            if batch:
                self._run(batch)
            if closing:
                break
        while True:  # closed: what is still queued is unscored
            try:
                w = self._queue.get_nowait()
            except queue.Empty:
                return
            if w is not None and w.future.set_running_or_notify_cancel():
                w.future.set_result(ModelScore(None, "the reward model was closed"))

    def _run(self, batch: list[_Waiting]) -> None:
        self.batch_sizes = (self.batch_sizes + [len(batch)])[-1000:]
        try:
            results = self.compute([w.item for w in batch])
        except Exception as exc:  # noqa: BLE001 - the model failed on this batch: its items are unscored, named
            log.exception("the reward model failed on a batch of %d items", len(batch))
            results = [ModelScore(None, f"the reward model failed: {type(exc).__name__}: {exc}")] * len(batch)
        for w, r in zip(batch, results, strict=True):
            w.future.set_result(r)

    # ------------------------------------------------------------------ the model
    def compute(self, items: Sequence[ModelItem]) -> list[ModelScore]:
        """Score ``items`` as one batch, in the calling thread (the worker's; tests call it directly)."""
        inputs = [self._render(it) for it in items]
        room = self.max_len - (self.cfg.max_new_tokens if self.cfg.kind == "judge" and
                               self.cfg.parse != "verdict_prob" else 0)
        limit = min(self.cfg.max_input_tokens, room)
        out: list[ModelScore | None] = [None] * len(items)
        ok = []
        for i, ids in enumerate(inputs):
            if len(ids) > limit:
                out[i] = ModelScore(None, f"input of {len(ids)} tokens is past the limit of {limit} "
                                          f"(reward.model.max_input_tokens, and the model's context)")
            else:
                ok.append(i)
        if ok:
            got = self._classifier([inputs[i] for i in ok]) if self.cfg.kind == "classifier" else \
                self._judge([inputs[i] for i in ok])
            for i, r in zip(ok, got, strict=True):
                out[i] = r
        if self.reference is not None:  # the same items through the bf16 copy: its score beside the FP8 one
            refs = self.reference.compute(items)
            out = [dataclasses.replace(r, compared=True, reference=x.score) for r, x in zip(out, refs, strict=True)]
        return out  # type: ignore[return-value]

    def _render(self, it: ModelItem) -> list[int]:
        if self.cfg.kind == "judge":
            return render_judge_prompt(self.tok, self.cfg.template, question=it.question, response=it.response,
                                       answer=it.answer, other=it.other)
        if chat_template_of(self.tok) is not None:  # the conversation the classifier was trained to read
            text = self.tok.hf_tokenizer.apply_chat_template(  # type: ignore[attr-defined]
                [{"role": "user", "content": it.question}, {"role": "assistant", "content": it.response}],
                tokenize=False)
            return self.tok.encode(text, add_bos=False)
        return self.tok.encode(it.question + it.response)

    def _classifier(self, inputs: list[list[int]]) -> list[ModelScore]:
        scores = label_scores(classify(self.net, inputs, self.tok.pad_id), self.cfg.positive_label)
        return [ModelScore(float(s)) for s in scores.tolist()]

    def _calibrated(self, prompts: list[list[int]]) -> None:
        """FP8 KV: the judge's Q/K/V scales, once, from its unquantized copy over the first batch's prompts."""
        if self._master is None:
            return
        scales = QKVCalibrator(self._master, pad_token_id=self.tok.pad_id).calibrate(0, prompts)
        self.engine.load_scales(scales)
        self._master = None

    def _judge(self, prompts: list[list[int]]) -> list[ModelScore]:
        cfg = self.cfg
        self._calibrated(prompts)
        if cfg.parse == "verdict_prob":
            ids, mask = left_padded(prompts, self.tok.pad_id)
            with torch.inference_mode():
                logits = self.net(ids, attention_mask=mask, logits_to_keep=1)[:, -1]
            return [ModelScore(s) if s is not None else ModelScore(None, "the judge put no probability on any "
                                                                         "verdict word")
                    for s in verdict_prob_scores(logits, self._verdict_tokens)]
        self._seed += 1
        params = SamplingParams(temperature=cfg.temperature, max_tokens=cfg.max_new_tokens, n=cfg.n, seed=self._seed)
        samples = self.engine.generate(prompts, params)
        outputs: list[list[tuple[str, int]]] = [[] for _ in prompts]
        for s in samples:
            outputs[s.prompt_index].append((self.tok.decode(s.token_ids), len(s.token_ids)))
        return scores_of_outputs(outputs, cfg.parse, verdicts=cfg.verdict_scores, max_score=cfg.max_score)
