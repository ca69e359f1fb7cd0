"""``python -m fp8rl.export CHECKPOINT --out DIR [--format hf|hf-fp8]`` (also ``fp8rl export ...``).

Exit codes: 0 exported; 2 bad input (a missing or unreadable checkpoint, an unknown format or model, weights
that do not fit the model, a non-empty ``--out`` without ``--force``); 1 anything else; 130 interrupted.
Progress bars go to stderr, one summary line to stdout.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .api import FORMATS, export_checkpoint
from .readers import ExportError

__all__ = ["main"]

EXIT_OK, EXIT_OTHER, EXIT_BAD_INPUT, EXIT_INTERRUPTED = 0, 1, 2, 130


def build_parser(prog: str = "python -m fp8rl.export") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Export a trainer checkpoint (.pt, .dcp, Megatron .pt) or an "
                                "HF directory as a Hugging Face model directory (transformers, vLLM).")
    p.add_argument("checkpoint", metavar="CHECKPOINT", help="a trainer checkpoint file or directory")
    p.add_argument("--out", required=True, metavar="DIR", help="the directory to write (created; must be empty)")
    p.add_argument("--format", dest="fmt", choices=FORMATS, default="hf",
                   help="hf: the master weights in their dtype; hf-fp8: blockwise FP8 (E4M3 + weight_scale_inv per "
                        "128x128 block), the trainer's own FP8 weights; of a LoRA checkpoint both merge the "
                        "adapters into the base; peft: a LoRA checkpoint's adapters as a PEFT adapter directory "
                        "(adapter_config.json + adapter_model.safetensors) (default hf)")
    p.add_argument("--model", default=None, metavar="PRESET_OR_HF_DIR",
                   help="the checkpoint's model: a preset or an HF model directory (tokenizer, chat template, "
                        "config); default the one the checkpoint records")
    p.add_argument("--force", action="store_true", help="replace --out when it holds files")
    p.add_argument("--num-first-layers-in-bf16", type=int, default=None, metavar="N",
                   help="hf-fp8: leading layers kept in high precision (default: the checkpoint's recipe)")
    p.add_argument("--num-last-layers-in-bf16", type=int, default=None, metavar="N",
                   help="hf-fp8: trailing layers kept in high precision (default: the checkpoint's recipe)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


def main(argv: Sequence[str] | None = None, prog: str = "python -m fp8rl.export") -> int:
    """Run the command line; the exit code (module docstring)."""
    try:
        args = build_parser(prog).parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error (2, already printed)
        return int(e.code or 0)
    try:
        res = export_checkpoint(args.checkpoint, args.out, fmt=args.fmt, model=args.model,
                                progress=not args.no_progress, force=args.force,
                                num_first_layers_in_bf16=args.num_first_layers_in_bf16,
                                num_last_layers_in_bf16=args.num_last_layers_in_bf16)
    except (ExportError, ValueError, FileNotFoundError) as e:
        print(f"{prog.split()[-1]}: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return EXIT_INTERRUPTED
    print(f"exported {args.checkpoint} -> {res.out} ({res.fmt}, {res.bytes_written / 1e6:.1f} MB in "
          f"{res.seconds:.1f} s)", flush=True)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
