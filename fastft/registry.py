"""Version-pinned patch registry: which fastft patch runs on which library versions, per model instance.

A patch is known by its name (``"llama.rms_norm"``) and may have several :class:`PatchRecord` s, one per range of
upstream versions it was written and tested against. For each name, :func:`apply_patches` picks the one record whose
ranges hold the installed versions, checks that the upstream object still has the signature the record was written
for, and only then changes the model instance (swapping one module's class; upstream classes and functions are
never edited). A name with no matching record, or a changed signature, is skipped: the model keeps the stock
upstream module there, one ``UserWarning`` says which patches were skipped and why, and ``FASTFT_STRICT=1`` turns
that into a :class:`PatchSkippedError` before anything is changed.

Supporting a new transformers release is a new record beside the old one::

    register(PatchRecord(name="llama.rms_norm", target=..., versions={"transformers": ">=5.24,<=5.30.1"}, ...))
"""

from __future__ import annotations

import importlib
import inspect
import os
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

import torch
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

_REPORT_ATTR = "_fastft_patch_report"
_RECORDS_ATTR = "_fastft_applied_records"
STRICT_ENV = "FASTFT_STRICT"

APPLIED = "applied"
SKIPPED = "skipped"
NOT_APPLICABLE = "not applicable"
DISABLED = "disabled"


class PatchSkippedError(RuntimeError):
    """A patch was skipped while ``FASTFT_STRICT=1`` asked for every patch to apply."""


@dataclass(frozen=True)
class PatchRecord:
    """One patch, as written and tested against one range of upstream versions.

    Attributes:
        name: Stable name shown in reports, e.g. ``"llama.rms_norm"``. Records sharing a name are versions of one
            patch; at most one of them may match any set of installed versions.
        target: Dotted path of the upstream object the patch stands in for, e.g.
            ``"transformers.models.llama.modeling_llama.LlamaRMSNorm.forward"``.
        versions: Library name to the ``packaging`` specifier of the versions the record was tested against,
            e.g. ``{"transformers": ">=4.53.3,<=4.57.6"}``.
        fingerprint: The target's signature as :func:`signature_fingerprint` writes it, when the record was written.
        applies_to: Given the model, a reason it does not apply (another architecture, another activation), or
            ``None`` when it does.
        apply: Patches one model instance; returns how many modules it changed.
        replacement: What the patch puts in place (e.g. the module subclass), for reports and tests.
        fallbacks: Given the model, the patched places that currently run the stock path instead (a layer name to
            the reason), for patches that decide per layer; None for all-or-nothing patches.
        model_types: The ``config.model_type`` s the patch is written for (``("qwen3",)``); empty for a patch of any
            architecture (the checkpointer); ``("*",)`` for every architecture no other patch names (the generic
            fused loss). A model's report lists only the patches of its own architecture and
            the architecture-free ones.
        gemm_groups: The fused LoRA projection groups the patch runs (``"qkv"``, ``"o"``, ``"gate_up"``, ``"down"``),
            whose base GEMM :mod:`fastft.kernels.gemm_tuner` places on cuBLAS or Triton; the report shows each choice.
    """

    name: str
    target: str
    versions: Mapping[str, str]
    fingerprint: str
    applies_to: Callable[[torch.nn.Module], str | None]
    apply: Callable[[torch.nn.Module], int]
    replacement: Any = None
    fallbacks: Callable[[torch.nn.Module], dict[str, str]] | None = None
    gemm_groups: tuple[str, ...] = ()
    model_types: tuple[str, ...] = ()
    specifiers: Mapping[str, SpecifierSet] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "specifiers", {lib: SpecifierSet(spec) for lib, spec in self.versions.items()})

    def tested(self) -> str:
        """The record's ranges as text, e.g. ``"transformers >=4.53.3,<=4.57.6"``."""
        return ", ".join(f"{lib} {spec}" for lib, spec in self.versions.items())


_RECORDS: dict[str, list[PatchRecord]] = {}
_WARNED: set[str] = set()


