"""Vision-language checkpoints in ``FastModel.from_pretrained``: which model class loads them, what 4-bit leaves
unquantised, and the processor returned in place of the tokenizer."""

from __future__ import annotations

import warnings
from typing import Any

# model_type -> the vision side's modules (tower and merger / projector) by their names in the loaded model, as
# bitsandbytes' skip list reads them (transformers 4.x: a substring of the module's name; 5.x: its start).
# Qwen3-VL's DeepStack mergers sit inside its tower (model.visual.deepstack_merger_list).
VISION_MODULES = {
    "qwen2_5_vl": ("model.visual",),
    "qwen3_vl": ("model.visual",),
    "gemma3": ("model.vision_tower", "model.multi_modal_projector"),
    "mllama": ("model.vision_model", "model.multi_modal_projector"),
}
# model_type -> the first transformers release with the family, for the error an older one gets.
FIRST_RELEASE = {"qwen3_vl": "4.57"}


def _cross_attention_modules(config: Any) -> list[str]:
    """Llama 3.2 Vision's cross-attention projections (q / k / v / o of each cross-attention layer), by layer."""
    return [f"model.language_model.layers.{i}.cross_attn" for i in config.get_text_config().cross_attention_layers]


# model_type -> the language model's modules that 4-bit leaves in 16 bit as well, read from the config. Mllama's
# cross-attention projections are the only path from the image into the text, and the ones whose 4-bit weight error
# stands out (Unsloth's per-layer analysis of Llama-3.2-11B-Vision); 16 bit they add ~0.5 GB to the 11B model's ~7 GB.
LANGUAGE_16BIT = {"mllama": _cross_attention_modules}


def refuse_missing_family(source: str, error: ValueError) -> None:
    """Raise ImportError naming the transformers release a vision-language family needs, when ``error`` is
    AutoConfig refusing that family's model type because the installed transformers predates it. Any other error:
    returns, and the caller re-raises it.

    Raises:
        ImportError: ``source`` is a family of :data:`FIRST_RELEASE` that this transformers does not know.
    """
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    for model_type, release in FIRST_RELEASE.items():
        # AutoConfig names the unknown type in backticks (transformers 4.x and 5.x).
        if model_type not in CONFIG_MAPPING and f"`{model_type}`" in str(error):
            raise ImportError(
                f"fastft.from_pretrained: {source} is a {model_type} model, which transformers "
                f"{transformers.__version__} does not know; it needs transformers >= {release} "
                f'(pip install -U "transformers>={release}").'
            ) from error


def is_vision_language(config: Any) -> bool:
    """Whether ``config`` is an image-text-to-text model fastft loads as one (Qwen2.5-VL, Qwen3-VL, Gemma 3, Llama 3.2
    Vision)."""
    return getattr(config, "model_type", None) in VISION_MODULES


def vision_parts(config: Any) -> tuple[str, ...]:
    """The vision side's module names, last part only (``"vision_tower"``), as they appear in a checkpoint's tensor
    names whatever prefix the saving release gave them: their attention has the vision config's sizes, not the
    text config's the checkpoint contract checks."""
    return tuple(name.rsplit(".", 1)[-1] for name in VISION_MODULES[config.model_type])


def vision_model_class() -> type:
    """transformers' auto class for image-text-to-text models (``AutoModelForImageTextToText``; transformers 4.x also
    maps Qwen2.5-VL under ``AutoModelForVision2Seq``)."""
    import transformers

    found = getattr(transformers, "AutoModelForImageTextToText", None) or getattr(
        transformers, "AutoModelForVision2Seq", None
    )
    if found is None:
        raise ImportError(
            f"fastft.from_pretrained: transformers {transformers.__version__} has no AutoModelForImageTextToText; "
            "vision-language models need transformers >= 4.53.3 (pip install -U transformers)."
        )
    return found


def skip_4bit_modules(config: Any, vision_too: bool = False) -> list[str]:
    """What ``load_in_4bit`` leaves in 16 bit on a vision-language model: the vision tower and merger (projector),
    the LM head (bitsandbytes' own default, which naming any module replaces), and for Llama 3.2 Vision the
    cross-attention projections (:data:`LANGUAGE_16BIT`); their tanh gates and per-head norms are not linear layers
    and stay 16-bit anyway. The cross-attention layers' MLPs are quantised like every other MLP.

    The tower is a small share of the weights (~0.7 B of Qwen2.5-VL-7B's 8.3 B) and the part whose quality suffers
    most from 4-bit: its errors reach every image token the language model reads. ``vision_too``
    (``from_pretrained(load_vision_in_4bit=True)``) quantises the tower and projector as well.
    """
    language = LANGUAGE_16BIT.get(config.model_type)
    vision = () if vision_too else VISION_MODULES[config.model_type]
    return [*vision, *(language(config) if language else ()), "lm_head"]


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else "no message"


def load_processor(source: str, tokenizer: Any, max_seq_length: int, **kwargs: Any) -> Any:
    """The checkpoint's ``AutoProcessor`` (image processor and tokenizer, with its chat template), its tokenizer
    limited to ``max_seq_length`` like a text model's.

    Where the installed transformers cannot build the processor (Qwen2.5-VL's and Qwen3-VL's need torchvision for
    their video processor), the same processor class is built without its video processor
    (:func:`fastft.loading.image_processor.image_only_processor`: text and images work), with a warning. Where even
    that fails, a warning says so and ``tokenizer`` is returned instead: the model still trains on batches prepared
    elsewhere (pixel values and image grid from the image processor, ``<|image_pad|>`` expanded).

    Args:
        source: The model folder or hub id.
        tokenizer: The tokenizer already loaded from ``source``.
        max_seq_length: The model's ``max_seq_length``.
        **kwargs: Hub arguments (``revision``, ``token``, ...).

    Returns:
        The processor, or ``tokenizer`` when none can be built.
    """
    from transformers import AutoProcessor

    from fastft.loading.image_processor import image_only_processor

    try:
        processor = AutoProcessor.from_pretrained(source, **kwargs)
    except (ImportError, TypeError, ValueError, OSError) as error:
        try:
            # Without torchvision only the video processor is missing: images need the image processor alone.
            processor = image_only_processor(source, tokenizer, **kwargs)
        except (ImportError, TypeError, ValueError, OSError) as image_error:
            warnings.warn(
                f"fastft.from_pretrained: {source} is a vision-language model, but its processor could not be built "
                f"({type(error).__name__}: {_first_line(error)}; without videos: {type(image_error).__name__}: "
                f"{_first_line(image_error)}); returning its tokenizer instead. Images need the processor: install "
                "what the message names (for Qwen2.5-VL and Qwen3-VL, pip install torchvision) and load again.",
                UserWarning,
                stacklevel=3,
            )
            return tokenizer
        warnings.warn(
            f"fastft.from_pretrained: {source}'s full processor could not be built ({type(error).__name__}: "
            f"{_first_line(error)}); returning {type(processor).__name__} without a video processor: text and "
            "images work, videos need what the message names (for Qwen2.5-VL and Qwen3-VL, pip install torchvision).",
            UserWarning,
            stacklevel=3,
        )
    inner = getattr(processor, "tokenizer", None)
    if inner is None:
        return processor
    inner.model_max_length = max_seq_length
    if inner.pad_token is None:
        inner.pad_token = inner.eos_token
    return processor


__all__ = [
    "FIRST_RELEASE",
    "LANGUAGE_16BIT",
    "VISION_MODULES",
    "is_vision_language",
    "load_processor",
    "refuse_missing_family",
    "skip_4bit_modules",
    "vision_model_class",
    "vision_parts",
]
