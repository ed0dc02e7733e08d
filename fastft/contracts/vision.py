"""Vision-language batches: image placeholder tokens against the images given, pixel tensors against the vision
config, and images refused by a text-only model, all checked before the forward runs.

One forward pre-hook on the decoder backbone (the module ``guard_max_seq_length`` hooks, which trl >= 1.15 calls
directly) checks each batch that carries ``pixel_values``; a batch without any costs one dict lookup. What an image
expects is a row of :data:`VISION_RULES`, keyed on ``config.model_type``:

- images in order (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Gemma 3): every image is one run of placeholder tokens, the
  images taken by the runs in row-major order (example 0's first, ...); the run's length is what the image implies
  (Qwen: ``prod(image_grid_thw[i]) / spatial_merge_size**2``; Gemma 3: ``mm_tokens_per_image``).
- images per example (mllama, cross-attention): one ``<|image|>`` token per image, each example's images the
  non-padding entries of its ``aspect_ratio_ids`` row (padding images have id 0).

Before that, the pixel tensors are checked against the vision config (Qwen: ``[sum of t·h·w, in_channels ·
temporal_patch_size · patch_size²]`` beside ``image_grid_thw``), a run of placeholders that the end of the row cuts
is named as truncation (with ``max_seq_length``), and where Qwen's backbone reads ``mm_token_type_ids``
(transformers 5.x) it must mark exactly the image placeholders, else the image tokens get text M-RoPE positions
without any error. A text-only model (no ``vision_config``) refuses ``pixel_values`` by name instead of ignoring it.

transformers itself only compares the batch's total placeholder count with the image features (and mllama not
even that), deep inside the model; these name the example, the image, both counts and what to do.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from fastft.contracts._layers import _base_model
from fastft.kernels.errors import ShapeContractError

# The batch keys only an image (or video) model reads; a text-only model's forward takes them into **kwargs unread.
_IMAGE_KEYS = ("pixel_values", "pixel_values_videos")
_FIX = (
    "Build the batch with the model's own processor (it expands each image placeholder to the image's token count), "
    "and keep truncation out of images."
)


@dataclass(frozen=True)
class Expected:
    """What a batch's images ask of its placeholder tokens.

    Attributes:
        counts: Images in order: placeholder tokens per image. Images per example: images (one token each) per
            example.
        why: Image (or example) index -> how its count follows from the inputs and config, for messages.
    """

    counts: list[int]
    why: Callable[[int], str]


@dataclass(frozen=True)
class VisionRule:
    """How one family's batch ties images to placeholder tokens.

    Attributes:
        placeholder: The placeholder token as text, for messages.
        in_order: Images are assigned to runs of placeholder tokens in order (else counted per example).
        expected: ``(config, inputs, batch size) -> Expected``; checks the pixel tensors against the vision config
            first, raising :class:`ShapeContractError` naming the tensor, both shapes and the config values.
        type_ids: Where the model's forward takes ``mm_token_type_ids`` (Qwen on transformers 5.x), it must come
            with the images and mark exactly the image placeholders with 1: the model builds the image tokens'
            M-RoPE positions from it, and without it gives them text positions (no error, another model).
    """

    placeholder: str
    in_order: bool
    expected: Callable[[Any, dict[str, Any], int], Expected]
    type_ids: bool = False


def _refuse(where: str, message: str) -> ShapeContractError:
    return ShapeContractError(f"{where}: {message}")


def _square(size: Any) -> tuple[int, int]:
    return (int(size[0]), int(size[1])) if isinstance(size, (list, tuple)) else (int(size), int(size))


def _grid_images(config: Any, inputs: dict[str, Any], batch: int) -> Expected:
    """Qwen2-VL / Qwen2.5-VL / Qwen3-VL: ``pixel_values [sum of t·h·w, channels · temporal · patch²]`` (flattened
    patches) and ``image_grid_thw [images, 3]``; ``t·h·w / spatial_merge_size²`` tokens per image."""
    vision = config.vision_config
    pixels, grid = inputs["pixel_values"], inputs.get("image_grid_thw")
    where = f"{config.model_type} pixel_values"
    if not isinstance(grid, torch.Tensor) or grid.dim() != 2 or grid.shape[-1] != 3:
        got = list(grid.shape) if isinstance(grid, torch.Tensor) else repr(grid)
        raise _refuse(
            where,
            f"expected image_grid_thw of shape [images, 3] (temporal, height, width patches per image) beside "
            f"pixel_values, got {got}. Pass the image_grid_thw the image processor returned with the pixel values.",
        )
    channels = getattr(vision, "in_channels", None) or getattr(vision, "in_chans", 3)
    patch, temporal, merge = int(vision.patch_size), int(vision.temporal_patch_size), int(vision.spatial_merge_size)
    width = channels * temporal * patch * patch
    if pixels.dim() != 2 or pixels.shape[-1] != width:
        raise _refuse(
            where,
            f"expected shape [patches, {width}] (in_channels {channels} x temporal_patch_size {temporal} x "
            f"patch_size {patch}²: one flattened patch per row), got {list(pixels.shape)}. Make pixel_values with "
            "the checkpoint's image processor (its patch_size and temporal_patch_size must match the vision config).",
        )
    sizes = grid.tolist()
    rows = sum(math.prod(thw) for thw in sizes)
    if pixels.shape[0] != rows:
        raise _refuse(
            where,
            f"expected {rows} rows (the sum over images of t·h·w in image_grid_thw {sizes}), got "
            f"{pixels.shape[0]}. pixel_values and image_grid_thw must come from the same image processor call, "
            "their images in the same order.",
        )
    for index, (_, height, wide) in enumerate(sizes):
        if height % merge or wide % merge:
            raise _refuse(
                where,
                f"image {index}: image_grid_thw[{index}]={sizes[index]} has a height or width not divisible by "
                f"spatial_merge_size={merge}, so it maps to no whole number of tokens. Resize the image with the "
                "checkpoint's image processor.",
            )

    def why(index: int) -> str:
        return f"image_grid_thw[{index}]={sizes[index]}: t·h·w / spatial_merge_size² ({merge}²)"

    return Expected([math.prod(thw) // merge**2 for thw in sizes], why)


def _fixed_images(config: Any, inputs: dict[str, Any], batch: int) -> Expected:
    """Gemma 3: ``pixel_values [images, channels, size, size]``, ``mm_tokens_per_image`` tokens per image."""
    vision = config.vision_config
    pixels = inputs["pixel_values"]
    channels, (height, width) = int(vision.num_channels), _square(vision.image_size)
    if pixels.dim() != 4 or tuple(pixels.shape[1:]) != (channels, height, width):
        raise _refuse(
            f"{config.model_type} pixel_values",
            f"expected shape [images, {channels}, {height}, {width}] (vision_config num_channels, image_size), got "
            f"{list(pixels.shape)}. Make pixel_values with the checkpoint's image processor.",
        )
    tokens = int(config.mm_tokens_per_image)
    return Expected([tokens] * pixels.shape[0], lambda index: f"mm_tokens_per_image={tokens}")


def _tiled_images(config: Any, inputs: dict[str, Any], batch: int) -> Expected:
    """mllama: ``pixel_values [batch, images, tiles, channels, size, size]`` with ``aspect_ratio_ids [batch, images]``
    (0 marks a padding image) and ``aspect_ratio_mask [batch, images, tiles]``; one ``<|image|>`` token per image."""
    vision = config.vision_config
    pixels, ids, mask = inputs["pixel_values"], inputs.get("aspect_ratio_ids"), inputs.get("aspect_ratio_mask")
    where = f"{config.model_type} pixel_values"
    channels, (height, width), tiles = int(vision.num_channels), _square(vision.image_size), int(vision.max_num_tiles)
    if (
        pixels.dim() != 6
        or pixels.shape[0] != batch
        or pixels.shape[2] > tiles
        or tuple(pixels.shape[3:]) != (channels, height, width)
    ):
        raise _refuse(
            where,
            f"expected shape [batch {batch}, images, tiles <= max_num_tiles {tiles}, {channels}, {height}, {width}] "
            f"(vision_config num_channels, image_size), got {list(pixels.shape)}. Make pixel_values with the "
            "checkpoint's image processor, one row per example.",
        )
    for name, tensor, shape in (
        ("aspect_ratio_ids", ids, list(pixels.shape[:2])),
        ("aspect_ratio_mask", mask, list(pixels.shape[:3])),
    ):
        if not isinstance(tensor, torch.Tensor) or list(tensor.shape) != shape:
            got = list(tensor.shape) if isinstance(tensor, torch.Tensor) else repr(tensor)
            raise _refuse(
                f"{config.model_type} {name}",
                f"expected shape {shape} (pixel_values' leading dimensions), got {got}. Pass the {name} the image "
                "processor returned with the pixel values.",
            )
    counts = (ids > 0).sum(dim=1).tolist()
    return Expected(counts, lambda row: f"aspect_ratio_ids[{row}] has {counts[row]} non-padding images")


_GRID = VisionRule("<|image_pad|>", in_order=True, expected=_grid_images, type_ids=True)
# Keyed on config.model_type; a family's loading adds nothing else for its batches to be checked.
VISION_RULES: dict[str, VisionRule] = {
    "qwen2_vl": _GRID,
    "qwen2_5_vl": _GRID,
    "qwen3_vl": _GRID,
    "qwen3_vl_moe": _GRID,
    "gemma3": VisionRule("<image_soft_token>", in_order=True, expected=_fixed_images),
    "mllama": VisionRule("<|image|>", in_order=False, expected=_tiled_images),
}


def _images(first: int, stop: int) -> str:
    return f"image {first}" if stop - first == 1 else f"images {first}..{stop - 1}"


def _runs(mask: torch.Tensor) -> list[tuple[int, int, int]]:
    """``(row, start, stop)`` of every run of True in a ``[batch, seq]`` bool mask, row by row, left to right."""
    edges = torch.nn.functional.pad(mask.to(torch.int8), (1, 1)).diff(dim=1)
    starts, stops = (edges == 1).nonzero().tolist(), (edges == -1).nonzero()[:, 1].tolist()
    return [(row, start, stop) for (row, start), stop in zip(starts, stops, strict=True)]


class _VisionInputGuard:
    """Forward pre-hook (with kwargs) of a vision-language model's backbone: each batch with images checked against
    ``rule`` before the forward runs."""

    def __init__(
        self, name: str, config: Any, rule: VisionRule, max_seq_length: int | None, type_ids: bool = False
    ) -> None:
        self.name = name
        self.config = config
        self.rule = rule
        self.max_seq_length = max_seq_length
        self.token_id = int(config.image_token_id)
        self.type_ids = type_ids

    def __call__(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if kwargs.get("pixel_values") is None:
            return
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        if not isinstance(input_ids, torch.Tensor):
            # inputs_embeds only: the placeholders are not readable as ids, transformers compares the totals.
            return
        expected = self.rule.expected(self.config, kwargs, input_ids.shape[0])
        # One transfer of [batch, seq] bool masks; everything after it is host arithmetic on small lists.
        mask = input_ids == self.token_id
        mask = self._check_type_ids(mask, kwargs.get("mm_token_type_ids")) if self.type_ids else mask.cpu()
        if self.rule.in_order:
            self._check_in_order(mask, expected)
        else:
            self._check_per_example(mask, expected)

    def _where(self) -> str:
        return f"{self.name} ({self.config.model_type})"

    def _truncation(self, row: int, length: int) -> str:
        limit = f"max_seq_length={self.max_seq_length}" if self.max_seq_length else "the tokenizer's max_length"
        return (
            f"Example {row}'s tokens end inside this image (the batch is {length} tokens long, {limit}): truncation "
            f"cut the image. An image cannot be cut: shorten the text of example {row} or drop it, or raise the limit "
            f"(FastModel.from_pretrained(..., max_seq_length=...) and SFTConfig(max_length=...)) so the whole image "
            "fits."
        )

    def _check_type_ids(self, mask: torch.Tensor, types: Any) -> torch.Tensor:
        """``mask`` on the host, after checking that ``mm_token_type_ids`` marks exactly its tokens as image (1)."""
        token = self.rule.placeholder
        fix = (
            f"Pass mm_token_type_ids as Qwen's processor makes it: (input_ids == {self.token_id}).int() for images "
            f"({token}), 2 for video tokens, 0 elsewhere."
        )
        if not isinstance(types, torch.Tensor) or types.shape != mask.shape:
            got = list(types.shape) if isinstance(types, torch.Tensor) else repr(types)
            raise _refuse(
                self._where(),
                f"expected mm_token_type_ids of shape {list(mask.shape)} (input_ids') beside pixel_values, got {got}: "
                "this transformers builds the image tokens' M-RoPE positions from it, and without it gives them text "
                f"positions, which the checkpoint was not trained with. {fix}",
            )
        both = torch.stack((mask, (types == 1) != mask)).cpu()
        if both[1].any():
            row = int(both[1].any(dim=1).nonzero()[0])
            marked, placed = int((types[row] == 1).sum()), int(both[0][row].sum())
            raise _refuse(
                self._where(),
                f"example {row}: expected mm_token_type_ids to mark its {placed} {token} tokens as image (1), got "
                f"{marked} marked, not all at the same positions: the image tokens' M-RoPE positions would be "
                f"wrong. {fix}",
            )
        return both[0]

    def _check_in_order(self, mask: torch.Tensor, expected: Expected) -> None:
        counts, token, length = expected.counts, self.rule.placeholder, mask.shape[1]
        image = 0
        for row, start, stop in _runs(mask):
            got, first, left = stop - start, image, stop - start
            # A run may hold several images placed back to back (no marker tokens between them).
            while image < len(counts) and counts[image] <= left:
                left -= counts[image]
                image += 1
            if left == 0:
                continue
            span = f"example {row}: the {token} tokens at positions {start}..{stop - 1}"
            if image < len(counts) and (image == first or stop == length):
                # The run stops short of image `image`: too few tokens, or the row ends inside the image.
                have = left if image > first else got
                tail = self._truncation(row, length) if stop == length else _FIX
                raise _refuse(
                    self._where(),
                    f"{span}: expected {counts[image]} tokens for image {image} ({expected.why(image)}), got "
                    f"{have}. {tail}",
                )
            if image == first:
                raise _refuse(
                    self._where(),
                    f"{span}: expected no more {token} tokens (the batch's {len(counts)} images take "
                    f"{sum(counts)}), got {got} more ({int(mask.sum())} in all). Remove the extra placeholders or "
                    f"pass their images. {_FIX}",
                )
            raise _refuse(
                self._where(),
                f"{span}: expected {sum(counts[first:image])} tokens for {_images(first, image)} "
                f"({expected.why(first)}), got {got}. {_FIX}",
            )
        if image < len(counts):
            rows = mask.any(dim=1).nonzero().flatten().tolist()
            last = f"the last placeholders are in example {rows[-1]}" if rows else "input_ids has no placeholders"
            verb = "has" if image + 1 == len(counts) else "have"
            raise _refuse(
                self._where(),
                f"expected {sum(counts)} {token} tokens for the batch's {len(counts)} images, got "
                f"{int(mask.sum())}: {_images(image, len(counts))} {verb} none ({last}). If truncation at "
                f"max_seq_length={self.max_seq_length} dropped them, shorten or drop that example, or raise the "
                f"limit. {_FIX}",
            )

    def _check_per_example(self, mask: torch.Tensor, expected: Expected) -> None:
        token, length = self.rule.placeholder, mask.shape[1]
        for row, (got, want) in enumerate(zip(mask.sum(dim=1).tolist(), expected.counts, strict=True)):
            if got == want:
                continue
            full = self.max_seq_length is not None and length >= self.max_seq_length and got < want
            raise _refuse(
                self._where(),
                f"example {row}: expected {want} {token} tokens (one per image: {expected.why(row)}), got {got}. "
                + (self._truncation(row, length) if full else _FIX),
            )


class _TextOnlyGuard:
    """Forward pre-hook (with kwargs) of a text-only model's backbone: images are refused, never silently dropped."""

    def __init__(self, name: str, model_type: str | None) -> None:
        self.name = name
        self.model_type = model_type

    def __call__(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        for key in _IMAGE_KEYS:
            value = kwargs.get(key)
            if value is not None:
                shape = list(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                raise ShapeContractError(
                    f"{self.name} ({self.model_type}): {key} of shape {shape} given to a text-only model, which has "
                    f"no vision tower and would ignore it: expected no {key}. Load a vision-language checkpoint "
                    f"(model types {', '.join(sorted(VISION_RULES))}) to train on images, or drop {key} from the "
                    "batch (a text collator)."
                )


_GUARDS = (_VisionInputGuard, _TextOnlyGuard)


def _backbone(model: torch.nn.Module) -> tuple[torch.nn.Module, str]:
    # The module guard_max_seq_length hooks: the one every forward passes, trl's direct backbone calls included.
    base = _base_model(model)
    prefix = getattr(base, "base_model_prefix", "")
    backbone = getattr(base, prefix, None) if prefix else None
    if isinstance(backbone, torch.nn.Module):
        return backbone, prefix
    return base, type(base).__name__


def guard_vision_inputs(model: torch.nn.Module, max_seq_length: int | None = None) -> torch.nn.Module | None:
    """Check every batch's images before the forward: placeholders against images for a vision-language model with a
    row in :data:`VISION_RULES`, refusal of images for a text-only model.

    Installed once per model (a forward pre-hook on the decoder backbone, beside ``max_seq_length``'s); calling it
    again replaces the limit named in truncation messages. A vision-language model without a row is left unchecked.

    Args:
        model: A transformers model or a ``PeftModel``.
        max_seq_length: The model's ``max_seq_length``, named when truncation cut an image.

    Returns:
        The module the hook is on, or ``None`` where none is installed.

    Raises:
        ShapeContractError: From the hook, on a forward whose images do not fit (see the module docstring).
    """
    config = getattr(_base_model(model), "config", None)
    model_type = getattr(config, "model_type", None)
    rule = VISION_RULES.get(model_type)
    if rule is None and getattr(config, "vision_config", None) is not None:
        return None
    backbone, name = _backbone(model)
    for hook in backbone._forward_pre_hooks.values():
        if isinstance(hook, _GUARDS):
            if isinstance(hook, _VisionInputGuard):
                hook.max_seq_length = max_seq_length
            return backbone
    if rule is None:
        guard: _TextOnlyGuard | _VisionInputGuard = _TextOnlyGuard(name, model_type)
    else:
        # Read once: whether this transformers' backbone takes mm_token_type_ids (Qwen on 5.x does).
        takes = "mm_token_type_ids" in inspect.signature(backbone.forward).parameters
        guard = _VisionInputGuard(name, config, rule, max_seq_length, type_ids=rule.type_ids and takes)
    backbone.register_forward_pre_hook(guard, with_kwargs=True)
    return backbone


__all__ = ["VISION_RULES", "Expected", "VisionRule", "guard_vision_inputs"]