def register(record: PatchRecord) -> PatchRecord:
    """Add a record to the registry.

    Args:
        record: The record. Its ranges must not overlap those of another record with the same name.

    Returns:
        The record, so a module can keep a reference.

    Raises:
        ValueError: A record of the same name already covers a version this one covers (checked on the endpoints
            and the lowest version of each range).
    """
    for other in _RECORDS.get(record.name, []):
        shared = set(other.versions) & set(record.versions)
        if shared and all(_ranges_overlap(other.versions[lib], record.versions[lib]) for lib in shared):
            raise ValueError(
                f"fastft.registry: {record.name} has two records for overlapping versions: "
                f"[{other.tested()}] and [{record.tested()}]; narrow one of them."
            )
    _RECORDS.setdefault(record.name, []).append(record)
    return record


def _ranges_overlap(a: str, b: str) -> bool:
    specs = [*SpecifierSet(a), *SpecifierSet(b)]
    probes = {Version(spec.version) for spec in specs if _is_version(spec.version)}
    return any(probe in SpecifierSet(a) and probe in SpecifierSet(b) for probe in probes)


def _is_version(text: str) -> bool:
    try:
        Version(text)
    except InvalidVersion:
        return False
    return True


def records() -> dict[str, list[PatchRecord]]:
    """Every registered record, by patch name, in registration order (``import fastft.patches`` registers the
    built-in ones; the registry imports no patch itself)."""
    return {name: list(group) for name, group in _RECORDS.items()}


def installed_version(library: str) -> str | None:
    """The installed version of ``library``, as the imported module reports it (``None`` when not installed).

    The module's ``__version__`` comes first, so a test can pretend another version is installed.
    """
    try:
        module = importlib.import_module(library)
    except ImportError:
        return None
    version = getattr(module, "__version__", None)
    if version is None:
        try:
            version = metadata.version(library)
        except metadata.PackageNotFoundError:
            return None
    return str(version)


def resolve_target(path: str) -> Any:
    """Import the object at a dotted path such as ``"pkg.module.Class.method"``.

    Raises:
        ImportError: No prefix of the path is an importable module, or an attribute along it is missing.
    """
    parts = path.split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for attribute in parts[split:]:
            if not hasattr(obj, attribute):
                raise ImportError(f"{'.'.join(parts[:split])} has no attribute path {'.'.join(parts[split:])}")
            obj = getattr(obj, attribute)
        return obj
    raise ImportError(f"no module along {path} can be imported")


def signature_fingerprint(obj: Callable[..., Any]) -> str:
    """The parts of a callable's signature a replacement depends on: names, kinds and defaults, in order.

    Annotations are left out: upstream rewrites ``Optional[X]`` as ``X | None`` between releases without changing
    what a caller may pass. A function or class default is written by its dotted name, since its ``repr`` holds a
    memory address.
    """
    parts = []
    for parameter in inspect.signature(obj).parameters.values():
        text = parameter.name
        if parameter.kind is parameter.VAR_POSITIONAL:
            text = "*" + text
        elif parameter.kind is parameter.VAR_KEYWORD:
            text = "**" + text
        elif parameter.kind is parameter.KEYWORD_ONLY:
            text = "kw:" + text
        if parameter.default is not parameter.empty:
            default = parameter.default
            named = inspect.isfunction(default) or inspect.isclass(default) or inspect.isbuiltin(default)
            text += f"={default.__module__}.{default.__qualname__}" if named else f"={default!r}"
        parts.append(text)
    return "(" + ", ".join(parts) + ")"


def _versions_of(libraries: set[str]) -> dict[str, str | None]:
    return {library: installed_version(library) for library in sorted(libraries)}


def _matches(record: PatchRecord, installed: Mapping[str, str | None]) -> bool:
    for library, specifier in record.specifiers.items():
        version = installed.get(library)
        if version is None:
            return False
        try:
            if not specifier.contains(Version(version), prereleases=True):
                return False
        except InvalidVersion:
            return False
    return True


