"""A vision-language model's processor without its video processor, for where the video side cannot be built.

Qwen2.5-VL's ``AutoProcessor`` builds a video processor, which needs torchvision; without it the whole processor
fails to load, although images need only the image processor (transformers' PIL / numpy backend) and the tokenizer.
:func:`image_only_processor` builds the checkpoint's own processor class over those two: the same chat template, the
same image-token expansion and the same outputs (``pixel_values``, ``image_grid_thw``, ``mm_token_type_ids`` ...) for
text and images; only ``videos=`` is unavailable.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any


@functools.cache
def _without_video(processor_class: type) -> type:
    """``processor_class`` with its image processor and tokenizer only.

    transformers reads a processor's parts from its ``__init__`` signature (5.x) or its ``attributes`` (4.x); both
    name the two parts here. The class keeps the upstream name, so what ``save_pretrained`` writes names the upstream
    class and ``AutoProcessor`` reloads it (video processor included) where torchvision is installed.
    """

    def __init__(self, image_processor: Any = None, tokenizer: Any = None, chat_template: Any = None, **kwargs: Any):
        processor_class.__init__(
            self, image_processor=image_processor, tokenizer=tokenizer, chat_template=chat_template, **kwargs
        )

    namespace = {
        "__init__": __init__,
        "attributes": ["image_processor", "tokenizer"],
        "__module__": __name__,
        "__doc__": f"{processor_class.__name__} without its video processor (images and text only).",
    }
    return type(processor_class.__name__, (processor_class,), namespace)


def _chat_template(source: str, tokenizer: Any) -> str | None:
    """The processor's chat template from a local checkpoint folder, else the tokenizer's."""
    folder = Path(source)
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text(encoding="utf-8")
    if (folder / "chat_template.json").is_file():
        return json.loads((folder / "chat_template.json").read_text(encoding="utf-8")).get("chat_template")
    return getattr(tokenizer, "chat_template", None)


def image_only_processor(source: str, tokenizer: Any, **kwargs: Any) -> Any:
    """The checkpoint's processor class over its image processor and ``tokenizer``, without a video processor.

    Args:
        source: The model folder or hub id (its config's ``model_type`` picks the processor class).
        tokenizer: The tokenizer already loaded from ``source``; it takes the processor's chat template when it has
            none, so response-only masking reads the same template as the processor.
        **kwargs: Hub arguments (``revision``, ``token``, ...).

    Returns:
        The processor.

    Raises:
        ImportError, TypeError, ValueError, OSError: transformers maps no processor to the model type, or the image
            processor cannot be built either.
    """
    import transformers
    from transformers import AutoConfig, AutoImageProcessor
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    model_type = AutoConfig.from_pretrained(source, **kwargs).model_type
    name = PROCESSOR_MAPPING_NAMES.get(model_type)
    processor_class = getattr(transformers, name, None) if isinstance(name, str) else None
    if processor_class is None:
        raise ValueError(f"transformers {transformers.__version__} maps no processor class to {model_type!r}")
    try:
        image_processor = AutoImageProcessor.from_pretrained(source, **kwargs)
    except ImportError:
        # transformers 5.0-5.5: the auto class itself needs torchvision, while the class the checkpoint names falls
        # back to its PIL backend without it.
        from transformers.image_processing_base import ImageProcessingMixin

        settings, _ = ImageProcessingMixin.get_image_processor_dict(source, **kwargs)
        image_class = getattr(transformers, str(settings.get("image_processor_type")), None)
        if image_class is None:
            raise
        image_processor = image_class.from_pretrained(source, **kwargs)
    template = _chat_template(source, tokenizer)
    if template and not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = template
    return _without_video(processor_class)(image_processor=image_processor, tokenizer=tokenizer, chat_template=template)


__all__ = ["image_only_processor"]
