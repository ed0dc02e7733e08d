"""The ``fastft`` command: ``fastft train``, ``fastft export``, ``fastft bench`` and ``fastft doctor``."""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import fields
from pathlib import Path

from fastft._version import __version__


def _train_parser(sub: argparse._SubParsersAction) -> None:
    # The light module: --help and --version must not wait for transformers, peft, trl and datasets to import.
    from fastft.training.options import METHODS, TrainOptions

    defaults = {field.name: field.default for field in fields(TrainOptions) if field.name != "output"}
    parser = sub.add_parser(
        "train",
        help="LoRA / QLoRA fine-tune a model with trl's SFT, DPO, KTO or GRPO trainer",
        description="Fine-tune with LoRA (or QLoRA with --load-in-4bit): supervised (--method sft), or from "
        "preferences (dpo: prompt/chosen/rejected rows; kto: prompt/completion/label rows, or paired ones) or "
        "rewards (grpo: prompt/answer rows, reward 1.0 when a completion states the answer). Writes the adapter, "
        "metrics.json and loss.png into --output; checkpoints every --save-steps steps so --resume can continue a "
        "killed run.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--output", required=True, help="output folder")
    parser.add_argument("--model", help="hub id, local folder, or 'smollm2-135m' (embedded)")
    parser.add_argument(
        "--tokenizer", help="hub id or folder of the tokenizer, when the --model folder has none (default: --model's)"
    )
    parser.add_argument("--method", choices=METHODS, help="trl trainer: SFT, DPO, KTO or GRPO")
    parser.add_argument(
        "--data",
        help="JSONL/JSON/CSV/Parquet/TXT file or dataset folder; default: shipped demo (instructions for sft, "
        "the preference split for dpo/kto/grpo; for a vision-language --model, the built-in shapes set). A "
        "vision-language model trains on 'messages' chats with {'type': 'image', 'image': 'path.png'} parts (paths "
        "relative to the file) or an 'images' column",
    )
    parser.add_argument("--max-steps", type=int, help="optimizer steps (<= 0: run --epochs instead)")
    parser.add_argument("--epochs", type=float, help="epochs, when --max-steps <= 0")
    parser.add_argument("--lr", type=float, help="peak learning rate")
    # --lora-r also works after torchrun, whose own option parser reads a bare --r as an abbreviation of its options.
    parser.add_argument("--r", "--lora-r", dest="r", type=int, help="LoRA rank")
    parser.add_argument("--lora-alpha", type=int, help="LoRA alpha")
    parser.add_argument("--lora-dropout", type=float, help="LoRA dropout")
    parser.add_argument("--seq-len", type=int, help="max sequence length (tokens)")
    parser.add_argument("--batch-size", type=int, help="examples per device per step")
    parser.add_argument("--grad-accum", type=int, help="gradient accumulation steps")
    parser.add_argument("--load-in-4bit", action="store_true", help="QLoRA: NF4 4-bit base weights")
    parser.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], help="default: bf16/fp16 GPU, fp32 CPU")
    parser.add_argument(
        "--gradient-checkpointing",
        choices=["offload", "unsloth", "sqrt", "sqrt-offload", "true", "false"],
        help="checkpointing mode",
    )
    parser.add_argument(
        "--compile", action="store_true", help="regional torch.compile of the decoder layers (time reported)"
    )
    parser.add_argument("--warmup-steps", type=int, help="linear warm-up steps")
    parser.add_argument("--save-steps", type=int, help="checkpoint every N steps")
    parser.add_argument("--seed", type=int, help="random seed")
    parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --output")
    parser.add_argument("--overwrite", action="store_true", help="start again even if --output has checkpoints")
    parser.add_argument("--beta", type=float, help="dpo/kto: how far from the reference model (higher: less far)")
    parser.add_argument("--num-generations", type=int, help="grpo: completions per prompt (>= 2)")
    parser.add_argument("--max-completion-length", type=int, help="grpo: longest generated completion (tokens)")
    parser.set_defaults(**defaults, command="train")