def select(name: str, group: list[PatchRecord]) -> tuple[PatchRecord | None, str]:
    """Pick the record of one patch for the installed versions and check its fingerprint.

    Args:
        name: The patch name.
        group: Its records.

    Returns:
        ``(record, "")`` when one matches and its target's signature is unchanged, else ``(None, reason)``.
    """
    installed = _versions_of({library for record in group for library in record.versions})
    matching = [record for record in group if _matches(record, installed)]
    if not matching:
        have = ", ".join(f"{library} {version or 'not installed'}" for library, version in installed.items())
        tested = "; ".join(record.tested() for record in group)
        return None, f"installed {have} is outside every tested range ({tested})"
    record = matching[0]
    try:
        target = resolve_target(record.target)
    except ImportError as error:
        return None, f"upstream {record.target} is gone ({error})"
    found = signature_fingerprint(target)
    if found != record.fingerprint:
        return None, (
            f"upstream {record.target} changed its signature: tested against {record.fingerprint}, "
            f"installed has {found}"
        )
    return record, ""


def strict_mode() -> bool:
    """Whether ``FASTFT_STRICT`` asks for a skipped patch to be an error."""
    return os.environ.get(STRICT_ENV, "0").strip().lower() not in ("", "0", "false", "no")


def apply_patches(model: torch.nn.Module, enabled: bool = True, strict: bool | None = None) -> list[dict]:
    """Apply every registered patch that fits the installed versions to ``model`` and record the outcome on it.

    Args:
        model: The model instance to patch (a transformers ``PreTrainedModel``).
        enabled: ``False`` records every patch as ``"disabled"`` and changes nothing (``patch=False``).
        strict: Raise instead of skipping; ``None`` reads ``FASTFT_STRICT`` from the environment.

    Returns:
        The report, as :func:`patch_report` returns it.

    Raises:
        PatchSkippedError: ``FASTFT_STRICT=1`` and a patch that applies to this model was skipped; raised before
            any patch is applied.
    """
    plan = []
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    for name, group in records().items():
        # Another architecture's patches are not this model's business: its report leaves them out.
        if not _concerns(group[0], model_type):
            continue
        row = {"name": name, "target": group[0].target, "status": "", "reason": "", "tested": "", "modules": 0}
        record = None
        if not enabled:
            row.update(status=DISABLED, reason="patch=False")
        else:
            record, reason = select(name, group)
            not_applicable = (record or group[0]).applies_to(model)
            if not_applicable:
                row.update(status=NOT_APPLICABLE, reason=not_applicable)
                record = None
            elif record is None:
                row.update(status=SKIPPED, reason=reason, tested="; ".join(r.tested() for r in group))
            else:
                row.update(target=record.target, tested=record.tested())
        plan.append((row, record))

    unsupported = _unsupported_architecture(model, model_type)
    if unsupported is not None:
        plan.insert(0, (unsupported, None))
        if enabled and unsupported["reason"] not in _WARNED:
            _WARNED.add(unsupported["reason"])
            warnings.warn(f"fastft: {unsupported['reason']}.", UserWarning, stacklevel=3)

    skipped = [row for row, _ in plan if row["status"] == SKIPPED]
    if skipped:
        message = "fastft: running the stock upstream path for " + "; ".join(
            f"{row['name']} ({row['reason']})" for row in skipped
        )
        if strict_mode() if strict is None else strict:
            raise PatchSkippedError(
                f"{message}. {STRICT_ENV}=1 forbids skipping a patch: install a tested version "
                f"(README, 'Supported versions') or unset {STRICT_ENV}."
            )
        if message not in _WARNED:
            _WARNED.add(message)
            warnings.warn(message + ". Training is correct but slower.", UserWarning, stacklevel=3)

    applied = {}
    for row, record in plan:
        if record is not None:
            row.update(status=APPLIED, modules=record.apply(model))
            # The record's position, not the record: its callables are closures, and models must still pickle.
            applied[row["name"]] = records()[row["name"]].index(record)
    report = [row for row, _ in plan]
    setattr(model, _REPORT_ATTR, report)
    setattr(model, _RECORDS_ATTR, applied)
    return _with_fallbacks(model, report)


ARCHITECTURE_ROW = "architecture"


# In model_types: the patch is for every architecture that no other patch names (a generic fallback).
OTHER_ARCHITECTURES = "*"


def supported_model_types() -> list[str]:
    """The ``config.model_type`` s some registered patch is written for."""
    named = {t for group in _RECORDS.values() for record in group for t in record.model_types}
    return sorted(named - {OTHER_ARCHITECTURES})


