"""The systems ``fastft bench`` compares, and the environment each one runs in."""

from __future__ import annotations

from dataclasses import dataclass

BASELINE = "transformers+peft"
BASELINE_GC = "transformers+peft+gc"
# Like-for-like checkpointing classes, in table order: none; the library's own recompute; layer inputs parked in host
# memory (fastft "offload", Unsloth "unsloth"); fastft's sqrt(n) segments.
MODE_CLASSES = ("none", "recompute", "offload", "sqrt")
# The system each class compares fastft with (issue 28's targets: Unsloth in the same mode).
COMPETITOR_FAMILY = "unsloth"


@dataclass(frozen=True)
class System:
    """One way to train LoRA: the library (``family``), its checkpointing setting (``mode``), where it runs.

    Attributes:
        name: The row label, also the worker's key.
        family: ``"transformers+peft"``, ``"liger"``, ``"unsloth"`` or ``"fastft"``: how the worker builds it.
        mode: The value the family takes for checkpointing: ``use_gradient_checkpointing`` for Unsloth and fastft
            (``False``, ``True``, ``"unsloth"``, ``"offload"``, ``"sqrt"``); for transformers + peft and Liger,
            whether ``gradient_checkpointing_enable`` is called.
        checkpointing: The like-for-like class of ``mode`` (one of ``MODE_CLASSES``): rows of one class compare.
        venv: ``None`` runs in the harness's own environment; else the key of a competitor venv in ``VENVS``.
        devices: Where the system has a training path (Liger-Kernel has no CPU path).
        default: Whether a run without ``--systems`` or ``--modes`` includes it (the six systems before modes).
        compile: fastft only: ``get_peft_model(compile=True)``, regional compilation of the decoder layers (issue 28
            asks for a GPU measurement before it becomes the default on CUDA).
    """

    name: str
    family: str
    mode: bool | str
    checkpointing: str
    venv: str | None = None
    devices: tuple[str, ...] = ("cpu", "cuda")
    default: bool = True
    compile: bool = False

    @property
    def mode_label(self) -> str:
        """``mode`` as the family's users write it: ``False``, ``True`` or a quoted string."""
        return repr(self.mode) if isinstance(self.mode, bool) else f'"{self.mode}"'

    def to_dict(self) -> dict[str, object]:
        """The JSON form kept in a run's settings."""
        return {
            "name": self.name,
            "family": self.family,
            "mode": self.mode,
            "checkpointing": self.checkpointing,
            "venv": self.venv,
            "devices": list(self.devices),
            "compile": self.compile,
        }


_LIGER, _UNSLOTH = {"venv": "liger", "devices": ("cuda",)}, {"venv": "unsloth"}
# In the order ``--modes`` runs them: class by class, so the rows a target compares run close together in time.
SYSTEMS: tuple[System, ...] = (
    System(BASELINE, "transformers+peft", False, "none"),
    System("liger-nogc", "liger", False, "none", **_LIGER, default=False),
    System("unsloth-nogc", "unsloth", False, "none", **_UNSLOTH, default=False),
    System("fastft", "fastft", False, "none"),
    System(BASELINE_GC, "transformers+peft", True, "recompute"),
    System("liger", "liger", True, "recompute", **_LIGER),
    System("unsloth-gc", "unsloth", True, "recompute", **_UNSLOTH, default=False),
    System("fastft+recompute", "fastft", True, "recompute", default=False),
    System("unsloth", "unsloth", "unsloth", "offload", **_UNSLOTH),
    System("fastft+offload", "fastft", "offload", "offload"),
    System("fastft+sqrt", "fastft", "sqrt", "sqrt", default=False),
    # Regional compilation beside each like-for-like mode; only a name runs them (see select_systems).
    System("fastft+compile", "fastft", False, "none", default=False, compile=True),
    System("fastft+recompute+compile", "fastft", True, "recompute", default=False, compile=True),
    System("fastft+offload+compile", "fastft", "offload", "offload", default=False, compile=True),
)
FAMILIES = ("transformers+peft", "liger", "unsloth", "fastft")
# The default set's order before modes existed (tables and tests of earlier runs follow it).
_DEFAULT_ORDER = (BASELINE, BASELINE_GC, "liger", "unsloth", "fastft", "fastft+offload")


def aliases() -> dict[str, System]:
    """Every name ``--systems`` accepts: the row names, and ``family:mode`` as the family's users write the mode
    (``fastft:True``, ``unsloth:False``, ``fastft:offload``, ``unsloth:unsloth``; any case)."""
    names = {system.name.lower(): system for system in SYSTEMS}
    for system in SYSTEMS:
        if not system.compile:
            names[f"{system.family}:{system.mode}".lower()] = system
    return names


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


def select_systems(device: str, names: list[str] | None, modes: bool = False) -> list[System]:
    """The systems to run on ``device``.

    Without ``modes``: the default six (or ``names``, in the given order). With ``modes``: every checkpointing mode of
    each family (of the families ``names`` name, when given: a family or any of its systems), class by class.

    Raises:
        ValueError: An unknown name, or a system named explicitly that has no path on ``device`` (the message says
            which devices it has).
    """
    known = aliases()
    chosen = []
    for name in names or []:
        system = known.get(name.lower()) or next((s for s in SYSTEMS if s.family == name.lower()), None)
        if system is None:
            raise ValueError(
                f"fastft bench: unknown system {name!r}; choose from {[s.name for s in SYSTEMS]} (or family:mode, "
                f"e.g. fastft:True, or with --modes a family: {list(FAMILIES)})"
            )
        if device not in system.devices:
            raise ValueError(
                f"fastft bench: {system.name} has no {device} path (it runs on {', '.join(system.devices)}); "
                f"leave it out or pick --device {system.devices[0]}"
            )
        chosen.append(system)
    if modes:
        families = {system.family for system in chosen} or set(FAMILIES)
        # Compiled rows only when named: a compile per process would double a modes run's time.
        return [
            system
            for system in SYSTEMS
            if system.family in families and device in system.devices and not system.compile
        ]
    if chosen:
        return chosen
    defaults = {system.name: system for system in SYSTEMS if system.default and device in system.devices}
    return [defaults[name] for name in _DEFAULT_ORDER if name in defaults]
