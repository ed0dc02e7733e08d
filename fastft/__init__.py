"""fastft: faster, leaner LoRA and QLoRA fine-tuning of Hugging Face causal LMs.

The public API::

    from fastft import FastModel, HubFetchError, ShapeContractError, patch_report, train_on_responses_only
    from fastft import VisionDataCollator  # image + text chats for vision-language models

    model, tokenizer = FastModel.from_pretrained("smollm2-135m")
    model = FastModel.get_peft_model(model, r=16)
    fastft.apply(trainer.model)  # a model built elsewhere (a trainer's, with or without a peft LoRA adapter)

``FastModel``, ``HubFetchError``, ``patch_report``, ``train_on_responses_only`` and ``VisionDataCollator`` are
imported on first use, so
``import fastft.kernels`` (tensors only) does not pay for importing transformers and peft.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastft._version import __version__
from fastft.contracts import ShapeContractError

if TYPE_CHECKING:
    from fastft.integrations.apply_model import apply
    from fastft.loading.sources import HubFetchError
    from fastft.model import FastModel
    from fastft.registry import patch_report
    from fastft.training.responses import train_on_responses_only
    from fastft.training.vision_data import VisionDataCollator

_LAZY = {
    "FastModel": "fastft.model",
    "HubFetchError": "fastft.loading.sources",
    "patch_report": "fastft.registry",
    "train_on_responses_only": "fastft.training.responses",
    "VisionDataCollator": "fastft.training.vision_data",
    "apply": "fastft.integrations.apply_model",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'fastft' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "FastModel",
    "HubFetchError",
    "ShapeContractError",
    "VisionDataCollator",
    "__version__",
    "apply",
    "patch_report",
    "train_on_responses_only",
]