def _train(args: argparse.Namespace) -> int:
    from fastft.loading.distributed import is_main_process
    from fastft.loading.sources import HubFetchError
    from fastft.training.data import DataError
    from fastft.training.train import OptionsError, TrainOptions, run

    values = {field.name: getattr(args, field.name) for field in fields(TrainOptions)}
    flag = values["gradient_checkpointing"]
    values["gradient_checkpointing"] = {"true": True, "false": False}.get(flag, flag)
    try:
        metrics = run(TrainOptions(**values))
    except (FileNotFoundError, FileExistsError, DataError, OptionsError, HubFetchError) as error:
        # Bad paths, data and settings are the user's to fix; a traceback would only bury the message.
        print(f"error: {error}", file=sys.stderr)
        return 2
    if not is_main_process():
        return 0 if metrics["completed"] else 130
    if metrics.get("already_finished"):
        print(
            f"fastft train: {args.output} already finished its {metrics['global_step']} steps; nothing trained. "
            "Pass a larger --max-steps to train further, or --overwrite to start again."
        )
        return 0
    if not metrics["completed"]:
        print(
            f"fastft train: stopped at step {metrics['global_step']}; checkpoint saved. "
            f"Continue with the same command plus --resume.",
            file=sys.stderr,
        )
        return 130
    watched = metrics.get("watched")
    moved = ""
    if watched:
        moved = f", {watched['metric']} {watched['head_mean']:.4f} -> {watched['tail_mean']:.4f} (first / last fifth)"
    compiled = "" if metrics.get("compile_s") is None else f", {metrics['compile_s']:.1f} s of it compiling"
    print(
        f"fastft train: {metrics['global_step']} steps in {metrics['this_session_s']:.1f} s{compiled}, loss "
        f"{metrics['first_loss']:.4f} -> {metrics['last_loss']:.4f}{moved}; adapter, metrics.json and loss.png in "
        f"{args.output}"
    )
    return 0


def _export_parser(sub: argparse._SubParsersAction) -> None:
    # gguf_export's QUANTIZATIONS are these names; gguf_mixtures imports none of the training stack (--help).
    from fastft.export.gguf_mixtures import FILE_TYPES as QUANTIZATIONS

    parser = sub.add_parser(
        "export",
        help="merge a LoRA adapter into its base: a plain transformers folder and/or a GGUF file",
        description="Load the base model an adapter names (adapter_config.json's base_model_name_or_path), merge the "
        "adapter into it and write a plain transformers folder (--merged: safetensors shards, streamed one block "
        "of rows at a time, all-or-nothing) and/or one GGUF file for llama.cpp / Ollama (--gguf). The model in the "
        "adapter folder is left as it is.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--adapter", required=True, help="the adapter folder `fastft train --output` wrote")
    parser.add_argument("--merged", type=Path, help="output folder for the merged transformers model")
    parser.add_argument("--gguf", type=Path, help="output .gguf file (or a folder: the name is derived)")
    parser.add_argument("--ollama", type=Path, help="output folder for a GGUF plus an Ollama Modelfile (chat template)")
    parser.add_argument("--dtype", choices=["float16", "bfloat16", "float32"], default="float16", help="--merged dtype")
    parser.add_argument("--quantization", choices=list(QUANTIZATIONS), default="f16", help="--gguf tensor type")
    parser.add_argument("--max-shard-size", default="5GB", help="--merged: largest shard, e.g. 5GB or 500MB")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty --merged folder")
    parser.add_argument(
        "--load-in-4bit",
        action="store_true",
        help="merge into the NF4-quantised base (dequantised per projection), as a QLoRA run trained on, instead of "
        "the full-precision base",
    )


