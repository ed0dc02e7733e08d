"""A local checkpoint's attention weights checked against its config before anything is loaded.

transformers meets a projection whose stored width disagrees with config.json only while loading, and then either
re-initialises it (``ignore_mismatched_sizes``) or raises a long per-tensor report. The shapes are in the
safetensors headers, so fastft reads them first (no tensor data) and names the projection, both shapes and the fix.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from fastft.contracts.attention import attention_shape
from fastft.kernels.errors import ShapeContractError

_PROJECTION = re.compile(r"(?:^|\.)(q_proj|k_proj|v_proj|qkv_proj|o_proj)\.weight$")
_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"


def _weight_files(folder: Path) -> list[Path]:
    index = folder / _INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        return sorted({folder / name for name in weight_map.values()})
    single = folder / _SINGLE
    return [single] if single.is_file() else []


def check_checkpoint(source: str | Path, config: Any, skip: tuple[str, ...] = ()) -> int:
    """Check the attention projections stored in a local safetensors checkpoint against ``config``.

    Only the headers are read. A hub id, a folder without safetensors, or a packed 4-bit tensor (stored as bytes)
    is not checked here; :func:`fastft.contracts.check_projections` checks the loaded modules anyway.

    Args:
        source: The folder ``from_pretrained`` was given.
        config: Its config (already checked by :func:`fastft.contracts.check_config`).
        skip: Module names (one part of a tensor's dotted name, e.g. ``"vision_tower"``) whose projections are not
            the config's text attention: a vision tower's have its own sizes.

    Returns:
        How many projection tensors were checked.

    Raises:
        ShapeContractError: A q / k / v / qkv / o projection whose stored ``[out, in]`` is not the config's; the
            message names the tensor, both shapes and the fix.
    """
    folder = Path(source)
    if not folder.is_dir():
        return 0
    files = _weight_files(folder)
    if not files:
        return 0
    from safetensors import safe_open

    shape = attention_shape(config)
    expected = shape.projections()
    skip_parts = frozenset(skip)
    checked = 0
    for file in files:
        with safe_open(str(file), "pt") as handle:
            for key in handle.keys():  # noqa: SIM118 (safe_open handles are not iterable)
                match = _PROJECTION.search(key)
                if match is None or not skip_parts.isdisjoint(key.split(".")):
                    continue
                stored = handle.get_slice(key)
                if len(stored.get_shape()) != 2 or stored.get_dtype() in ("U8", "I8"):
                    continue
                actual = tuple(int(n) for n in stored.get_shape())
                proj = match.group(1)
                if actual != expected[proj]:
                    where = f"{key[: -len('.weight')]} in {file}"
                    raise ShapeContractError(shape.mismatch(where, proj, expected[proj], actual))
                checked += 1
    return checked


__all__ = ["check_checkpoint"]
