"""The name an adapter gives its base model: the hub id users know, not the cache folder fastft loaded it from.

The embedded ``smollm2-135m`` loads from a safetensors folder converted into fastft's cache; an adapter that named
that folder could not find its base on any other machine. It names the model's hub id instead, which plain peft
fetches from the hub, and which :meth:`fastft.FastModel.from_pretrained` maps back to the embedded copy (the weights
the adapter was trained on) when its package is installed.
"""

from __future__ import annotations

import importlib.util

from fastft.loading.embedded import ALIASES

# The hub id of each embedded model: the model its GGUF was quantised from.
EMBEDDED_HUB_IDS = {"smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct"}


def public_base_name(model_name: str) -> str | None:
    """The hub id an adapter of ``model_name`` should name as its base; ``None`` when it is not an embedded alias."""
    return EMBEDDED_HUB_IDS.get(model_name)


def embedded_alias(base_name: str) -> str | None:
    """The embedded alias whose hub id is ``base_name``, when that alias's package is installed; else ``None``."""
    for alias, hub_id in EMBEDDED_HUB_IDS.items():
        if base_name == hub_id and importlib.util.find_spec(ALIASES[alias][0]) is not None:
            return alias
    return None
