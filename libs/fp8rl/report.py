"""The report directory of a GRPO run: ``metrics.jsonl``, ``summary.md``, PNG plots and TensorBoard events.

:func:`write_report` takes the per-step dicts of either producer and writes::

    OUT/metrics.jsonl                one flat JSON row per step (the input, normalised)
    OUT/summary.md                   headline table: exact or not (mismatch/max_abs_logprob_diff == 0.0 on
                                     every step), first/last reward and accuracy, mean token_mult_prob_error,
                                     the largest |Δlogprob|, calibrate share of step time, phase means
    OUT/reward.png accuracy.png token_mult_prob_error.png phase_times.png (stacked per phase)
    OUT/validation.png               runs that validated: greedy accuracy, pass@j, mean@k over steps trained
    OUT/expert_load.png             mixture-of-experts models: each layer's expert load (mean over steps)
    OUT/tensorboard/events.out.tfevents.*   every numeric column as a scalar, x = step
    OUT/pictures.md, OUT/pictures/  :func:`write_pictures`: a vision-language run's pictures with its answers
    OUT/observatory.md .json .png    with ``observatory=``: the mismatch observatory's tables and bars
                                     (:mod:`fp8rl.observatory`), its tables also appended to summary.md

Accepted step dicts: the controller's step reports (``{"step", "weight_version", "reward_mean",
"accuracy", "metrics": {...}, "phase_times": {...}}``, as the SDK and Redis hold them) and
:mod:`fp8rl.loop`'s flat rows (``"time/rollout"``, ... ``"time/step"``). Both become one flat row
with ``time/<phase>`` and ``time/total`` columns.

Plots need ``matplotlib`` (Agg backend, no display) and events need ``tensorboard`` (written with
``torch.utils.tensorboard.SummaryWriter``); when one is missing that part is skipped and
``summary.md`` says so. NaN values (e.g. a step recovered without its rollout data) are left out of
means and plots.

``python -m fp8rl.report METRICS.jsonl OUT_DIR`` rebuilds a report from a metrics file.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger(__name__)

__all__ = ["PHASES", "flatten_step", "summarize", "tensorboard_writer", "write_pictures", "write_report", "main"]

# fp8rl.rl.metrics.MAX_ABS_LOGPROB_DIFF, spelled here: the report reads rows and imports only fp8rl.limits
MAX_ABS_LOGPROB_DIFF = "mismatch/max_abs_logprob_diff"
PHASES = ("rollout", "reward", "logprobs", "train", "publish", "calibrate", "refit")
_PLOTS = (("reward_mean", "reward.png", "mean reward"), ("accuracy", "accuracy.png", "accuracy"),
          ("token_mult_prob_error", "token_mult_prob_error.png", "token_mult_prob_error (1.0 = identical)"))


class ReportSection(Protocol):
    """Something a report carries beside the steps (e.g. :class:`fp8rl.observatory.ObservatoryResult`): it writes
    its own files into the report directory and returns the Markdown that ``summary.md`` appends."""

    def write(self, out_dir: str | Path) -> str: ...


def flatten_step(step: Mapping[str, Any]) -> dict[str, Any]:
    """One flat row from a controller step report or a :mod:`fp8rl.loop` row (see the module docstring)."""
    row = {k: v for k, v in step.items() if k not in ("metrics", "phase_times")}
    row.update(step.get("metrics") or {})
    for phase, seconds in (step.get("phase_times") or {}).items():
        row[f"time/{phase}"] = seconds
    if "time/total" not in row and "time/step" in row:  # fp8rl.loop names the whole step "time/step"
        row["time/total"] = row.pop("time/step")
    return row


def _finite(values: Iterable[Any]) -> list[float]:
    return [float(v) for v in values if isinstance(v, int | float) and math.isfinite(v)]


def _numbers(values: Iterable[Any]) -> list[float]:
    """The numbers among ``values``, NaN included (a NaN max |Δlogprob| is a broken step, never an exact one)."""
    return [float(v) for v in values if isinstance(v, int | float) and not isinstance(v, bool)]


def _mean(rows: list[dict], key: str) -> float:
    vals = _finite(r.get(key) for r in rows)
    return statistics.fmean(vals) if vals else math.nan


def summarize(rows: list[dict]) -> dict[str, float]:
    """Headline numbers of flat rows: reward and accuracy over the first/last k steps, means, shares.

    Single steps are noisy (a few dozen prompts each), so "first" and "last" are means over
    ``k = clamp(steps // 3, 1, 5)`` steps at each end.
    """
    done = [r for r in rows if math.isfinite(r.get("reward_mean", math.nan))]
    k = max(1, min(5, len(done) // 3))
    head, tail = done[:k], done[-k:]
    total = sum(_finite(r.get("time/total") for r in rows))
    errs = _finite(r.get("token_mult_prob_error") for r in rows)
    own = [r for r in rows if r.get("stale_fraction", 0.0) < 1.0]  # steps with rows of the trainer's own version
    numeric = _finite(r.get("numeric/token_mult_prob_error", r.get("token_mult_prob_error")) for r in own)
    # exactness is bitwise: the largest |train - rollout| logprob on the raw values (fp8rl.rl.metrics, issue 47),
    # not token_mult_prob_error == 1.0, which FP32 exp rounds to 1 for |Δ| below ~6e-8
    diffs = _numbers(r.get(f"numeric/{MAX_ABS_LOGPROB_DIFF}", r.get(MAX_ABS_LOGPROB_DIFF)) for r in own)
    out = {
        "steps": float(len(rows)), "window": float(k),
        "reward_first": _mean(head, "reward_mean"), "reward_last": _mean(tail, "reward_mean"),
        "accuracy_first": _mean(head, "accuracy"), "accuracy_last": _mean(tail, "accuracy"),
        "token_mult_prob_error_mean": _mean(rows, "token_mult_prob_error"),
        "token_mult_prob_error_median": statistics.median(errs) if errs else math.nan,
        "calibrate_share": sum(_finite(r.get("time/calibrate") for r in rows)) / total if total > 0 else math.nan,
        # steps whose trainer logprobs were bitwise the rollout's on the rows of the trainer's own version
        # (asynchronous GRPO: older-version rows differ by their weights, not by numerics; a step with only those
        # measures no numerics)
        "exact_steps": float(sum(d == 0.0 for d in diffs)), "measured_steps": float(len(diffs)),
        "stale_only_steps": float(sum(r.get("stale_fraction", 0.0) >= 1.0 for r in rows)),
        "token_mult_prob_error_max": max(numeric) if numeric else math.nan,
        "max_abs_logprob_diff_max": (math.nan if not diffs or any(math.isnan(d) for d in diffs) else max(diffs)),
        "step_seconds_mean": _mean(rows, "time/total"),
    }
    out.update({f"phase_seconds/{p}": _mean(rows, f"time/{p}") for p in PHASES})
    for key in ("moe/router_agreement", "moe/unreplayed/token_mult_prob_error", "moe/load_max_over_mean",
                "moe/aux_loss"):  # mixture-of-experts models only (NaN otherwise)
        out[key] = _mean(rows, key)
    out["entropy_first"], out["entropy_last"] = _mean(head, "train/entropy"), _mean(tail, "train/entropy")
    for key in ("dynamic_sampling/rounds", "dynamic_sampling/groups_dropped", "dynamic_sampling/filled",
                "overlong/truncated_fraction", "overlong/filtered_samples", "data/dropped_prompts/train",
                "data/dropped_prompts/validation"):
        out[key] = _mean(rows, key)
    for key in sorted({k for r in rows for k in r if k.startswith("memory/peak_rss_gb")}):  # per phase, and overall
        peaks = [r[key] for r in rows if _finite([r.get(key)])]
        if peaks:
            out[key] = max(peaks)
    for key in sorted({k for r in rows for k in r if k == "val_accuracy" or k.startswith("val/")}, key=_val_order):
        start = (rows[0].get("validation_start") or {}).get(key) if rows else None  # before training (the loop)
        vals = [v for v in [start, *(r.get(key) for r in rows)] if _finite([v])]
        if vals:
            out[f"{key}:first"], out[f"{key}:last"] = vals[0], vals[-1]
    return out


def _val_order(key: str) -> tuple[int, int]:
    """val_accuracy, then val/pass@1, @2, ..., then val/mean@k."""
    if key == "val_accuracy":
        return (0, 0)
    kind, _, j = key[4:].partition("@")
    return (1 if kind == "pass" else 2, int(j) if j.isdigit() else 0)


def _fmt(x: float, spec: str = ".4f", unit: str = "") -> str:
    return "n/a" if not math.isfinite(x) else format(x, spec) + unit


def _exactness(s: dict[str, float]) -> str:
    """One line: did the trainer recompute the rollout's logprobs bitwise on every step?"""
    n, exact, stale = int(s["measured_steps"]), int(s["exact_steps"]), int(s.get("stale_only_steps", 0))
    also = (f"; {stale} steps trained only on rows of older versions, which differ by their weights "
            "(asynchronous GRPO: stale/* metrics)") if stale else ""
    if n == 0:
        return f"no step measured the train/rollout numerics ({MAX_ABS_LOGPROB_DIFF}){also}"
    if exact == n:
        return (f"**exact**: the trainer's logprobs were bitwise the rollout's on all {n} steps with rows of its own "
                f"version (max |Δlogprob| 0){also}")
    return (f"**not exact**: trainer and rollout logprobs of the same version differed on {n - exact} of {n} steps "
            f"(max |Δlogprob| up to {_fmt(s['max_abs_logprob_diff_max'], '.3e')}, token_mult_prob_error up to "
            f"{s['token_mult_prob_error_max']:.6f}){also}")


def _summary_md(s: dict[str, float], title: str, notes: list[str], facts: Sequence[tuple[str, str]] = ()) -> str:
    lines = [f"# {title}", "", f"{int(s['steps'])} steps.", "", "| metric | value |", "|---|---|",
             f"| train/rollout numerics | {_exactness(s)} |", *[f"| {k} | {v} |" for k, v in facts],
             f"| reward (first → last {int(s['window'])} steps) | {_fmt(s['reward_first'], '.3f')} → "
             f"{_fmt(s['reward_last'], '.3f')} |",
             f"| accuracy (first → last {int(s['window'])} steps) | {_fmt(s['accuracy_first'], '.3f')} → "
             f"{_fmt(s['accuracy_last'], '.3f')} |",
             f"| token_mult_prob_error median / mean over steps | "
             f"{_fmt(s['token_mult_prob_error_median'], '.6f')} / {_fmt(s['token_mult_prob_error_mean'], '.6f')} |",
             f"| max abs Δlogprob over steps (0 = bitwise) | {_fmt(s['max_abs_logprob_diff_max'], '.3e')} |",
             f"| calibrate share of step time (on the step's critical path) | "
             f"{_fmt(100 * s['calibrate_share'], '.2f', ' %')} (target ≤ 1 %) |",
             f"| mean step time | {_fmt(s['step_seconds_mean'], '.2f', ' s')} |",
             "", "| phase | mean seconds | share of step |", "|---|---|---|"]
    for p in PHASES:
        sec, total = s[f"phase_seconds/{p}"], s["step_seconds_mean"]
        share = 100 * sec / total if math.isfinite(sec) and total and math.isfinite(total) else math.nan
        lines.append(f"| {p} | {_fmt(sec, '.3f')} | {_fmt(share, '.1f', ' %')} |")
    lines += _extra_rows(s)
    if math.isfinite(s.get("moe/load_max_over_mean", math.nan)):  # a mixture-of-experts model
        lines += ["", "| mixture of experts (mean over steps) | value |", "|---|---|"]
        for key, label in (("moe/router_agreement", "router agreement (trainer's own top-k = the rollout's)"),
                           ("moe/unreplayed/token_mult_prob_error", "token_mult_prob_error without replay"),
                           ("moe/load_max_over_mean", "expert load, busiest / mean (worst layer)"),
                           ("moe/aux_loss", "load-balancing loss")):
            if math.isfinite(s.get(key, math.nan)):
                lines.append(f"| {label} | {_fmt(s[key], '.4f')} |")
        lines.append("")
        lines.append("Expert load per layer: `expert_load.png`.")
    if notes:
        lines += ["", *[f"- {n}" for n in notes]]
    return "\n".join(lines) + "\n"


def _extra_rows(s: dict[str, float]) -> list[str]:
    """summary.md tables of what only some runs have: validation (first → last), entropy, DAPO's counts."""
    lines = []
    vals = [k[:-len(":first")] for k in s if k.endswith(":first")]
    if vals:
        lines += ["", "| validation (first → last) | value |", "|---|---|"]
        for key in vals:
            label = "greedy accuracy" if key == "val_accuracy" else key[4:]
            lines.append(f"| {label} | {_fmt(s[f'{key}:first'], '.3f')} → {_fmt(s[f'{key}:last'], '.3f')} |")
        lines += ["", "Validation over steps: `validation.png`."]
    phases = sorted((k for k in s if k.startswith("memory/peak_rss_gb/")), key=lambda k: -s[k])
    if phases:  # fp8rl.memory: the step's phases, largest first
        lines += ["", "| peak resident memory (max over steps) | GB |", "|---|---|",
                  f"| any phase | {_fmt(s.get('memory/peak_rss_gb', math.nan), '.2f')} |"]
        lines += [f"| {k.rsplit('/', 1)[1]} | {_fmt(s[k], '.2f')} |" for k in phases]
    rows = []
    if math.isfinite(s.get("entropy_first", math.nan)):
        rows.append(f"| policy entropy (first → last {int(s['window'])} steps) | {_fmt(s['entropy_first'])} → "
                    f"{_fmt(s['entropy_last'])} |")
    for key, label in (("dynamic_sampling/rounds", "dynamic sampling: generation rounds per step (mean)"),
                       ("dynamic_sampling/groups_dropped", "dynamic sampling: groups dropped per step (mean)"),
                       ("dynamic_sampling/filled", "dynamic sampling: share of steps filled"),
                       ("overlong/truncated_fraction", "truncated responses (share, mean over steps)"),
                       ("overlong/filtered_samples", "overlong filtering: samples left out per step (mean)")):
        if math.isfinite(s.get(key, math.nan)):
            rows.append(f"| {label} | {_fmt(s[key], '.3f')} |")
    train, val = s.get("data/dropped_prompts/train", math.nan), s.get("data/dropped_prompts/validation", math.nan)
    if math.isfinite(train) and (train or val):
        rows.append(f"| prompts dropped by data.max_prompt_tokens | train {train:.0f}, validation {val:.0f} |")
    if rows:
        lines += ["", "| training signal | value |", "|---|---|", *rows]
    return lines


def _expert_load(rows: list[dict]) -> list[list[float]] | None:
    """The mean share of each (layer, expert) over the steps (``moe/load/{layer}/{expert}`` metrics), or None."""
    cells: dict[tuple[int, int], list[float]] = {}
    for r in rows:
        for key, v in r.items():
            if key.startswith("moe/load/") and _finite([v]):
                layer, expert = (int(x) for x in key.split("/")[2:4])
                cells.setdefault((layer, expert), []).append(float(v))
    if not cells:
        return None
    n_l, n_e = max(k[0] for k in cells) + 1, max(k[1] for k in cells) + 1
    return [[sum(cells.get((i, e), [0.0])) / max(1, len(cells.get((i, e), []))) for e in range(n_e)]
            for i in range(n_l)]


def _plots(rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: never needs a display
    import matplotlib.pyplot as plt

    for key, name, label in _PLOTS:
        pts = [(r["step"], r[key]) for r in rows if _finite([r.get(key)])]
        fig, ax = plt.subplots(figsize=(6, 3.5))
        if pts:
            ax.plot(*zip(*pts, strict=True), marker="o", markersize=3)
        ax.set(xlabel="step", ylabel=label, title=label)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / name, dpi=100)
        plt.close(fig)
    _validation_plot(rows, out, plt)
    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [r["step"] for r in rows]
    bottom = [0.0] * len(rows)
    for p in PHASES:
        vals = [v if math.isfinite(v) else 0.0 for v in (float(r.get(f"time/{p}", 0.0) or 0.0) for r in rows)]
        ax.bar(steps, vals, bottom=bottom, label=p, width=0.85)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax.set(xlabel="step", ylabel="seconds", title="time per phase")
    ax.legend(fontsize="small", ncol=4)
    fig.tight_layout()
    fig.savefig(out / "phase_times.png", dpi=100)
    plt.close(fig)
    load = _expert_load(rows)
    if load is not None:  # a mixture-of-experts model: which experts take the tokens, layer by layer
        fig, ax = plt.subplots(figsize=(max(4, 0.5 * len(load[0]) + 2), max(2.5, 0.45 * len(load) + 1.5)))
        im = ax.imshow(load, aspect="auto", cmap="viridis")
        ax.set(xlabel="expert", ylabel="mixture-of-experts layer", title="share of routed tokens (mean over steps)",
               xticks=range(len(load[0])), yticks=range(len(load)))
        fig.colorbar(im, ax=ax)
        fig.tight_layout()
        fig.savefig(out / "expert_load.png", dpi=100)
        plt.close(fig)


def _validation_plot(rows: list[dict], out: Path, plt) -> None:
    """validation.png: greedy accuracy, pass@j and mean@k against steps trained (a row's validation measured the
    version its step made: x = step + 1; a ``validation_start`` row field, x = 0)."""
    keys = sorted({k for r in rows for k in r if k == "val_accuracy" or k.startswith("val/")}, key=_val_order)
    if not keys:
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for key in keys:
        pts = [(0, r["validation_start"][key]) for r in rows[:1] if _finite([(r.get("validation_start") or {})
                                                                               .get(key)])]
        pts += [(r["step"] + 1, r[key]) for r in rows if _finite([r.get(key)])]
        ax.plot(*zip(*pts, strict=True), marker="o", markersize=3,
                label="greedy accuracy" if key == "val_accuracy" else key[4:])
    ax.set(xlabel="steps trained", ylabel="share of problems", title="validation", ylim=(-0.02, 1.02))
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(out / "validation.png", dpi=100)
    plt.close(fig)


def tensorboard_writer(out: str | Path):
    """A TensorBoard writer into ``out/tensorboard``, or None (with a warning) where `tensorboard` is not installed
    (the loop's run directory streams each step's row through it: :mod:`fp8rl.rundir`)."""
    try:
        from torch.utils.tensorboard import SummaryWriter  # needs the `tensorboard` package
    except ImportError as exc:
        log.warning("report: no TensorBoard events (%s); pip install tensorboard", exc)
        return None
    return SummaryWriter(log_dir=str(Path(out) / "tensorboard"))


def _tensorboard(rows: list[dict], out: Path) -> None:
    from torch.utils.tensorboard import SummaryWriter  # needs the `tensorboard` package

    writer = SummaryWriter(log_dir=str(out / "tensorboard"))
    try:
        for r in rows:
            for key, value in r.items():
                if key != "step" and _finite([value]):
                    writer.add_scalar(key, float(value), global_step=int(r["step"]))
    finally:
        writer.close()


def write_report(steps: Iterable[Mapping[str, Any]], out_dir: str | Path, *, title: str = "GRPO run",
                 observatory: ReportSection | None = None, facts: Sequence[tuple[str, str]] = (),
                 tensorboard: bool = True) -> Path:
    """Write the report directory of ``steps`` (see the module docstring) into ``out_dir``; returns it.

    ``tensorboard=False``: no TensorBoard events (the caller streamed them as the steps ended).

    ``facts`` are ``(label, value)`` rows of the run's set-up printed under the exactness line (the job's
    numerics and where its calibration ran: :func:`job_facts`).

    ``python -m fp8rl.loop --out DIR`` can call ``write_report(result["steps"], DIR)``; ``observatory`` (the
    loop's ``auto_bf16_layers`` measurement) adds its files and appends its tables to ``summary.md``.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = [flatten_step(s) for s in steps]
    for i, r in enumerate(rows):
        r.setdefault("step", i)
    with open(out / "metrics.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    notes = []
    writers = [("plots", _plots, "matplotlib")] + ([("TensorBoard events", _tensorboard, "tensorboard")]
                                                   if tensorboard else [])
    for what, fn, package in writers:
        try:
            fn(rows, out)
        except ImportError as exc:
            log.warning("report: no %s (%s); pip install %s", what, exc, package)
            notes.append(f"{what} skipped: `{package}` is not installed (`pip install {package}`)")
    summary = _summary_md(summarize(rows), title, notes, facts)
    if observatory is not None:
        summary += "\n" + observatory.write(out)
    (out / "summary.md").write_text(summary)
    return out


def job_facts(job, *, in_process: bool = False) -> list[tuple[str, str]]:
    """The report's set-up rows of a :class:`fp8rl.config.JobConfig`: numerics mode, calibration site, activation
    checkpointing (the share each step recomputed is ``train/recomputed`` in the metrics)."""
    on, why = job.batch_invariance
    facts = [("batch-invariant numerics", why)]
    t = job.policy.training
    if t.backend == "torch":
        ckpt = t.activation_checkpointing
        facts.append(("activation checkpointing", "auto: on one trainer process, micro-batches whose saved "
                      "activations would pass a quarter of the trainer's floor and 1 GiB recompute their layers "
                      "(train/recomputed)" if ckpt is None
                      else f"{'on' if ckpt else 'off'}: policy.training.activation_checkpointing={str(ckpt).lower()}"))
    if job.kv_cache_dtype == "fp8":
        where = job.calibration_site[1]
        if in_process and job.calibration_site[0] != "logprobs":
            where = "the trainer's weights, right after each optimizer step (in-process loop)"
        facts.append(("QKV scale calibration", where))
    return facts


def write_pictures(out: Path, items: Sequence[tuple[Sequence[bytes], str, str, str, bool]]) -> None:
    """``out/pictures.md`` and the pictures beside it (``out/pictures/``): per item — ``(image files, prompt,
    reference answer, sampled answer, graded right)`` — its pictures, then its prompt and answers."""
    pictures = out / "pictures"
    pictures.mkdir(parents=True, exist_ok=True)
    lines = ["# Pictures of the last generation", "", "Each picture as the policy saw it, with the answer it sampled.",
             ""]
    for i, (images, prompt, reference, sampled, right) in enumerate(items):
        for j, data in enumerate(images):
            (pictures / f"{i}-{j}.png").write_bytes(data)
            lines.append(f"![picture {i}-{j}](pictures/{i}-{j}.png)")
        lines += ["", f"prompt `{prompt!r}` · reference `{reference}` · sampled `{sampled!r}` · "
                      f"{'right' if right else 'wrong'}", ""]
    (out / "pictures.md").write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fp8rl.report", description="Write a GRPO report directory.")
    ap.add_argument("metrics", help="metrics.jsonl (one step per line: a step report or an fp8rl.loop row)")
    ap.add_argument("out", help="report directory to write")
    ap.add_argument("--title", default="GRPO run")
    args = ap.parse_args(argv)
    steps = [json.loads(line) for line in Path(args.metrics).read_text().splitlines() if line.strip()]
    print(write_report(steps, args.out, title=args.title))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
