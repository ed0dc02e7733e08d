"""Glue between fastft models and trl's ``SFTTrainer``: config defaults, graceful stop, loss history."""

from __future__ import annotations

import dataclasses
import logging
import signal
from typing import Any

import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from trl import SFTConfig

from fastft.distributed import one_gpu_per_process
from fastft.model import resolve_dtype

logger = logging.getLogger(__name__)


def sft_config(output_dir: str, dtype: torch.dtype | str | None, max_length: int, **overrides: Any) -> SFTConfig:
    """An ``SFTConfig`` that fits a fastft model.

    Mixed precision follows the model's dtype (trl would otherwise turn bf16 autocast on, even on CPU): bf16 autocast
    for a bf16 model; for an fp16 model on a GPU, fp16 autocast with a gradient scaler (the adapters are fp32, see
    :func:`fastft.model.keep_trainable_fp32`, so the scaler can unscale their gradients). The dtype goes through
    :func:`fastft.model.resolve_dtype` first, so on a GPU below compute capability 8.0 (T4, V100), which has no bf16
    tensor cores, bf16 becomes fp16 with a warning, as it does when the model is loaded. Checkpointing is left to the
    mode chosen in ``FastModel.get_peft_model``. Under torchrun / ``accelerate launch`` Trainer trains with DDP, on CPU
    too (gloo); a single process that sees several GPUs trains on one of them
    (:func:`fastft.distributed.one_gpu_per_process`) instead of falling back to ``nn.DataParallel``.

    Args:
        output_dir: Where checkpoints go.
        dtype: The model's compute dtype (``model.dtype`` of a model from ``FastModel.from_pretrained``), a name such
            as ``"fp16"``, or ``None`` for what ``from_pretrained`` picks automatically on this machine.
        max_length: Longest tokenized example; longer ones are truncated by trl.
        **overrides: Any other ``SFTConfig`` field.

    Returns:
        The config.
    """
    dtype = resolve_dtype(dtype)
    on_gpu = torch.cuda.is_available()
    settings: dict[str, Any] = {
        "output_dir": output_dir,
        "max_length": max_length,
        # Without use_cpu, accelerate treats a CPU process launched by torchrun as not distributed: every rank would
        # train on all the data alone.
        "use_cpu": not on_gpu,
        "bf16": dtype == torch.bfloat16,
        # Trainer refuses fp16 mixed precision on CPU; an fp16 model there computes in fp16 without autocast.
        "fp16": dtype == torch.float16 and on_gpu,
        "report_to": "none",
        "logging_steps": 1,
        "save_total_limit": 2,
        "dataloader_num_workers": 0,
        "dataloader_pin_memory": on_gpu,
        "disable_tqdm": False,
        # Every LoRA weight takes part in every forward; DDP's search for unused ones would cost a graph traversal
        # per step.
        "ddp_find_unused_parameters": False,
    }
    # transformers 5.23 renamed gradient_checkpointing to activation_checkpointing; trl defaults it to on.
    names = {field.name for field in dataclasses.fields(SFTConfig)}
    settings["activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"] = False
    settings.update(overrides)
    return one_gpu_per_process(SFTConfig(**settings))


class StopOnSignal(TrainerCallback):
    """Turn SIGINT / SIGTERM into "save a checkpoint and stop" at the end of the current step.

    A second signal is left to the default handler, so a stuck run can still be interrupted.
    """

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        self.received = signum
        logger.warning("fastft: signal %d received; saving a checkpoint after this step, then stopping.", signum)
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        if self.received is not None:
            control.should_save = True
            control.should_training_stop = True
        return control

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


def loss_history(state: TrainerState) -> list[dict[str, float]]:
    """The training log rows that carry a loss, in the order they were logged.

    Args:
        state: ``trainer.state`` after (or during) training; after a resume it holds the earlier steps too.

    Returns:
        One row per logged step with ``step``, ``loss`` and the other numbers logged with it.
    """
    return [
        {key: value for key, value in entry.items() if isinstance(value, (int, float))}
        for entry in state.log_history
        if "loss" in entry and "step" in entry
    ]
