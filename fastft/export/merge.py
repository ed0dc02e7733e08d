"""Merging LoRA adapters into dense base weights, one tensor at a time.

:func:`merge_plan` lists every tensor the merged model holds (name, shape, dtype) without computing any of them;
each :class:`MergedTensor` then produces its float32 rows on demand, a block of rows at a time, with the LoRA update
``B @ A * scale`` added for those rows only. The writers (:func:`.merged_save.save_merged`'s safetensors shards and
:func:`.gguf_export.save_gguf`) stream those blocks to disk, so merging a model never holds more than
one block of dense weights beside the model itself -- or, for a 4-bit base, one dequantised projection.
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from peft import PeftModel
from peft.tuners.lora import LoraLayer
from peft.utils import ModulesToSaveWrapper

from fastft.contracts import ShapeContractError
from fastft.kernels import dequantize_nf4
from fastft.patches.moe_experts import expert_views

# The name it had as fastft/merge.py, which logging configurations and filters use.
logger = logging.getLogger("fastft.merge")


def dense_weight(name: str, parameter: torch.Tensor) -> torch.Tensor:
    """A float32 dense copy of a parameter, dequantising bitsandbytes 4-bit weights.

    Args:
        name: The parameter's name, for error messages.
        parameter: A plain tensor or a bitsandbytes ``Params4bit``.

    Returns:
        A float32 tensor on the parameter's device.

    Raises:
        ShapeContractError: A 4-bit weight that lost its ``quant_state``.
        NotImplementedError: An 8-bit weight.
    """
    kind = type(parameter).__name__
    if kind == "Params4bit":
        import bitsandbytes.functional as bnb_functional

        packed, state = parameter.data, parameter.quant_state
        if getattr(state, "packing_format_for_cpu", False):
            # bitsandbytes' CPU inference path repacks the weight in place into a kernel-specific layout.
            packed, state = bnb_functional._convert_weight_packed_for_cpu_inverse(packed, copy.deepcopy(state))
        if state is not None and state.quant_type != "nf4":
            return bnb_functional.dequantize_4bit(packed, state).float()
        try:
            # fastft's dequantiser rather than bitsandbytes': bnb 0.50's AVX-512 CPU dequantize_4bit scales by the
            # wrong block when in_features is not a multiple of the blocksize. It also refuses a lost quant_state.
            return dequantize_nf4(packed, state).float()
        except ShapeContractError as error:
            raise ShapeContractError(f"{name}: {error}") from error
    if kind == "Int8Params":
        raise NotImplementedError(f"{name}: merging into 8-bit bitsandbytes weights is not supported; load in 4-bit.")
    return parameter.detach().float()


def dense_shape(name: str, parameter: torch.Tensor) -> tuple[int, ...]:
    """The shape :func:`dense_weight` returns for ``parameter``, read without dequantising it.

    Raises:
        ShapeContractError: A 4-bit weight that lost its ``quant_state``.
        NotImplementedError: An 8-bit weight.
    """
    kind = type(parameter).__name__
    if kind == "Params4bit":
        state = parameter.quant_state
        if state is None or getattr(state, "shape", None) is None:
            raise ShapeContractError(
                f"{name}: this 4-bit weight has no quant_state, so its dense shape is unknown; reload the model with "
                "FastModel.from_pretrained(..., load_in_4bit=True) instead of copying its weights by hand."
            )
        return tuple(int(size) for size in state.shape)
    if kind == "Int8Params":
        raise NotImplementedError(f"{name}: merging into 8-bit bitsandbytes weights is not supported; load in 4-bit.")
    return tuple(parameter.shape)


def _active_lora(name: str, layer: LoraLayer) -> list[tuple[torch.Tensor, torch.Tensor, float]]:
    """``(A, B, scale)`` of each adapter whose update the merged weight must hold."""
    if layer.merged or layer.disable_adapters:
        # A merged layer's base weight already holds the update; a disabled one contributes none.
        return []
    terms = []
    for adapter in layer.active_adapters:
        if adapter not in layer.lora_A:
            raise NotImplementedError(f"{name}: merging LoRA adapter {adapter!r} of this layer type is not supported.")
        if layer.use_dora.get(adapter, False):
            raise NotImplementedError(f"{name}: merging DoRA adapters is not supported yet.")
        terms.append((layer.lora_A[adapter].weight, layer.lora_B[adapter].weight, float(layer.scaling[adapter])))
    return terms


@dataclass
class MergedTensor:
    """One tensor of the merged model, produced on demand.

    Attributes:
        name: Its key in the merged state dict (the name plain transformers loads).
        shape: Its shape.
        dtype: ``torch.float32`` for floating-point tensors (the writer casts), else the stored dtype.
        parameter: Whether it is a parameter (``num_parameters`` counts it) rather than a buffer.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    parameter: bool
    _base: Callable[[], torch.Tensor] = field(repr=False)
    _lora: list[tuple[torch.Tensor, torch.Tensor, float]] = field(default_factory=list, repr=False)
    _fan_in_fan_out: bool = field(default=False, repr=False)
    # Per-expert updates of a 3-D [E, ...] tensor (peft's LoRA on parameters): (A, B, scale, transposed).
    _expert_lora: list[tuple[torch.Tensor, torch.Tensor, float, bool]] = field(default_factory=list, repr=False)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def chunks(self, max_elements: int) -> Iterator[torch.Tensor]:
        """The merged tensor as consecutive blocks of rows (dim 0) of at most ``max_elements`` values, on the CPU.

        Floating-point blocks are float32. A 4-bit base is dequantised once per call (the whole projection); any
        other base is read a block at a time, so only one block of dense weights exists at once.
        """
        base = self._base()
        if len(self.shape) < 2:
            yield self._rows(base, 0, self.shape[0] if self.shape else 1, whole=True)
            return
        per_row = max(1, self.numel // self.shape[0])
        step = max(1, max_elements // per_row)
        for start in range(0, self.shape[0], step):
            yield self._rows(base, start, min(start + step, self.shape[0]), whole=False)

    def expert(self, index: int) -> torch.Tensor:
        """Expert ``index``'s merged ``[out, in]`` matrix of a 3-D ``[E, out, in]`` tensor (float32, on the CPU)."""
        return self._rows(self._base(), index, index + 1, whole=False)[0]

    def whole(self) -> torch.Tensor:
        """The whole merged tensor (float32 when floating), on the CPU."""
        blocks = list(self.chunks(max(1, self.numel)))
        return blocks[0] if len(blocks) == 1 else torch.cat(blocks)

    def _rows(self, base: torch.Tensor, start: int, stop: int, whole: bool) -> torch.Tensor:
        rows = base if whole else base[start:stop]
        if not self.dtype.is_floating_point:
            return rows.detach().cpu()
        rows = rows.detach().float()
        for lora_a, lora_b, scale in self._lora:
            a, b = lora_a.detach().float().to(rows.device), lora_b.detach().float().to(rows.device)
            # One fused multiply-add per adapter, so a block costs one new buffer, not three. A fan_in_fan_out weight
            # is stored [in, out]: its rows are columns of B @ A.
            if self._fan_in_fan_out:
                rows = torch.addmm(rows, a[:, start:stop].T, b.T, alpha=scale)
            else:
                rows = torch.addmm(rows, b[start:stop], a, alpha=scale)
        for lora_a, lora_b, scale, transposed in self._expert_lora:
            update = _expert_update(lora_a, lora_b, self.shape[0], start, stop, transposed)
            rows = rows + scale * update.to(rows.device)
        rows = rows.cpu()
        expected = self.shape if whole else (stop - start, *self.shape[1:])
        if tuple(rows.shape) != tuple(expected):
            raise ShapeContractError(
                f"fastft.merge: {self.name} rows {start}:{stop} came out {tuple(rows.shape)}, expected "
                f"{tuple(expected)} (the tensor's planned shape is {self.shape}); its base weight or LoRA factors "
                "changed shape after the model was loaded."
            )
        return rows


def _expert_update(
    lora_a: torch.Tensor, lora_b: torch.Tensor, experts: int, start: int, stop: int, transposed: bool
) -> torch.Tensor:
    """``B_e @ A_e`` of experts ``start:stop`` (float32), from peft's stacked factors of a 3-D parameter
    (:func:`~fastft.patches.moe_experts.expert_views`); ``transposed``: the parameter stores each expert as
    ``[in, out]``."""
    a, b = expert_views(lora_a.detach().float(), lora_b.detach().float(), experts)
    update = torch.bmm(b[start:stop], a[start:stop])
    return update.transpose(1, 2) if transposed else update


@dataclass
class MergePlan:
    """Every tensor of the merged model, in state-dict order, and what the merge does to tied embeddings.

    Attributes:
        tensors: The tensors to write; a weight tied to one listed earlier (the LM head of a model with tied
            embeddings) is not listed again, as transformers' ``save_pretrained`` does.
        untied: The config ties the embeddings, but an adapter changed one of the pair, so both are listed and the
            saved config must set ``tie_word_embeddings=False`` (else the loader would drop the head's update).
    """

    tensors: list[MergedTensor]
    untied: bool

    @property
    def parameters(self) -> int:
        """How many parameters the merged model has (``PreTrainedModel.num_parameters()`` of the result)."""
        return sum(tensor.numel for tensor in self.tensors if tensor.parameter)


def _fixed(tensor: torch.Tensor) -> Callable[[], torch.Tensor]:
    return lambda: tensor


def _plain(name: str, tensor: torch.Tensor, parameter: bool) -> MergedTensor:
    shape = dense_shape(name, tensor)  # refuses an 8-bit weight, or a 4-bit one without its quant_state
    if type(tensor).__name__ == "Params4bit":
        # Dequantised when its rows are asked for, and only then.
        return MergedTensor(name, shape, torch.float32, parameter, lambda: dense_weight(name, tensor))
    dtype = torch.float32 if tensor.is_floating_point() else tensor.dtype
    return MergedTensor(name, shape, dtype, parameter, _fixed(tensor))


def merge_plan(model: torch.nn.Module) -> MergePlan:
    """List the tensors of ``model`` with every active LoRA update merged, without computing any of them.

    Args:
        model: A ``PeftModel`` with LoRA adapters, a plain ``PreTrainedModel``, or any module of one (a decoder
            layer, say).

    Returns:
        The plan; names are relative to the base model (``model.layers.0.self_attn.q_proj.weight``).

    Raises:
        NotImplementedError: DoRA adapters, non-LoRA adapters on a LoRA layer, or 8-bit weights.
        ShapeContractError: A 4-bit weight that lost its ``quant_state``.
    """
    base = model.get_base_model() if isinstance(model, PeftModel) else model
    tensors: list[MergedTensor] = []
    written: set[int] = set()
    handled: list[str] = []
    for name, module in base.named_modules():
        if any(name.startswith(prefix) for prefix in handled):
            continue
        prefix = f"{name}." if name else ""
        if isinstance(module, LoraLayer) and getattr(module, "parameter_name", None) is not None:
            tensors += _parameter_wrapped(name, prefix, module)
            handled.append(prefix)
        elif isinstance(module, LoraLayer):
            base_layer = module.get_base_layer()
            weight = base_layer.weight
            entry = _plain(f"{prefix}weight", weight, parameter=True)
            entry._lora = _active_lora(name, module)
            entry._fan_in_fan_out = bool(getattr(module, "fan_in_fan_out", False))
            tensors.append(entry)
            if getattr(base_layer, "bias", None) is not None:
                tensors.append(_plain(f"{prefix}bias", base_layer.bias, parameter=True))
            handled.append(prefix)
        elif isinstance(module, ModulesToSaveWrapper):
            chosen = (
                module.original_module if module.disable_adapters else module.modules_to_save[module.active_adapter]
            )
            owned = {id(parameter) for parameter in chosen.parameters()}
            for key, tensor in chosen.state_dict(keep_vars=True).items():
                tensors.append(_plain(f"{prefix}{key}", tensor, parameter=id(tensor) in owned))
            handled.append(prefix)
        else:
            for key, parameter in module.named_parameters(recurse=False):
                if id(parameter) in written:
                    # Tied to a weight written earlier: saved once, as transformers does.
                    continue
                written.add(id(parameter))
                tensors.append(_plain(f"{prefix}{key}", parameter, parameter=True))
            for key, buffer in module.named_buffers(recurse=False):
                if key not in module._non_persistent_buffers_set:
                    tensors.append(_plain(f"{prefix}{key}", buffer, parameter=False))
    return MergePlan(tensors, untied=_untied(base, {tensor.name for tensor in tensors}))


def _parameter_wrapped(name: str, prefix: str, module: LoraLayer) -> list[MergedTensor]:
    """The tensors of a module under peft's LoRA on parameters (``ParamWrapper``, one per targeted parameter,
    nested): its own parameters and buffers, each targeted one with its per-expert updates."""
    updates: dict[str, list[tuple[torch.Tensor, torch.Tensor, float, bool]]] = {}
    layer: torch.nn.Module = module
    while isinstance(layer, LoraLayer) and getattr(layer, "parameter_name", None) is not None:
        parameter = layer.get_param()
        for lora_a, lora_b, scale in _active_lora(name, layer):
            if parameter.dim() != 3:
                raise NotImplementedError(
                    f"{name}.{layer.parameter_name}: merging peft's LoRA on a {parameter.dim()}-D parameter is not "
                    "supported (3-D expert stacks are)."
                )
            # peft swaps in / out for a 3-D parameter unless its module says it stores experts transposed.
            transposed = not getattr(layer, "_did_swap_in_out_features", False)
            updates.setdefault(layer.parameter_name, []).append((lora_a, lora_b, scale, transposed))
        layer = layer.base_layer
    entries = []
    for key, tensor in layer.state_dict(keep_vars=True).items():
        entry = _plain(f"{prefix}{key}", tensor, parameter=isinstance(tensor, torch.nn.Parameter))
        entry._expert_lora = updates.get(key, [])
        entries.append(entry)
    return entries


def _untied(base: torch.nn.Module, names: set[str]) -> bool:
    config = getattr(base, "config", None)
    if not getattr(config, "tie_word_embeddings", False):
        return False
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if head is None:
        return False
    head_name = next((name for name, module in base.named_modules() if module is head), None)
    # A tied head whose weight is the embeddings' own is skipped by the plan; a listed head was changed by an
    # adapter (LoRA on lm_head, or a trained modules_to_save copy of either side).
    return head_name is not None and f"{head_name}.weight" in names


def merged_state_dict(model: torch.nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The merged model's whole state dict in ``dtype`` on the CPU, built from :func:`merge_plan`.

    This holds every tensor at once; to write a model, stream :meth:`MergedTensor.chunks` instead (as
    ``FastModel.save_merged`` does). Meant for one decoder layer or a small model.

    Args:
        model: As for :func:`merge_plan`.
        dtype: dtype of the floating-point tensors returned.

    Returns:
        Tensors keyed by the names plain transformers expects.
    """
    state = {}
    for tensor in merge_plan(model).tensors:
        value = tensor.whole()
        state[tensor.name] = value.to(dtype) if value.is_floating_point() else value
    return state
