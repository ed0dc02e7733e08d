"""The main job: LoRA / QLoRA fine-tuning with trl's SFTTrainer, or preference / RL training with its DPOTrainer,
KTOTrainer or GRPOTrainer, with resume, metrics and a loss plot."""

from __future__ import annotations

import json
import logging
import platform
import re
import time
import warnings
from collections.abc import Sized
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from fastft.bench.environment import package_versions
from fastft.export.file_modes import as_if_created
from fastft.loading.base_names import public_base_name
from fastft.loading.compile import compile_seconds
from fastft.loading.distributed import launch
from fastft.loading.vision import is_vision_language
from fastft.model import FastModel, keep_trainable_fp32, resolve_dtype
from fastft.training.checks import OptionsError, check_json_lines, check_model, check_numbers, check_rows
from fastft.training.data import METHODS, DataError, load_rows, prepare_rows
from fastft.training.model_card import model_card
from fastft.training.options import TrainOptions
from fastft.training.plot import plot_loss
from fastft.training.trl import (
    StopOnSignal,
    answer_reward,
    dpo_config,
    grpo_config,
    kto_config,
    loss_history,
    sft_config,
)
from fastft.training.vision_data import VisionDataCollator, has_images, prepare_vision_rows, trainer_settings

# The name it had as fastft/train.py, which logging configurations and filters use.
logger = logging.getLogger("fastft.train")

VERSIONED = ("fastft", "torch", "transformers", "peft", "trl", "accelerate", "datasets", "bitsandbytes", "triton")
# The logged number that shows a preference / RL run learning: DPO's and KTO's reward margin (chosen minus rejected
# implicit reward), GRPO's mean reward.
WATCHED = {"dpo": "rewards/margins", "kto": "rewards/margins", "grpo": "reward"}


def versions() -> dict[str, str | None]:
    """Installed versions of the libraries a run depends on (``None`` when missing)."""
    return {"python": platform.python_version(), **package_versions(VERSIONED)}


