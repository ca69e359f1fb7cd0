"""What the observatory found, as data: per-source and per-layer rows, the bf16-layer suggestion, and its
rendering (a Markdown table, a JSON file and a PNG of bars) into a report directory.

:meth:`ObservatoryResult.write` is the one writer; :func:`fp8rl.report.write_report` calls it (duck-typed,
so the report package imports nothing from here) and appends the returned Markdown to ``summary.md``.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

__all__ = ["Candidate", "LayerRow", "ObservatoryResult", "SourceRow", "Suggestion"]

FEW_SEQUENCES = 8  # below this many sequences a standard error over sequences is itself unreliable: said so
MARKDOWN = "observatory.md"
JSON = "observatory.json"
PNG = "observatory.png"


def _pm(value: float, se: float) -> str:
    """``value ± se`` (the value alone where the error is unknown)."""
    return f"{value:.6f}" if math.isnan(se) else f"{value:.6f} ± {se:.6f}"


@dataclass(frozen=True)
class SourceRow:
    """One divergence source: ``token_mult_prob_error`` (1.0 = equal) of ``logprobs`` against ``baseline``.

    Attributes:
        name: ``linear``, ``qkv``, ``probs``, ``decode``, ``rollout_numerics``, ``routing`` (mixture-of-experts
            models: the trainer's own routing against the rollout's experts replayed) or ``total``.
        on: whether the observed rollout recipe uses this source (an off source measures max_abs_dlogp 0.0).
        compared: what was compared with what, in words (the table's second column).
        token_mult_prob_error: mean over generated tokens of ``exp(|Δlogp|)``.
        mean_abs_dlogp: mean of ``|Δlogp|`` over the same tokens.
        max_abs_dlogp: the largest ``|Δlogp|`` (:func:`fp8rl.rl.metrics.max_abs_logprob_diff`): 0.0 iff the
            two are bitwise equal, the source's exactness verdict.
        standard_error: of ``token_mult_prob_error``, over sequences
            (:func:`fp8rl.rl.metrics.token_mult_prob_error_stderr`); NaN with fewer than two sequences.
        num_sequences, num_tokens: the sample it was measured on.
    """

    name: str
    on: bool
    compared: str
    token_mult_prob_error: float
    mean_abs_dlogp: float
    max_abs_dlogp: float
    standard_error: float = math.nan
    num_sequences: int = 0
    num_tokens: int = 0


@dataclass(frozen=True)
class LayerRow:
    """Decoder layer ``index`` under FP8 linears (see :mod:`fp8rl.observatory` for how each is measured).

    Attributes:
        index: 0-based layer index.
        in_fp8: whether the observed recipe runs this layer's linears in FP8.
        local_rel_err: ``‖out_fp8 − out_hp‖ / ‖out_hp‖`` of this layer alone on the high-precision input,
            under the observed recipe (exactly 0 for a layer it keeps in bf16).
        cumulative_rel_err: the same ratio of the hidden states after this layer in a whole forward under
            the observed recipe (errors of earlier layers included).
        alone_rel_err: ``local_rel_err`` as if this layer ran FP8 linears (also for layers kept in bf16).
        alone_token_mult_prob_error: mismatch against high precision with only this layer's linears in FP8;
            NaN when not measured.
        alone_standard_error: its standard error over the batch's sequences (NaN when not measured).
    """

    index: int
    in_fp8: bool
    local_rel_err: float
    cumulative_rel_err: float
    alone_rel_err: float
    alone_token_mult_prob_error: float = math.nan
    alone_standard_error: float = math.nan


@dataclass(frozen=True)
class Candidate:
    """One bf16-layer setting tried by the suggestion: its predicted score and its measured mismatch.

    Attributes:
        first, last: ``num_first_layers_in_bf16`` / ``num_last_layers_in_bf16``.
        score: per-layer excess still in FP8 (sum over those layers of ``alone_token_mult_prob_error - 1``,
            or of ``alone_rel_err`` when per-layer logprobs were not measured): the ranking, not a mismatch.
        token_mult_prob_error: rollout-vs-trainer mismatch re-measured with this setting (its own rollout).
        standard_error, num_sequences, num_tokens: its standard error over sequences and the sample measured.
    """

    first: int
    last: int
    score: float
    token_mult_prob_error: float
    standard_error: float = math.nan
    num_sequences: int = 0
    num_tokens: int = 0


@dataclass(frozen=True)
class Suggestion:
    """The smallest ``first + last`` whose measured mismatch is within ``target``, or the best one measured.

    Attributes:
        first, last: the suggested ``num_first_layers_in_bf16`` / ``num_last_layers_in_bf16``.
        token_mult_prob_error: its measured rollout-vs-trainer mismatch.
        target: the bound asked for.
        met: whether ``token_mult_prob_error <= target``; False means the budget ran out and this is the
            lowest mismatch measured.
        max_bf16_layers: the budget (largest ``first + last`` tried).
        candidates: every setting measured, in order.
        warnings: where the sample was too small to separate what the search compared (a candidate within two
            standard errors of the target or of the chosen one).
    """

    first: int
    last: int
    token_mult_prob_error: float
    target: float
    met: bool
    max_bf16_layers: int
    candidates: list[Candidate] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


@dataclass
class ObservatoryResult:
    """Rollout-vs-trainer divergence of one batch, attributed per source and per layer.

    Attributes:
        model: the model's name or path.
        recipe, kv_cache_dtype: the job-level recipe and the rollout's KV cache dtype observed.
        num_first_layers_in_bf16, num_last_layers_in_bf16: the observed recipe's bf16 layers.
        batch_invariant: whether both engines ran batch-invariant numerics.
        num_sequences, num_tokens: rollout rows and generated tokens measured.
        sources: one :class:`SourceRow` per source, then ``rollout_numerics`` and ``total``.
        layers: one :class:`LayerRow` per decoder layer.
        suggestion: the bf16-layer suggestion, or None when not searched.
        seconds: wall time of the whole observation.
        stopped_in: None for a whole observation; else the part it was stopped in (a signal or the time limit)
            — the tables measured before are kept, the rest are empty.
    """

    model: str
    recipe: str
    kv_cache_dtype: str
    num_first_layers_in_bf16: int
    num_last_layers_in_bf16: int
    batch_invariant: bool
    num_sequences: int
    num_tokens: int
    sources: list[SourceRow]
    layers: list[LayerRow]
    suggestion: Suggestion | None = None
    seconds: float = 0.0
    stopped_in: str | None = None

    def source(self, name: str) -> SourceRow:
        """The row of source ``name`` (KeyError naming the known ones otherwise)."""
        for row in self.sources:
            if row.name == name:
                return row
        raise KeyError(f"no source {name!r}; sources: {', '.join(r.name for r in self.sources)}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ObservatoryResult:
        d = dict(d)
        d["sources"] = [SourceRow(**r) for r in d["sources"]]
        d["layers"] = [LayerRow(**r) for r in d["layers"]]
        if d.get("suggestion") is not None:
            s = dict(d["suggestion"])
            s["candidates"] = [Candidate(**c) for c in s["candidates"]]
            d["suggestion"] = Suggestion(**s)
        return cls(**d)

    def to_markdown(self) -> str:
        """The per-source, per-layer and suggestion tables (``observatory.md``, appended to ``summary.md``)."""
        bf16 = f"first {self.num_first_layers_in_bf16} / last {self.num_last_layers_in_bf16} layers in bf16"
        lines = ["## Mismatch observatory", "",
                 f"{self.model}, recipe {self.recipe}, kv_cache_dtype {self.kv_cache_dtype}, {bf16}, "
                 f"batch_invariant {str(self.batch_invariant).lower()}: {self.num_sequences} sequences, "
                 f"{self.num_tokens} generated tokens ({self.seconds:.1f} s). ± is one standard error over "
                 "sequences; n = sequences / generated tokens measured.", ""]
        if self.stopped_in is not None:
            lines += [f"**Partial result: stopped during {self.stopped_in}** (the tables below are what was measured "
                      "before).", ""]
        if self.num_sequences and self.num_sequences < FEW_SEQUENCES:
            lines += [f"Warning: {self.num_sequences} sequences — standard errors over fewer than {FEW_SEQUENCES} "
                      "are themselves rough; more prompts (--prompts, --n) give a steadier reading.", ""]
        lines += ["| source | on | compared | token_mult_prob_error | n | mean abs Δlogp | max abs Δlogp |",
                  "|---|---|---|---|---|---|---|"]
        for r in self.sources:
            lines.append(f"| {r.name} | {'yes' if r.on else 'no'} | {r.compared} | "
                         f"{_pm(r.token_mult_prob_error, r.standard_error)} | {r.num_sequences} / {r.num_tokens} | "
                         f"{r.mean_abs_dlogp:.3e} | {r.max_abs_dlogp:.3e} |")
        lines += ["", "| layer | linears | local rel err | cumulative rel err | rel err if FP8 | "
                  "token_mult_prob_error with only this layer FP8 |", "|---|---|---|---|---|---|"]
        for r in self.layers:
            alone = "n/a" if math.isnan(r.alone_token_mult_prob_error) else _pm(r.alone_token_mult_prob_error,
                                                                                r.alone_standard_error)
            lines.append(f"| {r.index} | {'fp8' if r.in_fp8 else 'bf16'} | {r.local_rel_err:.3e} | "
                         f"{r.cumulative_rel_err:.3e} | {r.alone_rel_err:.3e} | {alone} |")
        s = self.suggestion
        if s is not None:
            lines += ["", "| num_first_layers_in_bf16 | num_last_layers_in_bf16 | score | token_mult_prob_error "
                      "(re-measured) | n | within target |", "|---|---|---|---|---|---|"]
            for c in s.candidates:
                err = _pm(c.token_mult_prob_error, c.standard_error)
                lines.append(f"| {c.first} | {c.last} | {c.score:.3e} | {err} | {c.num_sequences} / {c.num_tokens} | "
                             f"{'yes' if c.token_mult_prob_error <= s.target else 'no'} |")
            how = ("the smallest setting within the target" if s.met else
                   "the search was stopped; the lowest measured so far" if self.stopped_in is not None else
                   f"no setting with at most {s.max_bf16_layers} bf16 layers met the target; the lowest measured")
            lines += ["", f"Suggestion: num_first_layers_in_bf16={s.first}, num_last_layers_in_bf16={s.last} "
                      f"(token_mult_prob_error {s.token_mult_prob_error:.6f}, target {s.target}): {how}."]
            lines += [f"\nWarning: {w}" for w in s.warnings]
        return "\n".join(lines) + "\n"

    def write(self, out_dir: str | Path) -> str:
        """Write ``observatory.md``, ``observatory.json`` and ``observatory.png`` (the PNG only when matplotlib
        is installed) into ``out_dir``; return the Markdown (what a report appends to its summary)."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        md = self.to_markdown()
        try:
            self.plot(out / PNG)
        except ImportError as exc:
            log.warning("observatory: no plot (%s); pip install matplotlib", exc)
            md += "\n- plot skipped: `matplotlib` is not installed (`pip install matplotlib`)\n"
        for name, text in ((MARKDOWN, md), (JSON, json.dumps(self.to_dict(), indent=2))):
            tmp = out / (name + ".tmp")  # replaced whole: a stop mid-write leaves the previous file, never half of one
            tmp.write_text(text)
            os.replace(tmp, out / name)
        return md

    def plot(self, path: str | Path) -> None:
        """Per-source bars (``token_mult_prob_error − 1``) beside per-layer bars (relative errors, and the
        mismatch with only that layer in FP8 when measured). Needs matplotlib (Agg backend)."""
        import matplotlib

        matplotlib.use("Agg")  # files only: never needs a display
        import matplotlib.pyplot as plt

        alone = [r.alone_token_mult_prob_error - 1 for r in self.layers]
        panels = 3 if not all(math.isnan(a) for a in alone) else 2
        fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 3.8))
        ax = axes[0]
        names = [r.name for r in self.sources]
        ax.bar(names, [r.token_mult_prob_error - 1 for r in self.sources],
               color=["tab:blue" if r.on else "tab:gray" for r in self.sources])
        ax.set(title="per source", ylabel="token_mult_prob_error − 1")
        ax.tick_params(axis="x", labelrotation=30, labelsize="small")
        idx = [r.index for r in self.layers]
        ax = axes[1]
        ax.bar([i - 0.2 for i in idx], [r.local_rel_err for r in self.layers], width=0.4, label="local")
        ax.bar([i + 0.2 for i in idx], [r.cumulative_rel_err for r in self.layers], width=0.4, label="cumulative")
        ax.set(title="per layer: hidden-state rel. error", xlabel="layer")
        ax.legend(fontsize="small")
        if panels == 3:
            ax = axes[2]
            ax.bar(idx, alone, color=["tab:red" if r.in_fp8 else "tab:gray" for r in self.layers])
            ax.set(title="only this layer in FP8", xlabel="layer", ylabel="token_mult_prob_error − 1")
        from matplotlib.ticker import MaxNLocator

        for a in axes[1:]:
            a.xaxis.set_major_locator(MaxNLocator(integer=True))  # layer indices
        for a in axes:
            a.grid(alpha=0.3, axis="y")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
