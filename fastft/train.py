"""The main job: LoRA / QLoRA fine-tuning with trl's SFTTrainer, with resume, metrics and a loss plot."""

from __future__ import annotations

import json
import logging
import platform
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from trl import SFTTrainer

from fastft.data import load_rows, to_sft_rows
from fastft.distributed import launch
from fastft.environment import package_versions
from fastft.model import FastModel, keep_trainable_fp32, resolve_dtype
from fastft.plot import plot_loss
from fastft.trl import StopOnSignal, loss_history, sft_config

logger = logging.getLogger(__name__)

VERSIONED = ("fastft", "torch", "transformers", "peft", "trl", "accelerate", "datasets", "bitsandbytes", "triton")


@dataclass
class TrainOptions:
    """Settings of one ``fastft train`` run (the command's flags)."""

    output: str
    model: str = "smollm2-135m"
    data: str | None = None
    max_steps: int = 60
    epochs: float = 1.0
    lr: float = 2e-4
    r: int = 16
    lora_alpha: int = 16
    lora_dropout: float = 0.0
    seq_len: int = 256
    batch_size: int = 4
    grad_accum: int = 1
    load_in_4bit: bool = False
    dtype: str | None = None
    gradient_checkpointing: str = "offload"
    warmup_steps: int = 2
    save_steps: int = 10
    seed: int = 3407
    resume: bool = False
    overwrite: bool = False


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

    The Trainer writes ``trainer_state.json`` last, so a folder without it is what a kill during saving left
    behind; it is skipped with a warning rather than resumed from.

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
        if (child / "trainer_state.json").exists():
            return str(child)
        logger.warning("fastft train: %s is incomplete (killed while saving?); skipping it.", child)
    return None


def _check_output(options: TrainOptions) -> str | None:
    output = Path(options.output)
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


def run(options: TrainOptions) -> dict:
    """Fine-tune, write the adapter, ``metrics.json`` and ``loss.png`` into ``options.output``.

    Under torchrun / ``accelerate launch`` every process trains (DDP, ``batch_size`` examples each per step) and only
    rank 0 writes files; every process returns the metrics.

    Args:
        options: The run's settings.

    Returns:
        The metrics written to ``metrics.json``; ``metrics["completed"]`` is ``False`` when a signal stopped
        the run early (a checkpoint was saved; rerun with ``resume=True``).
    """
    job = launch()
    resume_from = _check_output(options)
    rows = load_rows(options.data)  # a bad --data fails here, before model loading and before --output exists
    output = Path(options.output)
    if job.is_main:
        output.mkdir(parents=True, exist_ok=True)
    dtype = resolve_dtype(options.dtype)
    model, tokenizer = FastModel.from_pretrained(
        options.model, max_seq_length=options.seq_len, dtype=dtype, load_in_4bit=options.load_in_4bit
    )
    model = FastModel.get_peft_model(
        model,
        r=options.r,
        lora_alpha=options.lora_alpha,
        lora_dropout=options.lora_dropout,
        use_gradient_checkpointing=options.gradient_checkpointing,
        random_state=options.seed,
    )
    dataset = to_sft_rows(rows, tokenizer)
    config = sft_config(
        str(output),
        dtype,
        options.seq_len,
        max_steps=options.max_steps,
        num_train_epochs=options.epochs,
        learning_rate=options.lr,
        per_device_train_batch_size=options.batch_size,
        gradient_accumulation_steps=options.grad_accum,
        warmup_steps=options.warmup_steps,
        save_steps=options.save_steps,
        seed=options.seed,
    )
    stopper = StopOnSignal()
    trainer = SFTTrainer(
        model=model, processing_class=tokenizer, train_dataset=dataset, args=config, callbacks=[stopper]
    )
    # trl casts the trained weights of a 4-bit model to bf16 while building the trainer; an fp16 run (GPUs below
    # compute capability 8.0) keeps them in fp32 for its gradient scaler. The optimizer is only built in train().
    keep_trainable_fp32(model)
    started = time.perf_counter()
    result = trainer.train(resume_from_checkpoint=resume_from)
    completed = stopper.received is None
    history = loss_history(trainer.state)
    losses = [row["loss"] for row in history]
    head, tail = losses[: max(1, len(losses) // 5)], losses[-max(1, len(losses) // 5) :]
    metrics = {
        "completed": completed,
        "steps": history,
        "global_step": trainer.state.global_step,
        "max_steps": trainer.state.max_steps,
        "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None,
        "loss_fell": bool(losses) and sum(tail) / len(tail) < sum(head) / len(head),
        "train_runtime_s": result.metrics.get("train_runtime"),
        "this_session_s": time.perf_counter() - started,
        "resumed_from": Path(resume_from).name if resume_from else None,
        "options": asdict(options),
        "dtype": str(dtype).removeprefix("torch."),
        "device": device_name(),
        "processes": job.world_size,
        "versions": versions(),
    }
    if trainer.is_world_process_zero():
        if completed:
            model.save_pretrained(output)
            tokenizer.save_pretrained(output)
        (output / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
        if losses:
            plot_loss([row["step"] for row in history], losses, output / "loss.png", f"fastft train: {options.model}")
    return metrics
