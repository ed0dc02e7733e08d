"""One family's patch records from a table: each part (norm, attention, MLP, loss head ...) registered once per
transformers range, with the forward signature that range's upstream class has.

The vision-language families and gpt-oss register four or five parts over three or four ranges each; a table and
this one loop replace a registration loop per file.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType

from fastft.patches.decoder import swap_class
from fastft.registry import PatchRecord, register

# The forward signature of a part no range overrides: a norm's or an MoE block's.
DEFAULT_FINGERPRINT = "(self, hidden_states)"


@dataclass(frozen=True)
class Part:
    """One patched class of a family.

    Attributes:
        name: The record's part name (``"attention"``): the record is ``<family>.<name>``.
        upstream: transformers' class whose ``forward`` the record targets.
        fast: fastft's replacement class.
        applies_to: The record's ``applies_to`` (which models it patches).
        fallbacks: The record's ``fallbacks``, or None.
        gemm_groups: The fused GEMM groups the part's modules run (``("qkv", "o")``).
        swap: ``(upstream, fast) -> apply``: how the record swaps the class (every instance by default; a
            vision-language family passes one that spares its vision tower).
    """

    name: str
    upstream: type
    fast: type
    applies_to: Callable
    fallbacks: Callable | None = None
    gemm_groups: tuple[str, ...] = ()
    swap: Callable[[type, type], Callable] = swap_class


def register_parts(
    family: str,
    module: ModuleType,
    model_type: str,
    ranges: Iterable[tuple[str, Mapping[str, str]]],
    parts: Sequence[Part],
) -> None:
    """Register every part for every transformers range.

    Args:
        family: The records' name prefix (``"qwen2_5_vl"``).
        module: transformers' modeling module the upstream classes live in (the records' target prefix).
        model_type: The ``config.model_type`` the records are for.
        ranges: ``(transformers specifier, {part name: forward signature})`` per range; a part the mapping does
            not name has :data:`DEFAULT_FINGERPRINT`.
        parts: The family's parts.
    """
    for versions, fingerprints in ranges:
        for part in parts:
            register(
                PatchRecord(
                    name=f"{family}.{part.name}",
                    target=f"{module.__name__}.{part.upstream.__name__}.forward",
                    versions={"transformers": versions},
                    fingerprint=fingerprints.get(part.name, DEFAULT_FINGERPRINT),
                    applies_to=part.applies_to,
                    apply=part.swap(part.upstream, part.fast),
                    replacement=part.fast,
                    fallbacks=part.fallbacks,
                    gemm_groups=part.gemm_groups,
                    model_types=(model_type,),
                )
            )


__all__ = ["DEFAULT_FINGERPRINT", "Part", "register_parts"]
