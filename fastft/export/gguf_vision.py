"""GGUF of a vision-language model: which families fastft exports, and why the others are refused.

llama.cpp runs a vision-language model from two files: the language model, and a projector file (``mmproj``,
architecture ``clip``) holding the vision tower and the merger / projector that turns its output into language-model
embeddings. :mod:`fastft.export.gguf_vlm` writes both for the families in :data:`EXPORTED` (``FastModel.save_gguf``
sends them there); every other vision-language model is refused here, before anything is merged, with the reason
and the route that works today.
"""

from __future__ import annotations

import torch

# model_type -> what fastft writes for it.
EXPORTED = {
    "qwen2_5_vl": "the language model as llama.cpp's qwen2vl (M-RoPE) and an mmproj of projector qwen2.5vl_merger",
}
# model_type -> why fastft writes no GGUF for it.
_REFUSED = {
    "mllama": (
        "llama.cpp no longer runs Llama 3.2 Vision (mllama): its cross-attention layers were dropped from llama.cpp "
        "and its converter, so no GGUF of it would load"
    ),
    "qwen3_vl": (
        "Qwen3-VL's mmproj needs the deepstack tensors (v.deepstack.N.*, written from the vision tower's "
        "intermediate layers) and its language model llama.cpp's qwen3vl (interleaved M-RoPE), which fastft does not "
        "write yet"
    ),
    "gemma3": (
        "fastft does not write Gemma 3's files yet: its checkpoints' tokenizer is SentencePiece-style (byte-fallback "
        "BPE), which fastft's GGUF tokenizer writer does not handle (byte-level BPE only), and its language model "
        "(llama.cpp's gemma3: each norm weight stored as 1 + w) and gemma3-projector mmproj are not written"
    ),
}


def _base(model: torch.nn.Module) -> torch.nn.Module:
    getter = getattr(model, "get_base_model", None)
    return getter() if callable(getter) else model


def vision_family(model: torch.nn.Module) -> str | None:
    """``config.model_type`` of a vision-language model (one with a ``vision_config``), else None.

    Args:
        model: A transformers model or a ``PeftModel``.
    """
    config = getattr(_base(model), "config", None)
    if getattr(config, "vision_config", None) is None:
        return None
    return str(getattr(config, "model_type", "?"))


def refuse_unexported_family(model: torch.nn.Module) -> None:
    """Refuse a vision-language model that :mod:`fastft.export.gguf_vlm` cannot write, naming why.

    A text model, or a family in :data:`EXPORTED`, passes.

    Args:
        model: A transformers model or a ``PeftModel``.

    Raises:
        ValueError: A vision-language model of another family.
    """
    family = vision_family(model)
    if family is None or family in EXPORTED:
        return
    reason = _REFUSED.get(family, f"fastft writes GGUF files for vision-language models of {sorted(EXPORTED)} only")
    raise ValueError(
        f"fastft.save_gguf: {type(_base(model)).__name__} ({family}) is a vision-language model, which llama.cpp runs "
        f"from two GGUF files (the language model and an mmproj file with the vision tower); {reason}. Nothing was "
        "written. Save the merged model with FastModel.save_merged(model, processor, folder) (transformers' "
        "checkpoint names, the image processor config beside them) and, where llama.cpp supports the family, convert "
        "it with llama.cpp: python convert_hf_to_gguf.py folder, then python convert_hf_to_gguf.py folder --mmproj."
    )


def refuse_vision_language(model: torch.nn.Module) -> None:
    """Refuse a vision-language model in the one-file (text model) GGUF writer, :mod:`fastft.export.gguf_export`.

    Args:
        model: A transformers model or a ``PeftModel``.

    Raises:
        ValueError: Any vision-language model: an exported family is named with its two-file writer, another with
            the reason it is not exported.
    """
    refuse_unexported_family(model)
    family = vision_family(model)
    if family is not None:
        raise ValueError(
            f"fastft.save_gguf: {family} is a vision-language model; a language-model GGUF alone would drop the "
            "images. Write both files with FastModel.save_gguf(model, processor, path) (fastft.export.gguf_vlm)."
        )


__all__ = ["EXPORTED", "refuse_unexported_family", "refuse_vision_language", "vision_family"]
