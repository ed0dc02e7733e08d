"""Glue between fastft models and trl's trainers (SFT, DPO, KTO, GRPO): config defaults, the GRPO answer reward,
graceful stop, loss history."""

from __future__ import annotations

import dataclasses
import logging
import signal
from typing import Any

import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from trl import SFTConfig

from fastft.loading.distributed import one_gpu_per_process
from fastft.loading.dtypes import resolve_dtype

# The name it had as fastft/trl.py, which logging configurations and filters use.
logger = logging.getLogger("fastft.trl")


def _config(config_class: type, output_dir: str, dtype: torch.dtype | str | None, defaults: dict[str, Any], overrides):
    """A trl config of ``config_class`` with fastft's settings; what :func:`sft_config` documents holds for all.

    ``defaults`` are the method's own settings; a default that this trl version's config class has no field for is
    left out (so one builder serves every supported trl), an override never is (a misspelt one fails loudly).
    """
    dtype = resolve_dtype(dtype)
    on_gpu = torch.cuda.is_available()
    settings: dict[str, Any] = {
        "output_dir": output_dir,
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
        **defaults,
    }
    names = {field.name for field in dataclasses.fields(config_class)}
    # transformers 5.23 renamed gradient_checkpointing to activation_checkpointing; trl defaults it to on.
    settings["activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"] = False
    settings = {name: value for name, value in settings.items() if name in names}
    settings.update(overrides)
    return one_gpu_per_process(config_class(**settings))


def sft_config(output_dir: str, dtype: torch.dtype | str | None, max_length: int, **overrides: Any) -> SFTConfig:
    """An ``SFTConfig`` that fits a fastft model.

    Mixed precision follows the model's dtype (trl would otherwise turn bf16 autocast on, even on CPU): bf16 autocast
    for a bf16 model; for an fp16 model on a GPU, fp16 autocast with a gradient scaler (the adapters are fp32, see
    :func:`fastft.model.keep_trainable_fp32`, so the scaler can unscale their gradients). The dtype goes through
    :func:`fastft.model.resolve_dtype` first, so on a GPU below compute capability 8.0 (T4, V100), which has no bf16
    tensor cores, bf16 becomes fp16 with a warning, as it does when the model is loaded. Checkpointing is left to the
    mode chosen in ``FastModel.get_peft_model``. Under torchrun / ``accelerate launch`` Trainer trains with DDP, on CPU
    too (gloo); a single process that sees several GPUs trains on one of them
    (:func:`fastft.loading.distributed.one_gpu_per_process`) instead of falling back to ``nn.DataParallel``. The loss
    is the model's own (``loss_type="nll"``, where trl has the field): fastft's fused cross-entropy.

    :func:`dpo_config`, :func:`kto_config` and :func:`grpo_config` build the other trainers' configs the same way.

    Args:
        output_dir: Where checkpoints go.
        dtype: The model's compute dtype (``model.dtype`` of a model from ``FastModel.from_pretrained``), a name such
            as ``"fp16"``, or ``None`` for what ``from_pretrained`` picks automatically on this machine.
        max_length: Longest tokenized example; longer ones are truncated by trl.
        **overrides: Any other ``SFTConfig`` field.

    Returns:
        The config.
    """
    # trl 1.14's default loss, "chunked_nll", puts trl's own chunked loss on the model's forward, in place of the
    # fused one fastft's forward computes; "nll", the default before it and again since 1.16, keeps the model's own.
    return _config(SFTConfig, output_dir, dtype, {"max_length": max_length, "loss_type": "nll"}, overrides)


def dpo_config(
    output_dir: str, dtype: torch.dtype | str | None, max_length: int, beta: float = 0.1, **overrides: Any
) -> Any:
    """A ``DPOConfig`` that fits a fastft model, set up like :func:`sft_config`.

    Args:
        output_dir: Where checkpoints go.
        dtype: The model's compute dtype, a name, or ``None`` (see :func:`sft_config`).
        max_length: Longest tokenized prompt + completion; trl truncates longer ones.
        beta: How far the policy may move from the reference (higher: less far); 0.1 is trl's default.
        **overrides: Any other ``DPOConfig`` field (``loss_type``, ``label_smoothing``, ...).

    Returns:
        The config.
    """
    from trl import DPOConfig

    return _config(DPOConfig, output_dir, dtype, {"max_length": max_length, "beta": beta}, overrides)


def kto_config(
    output_dir: str, dtype: torch.dtype | str | None, max_length: int, beta: float = 0.1, **overrides: Any
) -> Any:
    """A ``KTOConfig`` that fits a fastft model, set up like :func:`sft_config`.

    trl's KTO estimates its KL term from the other completions of a batch, so ``per_device_train_batch_size`` must be
    at least 2 (trl refuses 1).

    Args:
        output_dir: Where checkpoints go.
        dtype: The model's compute dtype, a name, or ``None`` (see :func:`sft_config`).
        max_length: Longest tokenized prompt + completion; trl truncates longer ones.
        beta: How far the policy may move from the reference (higher: less far); 0.1 is trl's default.
        **overrides: Any other ``KTOConfig`` field (``desirable_weight``, ``undesirable_weight``, ...).

    Returns:
        The config.
    """
    from trl import KTOConfig

    return _config(KTOConfig, output_dir, dtype, {"max_length": max_length, "beta": beta}, overrides)


def grpo_config(
    output_dir: str,
    dtype: torch.dtype | str | None,
    max_completion_length: int = 64,
    num_generations: int = 4,
    **overrides: Any,
) -> Any:
    """A ``GRPOConfig`` that fits a fastft model, set up like :func:`sft_config`; completions come from
    ``model.generate`` (no vLLM).

    Each optimizer step generates ``num_generations`` completions for each of
    ``per_device_train_batch_size * gradient_accumulation_steps / num_generations`` prompts, so that product must be
    divisible by ``num_generations`` (trl raises ``ValueError`` otherwise).

    Args:
        output_dir: Where checkpoints go.
        dtype: The model's compute dtype, a name, or ``None`` (see :func:`sft_config`).
        max_completion_length: Longest generated completion, in tokens.
        num_generations: Completions per prompt, whose rewards are compared with each other (at least 2).
        **overrides: Any other ``GRPOConfig`` field (``beta``, ``temperature``, ``loss_type``, ...).

    Returns:
        The config.
    """
    from trl import GRPOConfig

    defaults = {"max_completion_length": max_completion_length, "num_generations": num_generations, "use_vllm": False}
    return _config(GRPOConfig, output_dir, dtype, defaults, overrides)


def answer_reward(completions: list, answer: list, **kwargs: Any) -> list[float]:
    """GRPO reward: 1.0 for a completion that contains its row's answer, else 0.0.

    The answer must appear as a whole word or number, ignoring case and runs of whitespace: answer ``52`` scores
    ``"37 + 15 = 52."`` and ``"It is 52"`` 1.0, but ``"152"`` and ``"52.5"`` 0.0 (see
    :func:`fastft.training.data.contains_answer`). trl passes the dataset's other columns as keyword arguments; this
    reads ``answer`` (``fastft train`` renames a ``solution`` column to it).

    Args:
        completions: The generated completions: strings, or (conversational data) lists of messages.
        answer: Each completion's expected answer.
        **kwargs: The other columns and trl's extras, unused.

    Returns:
        One reward per completion.
    """
    from fastft.training.data import completion_text, contains_answer

    return [
        float(contains_answer(completion_text(done), str(want))) for done, want in zip(completions, answer, strict=True)
    ]


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
