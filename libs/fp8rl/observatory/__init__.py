"""The mismatch observatory (issue 18): where the rollout-vs-trainer divergence of one batch comes from.

:func:`observe` samples one batch with the rollout engine under a recipe, then attributes the mismatch
(``token_mult_prob_error = mean exp(|Δlogp|)`` over generated tokens, 1.0 = equal; and mean ``|Δlogp|``):

**Per source.** Starting from the high-precision full-forward logprobs of the batch's tokens, one source
of the rollout's numerics is turned on at a time and compared with them:

==================  ==========================================================================
``linear``          FP8 linears (weights 128×128 blocks, activations 1×128 groups), the recipe's
                    bf16 layers kept
``qkv``             E4M3 Q/K/V under the calibrated per-tensor scales (Q only with FP8 attention)
``probs``           E4M3 softmax probabilities (FP8 attention)
``decode``          the rollout's own logprobs (decode with a KV cache) vs its full-forward recompute
                    with the same converted model: the order-of-summation part
``rollout_numerics``  the rollout recipe's full forward (all of the above but ``decode``) vs high precision
``total``           the rollout as it ran vs the trainer's recompute: what a training step measures
==================  ==========================================================================

A source the recipe does not use is still measured, on a variant equal to the reference, so it reads
max abs Δlogp exactly 0 (the ``on`` column says which sources the recipe uses). The sources do not add up to
``total``: in ``fp8_e2e`` the trainer computes the FP8 linears too, so they largely cancel in the total.

**Per layer** (FP8 linears, the part the ``num_*_layers_in_bf16`` knobs control). Forward hooks on the
decoder layers of one high-precision forward record each layer's inputs and output. Then:

* ``local_rel_err``: the observed recipe's layer *i* run on the high-precision input of layer *i*,
  ``‖out − out_hp‖ / ‖out_hp‖`` over real tokens. It is what the layer adds by itself, free of what
  earlier layers did (exactly 0 for a layer the recipe keeps in bf16), and costs one layer pass each.
* ``cumulative_rel_err``: the same ratio after layer *i* in a whole forward under the recipe (the error the
  hidden state carries there; grows with depth).
* ``alone_rel_err``: ``local_rel_err`` as if layer *i* ran FP8 linears (for layers kept in bf16 too).
* ``alone_token_mult_prob_error`` (``layer_logprobs``): the logprob mismatch against high precision with
  only layer *i*'s linears in FP8, one full forward per layer; the most direct ranking of layers, and
  the one the suggestion uses when present.

Hidden-state errors are cheap (two forwards in all) but not in logprob units; the per-layer logprob
pass is ``L`` forwards (a few seconds on SmolLM2-135M for a small batch), so it is on by default and
can be switched off.

**Suggestion** (:mod:`.suggest`): the smallest ``num_first_layers_in_bf16 + num_last_layers_in_bf16``
whose re-measured total mismatch is within a target (default 1.03), or the best one within a budget.

**Uncertainty.** Every ``token_mult_prob_error`` carries its sample (sequences, generated tokens) and a standard
error over sequences (:func:`fp8rl.rl.metrics.token_mult_prob_error_stderr`: the tokens of one sequence are not
independent draws); the search warns where its sample cannot separate what it compares (:func:`.suggest.unseparated`).

**Nothing measured is lost.** ``observe(on_partial=...)`` hands over the result so far as each part is measured
(sources, layers, each search candidate; ``stopped_in`` names what was still to come); the command writes it at once,
and on SIGINT, SIGTERM or ``--time-limit`` prints and keeps the last one.

``python -m fp8rl.observatory --model tiny-arith --recipe fp8_e2e --kv-cache-dtype fp8 --out DIR`` runs
it and writes ``observatory.md`` / ``.json`` / ``.png`` (:meth:`ObservatoryResult.write`); the
in-process loop runs it before step 0 with ``policy.numerics.auto_bf16_layers: true``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from fp8rl.model import CausalLM

from .measure import ObservatoryConfig, Probe, Progress, full_forward_logprobs
from .result import Candidate, LayerRow, ObservatoryResult, SourceRow, Suggestion
from .suggest import best_split, layer_scores, suggest

__all__ = ["ObservatoryConfig", "ObservatoryResult", "SourceRow", "LayerRow", "Candidate", "Suggestion", "Probe",
           "observe", "full_forward_logprobs", "best_split", "layer_scores", "suggest"]


def observe(model: CausalLM, prompts: Sequence[Sequence[int]], config: ObservatoryConfig | None = None, *,
            pad_token_id: int = 0, eos_token_ids: Sequence[int] = (2,), name: str = "model",
            search: bool = True, progress: Progress | None = None,
            on_partial: Callable[[ObservatoryResult], None] | None = None) -> ObservatoryResult:
    """Sample ``prompts`` with the rollout engine under ``config``'s recipe and attribute the mismatch.

    Args:
        model: the high-precision policy (not modified).
        prompts: token ids of each prompt (chat template already applied).
        config: the recipe, sampling, and the suggestion's target and budget (default: ``ObservatoryConfig()``).
        pad_token_id, eos_token_ids: the tokenizer's padding and stop tokens.
        name: how the model is named in the tables.
        search: also search the bf16-layer suggestion (``max_bf16_layers + 1`` more rollouts).
        progress: called with one line per phase.
        on_partial: called with the result so far (``stopped_in`` naming the part still to come) as soon as each
            part is measured: the sources, the layers, then each search candidate — what ``python -m
            fp8rl.observatory --out`` writes, so a run stopped later keeps them.

    Returns:
        The per-source and per-layer rows and, with ``search``, the suggestion.
    """
    t0 = time.perf_counter()
    config = config or ObservatoryConfig()
    say = progress or (lambda _msg: None)
    partial = on_partial or (lambda _r: None)
    probe = Probe(model, prompts, config, pad_token_id=pad_token_id, eos_token_ids=eos_token_ids, progress=say)
    engine, batch, total = probe.total()
    tokens = int(batch.loss_mask.sum())
    say(f"rollout: {batch.input_ids.shape[0]} sequences, {tokens} generated tokens; total token_mult_prob_error "
        f"{total.token_mult_prob_error:.6f} ± {total.standard_error:.6f} (one standard error over sequences)")

    def result(sources, layers, suggestion, stopped_in):
        return ObservatoryResult(
            model=name, recipe=config.recipe, kv_cache_dtype=config.kv_cache_dtype,
            num_first_layers_in_bf16=config.num_first_layers_in_bf16,
            num_last_layers_in_bf16=config.num_last_layers_in_bf16, batch_invariant=config.batch_invariant,
            num_sequences=batch.input_ids.shape[0], num_tokens=tokens, sources=sources, layers=layers,
            suggestion=suggestion, seconds=time.perf_counter() - t0, stopped_in=stopped_in)

    ref, lin = probe.variant(probe.reference_recipe()), probe.variant(probe.linear_recipe())
    sources, ref_lp = probe.sources(engine, batch, total, ref, lin)
    del engine
    partial(result(sources, [], None, "the per-layer pass"))
    say("per layer ...")
    layers = probe.layers(batch, ref, lin, ref_lp)
    del ref, lin
    suggestion = None
    observed = (config.num_first_layers_in_bf16, config.num_last_layers_in_bf16)
    if search and not config.recipe_for("rollout").fp8_linears:  # no FP8 linear anywhere: the knobs change nothing
        say("suggestion: the recipe has no FP8 linears; the observed setting stands")
        err = total.token_mult_prob_error
        suggestion = Suggestion(*observed, err, config.target, err <= config.target, 0,
                                [Candidate(*observed, 0.0, err, total.standard_error, total.num_sequences,
                                           total.num_tokens)])
    elif search:
        partial(result(sources, layers, None, "the suggestion search"))
        say(f"suggestion: target {config.target}, at most {config.max_bf16_layers} bf16 layers")

        def measure(first: int, last: int) -> SourceRow:
            if (first, last) == observed:  # already measured: the observed recipe's total
                return total
            return probe.total(first, last)[2]

        def searched(tried: list[Candidate]) -> None:
            best = min(tried, key=lambda c: (c.token_mult_prob_error, c.first + c.last))
            so_far = Suggestion(best.first, best.last, best.token_mult_prob_error, config.target,
                                best.token_mult_prob_error <= config.target, config.max_bf16_layers, tried,
                                [f"the search was stopped after {len(tried)} candidate(s): the best so far"])
            partial(result(sources, layers, so_far, "the suggestion search"))

        suggestion = suggest(layer_scores(layers), measure, target=config.target,
                             max_bf16_layers=config.max_bf16_layers, say=say, on_candidate=searched)
    return result(sources, layers, suggestion, None)
