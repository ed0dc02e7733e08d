"""Several GPUs: one process per GPU (torchrun / accelerate launch, PyTorch DDP), never ``nn.DataParallel``.

torchrun and ``accelerate launch`` start one process per GPU and tell each its place through ``RANK``,
``LOCAL_RANK`` and ``WORLD_SIZE``; :func:`launch` reads them. A fastft model is loaded onto the GPU of its local rank
and Trainer wraps it in ``DistributedDataParallel``, which leaves every module, 4-bit weights and fastft's patched
layers included, as it is in each process.

``nn.DataParallel`` (what ``Trainer`` falls back to when one process sees several GPUs) instead copies the model onto
every GPU on every forward, as plain tensors: 4-bit weights lose their quant_state, and fastft's offloaded checkpointer
would be shared by replicas running in threads. fastft keeps Trainer off it where it can (:func:`one_gpu_per_process`,
which :func:`fastft.training.trl.sft_config` applies) and refuses it by name where it cannot
(:func:`guard_data_parallel`).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

# The name it had as fastft/distributed.py, which logging configurations and filters use.
logger = logging.getLogger("fastft.distributed")

_warned_single_process = False  # once per process: from_pretrained may run many times


def launch_commands(gpus: int | str = "N") -> str:
    """The commands that start one training process per GPU, for messages and the README."""
    return (
        f"`torchrun --nproc_per_node={gpus} train.py`, `accelerate launch --num_processes={gpus} train.py`, or "
        f"`torchrun --nproc_per_node={gpus} -m fastft.cli train ...`"
    )


class DataParallelRefused(RuntimeError):
    """``nn.DataParallel`` tried to replicate a fastft model; fastft trains one process per GPU instead."""


@dataclass(frozen=True)
class Launch:
    """Where this process sits in a torchrun / ``accelerate launch`` job (one process when not launched so).

    Attributes:
        rank: Global rank, 0 to ``world_size - 1``.
        local_rank: Rank on this machine; the GPU index the process trains on.
        world_size: Number of processes in the job.
    """

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def distributed(self) -> bool:
        """More than one process."""
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """The process that writes files and prints progress (global rank 0)."""
        return self.rank == 0


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        number = int(value)
    except ValueError:
        raise ValueError(
            f"fastft: environment variable {name}={value!r} is not an integer; torchrun and accelerate set it "
            "themselves, so unset it or launch through them."
        ) from None
    if number < 0:
        raise ValueError(f"fastft: environment variable {name}={number} is negative.")
    return number


def launch() -> Launch:
    """This process's place in the job, from the variables torchrun and ``accelerate launch`` set.

    Returns:
        A :class:`Launch`; ``Launch()`` (rank 0 of 1) for a plain ``python`` process.

    Raises:
        ValueError: ``RANK``, ``LOCAL_RANK`` or ``WORLD_SIZE`` is set but not a non-negative integer, or the rank
            does not fit the world size.
    """
    world_size = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", rank)
    if world_size < 1 or rank >= world_size:
        raise ValueError(f"fastft: RANK={rank} does not fit WORLD_SIZE={world_size} (expected 0 <= RANK < WORLD_SIZE).")
    return Launch(rank=rank, local_rank=local_rank, world_size=world_size)


def is_main_process() -> bool:
    """Whether this process should write files and print progress: rank 0, or the only process."""
    return launch().is_main


def _warn_single_process(gpus: int) -> None:
    global _warned_single_process
    if _warned_single_process:
        return
    _warned_single_process = True
    logger.warning(
        "fastft: this one process sees %d GPUs; it trains on cuda:%d only: pass the trainer's config through "
        "fastft.distributed.one_gpu_per_process(args) (fastft.trl.sft_config does); nn.DataParallel is refused. "
        "To train on all %d, start one process per GPU: %s.",
        gpus,
        torch.cuda.current_device(),
        gpus,
        launch_commands(gpus),
    )


def device_map() -> dict[str, int] | None:
    """The ``device_map`` that puts the whole model on this process's GPU (``None`` without CUDA).

    Under torchrun / ``accelerate launch`` that is the GPU of ``LOCAL_RANK``, which also becomes the current CUDA
    device, because Triton launches kernels on the current device whatever device the tensors are on. A single
    process that sees several GPUs uses the current one and gets a warning with the commands that use them all.

    Raises:
        RuntimeError: ``LOCAL_RANK`` names a GPU this process cannot see.
    """
    if not torch.cuda.is_available():
        return None
    gpus = torch.cuda.device_count()
    if "LOCAL_RANK" not in os.environ:
        if gpus > 1:
            _warn_single_process(gpus)
        return {"": torch.cuda.current_device()}
    local_rank = launch().local_rank
    if local_rank >= gpus:
        raise RuntimeError(
            f"fastft: LOCAL_RANK={local_rank} but this process sees {gpus} GPU(s) (cuda:0 to cuda:{gpus - 1}). "
            f"Launch at most {gpus} processes per machine (--nproc_per_node={gpus}), and leave CUDA_VISIBLE_DEVICES "
            "the same for every process."
        )
    torch.cuda.set_device(local_rank)
    return {"": local_rank}


class _RefuseDataParallel:
    """Stands in for ``Module._replicate_for_data_parallel`` on a fastft model (an instance attribute).

    ``torch.nn.parallel.replicate`` calls it on every module when ``nn.DataParallel`` copies the model onto its GPUs,
    so raising here stops the copy before any replica runs. A module-level class, so the model still pickles.
    """

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self) -> torch.nn.Module:
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else "N"
        raise DataParallelRefused(
            f"fastft: nn.DataParallel tried to copy {self.name} onto {gpus} GPUs. transformers' Trainer does that "
            "when one process sees several GPUs; its copies would drop 4-bit weights' quant_state and share fastft's "
            f"offload buffers between threads. Start one process per GPU instead: {launch_commands(gpus)}. To train "
            "on one GPU, pass the trainer's config through fastft.distributed.one_gpu_per_process(args) "
            "(fastft.trl.sft_config does), or start Python with CUDA_VISIBLE_DEVICES=0."
        )


def guard_data_parallel(model: torch.nn.Module) -> None:
    """Make ``nn.DataParallel`` replication of ``model`` raise :class:`DataParallelRefused` with the launch commands.

    Guarding the transformers model covers every wrapper around it (a ``PeftModel`` holds it as a submodule, and
    replication walks all submodules). Calling it again does nothing.

    Args:
        model: A transformers model (or any module).
    """
    if not isinstance(model.__dict__.get("_replicate_for_data_parallel"), _RefuseDataParallel):
        model._replicate_for_data_parallel = _RefuseDataParallel(type(model).__name__)


def one_gpu_per_process(args: Any) -> Any:
    """Keep a Trainer built from ``args`` on one GPU when one process sees several.

    Trainer reads ``args.n_gpu``: above 1 in a process that was not launched distributed, it multiplies the batch by
    it and wraps the model in ``nn.DataParallel``. This sets it to 1 (with a warning naming the launch commands), so
    the process trains on its current GPU with the batch size it was given. Under torchrun it is already 1.

    Args:
        args: A ``transformers.TrainingArguments`` (an ``SFTConfig``, ...).

    Returns:
        ``args``, changed in place.
    """
    from transformers.training_args import ParallelMode

    gpus = args.n_gpu  # sets up devices (and the process group under torchrun), as Trainer would
    # NOT_DISTRIBUTED is transformers' name for "one process, several GPUs": nn.DataParallel.
    if gpus > 1 and args.parallel_mode == ParallelMode.NOT_DISTRIBUTED:
        logger.warning(
            "fastft: %d GPUs visible to one process: training on %s only, with per_device_train_batch_size=%d, "
            "instead of nn.DataParallel. To train on all %d, start one process per GPU: %s.",
            gpus,
            args.device,
            args.per_device_train_batch_size,
            gpus,
            launch_commands(gpus),
        )
        args._n_gpu = 1
    return args


__all__ = [
    "DataParallelRefused",
    "Launch",
    "device_map",
    "guard_data_parallel",
    "is_main_process",
    "launch",
    "launch_commands",
    "one_gpu_per_process",
]
