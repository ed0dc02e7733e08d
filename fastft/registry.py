"""Patch registry: which fastft patch applies to a model instance, and what happened to each.

Every patch is applied to one model instance (never to the upstream classes), and its outcome is recorded on
that instance so :func:`patch_report` can show it. No patch is registered yet: every model runs the stock
transformers + peft path until the kernel patches land.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

_REPORT_ATTR = "_fastft_patch_report"


@dataclass(frozen=True)
class Patch:
    """One registered patch.

    Attributes:
        name: Stable name shown in reports, e.g. ``"llama.rms_norm"``.
        target: The upstream object it replaces, as a dotted path.
        apply: Applies the patch to one model instance; returns a reason string when it chose to skip.
    """

    name: str
    target: str
    apply: Callable[[torch.nn.Module], str | None]


PATCHES: list[Patch] = []


def apply_patches(model: torch.nn.Module, enabled: bool = True) -> list[dict]:
    """Apply every registered patch to ``model`` and record the outcome on it.

    Args:
        model: The model instance to patch.
        enabled: ``False`` records every patch as ``"disabled"`` and changes nothing (``patch=False``).

    Returns:
        The report, as :func:`patch_report` returns it.
    """
    report = []
    for patch in PATCHES:
        if not enabled:
            report.append({"name": patch.name, "status": "disabled", "reason": "patch=False"})
            continue
        reason = patch.apply(model)
        status = "applied" if reason is None else "skipped"
        report.append({"name": patch.name, "status": status, "reason": reason or ""})
    setattr(model, _REPORT_ATTR, report)
    return report


def patch_report(model: torch.nn.Module) -> list[dict]:
    """List every registered patch and what happened to it on this model.

    Args:
        model: A model from ``FastModel.from_pretrained`` or ``FastModel.get_peft_model``.

    Returns:
        One dict per registered patch with keys ``name``, ``status`` (``"applied"``, ``"skipped"`` or
        ``"disabled"``) and ``reason``. Empty while no patch is registered.

    Raises:
        ValueError: ``model`` did not come through ``FastModel``.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    report = getattr(base, _REPORT_ATTR, None)
    if report is None:
        raise ValueError(
            f"fastft.patch_report: {type(model).__name__} was not loaded with FastModel.from_pretrained, "
            "so fastft has no patch record for it."
        )
    return [dict(row) for row in report]