def _export(args: argparse.Namespace) -> int:
    import json

    from fastft.export.merged_save import check_target
    from fastft.export.shards import parse_shard_size

    adapter = Path(args.adapter).expanduser()
    try:
        if args.merged is None and args.gguf is None and args.ollama is None:
            raise ValueError(
                "fastft export: nothing to write; pass --merged DIR, --gguf FILE, or both (and/or --ollama DIR)."
            )
        if not (adapter / "adapter_config.json").is_file():
            found = "does not exist" if not adapter.exists() else "has no adapter_config.json"
            raise FileNotFoundError(
                f"fastft export: --adapter {adapter} {found}; pass the folder `fastft train --output` wrote (it holds "
                "adapter_config.json and adapter_model.safetensors)."
            )
        base = json.loads((adapter / "adapter_config.json").read_text()).get("base_model_name_or_path")
        if not base:
            raise ValueError(f"fastft export: {adapter}/adapter_config.json names no base_model_name_or_path.")
        try:
            parse_shard_size(args.max_shard_size, where="fastft export")
        except ValueError as error:
            # The library's message names the Python argument; the user typed the flag.
            raise ValueError(
                f"fastft export: --max-shard-size {args.max_shard_size!r} is not a positive size; pass a size such "
                "as 5GB, 500MB or 2GiB, or a number of bytes."
            ) from error
        if args.merged is not None:
            check_target(
                args.merged.expanduser(), args.overwrite, where="fastft export --merged", overwrite_name="--overwrite"
            )
        if args.gguf is not None and args.gguf.suffix.lower() == ".gguf" and args.gguf.is_dir():
            raise FileExistsError(f"fastft export: --gguf {args.gguf} is a folder; pass a .gguf file name.")
        if args.gguf is not None:
            folder = args.gguf.expanduser() if args.gguf.suffix.lower() != ".gguf" else args.gguf.expanduser().parent
            if (folder / "adapter_config.json").is_file():
                # transformers' from_pretrained(folder, gguf_file=...) follows adapter_config.json to the base model
                # and looks for the GGUF there, so a GGUF beside an adapter cannot be reloaded.
                raise ValueError(
                    f"fastft export: --gguf {args.gguf} would go into the adapter folder {folder}, from which "
                    "transformers cannot reload it (it follows adapter_config.json to the base model); pass a path "
                    f"in a folder of its own, e.g. --gguf {folder.name}-gguf/model.gguf."
                )
    except (FileNotFoundError, FileExistsError, ValueError) as error:
        # Checked before the base model loads, so a typo costs seconds, not a model load.
        print(f"error: {error}", file=sys.stderr)
        return 2

    from fastft import FastModel
    from fastft.loading.sources import HubFetchError

    logging.getLogger("fastft").info("fastft export: loading %s with the adapter %s", base, adapter)
    written = []
    try:
        model, tokenizer = FastModel.from_pretrained(str(adapter), load_in_4bit=args.load_in_4bit)
        if args.merged is not None:
            folder = FastModel.save_merged(
                model,
                tokenizer,
                args.merged,
                dtype=args.dtype,
                max_shard_size=args.max_shard_size,
                overwrite=args.overwrite,
            )
            written.append(f"{folder} (transformers, {args.dtype})")
        if args.gguf is not None:
            file = FastModel.save_gguf(model, tokenizer, args.gguf, quantization=args.quantization)
            written.append(f"{file} (GGUF, {args.quantization})")
        if args.ollama is not None:
            file, modelfile = FastModel.save_ollama(model, tokenizer, args.ollama, quantization=args.quantization)
            written.append(f"{file} (GGUF, {args.quantization}) with {modelfile} (ollama create NAME -f {modelfile})")
    except (FileNotFoundError, FileExistsError, NotImplementedError, ValueError, HubFetchError) as error:
        # A missing base, a model GGUF cannot hold, diverged weights: the message says what to do.
        print(f"error: {error}", file=sys.stderr)
        return 2
    print("fastft export: wrote " + " and ".join(written))
    return 0


def _bench_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "bench",
        help="benchmark fastft against transformers + peft, Liger-Kernel and Unsloth",
        description="One LoRA training step per system, one process per measurement, systems alternated; prints "
        "the table and writes JSON and a plot (bench/results/ in a source checkout). Competitors run in their own "
        "venvs, built on first use.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available")
    parser.add_argument("--workloads", nargs="+", help="workload names (default: all of the device's)")
    parser.add_argument(
        "--systems",
        nargs="+",
        help="system names or family:mode (fastft:True, unsloth:False); with --modes, families (default: the six "
        "systems of bench/README.md with a path on the device)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="alternated rounds (one process per system each; 0 with --longest: only the longest-sequence search)",
    )
    parser.add_argument("--steps", type=int, default=3, help="timed steps per process, after the first step")
    parser.add_argument(
        "--modes",
        action="store_true",
        help="every system in each checkpointing mode it has (transformers+peft and Liger with and without "
        'checkpointing, Unsloth False / True / "unsloth", fastft False / True / "offload" / "sqrt"), '
        "compared mode with mode; --systems then names families",
    )
    parser.add_argument(
        "--longest",
        action="store_true",
        help="also search each system's longest batch-1 sequence: one process per system, lengths doubling then "
        "bisected after the first out-of-memory error, within --longest-budget",
    )
    parser.add_argument(
        "--longest-budget",
        type=float,
        metavar="SECONDS",
        help="seconds each system's search may take, model load included (default: 360 s shared among the "
        "searches, at least 30 s each); a search it stops reports its length as a lower bound",
    )
    parser.add_argument("--quick", action="store_true", help="a tiny model, to check the harness in seconds")
    parser.add_argument("--output-dir", type=Path, help="where the JSON and plot go")
    parser.add_argument("--venv-root", type=Path, help="where competitor venvs are built and reused")
    parser.add_argument("--rebuild-venvs", action="store_true", help="rebuild competitor venvs")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds one measurement may take")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG")
    parser.add_argument("--readme", type=Path, help="README whose section for this device gets the new table")
    parser.add_argument(
        "--readme-from",
        type=Path,
        help="only redraw the plot and README section from this JSON (its runs read again by this harness)",
    )


