"""Writing safetensors shards tensor block by tensor block, with the index transformers writes.

transformers' ``save_pretrained`` needs the whole state dict in memory and builds each shard in memory before writing
it. A safetensors file is an 8-byte header length, a JSON header with each tensor's dtype, shape and byte range, then
the raw bytes; everything the header says is known from the shapes alone, so here the header is written first and
each tensor's bytes follow as its producer yields them. Shard boundaries and file names come from huggingface_hub's
own splitter, so the files and ``model.safetensors.index.json`` are those ``save_pretrained`` would write.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Protocol

import torch
from huggingface_hub import split_state_dict_into_shards_factory

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
# Blocks of 4M values: 16 MB of float32 rows, the most of the merged weights held at once besides a 4-bit projection.
BLOCK_ELEMENTS = 1 << 22
F16_MAX = 65504.0
_DTYPE_NAMES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
_UNITS["TIB"] = 2**40


class Producer(Protocol):
    """A tensor to write: its name, shape, dtype and its values as blocks of rows (``MergedTensor`` is one)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    def chunks(self, max_elements: int) -> Iterator[torch.Tensor]: ...


def parse_shard_size(value: int | str, where: str = "fastft.save_merged") -> int:
    """``max_shard_size`` in bytes: an int, or a string such as ``"5GB"``, ``"500MB"`` or ``"2GiB"``.

    Units follow huggingface_hub: KB, MB, GB, TB are powers of 1000, KiB, MiB, GiB, TiB powers of 1024.

    Raises:
        ValueError: Anything else, or a size that is not positive.
    """
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    else:
        match = (
            re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", value, re.IGNORECASE)
            if isinstance(value, str)
            else None
        )
        if match is None:
            raise ValueError(
                f"{where}: max_shard_size={value!r} is not a size; pass an int of bytes or a string such as "
                "'5GB', '500MB' or '2GiB'."
            )
        size = int(float(match.group(1)) * _UNITS[(match.group(2) or "").upper()])
    if size < 1:
        raise ValueError(f"{where}: max_shard_size={value!r} must be at least one byte; the default is '5GB'.")
    return size


def stored_dtype(tensor: Producer, dtype: torch.dtype) -> torch.dtype:
    """The dtype ``tensor`` is written in: ``dtype`` for floating-point tensors, its own otherwise."""
    return dtype if tensor.dtype.is_floating_point else tensor.dtype


def stored_bytes(tensor: Producer, dtype: torch.dtype) -> int:
    return math.prod(tensor.shape) * stored_dtype(tensor, dtype).itemsize


def _header(tensors: Sequence[Producer], dtype: torch.dtype) -> bytes:
    entries: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for tensor in tensors:
        target = stored_dtype(tensor, dtype)
        if target not in _DTYPE_NAMES:
            raise ValueError(f"fastft.save_merged: {tensor.name} has dtype {target}, which safetensors cannot store.")
        nbytes = stored_bytes(tensor, dtype)
        entries[tensor.name] = {
            "dtype": _DTYPE_NAMES[target],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    text = json.dumps(entries, separators=(",", ":")).encode()
    # safetensors pads the header with spaces so the data starts 8-byte aligned.
    return text + b" " * (-len(text) % 8)


def check_block(block: torch.Tensor, name: str, where: str, fp16_fix: str | None = None) -> None:
    """Refuse a merged block that holds NaN or inf, or, when it is stored as float16 (``fp16_fix`` given: what to
    do instead), one beyond float16's range. Reads the block once, without a temporary copy of it.

    Raises:
        ValueError: Naming ``where``, the tensor and the fix.
    """
    if not block.is_floating_point() or not block.numel():
        return
    low, high = (value.item() for value in torch.aminmax(block))
    # aminmax propagates NaN, and an inf anywhere is the minimum or the maximum.
    if not (math.isfinite(low) and math.isfinite(high)):
        raise ValueError(
            f"{where}: the merged tensor {name} holds NaN or inf values; the adapter (or the training run) diverged. "
            "Check the model before writing it."
        )
    if fp16_fix is not None and max(-low, high) > F16_MAX:
        raise ValueError(f"{where}: {name} has values beyond float16's range (|x| > {F16_MAX:g}); {fp16_fix}.")


def write_shard(path: Path, tensors: Sequence[Producer], dtype: torch.dtype, progress: object | None = None) -> int:
    """Write one safetensors file holding ``tensors`` (floating ones cast to ``dtype``), block by block.

    Args:
        path: The file to write.
        tensors: What it holds, in order.
        dtype: dtype of the floating-point tensors.
        progress: A tqdm bar advanced by the bytes written, or ``None``.

    Returns:
        Bytes of tensor data written.
    """
    header = _header(tensors, dtype)
    written = 0
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(header)))
        handle.write(header)
        for tensor in tensors:
            target = stored_dtype(tensor, dtype)
            expected = stored_bytes(tensor, dtype)
            done = 0
            fp16_fix = "save with dtype=torch.bfloat16 or torch.float32" if target == torch.float16 else None
            for block in tensor.chunks(BLOCK_ELEMENTS):
                check_block(block, tensor.name, "fastft.save_merged", fp16_fix)
                data = block.to(target).contiguous().reshape(-1).view(torch.uint8)
                handle.write(data.numpy().data)
                done += data.numel()
                if progress is not None:
                    progress.update(data.numel())
            if done != expected:
                raise ValueError(
                    f"fastft.save_merged: {tensor.name} produced {done} bytes, expected {expected} for shape "
                    f"{tensor.shape} in {target}; the model changed while it was being saved."
                )
            written += done
        handle.flush()
        # On disk before the folder is renamed into place, so a power loss cannot leave a truncated shard.
        os.fsync(handle.fileno())
    return written


def plan_shards(
    tensors: Sequence[Producer], dtype: torch.dtype, max_shard_size: int
) -> tuple[dict[str, list[Producer]], dict[str, int]]:
    """Split ``tensors`` into files as ``save_pretrained`` would: huggingface_hub's splitter, on the stored sizes.

    Returns:
        ``(file name -> its tensors in order, the index metadata's sizes)``; one file means no index.
    """
    by_name = {tensor.name: tensor for tensor in tensors}
    split = split_state_dict_into_shards_factory(
        by_name,
        get_storage_size=lambda tensor: stored_bytes(tensor, dtype),
        filename_pattern=WEIGHTS_NAME.replace(".safetensors", "{suffix}.safetensors"),
        max_shard_size=max_shard_size,
    )
    files = {file: [by_name[name] for name in names] for file, names in split.filename_to_tensors.items()}
    return files, dict(split.metadata)


def write_index(folder: Path, files: dict[str, list[Producer]], metadata: dict[str, int], parameters: int) -> Path:
    """Write ``model.safetensors.index.json`` as transformers 5 does (sorted keys, 2-space indent)."""
    weight_map = {tensor.name: file for file, tensors in files.items() for tensor in tensors}
    index = {"metadata": {"total_parameters": parameters, **metadata}, "weight_map": weight_map}
    path = folder / INDEX_NAME
    path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return path
