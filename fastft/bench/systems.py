"""The systems ``fastft bench`` compares, and the environment each one runs in."""

from __future__ import annotations

from dataclasses import dataclass

BASELINE = "transformers+peft"
BASELINE_GC = "transformers+peft+gc"


@dataclass(frozen=True)
class System:
    """One way to train LoRA: how the worker builds it (``name``), where it runs and what it checkpoints.

    Attributes:
        name: The row label, also the worker's key.
        checkpointing: ``"none"``, ``"recompute"`` (transformers' own) or the system's offloading checkpointer.
        venv: ``None`` runs in the harness's own environment; else the key of a competitor venv in ``VENVS``.
        devices: Where the system has a training path (Liger-Kernel has no CPU path).
    """

    name: str
    checkpointing: str
    venv: str | None = None
    devices: tuple[str, ...] = ("cpu", "cuda")


SYSTEMS: tuple[System, ...] = (
    System(BASELINE, "none"),
    System(BASELINE_GC, "recompute"),
    System("liger", "recompute", venv="liger", devices=("cuda",)),
    System("unsloth", "unsloth offload", venv="unsloth"),
    System("fastft", "none"),
    System("fastft+offload", "offload"),
)

# Each competitor's pins. Unsloth 2026.10.9 caps transformers at 5.17 and trl at 1.15; it is installed without its
# declared dependencies (xformers, torchvision and diffusers are not used for text LoRA and have no CPU wheel here),
# its runtime imports are listed instead. torch and triton are never pinned: the venv sees the system's, which must
# stay the pair torch was built with. pip installs only what the system lacks or pins differently (see
# bench/README.md for carrying wheels to an offline GPU machine).
VENVS: dict[str, dict[str, list[str]]] = {
    "unsloth": {
        "requirements": [
            "transformers==5.17.0",
            "trl==1.15.0",
            "peft==0.21.2",
            "datasets>=4.7,<5",
            "accelerate>=1.10",
            "bitsandbytes==0.50.2",
            "tyro",
            "protobuf",
            "sentencepiece",
            "hf_transfer",
            "psutil",
            "huggingface_hub",
            "typer",
            "rich",
            "pydantic",
            "pyyaml",
            "json5",
            "nest-asyncio",
            "einops",
            "cut_cross_entropy",
            "torchao",
            "msgspec",
            "regex",
            "pillow",
            "wheel",
            "safetensors",
        ],
        "no_deps": ["unsloth==2026.10.9", "unsloth_zoo==2026.10.9"],
        "packages": ["unsloth", "unsloth_zoo", "transformers", "peft", "trl", "bitsandbytes"],
    },
    "liger": {
        "requirements": ["transformers>=4.53", "peft>=0.16", "accelerate>=1.10", "bitsandbytes>=0.46"],
        "no_deps": ["liger-kernel==0.8.5"],
        "packages": ["liger-kernel", "transformers", "peft", "bitsandbytes"],
    },
}


def select_systems(device: str, names: list[str] | None) -> list[System]:
    """The systems with a path on ``device``, narrowed to ``names`` (in the given order) when given.

    Raises:
        ValueError: An unknown name, or a system with no path on ``device`` (the message says which devices it has).
    """
    known = {system.name: system for system in SYSTEMS}
    if not names:
        return [system for system in SYSTEMS if device in system.devices]
    chosen = []
    for name in names:
        if name not in known:
            raise ValueError(f"fastft bench: unknown system {name!r}; choose from {sorted(known)}")
        if device not in known[name].devices:
            raise ValueError(
                f"fastft bench: {name} has no {device} path (it runs on {', '.join(known[name].devices)}); "
                f"leave it out or pick --device {known[name].devices[0]}"
            )
        chosen.append(known[name])
    return chosen
