"""The image + text batch of a vision-language workload of ``fastft bench`` (Qwen2.5-VL's layout), built the way its
processor builds one: per example a block of image tokens (``<|vision_start|>``, one ``<|image_pad|>`` per merged
patch, ``<|vision_end|>``) after a few text tokens, random text around it, the image's patches as ``pixel_values``
with its grid, and labels that never fall on the image block.

The worker loads this file by path (a competitor's venv has no fastft), so it imports nothing of fastft.
"""

from __future__ import annotations

from typing import Any

INPUT_SEED = 1234
# Text tokens before each example's image block (a system prompt's worth).
PREFIX = 8


def image_tokens(config: Any, height: int, width: int) -> tuple[int, int, int]:
    """``(grid_h, grid_w, tokens)``: the patch grid of a ``height`` x ``width`` image and its merged-token count.

    Raises:
        ValueError: The image is not a whole number of merged patches.
    """
    vision = config.vision_config
    step = vision.patch_size * vision.spatial_merge_size
    if height % step or width % step:
        raise ValueError(
            f"fastft bench: a {height} x {width} image is not a whole number of merged patches of {step} px "
            f"(patch {vision.patch_size} x merge {vision.spatial_merge_size}); pick a multiple of {step}"
        )
    grid_h, grid_w = height // vision.patch_size, width // vision.patch_size
    return grid_h, grid_w, grid_h * grid_w // vision.spatial_merge_size**2


def batch(config: Any, batch_size: int, seq: int, image_size: list[int], device: str, five: bool) -> dict[str, Any]:
    """The model's keyword arguments for one step: ``input_ids``, ``pixel_values``, ``image_grid_thw``, ``labels``
    (and ``mm_token_type_ids`` on transformers 5.x, as its processor returns them).

    Text ids are drawn below every special id of the config, so no random token reads as an image token.

    Raises:
        ValueError: ``seq`` leaves no room for the image block and the text prefix.
    """
    import torch

    height, width = image_size
    grid_h, grid_w, count = image_tokens(config, height, width)
    if seq < PREFIX + count + 3:
        raise ValueError(
            f"fastft bench: {seq} tokens per example cannot hold a {height} x {width} image ({count} image tokens, "
            f"2 markers) after {PREFIX} text tokens; raise the workload's seq to at least {PREFIX + count + 3}"
        )
    special = (config.image_token_id, config.vision_start_token_id, config.vision_end_token_id, config.video_token_id)
    generator = torch.Generator().manual_seed(INPUT_SEED)
    ids = torch.randint(0, min(special), (batch_size, seq), generator=generator)
    start, end = PREFIX + 1, PREFIX + 1 + count
    ids[:, PREFIX] = config.vision_start_token_id
    ids[:, start:end] = config.image_token_id
    ids[:, end] = config.vision_end_token_id
    labels = ids.clone()
    labels[:, PREFIX : end + 1] = -100
    vision = config.vision_config
    width_of_patch = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    pixels = torch.randn(batch_size * grid_h * grid_w, width_of_patch, generator=generator)
    inputs = {
        "input_ids": ids,
        "labels": labels,
        "pixel_values": pixels,
        "image_grid_thw": torch.tensor([[1, grid_h, grid_w]] * batch_size),
    }
    if five:
        inputs["mm_token_type_ids"] = (ids == config.image_token_id).int()
    return {key: value.to(device) for key, value in inputs.items()}