def _bench(args: argparse.Namespace) -> int:

    from fastft.bench import BenchError, Options, run, write
    from fastft.bench.harness import repository_root
    from fastft.bench.inputs import check_folder, check_readme, read_record

    root = repository_root()
    readme = args.readme or (root / "bench" / "README.md" if root is not None and not args.quick else None)
    try:
        # The file system's part of the flags, checked before a model loads or a file is written.
        check_readme(args.readme)
        check_folder(args.output_dir, "--output-dir")
        check_folder(args.venv_root, "--venv-root")
        record = read_record(args.readme_from) if args.readme_from is not None else None
    except BenchError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if record is not None:
        from fastft.bench.report import evaluate_targets, plot, summarise, update_readme

        # Read again with this harness (mode-for-mode columns, the floor from the model's shape where the count
        # failed); the JSON itself stays as its run wrote it.
        record["summary"] = summarise(record)
        record["targets"] = evaluate_targets(record)
        if readme is None:
            print("error: --readme-from needs --readme outside a source checkout", file=sys.stderr)
            return 2
        paths = {"json": args.readme_from}
        if record["runs"]:
            paths["plot"] = plot(record, args.readme_from.with_suffix(".png"))
        update_readme(readme, record, paths)
        print(f"fastft bench: redrew {paths.get('plot', 'no plot (no timed runs)')} and updated {readme}")
        return 0
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    options = Options(
        device=args.device,
        workloads=args.workloads,
        systems=args.systems,
        rounds=args.rounds,
        steps=args.steps,
        quick=args.quick,
        longest=args.longest,
        longest_budget_s=args.longest_budget,
        modes=args.modes,
        output_dir=args.output_dir,
        venv_root=args.venv_root,
        rebuild_venvs=args.rebuild_venvs,
        timeout_s=args.timeout,
        plot=not args.no_plot,
        readme=readme,
    )
    if options.steps < 1 or options.rounds < (0 if options.longest else 1):
        print("error: --steps must be at least 1, and --rounds at least 1 (0 only with --longest)", file=sys.stderr)
        return 2
    if args.timeout < 1:
        print(
            f"error: --timeout is the seconds one measurement may take and must be at least 1, got {args.timeout}",
            file=sys.stderr,
        )
        return 2
    if options.longest_budget_s is not None and options.longest_budget_s <= 0:
        print(
            f"error: --longest-budget must be a positive number of seconds, got {args.longest_budget}", file=sys.stderr
        )
        return 2
    try:
        record = run(options)
    except (BenchError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    paths = write(record, options)
    print("fastft bench: wrote " + ", ".join(str(path) for path in paths.values()))
    failed = [row for row in record["summary"] if row["failed"]]
    failed += [entry for entry in record["longest"] if entry["stopped_by"] == "error"]
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``fastft`` console script."""
    parser = argparse.ArgumentParser(prog="fastft", description="fastft: fast LoRA / QLoRA fine-tuning.")
    parser.add_argument("--version", action="version", version=f"fastft {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _train_parser(sub)
    _export_parser(sub)
    _bench_parser(sub)
    doctor = sub.add_parser("doctor", help="show versions, device and the patch report")
    doctor.add_argument(
        "--compile",
        action="store_true",
        help="also compile every Triton kernel for sm_75/80/86/89/90 (no GPU needed; a few minutes) and check "
        "spills, shared memory and tensor-core use: python -m fastft.kernels.compile_check",
    )
    doctor.add_argument("--output", type=Path, default=None, help="with --compile: the JSON file to write")
    args = parser.parse_args(argv)
    # Under torchrun every process runs this; rank 0 speaks for all of them unless something goes wrong.
    from fastft.loading.distributed import is_main_process

    level = logging.INFO if is_main_process() else logging.WARNING
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "train":
        return _train(args)
    if args.command == "export":
        return _export(args)
    if args.command == "bench":
        return _bench(args)
    if args.output is not None and not args.compile:
        print(
            f"error: fastft doctor: --output {args.output} is where --compile writes its JSON, and --compile was not "
            "given; add --compile, or leave --output out.",
            file=sys.stderr,
        )
        return 2
    if args.compile and args.output is not None:
        from fastft.bench import BenchError
        from fastft.bench.inputs import check_folder

        try:
            # Before the report and the check run: the JSON goes into --output's folder.
            if args.output.is_dir():
                raise BenchError(f"fastft doctor --output {args.output}: is a folder; name the JSON file to write")
            check_folder(args.output.parent, f"--output {args.output}: its folder", "fastft doctor")
        except BenchError as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
    from fastft.doctor import report

    print(report())
    if args.compile:
        from fastft.kernels import compile_check

        print("\nstatic GPU check (python -m fastft.kernels.compile_check):")
        return compile_check.main(["--output", str(args.output or Path("compile.json"))])
    return 0


if __name__ == "__main__":
    sys.exit(main())
