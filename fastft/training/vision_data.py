"""Image + text chat examples for vision-language models: rows read for ``fastft train``, and the collator that turns
them into training batches through the model's own processor and chat template.

An example is a chat (``messages``: ``role`` and ``content``), where a content is text or a list of parts:
``{"type": "text", "text": ...}`` and ``{"type": "image", "image": ...}``, the image a file path, a PIL image, or an
RGB array (numpy or torch, ``[height, width, 3]`` or ``[3, height, width]``, uint8, or floats in [0, 1]). An image
part without an ``image`` takes the next one from the example's ``images`` list (trl's format, as in
``HuggingFaceH4/llava-instruct-mix-vsft``).

:class:`VisionDataCollator` renders each chat with the processor's chat template, runs the processor on the texts and
images of the batch (``input_ids``, ``attention_mask``, ``pixel_values``, ``image_grid_thw`` and whatever else the
processor returns), and sets labels for response-only loss: -100 on system and user turns, the turn markers, the image
placeholder tokens and padding; the assistant's replies (and their end-of-turn token) are learned. The turns are found
by :mod:`fastft.training.turns`, as for text.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fastft.contracts import ShapeContractError
from fastft.training.turns import IGNORE_INDEX, build_masker, snippet, text_tokenizer

NAME = "fastft.VisionDataCollator"
# Column a prepared dataset carries so that an error names the example's index in the dataset, not in the batch.
INDEX_COLUMN = "example_index"
# Per-token outputs of a processor: laid out again (truncated, right-padded) with input_ids; the rest pass unchanged.
# Processors that take a batch's images as one list per example (Llama 3.2 Vision's pairs each example's
# ``<|image|>`` tokens with its own images); the others take one flat list in placeholder order.
_NESTED_IMAGES = frozenset({"MllamaProcessor"})
# Per-image outputs, never laid out per token, whatever their first two sizes happen to be.
_PER_IMAGE_PREFIXES = ("pixel_", "image_", "aspect_ratio", "video_")
_IMAGE_FORMS = "a file path, a PIL image, or an RGB array of shape [height, width, 3] or [3, height, width]"


def where(example: Mapping[str, Any], position: int) -> str:
    """How an error names an example: by its dataset index when the rows carry one, else by its place in the batch."""
    index = example.get(INDEX_COLUMN) if isinstance(example, Mapping) else None
    return f"example {index}" if index is not None else f"example {position} of the batch"


def _array_image(value: Any, name: str) -> Any:
    from PIL import Image

    array = value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
    if array.ndim == 3 and array.shape[-1] != 3 and array.shape[0] == 3:
        array = array.transpose(1, 2, 0)
    if array.ndim != 3 or array.shape[-1] != 3:
        raise ShapeContractError(
            f"{name}: an image array of shape {list(array.shape)}; expected [height, width, 3] or [3, height, width] "
            "(RGB). Convert grey or RGBA images to RGB first (PIL: image.convert('RGB'))."
        )
    if array.dtype.kind == "f":
        if not np.isfinite(array).all() or array.min() < 0 or array.max() > 1:
            raise ValueError(
                f"{name}: a float image array with values in [{array.min()}, {array.max()}]; expected floats in "
                "[0, 1] or uint8 in [0, 255]."
            )
        array = np.rint(array * 255)
    elif array.dtype.kind in "iub" and array.size and (array.min() < 0 or array.max() > 255):
        raise ValueError(
            f"{name}: an integer image array with values in [{array.min()}, {array.max()}]; expected 0-255."
        )
    elif array.dtype.kind not in "iubf":
        raise ValueError(f"{name}: an image array of dtype {array.dtype}; expected uint8 or floats in [0, 1].")
    return Image.fromarray(np.ascontiguousarray(array.astype(np.uint8)), mode="RGB")


def load_image(value: Any, name: str) -> Any:
    """An RGB PIL image from a path, a PIL image, an array, or a datasets ``{"bytes", "path"}`` dict.

    Args:
        value: The image.
        name: How errors name it (``"example 3, image 0"``).

    Returns:
        The image, RGB.

    Raises:
        ShapeContractError: An array that is not ``[height, width, 3]`` or ``[3, height, width]``.
        ValueError: A missing or unreadable file, values out of range, or a value of another type.
    """
    from PIL import Image, UnidentifiedImageError

    if isinstance(value, Mapping) and (value.get("bytes") or value.get("path")):
        value = io.BytesIO(value["bytes"]) if value.get("bytes") else value["path"]
    if isinstance(value, Image.Image):
        return value.convert("RGB")
    if isinstance(value, (np.ndarray, torch.Tensor)):
        return _array_image(value, name)
    if isinstance(value, (str, Path, io.BytesIO)):
        if not isinstance(value, io.BytesIO) and not Path(value).is_file():
            raise ValueError(
                f"{name}: the image file {str(value)!r} does not exist; fix the path (a JSONL file's relative paths "
                "are read from the file's folder) or drop the example."
            )
        try:
            with Image.open(value) as image:
                return image.convert("RGB")
        except (UnidentifiedImageError, OSError) as error:
            raise ValueError(
                f"{name}: {str(value)!r} cannot be read as an image ({type(error).__name__}: {error}); expected a PNG, "
                "JPEG or other file PIL opens."
            ) from error
    raise ValueError(f"{name}: an image of type {type(value).__name__}; expected {_IMAGE_FORMS}.")


def split_images(example: Mapping[str, Any], name: str) -> tuple[list[dict[str, Any]], list[Any]]:
    """An example's chat with image parts reduced to ``{"type": "image"}`` (what chat templates render), and its
    images in the order the parts take them.

    Args:
        example: A row with ``messages`` and, optionally, ``images`` (or one ``image``) for parts without one.
        name: How errors name the example.

    Returns:
        ``(messages, images)``, the images as the example holds them (not loaded).

    Raises:
        ValueError: No messages, a message without role or content, a part of an unknown type, or image parts and
            ``images`` that differ in number.
    """
    messages = example.get("messages") if isinstance(example, Mapping) else None
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise ValueError(
            f"{NAME}: {name} has no 'messages' (a list of {{'role', 'content'}} turns); keys: "
            f"{sorted(example) if isinstance(example, Mapping) else type(example).__name__}."
        )
    extra = example.get("images")
    if extra is None and example.get("image") is not None:
        extra = [example["image"]]
    extra = list(extra or [])
    images, taken, chat = [], 0, []
    for number, message in enumerate(messages):
        if not isinstance(message, Mapping) or not message.get("role") or message.get("content") is None:
            raise ValueError(f"{NAME}: {name} message {number} needs a 'role' and a 'content'; got {message!r}.")
        content = message["content"]
        if isinstance(content, str):
            chat.append({"role": message["role"], "content": content})
            continue
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind == "text":
                parts.append({"type": "text", "text": part.get("text") or ""})
            elif kind == "image":
                if part.get("image") is not None:
                    images.append(part["image"])
                elif taken < len(extra):
                    images.append(extra[taken])
                    taken += 1
                else:
                    raise ValueError(
                        f"{NAME}: {name} message {number} has an image part with no 'image' and no image left in the "
                        f"example's 'images' ({len(extra)}); give each image part an 'image' (a path, PIL image or "
                        "array) or list the images in 'images'."
                    )
                parts.append({"type": "image"})
            else:
                raise ValueError(
                    f"{NAME}: {name} message {number} has a part of type {kind!r}; expected 'text' or 'image' parts "
                    f"({part!r})."
                )
        chat.append({"role": message["role"], "content": parts})
    if taken != len(extra):
        raise ValueError(
            f"{NAME}: {name} lists {len(extra)} images in 'images' but its messages have {taken} image parts that "
            "take one; give each image its {'type': 'image'} part."
        )
    return chat, images


class VisionDataCollator:
    """Turns image + text chats into a batch for a vision-language model, with response-only labels.

    Args:
        processor: The model's processor (what ``FastModel.from_pretrained`` returns for a vision-language model),
            with its chat template.
        max_length: Longest example in tokens (image tokens included), usually the model's ``max_seq_length``.
            Longer examples are cut at the end; one whose image tokens reach past it is refused, never cut inside an
            image. ``None``: no limit.
        instruction_part: Text that opens a non-assistant turn (or several); read from the chat template when
            ``None`` (:func:`fastft.training.turns.build_masker`).
        response_part: Text that opens an assistant turn; read from the chat template when ``None``.
        packing: The trainer's ``packing`` / ``padding_free`` setting. Examples are never packed here: with it set,
            a batch that holds an image is refused (a packed row would need each image's positions restarted with
            its example, which the model's M-RoPE position builder does not do).

    Raises:
        TypeError: ``processor`` is a tokenizer or has no image processor.
        ValueError: The turn markers cannot be read from the chat template.
    """

    def __init__(
        self,
        processor: Any,
        max_length: int | None = None,
        instruction_part: str | Sequence[str] | None = None,
        response_part: str | None = None,
        packing: bool = False,
    ) -> None:
        if getattr(processor, "image_processor", None) is None or not hasattr(processor, "apply_chat_template"):
            raise TypeError(
                f"{NAME}: needs the model's processor (image processor, tokenizer and chat template); got "
                f"{type(processor).__name__}. FastModel.from_pretrained returns it for a vision-language model; when "
                "it returned the tokenizer, its warning names what is missing."
            )
        if max_length is not None and max_length < 1:
            raise ValueError(f"{NAME}: max_length must be a positive number of tokens or None; got {max_length}.")
        self.processor = processor
        self.max_length = max_length
        self.packing = packing
        self.tokenizer = text_tokenizer(processor)
        self.masker = build_masker(processor, instruction_part, response_part)
        tokens = [getattr(processor, name, None) for name in ("image_token", "video_token")]
        self.image_token = tokens[0] or "<image>"
        ids = [self.tokenizer.convert_tokens_to_ids(token) for token in tokens if token]
        ids = [i for i in ids if i is not None and i != self.tokenizer.unk_token_id]
        self.image_token_ids = torch.tensor(ids, dtype=torch.long)
        pad = self.tokenizer.pad_token_id
        self.pad_token_id = pad if pad is not None else self.tokenizer.eos_token_id

    def render(self, example: Mapping[str, Any], position: int = 0) -> tuple[str, list[Any]]:
        """One example's text through the chat template and its images, loaded and checked.

        Args:
            example: The row.
            position: Its place in the batch (named in errors when the row carries no index).

        Returns:
            ``(text, images)``.

        Raises:
            ShapeContractError, ValueError: See :func:`split_images` and :func:`load_image`; also a template that
                renders a different number of image placeholders than the example has images.
        """
        name = where(example, position)
        chat, raw = split_images(example, name)
        images = [load_image(image, f"{NAME}: {name}, image {number}") for number, image in enumerate(raw)]
        text = self.processor.apply_chat_template(chat, tokenize=False, add_generation_prompt=False)
        placeholders = text.count(self.image_token)
        if placeholders != len(images):
            raise ValueError(
                f"{NAME}: {name} has {len(images)} images but the chat template rendered {placeholders} "
                f"{self.image_token!r} placeholders; use the model's own chat template (it must render "
                "{'type': 'image'} parts), and give each image one part."
            )
        return text, images

    def __call__(self, examples: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        """The batch: the processor's outputs, truncated and right-padded, and ``labels``.

        Raises:
            ShapeContractError: Packing with an image; an example whose image tokens reach past ``max_length``; a
                bad image array.
            ValueError: A bad example or image, or an example with no assistant token left to train on.
        """
        if not examples:
            raise ValueError(f"{NAME}: an empty batch.")
        texts, images, names, per_example = [], [], [], []
        for position, example in enumerate(examples):
            text, example_images = self.render(example, position)
            packed = isinstance(example, Mapping) and ("seq_lengths" in example or "position_ids" in example)
            if example_images and (self.packing or packed):
                raise ShapeContractError(
                    f"{NAME}: {where(example, position)} holds {len(example_images)} image(s) and the batch is packed "
                    "(packing / padding_free): image batches are not packed, since each image's M-RoPE positions "
                    "would have to restart with its example. Set packing=False and padding_free=False."
                )
            texts.append(text)
            images.extend(example_images)
            per_example.append(example_images)
            names.append(where(example, position))
        if images and type(self.processor).__name__ in _NESTED_IMAGES:
            images = per_example
        batch = self.processor(text=texts, images=images or None, padding=True, return_tensors="pt")
        return self._lay_out(dict(batch), names)

    def _lay_out(self, batch: dict[str, Any], names: list[str]) -> dict[str, torch.Tensor]:
        """Each row's real tokens (wherever the processor padded), cut to ``max_length`` and right-padded again,
        with labels."""
        input_ids, attention = batch["input_ids"], batch.get("attention_mask")
        valid = torch.ones_like(input_ids, dtype=torch.bool) if attention is None else attention.bool()
        rows = []
        for row, name in enumerate(names):
            tokens = input_ids[row][valid[row]]
            image = torch.isin(tokens, self.image_token_ids)
            if self.max_length is not None and len(tokens) > self.max_length:
                last = int(image.nonzero().max()) if image.any() else -1
                if last >= self.max_length:
                    raise ShapeContractError(
                        f"{NAME}: {name} is {len(tokens)} tokens and its image tokens run to position {last}; "
                        f"max_length={self.max_length} would cut inside an image. Raise max_seq_length (--seq-len) to "
                        f"{len(tokens)}, use smaller images (the image processor's max_pixels), or drop the example."
                    )
                tokens, image = tokens[: self.max_length], image[: self.max_length]
            keep = torch.from_numpy(self.masker.mask(tokens)) & ~image
            if not keep.any():
                raise ValueError(
                    f"{NAME}: {name} has no assistant token left to train on ({len(tokens)} tokens: "
                    f"{snippet(self.tokenizer, tokens.tolist())}); its reply was cut by max_length={self.max_length} "
                    "or it has no assistant turn. Raise max_seq_length, or drop the example."
                )
            rows.append((len(tokens), keep))
        width = max(length for length, _ in rows)
        # Every per-token tensor (ids, masks, token types, Llama 3.2 Vision's per-token cross_attention_mask) is
        # laid out like input_ids; per-image ones (pixel values, grids) pass through.
        per_token = [
            key
            for key, value in batch.items()
            if isinstance(value, torch.Tensor)
            and value.shape[:2] == input_ids.shape
            and not key.startswith(_PER_IMAGE_PREFIXES)
        ]
        out = {key: value for key, value in batch.items() if key not in per_token}
        for key in per_token:
            fill = self.pad_token_id if key == "input_ids" else 0
            laid = torch.full((len(rows), width, *batch[key].shape[2:]), fill, dtype=batch[key].dtype)
            for row, (length, _) in enumerate(rows):
                laid[row, :length] = batch[key][row][valid[row]][:length]
            out[key] = laid
        if "attention_mask" not in out:
            out["attention_mask"] = (torch.arange(width) < torch.tensor([n for n, _ in rows])[:, None]).long()
        labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
        for row, (length, keep) in enumerate(rows):
            labels[row, :length] = torch.where(keep, out["input_ids"][row, :length], IGNORE_INDEX)
        out["labels"] = labels
        return out


def _resolved(value: Any, folder: Path | None) -> Any:
    if folder is None or not isinstance(value, str) or Path(value).is_absolute():
        return value
    return str(folder / value)


def prepare_vision_rows(dataset: Any, folder: Path | None, source: str) -> Any:
    """Rows of a vision dataset for :class:`VisionDataCollator`: each checked, relative image paths read from
    ``folder``, and each row's index in :data:`INDEX_COLUMN` (named by the collator's errors).

    Args:
        dataset: A ``datasets.Dataset`` with ``messages`` (and optionally ``images``).
        folder: The data file's folder, against which relative image paths are resolved; ``None`` leaves them.
        source: The data's name in messages (``--data``'s value).

    Returns:
        The rows, with absolute image paths and the index column.

    Raises:
        fastft.training.data.DataError: A row whose chat is malformed or whose image file does not exist, named by
            its index.
    """
    from fastft.training.data import DataError

    def resolve(row: dict, index: int) -> dict:
        name = f"example {index}"
        try:
            _, images = split_images(row, name)
        except ValueError as error:
            raise DataError(f"fastft train: --data {source}: {error}") from error
        for number, image in enumerate(images):
            path = _resolved(image, folder)
            if isinstance(path, str) and not Path(path).is_file():
                raise DataError(
                    f"fastft train: --data {source}: {name}, image {number}: the file {path!r} does not exist; fix the "
                    "path (relative paths are read from the data file's folder) or drop the example."
                )
        messages = [
            {
                **message,
                "content": message["content"]
                if isinstance(message["content"], str)
                else [{**part, "image": _resolved(part.get("image"), folder)} for part in message["content"]],
            }
            for message in row["messages"]
        ]
        update = {"messages": messages, INDEX_COLUMN: index}
        if row.get("images") is not None:
            update["images"] = [_resolved(image, folder) for image in row["images"]]
        return update

    return dataset.map(resolve, with_indices=True)


def has_images(dataset: Any) -> bool:
    """Whether any row of a ``datasets.Dataset`` holds an image (an image part, or an ``images`` / ``image``
    column)."""
    columns = set(dataset.column_names)
    if "images" in columns or "image" in columns:
        return True
    if "messages" not in columns:
        return False
    for messages in dataset["messages"]:
        for message in messages or ():
            content = message.get("content") if isinstance(message, Mapping) else None
            if not isinstance(content, str) and any(
                isinstance(part, Mapping) and part.get("type") == "image" for part in content or ()
            ):
                return True
    return False


def trainer_settings() -> dict[str, Any]:
    """``SFTConfig`` fields a vision run needs with :class:`VisionDataCollator`: the raw rows reach the collator (no
    column removal, no tokenizing in advance)."""
    return {"remove_unused_columns": False, "dataset_kwargs": {"skip_prepare_dataset": True}}


__all__ = [
    "INDEX_COLUMN",
    "VisionDataCollator",
    "has_images",
    "load_image",
    "prepare_vision_rows",
    "split_images",
    "trainer_settings",
    "where",
]