def _concerns(record: PatchRecord, model_type: str | None) -> bool:
    if not record.model_types:
        return True
    if OTHER_ARCHITECTURES in record.model_types:
        return model_type not in supported_model_types()
    return model_type in record.model_types


def _unsupported_architecture(model: torch.nn.Module, model_type: str | None) -> dict | None:
    """The report row of a model no architecture patch is written for, or None."""
    supported = supported_model_types()
    if not supported or model_type in supported:
        return None
    generic = [name for name, group in _RECORDS.items() if _concerns(group[0], model_type)]
    reason = (
        f"no fused patches for model_type {model_type!r} ({type(model).__name__}): its norms, attention and MLP "
        f"run stock transformers (fused architectures: {', '.join(supported)}); the architecture-free patches "
        f"({', '.join(generic) or 'none'}) apply where they can, as patch_report shows"
    )
    return {
        "name": ARCHITECTURE_ROW,
        "target": type(model).__name__,
        "status": NOT_APPLICABLE,
        "reason": reason,
        "tested": "",
        "modules": 0,
    }


def _with_fallbacks(model: torch.nn.Module, report: list[dict]) -> list[dict]:
    applied = getattr(model, _RECORDS_ATTR, {})
    rows = []
    for row in report:
        index = applied.get(row["name"])
        record = None if index is None else records()[row["name"]][index]
        fallbacks = record.fallbacks(model) if record is not None and record.fallbacks is not None else {}
        rows.append({**row, "fallbacks": fallbacks, "gemm": _gemm_paths(record)})
    return rows


def _gemm_paths(record: PatchRecord | None) -> dict[str, str]:
    """Per fused group of an applied patch, the GEMM it ran last in this process, or what it will run."""
    if record is None or not record.gemm_groups:
        return {}
    from fastft.kernels import gemm_tuner

    made = gemm_tuner.by_group()
    pending = f"not run yet; {gemm_tuner.policy()}"
    return {group: made.get(group, pending) for group in record.gemm_groups}


def patch_report(model: torch.nn.Module) -> list[dict]:
    """List every registered patch and what happened to it on this model.

    Args:
        model: A model from ``FastModel.from_pretrained`` or ``FastModel.get_peft_model``.

    Returns:
        One dict per registered patch with keys ``name``, ``status`` (``"applied"``, ``"skipped"``,
        ``"not applicable"`` or ``"disabled"``), ``reason`` (why it was skipped or does not apply), ``target``
        (the upstream object it stands in for), ``tested`` (the version ranges of the record used, or of every
        record when none matched), ``modules`` (how many modules it changed), ``fallbacks`` (for per-layer
        patches: each patched layer that runs the stock path as the model stands now, with the reason, e.g.
        ``{"model.layers.0.mlp": "gate_proj: lora_dropout p=0.1 (fused only without dropout)"}``) and ``gemm``
        (for the attention and MLP patches: per fused group, the base GEMM it ran last in this process, cuBLAS or
        Triton, and why; e.g. ``{"qkv": "cublas (compute capability 7.5 < 8.0: ...)"}``).

    Raises:
        ValueError: ``model`` did not come through ``FastModel``.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    report = getattr(base, _REPORT_ATTR, None)
    if report is None:
        raise ValueError(
            f"fastft.patch_report: {type(model).__name__} was not loaded with FastModel.from_pretrained, "
            "so fastft has no patch record for it (a model built elsewhere gets one from fastft.apply(model))."
        )
    return _with_fallbacks(base, report)


def format_report(report: list[dict]) -> str:
    """The report as aligned text lines, as ``fastft doctor`` prints it."""
    lines = []
    for row in report:
        detail = row["reason"] or (f"{row['modules']} modules; tested {row['tested']}" if row["tested"] else "")
        lines.append(f"  {row['name']:<22} {row['status']:<15} {detail}".rstrip())
        for layer, reason in row.get("fallbacks", {}).items():
            lines.append(f"    stock path: {layer}: {reason}")
        for group, path in row.get("gemm", {}).items():
            lines.append(f"    GEMM {group}: {path}")
    return "\n".join(lines)