def device_name() -> str:
    """The device training runs on, in words."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"cpu ({torch.get_num_threads()} threads)"


def last_complete_checkpoint(output: str | Path) -> str | None:
    """The newest ``checkpoint-N`` folder in ``output`` that was written to the end.

    The Trainer writes ``trainer_state.json`` last, so a folder without it, or with one cut short (a kill while it
    was being written), is what a kill during saving left behind; it is skipped with a warning rather than resumed
    from.

    Args:
        output: The run's output folder.

    Returns:
        The folder's path, or ``None`` when there is no complete checkpoint.
    """
    folder = Path(output)
    if not folder.is_dir():
        return None
    found = []
    for child in folder.iterdir():
        match = re.fullmatch(r"checkpoint-(\d+)", child.name)
        if match and child.is_dir():
            found.append((int(match.group(1)), child))
    for _, child in sorted(found, reverse=True):
        if _whole_json(child / "trainer_state.json"):
            return str(child)
        logger.warning("fastft train: %s is incomplete (killed while saving?); skipping it.", child)
    return None


def _whole_json(path: Path) -> bool:
    try:
        return isinstance(json.loads(path.read_text()), dict)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False


def _check_output(options: TrainOptions) -> str | None:
    output = Path(options.output)
    if output.exists() and not output.is_dir():
        raise FileExistsError(f"fastft train: --output {output} is a file; pass a folder (it is created if missing).")
    last = last_complete_checkpoint(output)
    if options.resume:
        if last is None:
            logger.warning("fastft train: --resume given but %s has no checkpoint; starting from step 0.", output)
        return last
    if last is not None and not options.overwrite:
        raise FileExistsError(
            f"fastft train: {output} already holds {Path(last).name}. Pass --resume to continue that run, "
            "or --overwrite to start again (its checkpoints will be replaced), or choose another --output."
        )
    return None


def _config(options: TrainOptions, output: Path, dtype: torch.dtype) -> Any:
    """The trl config of ``options.method``; settings trl refuses become an :class:`OptionsError`."""
    common = dict(
        max_steps=options.max_steps,
        num_train_epochs=options.epochs,
        learning_rate=options.lr,
        per_device_train_batch_size=options.batch_size,
        gradient_accumulation_steps=options.grad_accum,
        warmup_steps=options.warmup_steps,
        save_steps=options.save_steps,
        seed=options.seed,
    )
    try:
        if options.method == "dpo":
            return dpo_config(str(output), dtype, options.seq_len, beta=options.beta, **common)
        if options.method == "kto":
            return kto_config(str(output), dtype, options.seq_len, beta=options.beta, **common)
        if options.method == "grpo":
            return grpo_config(
                str(output), dtype, options.max_completion_length, num_generations=options.num_generations, **common
            )
        return sft_config(str(output), dtype, options.seq_len, **common)
    except ValueError as error:  # e.g. GRPO: batch size * grad accum not divisible by --num-generations
        raise OptionsError(f"fastft train --method {options.method}: {error}") from error


def _trainer(
    options: TrainOptions,
    model: Any,
    tokenizer: Any,
    dataset: Any,
    config: Any,
    callbacks: list,
    data_collator: Any = None,
) -> Any:
    """The trl trainer of ``options.method`` over the LoRA model (SFT with ``data_collator`` when given)."""
    common = dict(model=model, processing_class=tokenizer, train_dataset=dataset, args=config, callbacks=callbacks)
    if options.method == "dpo":
        from trl import DPOTrainer

        trainer = DPOTrainer(**common)
    elif options.method == "kto":
        from trl import KTOTrainer

        trainer = KTOTrainer(**common)
    elif options.method == "grpo":
        from trl import GRPOTrainer

        trainer = GRPOTrainer(reward_funcs=[answer_reward], **common)
    else:
        from trl import SFTTrainer

        trainer = SFTTrainer(**common, data_collator=data_collator)
    _drop_reference_copy(model)
    return trainer


def _vision_data(options: TrainOptions, rows: Any, processor: Any, config: Any) -> tuple[Any, VisionDataCollator]:
    """The rows and collator of a vision-language run: ``--data`` (a chat file with image parts) or, for the demo, the
    shapes set (:mod:`fastft.demo.vision`); ``config`` set to hand the raw rows to the collator."""
    from fastft.demo.vision import vision_demo_path

    if options.method != "sft":
        raise OptionsError(
            f"fastft train: --model {options.model} is a vision-language model, which fastft train fine-tunes with "
            f"--method sft only (image + text chats); got --method {options.method}."
        )
    if getattr(processor, "image_processor", None) is None:
        raise OptionsError(
            f"fastft train: --model {options.model} is a vision-language model, but its processor could not be built "
            "(the warning above says why; for Qwen2.5-VL, pip install torchvision), so its images cannot be read."
        )
    if options.data in (None, "demo"):
        path, source = vision_demo_path(), "demo"
        rows = load_rows(str(path), "sft")
    else:
        path, source = Path(options.data), options.data
    if "messages" not in rows.column_names:
        raise DataError(
            f"fastft train: --data {source} has the columns {sorted(rows.column_names)}; a vision-language model "
            "trains on chats: a 'messages' column of {'role', 'content'} turns, a content being text or a list of "
            "{'type': 'text', 'text': ...} and {'type': 'image', 'image': 'path.png'} parts (and optionally "
            "'images', for image parts without one)."
        )
    dataset = prepare_vision_rows(rows, path.parent if path.is_file() else None, source)
    for name, value in trainer_settings().items():
        setattr(config, name, value)
    return dataset, VisionDataCollator(processor, max_length=options.seq_len)


def _drop_reference_copy(model: Any) -> None:
    """Remove the frozen copy trl makes of a fresh adapter as its reference.

    Given a LoRA model and no reference model, trl (1.x) adds an adapter named ``ref``, a copy of ``default``, and
    scores the reference through it. A fresh adapter (LoRA B all zero) changes nothing, so its copy is the base model:
    without the copy trl disables the adapters for the reference forward instead, which computes the same numbers
    without the extra LoRA products (fastft's fused layers serve disabled adapters), and the checkpoints and the
    saved adapter hold only the trained one. A copy of an adapter that was trained before is kept.
    """
    if "ref" not in getattr(model, "peft_config", {}):
        return
    fresh = all(not parameter.any() for name, parameter in model.named_parameters() if ".lora_B.default." in f"{name}.")
    if fresh:
        model.delete_adapter("ref")


def _watched(method: str, history: list[dict[str, float]]) -> dict[str, Any] | None:
    """How the method's watched number (:data:`WATCHED`) moved: mean of the first and of the last fifth of the steps
    that logged it."""
    name = WATCHED.get(method)
    values = [row[name] for row in history if name in row] if name else []
    if not values:
        return None
    k = max(1, len(values) // 5)
    head, tail = sum(values[:k]) / k, sum(values[-k:]) / k
    return {
        "metric": name,
        "first": values[0],
        "last": values[-1],
        "head_mean": head,
        "tail_mean": tail,
        "rose": tail > head,
    }


def run(options: TrainOptions) -> dict:
    """Train, write the adapter, ``metrics.json`` and ``loss.png`` into ``options.output``.

    ``options.method`` picks trl's trainer: ``"sft"`` (SFTTrainer), ``"dpo"`` (DPOTrainer), ``"kto"`` (KTOTrainer)
    or ``"grpo"`` (GRPOTrainer, rewarded by :func:`fastft.training.trl.answer_reward`); the data must have that method's
    columns (:func:`fastft.training.data.check_columns`). Under torchrun / ``accelerate launch`` every process trains
    (DDP, ``batch_size`` examples each per step) and only rank 0 writes files; every process returns the metrics.

    Args:
        options: The run's settings.

    Returns:
        The metrics written to ``metrics.json``; ``metrics["completed"]`` is ``False`` when a signal stopped
        the run early (a checkpoint was saved; rerun with ``resume=True``). For DPO, KTO and GRPO,
        ``metrics["watched"]`` says how the reward margin (mean reward for GRPO) moved.

    Raises:
        FileNotFoundError: ``options.data`` does not exist.
        FileExistsError: ``options.output`` holds checkpoints and neither ``resume`` nor ``overwrite`` is set.
        fastft.training.data.DataError: The data cannot be read, or lacks the method's columns.
        FileNotFoundError: A local ``options.model`` folder without config.json, weights or (with no
            ``options.tokenizer``) tokenizer files.
        OptionsError: An unknown method, a number out of range (:func:`fastft.training.checks.check_numbers`), or
            settings the method's trainer refuses.
        (All of them before the model is loaded and before ``options.output`` is created.)

    A ``batch_size`` larger than the data is clamped to it, with one warning; ``metrics["options"]`` records the
    batch size trained with, ``metrics["batch_size_requested"]`` the one asked for. With ``resume`` on a run whose
    metrics.json says it finished ``max_steps`` steps, nothing is trained and its metrics come back with
    ``"already_finished": True``.
    """
    if options.method not in METHODS:
        raise OptionsError(f"fastft train: unknown --method {options.method!r}; choose one of {', '.join(METHODS)}.")
    check_numbers(options)
    job = launch()
    resume_from = _check_output(options)
    finished = _finished_metrics(options)
    if finished is not None:
        return finished
    # Bad --data or settings fail here, before model loading and before --output exists.
    rows = _read_rows(options)
    check_model(options.model, options.tokenizer, options.seq_len)
    requested_batch = options.batch_size
    options = _fit_batch(options, rows)
    output = Path(options.output)
    dtype = resolve_dtype(options.dtype)
    config = _config(options, output, dtype)
    model, tokenizer = FastModel.from_pretrained(
        options.model,
        max_seq_length=options.seq_len,
        dtype=dtype,
        load_in_4bit=options.load_in_4bit,
        tokenizer_name=options.tokenizer,
    )
    # Created once the model has loaded, so a bad --model leaves no empty output folder behind; removed again when
    # the run fails before writing anything into it.
    created = job.is_main and not output.exists()
    if job.is_main:
        output.mkdir(parents=True, exist_ok=True)
    try:
        return _train(options, job, model, tokenizer, rows, config, resume_from, dtype, requested_batch)
    except BaseException:
        if created and output.is_dir() and not any(output.iterdir()):
            output.rmdir()
        raise


def _read_rows(options: TrainOptions) -> Any:
    """``--data``'s rows, each line of a JSON lines file and each row's fields checked (:mod:`.checks`)."""
    path = Path(options.data) if options.data not in (None, "demo") else None
    lines = None
    if path is not None and path.suffix.lower() == ".jsonl" and path.is_file():
        lines = check_json_lines(path)
    rows = load_rows(options.data, options.method)
    check_rows(rows, options.method, options.data or "demo", lines)
    return rows


def _fit_batch(options: TrainOptions, rows: Any) -> TrainOptions:
    """``options`` with ``batch_size`` clamped to the number of examples: the trainer would otherwise train on smaller
    batches than the one metrics.json records. GRPO's batch counts completions, not rows, and is left as it is."""
    examples = len(rows)
    if options.method == "kto" and "label" not in rows.column_names:
        examples *= 2  # each preference pair becomes a desirable and an undesirable example
    if options.method == "grpo" or options.batch_size <= examples:
        return options
    logger.warning(
        "fastft train: --batch-size %d is more than the %d examples of the data; training on batches of %d "
        "(metrics.json records batch_size %d). Pass --batch-size %d or less, or more data, to silence this.",
        options.batch_size,
        examples,
        examples,
        examples,
        examples,
    )
    return replace(options, batch_size=examples)


def _finished_metrics(options: TrainOptions) -> dict | None:
    """With ``--resume``, the metrics of a run that already reached ``--max-steps``, which is then not trained again;
    ``None`` when there is something left to train."""
    metrics_file = Path(options.output) / "metrics.json"
    if not options.resume or options.max_steps <= 0 or not metrics_file.is_file():
        return None
    metrics = json.loads(metrics_file.read_text())
    done = metrics.get("global_step", 0)
    # A run stopped by a signal has completed false and its adapter unsaved: resuming it trains the rest.
    if not metrics.get("completed") or done < options.max_steps:
        return None
    logger.warning(
        "fastft train: %s already finished (%d steps of --max-steps %d); nothing to resume. Pass a larger "
        "--max-steps to train further, or --overwrite to start again.",
        options.output,
        done,
        options.max_steps,
    )
    return {**metrics, "already_finished": True}


def _train(
    options: TrainOptions,
    job: Any,
    model: Any,
    tokenizer: Any,
    rows: Any,
    config: Any,
    resume_from: str | None,
    dtype: torch.dtype,
    requested_batch: int,
) -> dict:
    """Add the adapter, train, and write the adapter, metrics.json and loss.png (the second half of :func:`run`)."""
    output = Path(options.output)
    wall_start = time.time() - 1  # coarse file-system clocks: a file written in this second may stamp the last one
    collator = None
    if is_vision_language(model.config):
        rows, collator = _vision_data(options, rows, tokenizer, config)
    elif has_images(rows):
        raise DataError(
            f"fastft train: --data {options.data} holds images, and --model {options.model} is a text model; pass a "
            "vision-language model (e.g. Qwen/Qwen2.5-VL-3B-Instruct), or text-only data."
        )
    with warnings.catch_warnings():
        # peft's PeftModel.__init__ reads transformers' deprecated is_gradient_checkpointing (transformers >= 5.23);
        # the FutureWarning is peft's to fix and names nothing a fastft user can change.
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        model = FastModel.get_peft_model(
            model,
            r=options.r,
            lora_alpha=options.lora_alpha,
            lora_dropout=options.lora_dropout,
            use_gradient_checkpointing=options.gradient_checkpointing,
            random_state=options.seed,
            compile=options.compile,
        )
    dataset = rows if collator is not None else prepare_rows(rows, options.method, tokenizer)
    stopper = StopOnSignal()
    trainer = _trainer(options, model, tokenizer, dataset, config, [stopper], collator)
    if isinstance(trainer.train_dataset, Sized) and len(trainer.train_dataset) == 0:
        # trl drops examples left with nothing to learn from once cut to --seq-len (a prompt that fills it all).
        raise OptionsError(
            f"fastft train: none of the {len(rows)} examples of --data {options.data or 'demo'} is left to train on "
            f"at --seq-len {options.seq_len} (each is cut to that many tokens, prompt and chat template included); "
            "pass a larger --seq-len, e.g. --seq-len 256, or shorter examples."
        )
    # trl casts the trained weights of a 4-bit model to bf16 while building the trainer; an fp16 run (GPUs below
    # compute capability 8.0) keeps them in fp32 for its gradient scaler. The optimizer is only built in train().
    keep_trainable_fp32(model)
    started, compiling_before = time.perf_counter(), compile_seconds()
    result = trainer.train(resume_from_checkpoint=resume_from)
    completed = stopper.received is None
    history = loss_history(trainer.state)
    losses = [row["loss"] for row in history]
    head, tail = losses[: max(1, len(losses) // 5)], losses[-max(1, len(losses) // 5) :]
    metrics = {
        "completed": completed,
        "method": options.method,
        "steps": history,
        "global_step": trainer.state.global_step,
        "max_steps": trainer.state.max_steps,
        "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None,
        "loss_fell": bool(losses) and sum(tail) / len(tail) < sum(head) / len(head),
        "watched": _watched(options.method, history),
        "train_runtime_s": result.metrics.get("train_runtime"),
        "this_session_s": time.perf_counter() - started,
        # Regional compilation compiles on the first step (and again for a new sequence length): part of the run time.
        "compile_s": compile_seconds() - compiling_before if options.compile else None,
        "resumed_from": Path(resume_from).name if resume_from else None,
        "options": asdict(options),
        "batch_size_requested": requested_batch,
        "dtype": str(dtype).removeprefix("torch."),
        "device": device_name(),
        "processes": job.world_size,
        "versions": versions(),
    }
    if trainer.is_world_process_zero():
        if completed:
            base = public_base_name(options.model)
            if base is not None:
                # Not the cache folder the embedded model loads from, which exists on this machine only.
                for adapter in model.peft_config.values():
                    adapter.base_model_name_or_path = base
            model.save_pretrained(output)
            tokenizer.save_pretrained(output)
            base = model.peft_config["default"].base_model_name_or_path
            card = model_card(base, options.method, output, trainer.state.global_step)
            (output / "README.md").write_text(card)
        (output / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
        if losses:
            title = f"fastft train: {options.model}"
            if options.method != "sft":
                title = f"fastft train --method {options.method}: {options.model}"
            plot_loss([row["step"] for row in history], losses, output / "loss.png", title)
        # safetensors writes the adapter and the checkpoints' weights through a 0600 temporary file. Only what this
        # run wrote is touched: --output may be a folder that holds the user's own files too.
        for item in output.iterdir():
            if item.stat().st_mtime >= wall_start and (item.is_file() or item.name.startswith("checkpoint-")):
                as_if_created(item, recursive=True)
    return metrics
