"""The ``fastft`` command: ``fastft train`` and ``fastft doctor``."""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import fields

from fastft import __version__


def _train_parser(sub: argparse._SubParsersAction) -> None:
    from fastft.train import TrainOptions

    defaults = {field.name: field.default for field in fields(TrainOptions) if field.name != "output"}
    parser = sub.add_parser(
        "train",
        help="LoRA / QLoRA fine-tune a model with trl's SFTTrainer",
        description="Fine-tune with LoRA (or QLoRA with --load-in-4bit). Writes the adapter, metrics.json and "
        "loss.png into --output; checkpoints every --save-steps steps so --resume can continue a killed run.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--output", required=True, help="output folder")
    parser.add_argument("--model", help="hub id, local folder, or 'smollm2-135m' (embedded)")
    parser.add_argument("--data", help="JSONL/JSON/CSV/Parquet/TXT file or dataset folder; default: shipped demo")
    parser.add_argument("--max-steps", type=int, help="optimizer steps (<= 0: run --epochs instead)")
    parser.add_argument("--epochs", type=float, help="epochs, when --max-steps <= 0")
    parser.add_argument("--lr", type=float, help="peak learning rate")
    parser.add_argument("--r", type=int, help="LoRA rank")
    parser.add_argument("--lora-alpha", type=int, help="LoRA alpha")
    parser.add_argument("--lora-dropout", type=float, help="LoRA dropout")
    parser.add_argument("--seq-len", type=int, help="max sequence length (tokens)")
    parser.add_argument("--batch-size", type=int, help="examples per device per step")
    parser.add_argument("--grad-accum", type=int, help="gradient accumulation steps")
    parser.add_argument("--load-in-4bit", action="store_true", help="QLoRA: NF4 4-bit base weights")
    parser.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], help="default: bf16/fp16 GPU, fp32 CPU")
    parser.add_argument(
        "--gradient-checkpointing", choices=["offload", "unsloth", "true", "false"], help="checkpointing mode"
    )
    parser.add_argument("--warmup-steps", type=int, help="linear warm-up steps")
    parser.add_argument("--save-steps", type=int, help="checkpoint every N steps")
    parser.add_argument("--seed", type=int, help="random seed")
    parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --output")
    parser.add_argument("--overwrite", action="store_true", help="start again even if --output has checkpoints")
    parser.set_defaults(**defaults, command="train")


def _train(args: argparse.Namespace) -> int:
    from fastft.train import TrainOptions, run

    values = {field.name: getattr(args, field.name) for field in fields(TrainOptions)}
    flag = values["gradient_checkpointing"]
    values["gradient_checkpointing"] = {"true": True, "false": False}.get(flag, flag)
    try:
        metrics = run(TrainOptions(**values))
    except (FileNotFoundError, FileExistsError) as error:
        # Bad paths are the user's to fix; a traceback would only bury the message.
        print(f"error: {error}", file=sys.stderr)
        return 2
    if not metrics["completed"]:
        print(
            f"fastft train: stopped at step {metrics['global_step']}; checkpoint saved. "
            f"Continue with the same command plus --resume.",
            file=sys.stderr,
        )
        return 130
    print(
        f"fastft train: {metrics['global_step']} steps, loss {metrics['first_loss']:.4f} -> "
        f"{metrics['last_loss']:.4f}; adapter, metrics.json and loss.png in {args.output}"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``fastft`` console script."""
    parser = argparse.ArgumentParser(prog="fastft", description="fastft: fast LoRA / QLoRA fine-tuning.")
    parser.add_argument("--version", action="version", version=f"fastft {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _train_parser(sub)
    sub.add_parser("doctor", help="show versions, device and the patch report")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "train":
        return _train(args)
    from fastft.doctor import report

    print(report())
    return 0


if __name__ == "__main__":
    sys.exit(main())
