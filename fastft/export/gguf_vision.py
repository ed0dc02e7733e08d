"""GGUF of a vision-language model: what fastft exports, and what it leaves to llama.cpp's converter.

llama.cpp runs a vision-language model from two files: the language model (Qwen2.5-VL's as architecture ``qwen2vl``,
with its M-RoPE sections) and a projector file (``mmproj``, architecture ``clip``: the vision tower and merger,
patch embedding split per temporal slice, the image processor's mean and std). fastft does not write either yet:
:func:`refuse_vision_language` stops ``FastModel.save_gguf`` before anything is merged and names the route that works
today, ``FastModel.save_merged`` (which writes the folder under the names and with the image processor config
llama.cpp's ``convert_hf_to_gguf.py`` reads) and that converter, once for the language model and once with
``--mmproj`` for the projector.
"""

from __future__ import annotations

import torch


def _base(model: torch.nn.Module) -> torch.nn.Module:
    getter = getattr(model, "get_base_model", None)
    return getter() if callable(getter) else model


def refuse_vision_language(model: torch.nn.Module) -> None:
    """Refuse a GGUF export of a vision-language model, naming the two-file route llama.cpp supports.

    Args:
        model: A transformers model or a ``PeftModel``.

    Raises:
        ValueError: ``model``'s config has a vision tower (``vision_config``).
    """
    config = getattr(_base(model), "config", None)
    if getattr(config, "vision_config", None) is None:
        return
    model_type = getattr(config, "model_type", "?")
    raise ValueError(
        f"fastft.save_gguf: {type(_base(model)).__name__} ({model_type}) is a vision-language model, which llama.cpp "
        "runs from two GGUF files: the language model, and the vision tower and projector as an mmproj file (clip "
        "architecture). fastft writes neither yet, and a language model alone would drop the images. Write the merged "
        "model with FastModel.save_merged(model, processor, folder) (transformers' checkpoint names, the image "
        "processor config beside them), then convert it with llama.cpp: python convert_hf_to_gguf.py folder "
        "(language model) and python convert_hf_to_gguf.py folder --mmproj (projector)."
    )


__all__ = ["refuse_vision_language"]
