"""The decoder layer as one autograd node (:mod:`fastft.kernels.lora_decoder_layer`), where the layer is Llama-shaped
and every part of it already takes the fused path.

The per-module patches (RMSNorm, attention, MLP) still decide everything: this forward asks the attention and MLP
modules for their kept plans (:func:`~fastft.patches.decoder.attention_plan`, :func:`~fastft.patches.decoder.
mlp_plan`) and runs the one node only when both are fully fused (q / k / v with RoPE, o, the gated MLP), both norms
are the family's fused RMSNorm, nothing is hooked into the layer's parts, and the call needs nothing the node does not
do (a KV cache, attention weights, learnable rotary tables). Otherwise the layer runs upstream's own forward, part
by part, through the per-module patches, exactly as before. Which way a call went never changes its numbers: the
node computes what the separate nodes compute, in the same order, with the same kernels.

The forward takes upstream's signature for the installed transformers (read once, as the attention's is) and hands
the attention function the arguments upstream's layer would have handed the attention module.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch

from fastft.checkpointing.rerun import listening, offer
from fastft.kernels.custom_ops import compiling
from fastft.kernels.lora_decoder_layer import DecoderLayerSpec, lora_decoder_layer
from fastft.kernels.lora_group import LoRAGroup
from fastft.kernels.lora_layer_program import LayerProgram
from fastft.kernels.lora_mlp import LoRAMLP
from fastft.kernels.lora_projection import autocast_dtype
from fastft.patches.arguments import ArgumentReader
from fastft.patches.decoder import Family, attention_plan, mlp_plan, rms_norm_forward
from fastft.patches.lora_layers import forward_replaced
from fastft.patches.plans import PLAN_ATTRIBUTE, group_objects, group_stamp, planned

# KV-cache argument names across transformers releases (5.24, 4.56–5.23, 4.53–4.55).
_CACHE_NAMES = ("cache", "past_key_values", "past_key_value")
_module = torch.nn.modules.module
_GLOBAL_HOOKS = (
    _module._global_forward_hooks,
    _module._global_forward_pre_hooks,
    _module._global_backward_hooks,
    _module._global_backward_pre_hooks,
)


def upstream_layer_forward(upstream_class: type) -> Callable[..., Any]:
    """The layer class's own forward, beneath transformers' checkpointing wrapper (5.23 and later), which a subclass's
    forward gets again from ``GradientCheckpointingLayer.__init_subclass__``. ``functools.wraps`` gives the wrapper the
    forward's name, not its code, which keeps its own. Also what :mod:`fastft.loading.compile` compiles."""
    forward = upstream_class.forward
    if getattr(getattr(forward, "__code__", None), "co_name", None) == "forward_with_checkpointing":
        return forward.__wrapped__
    return forward


def returns_tuple() -> bool:
    """Whether the installed transformers' decoder layers return ``(hidden_states,)`` (4.53–4.55) or the tensor."""
    import transformers
    from packaging.version import Version

    return Version(transformers.__version__) < Version("4.56")


def _plain(module: torch.nn.Module) -> bool:
    """No hook and no instance-level forward (accelerate's device hooks set one) on ``module``."""
    state = module.__dict__
    # Spelled out rather than any() over a tuple of names: five of these run per layer per call.
    return not (
        state["_forward_hooks"]
        or state["_forward_pre_hooks"]
        or state["_backward_hooks"]
        or state["_backward_pre_hooks"]
        or forward_replaced(state)
    )


def _spec(layer: torch.nn.Module, attention: Any, mlp: Any) -> DecoderLayerSpec | None:
    """The layer's node spec for these plans, or None when a part is not fused."""
    spec = None
    if (
        attention.rotary is not None
        and isinstance(attention.qkv, LoRAGroup)
        and attention.qkv.split is None
        and isinstance(attention.o_group, LoRAGroup)
        and isinstance(mlp, LoRAMLP)
    ):
        modules = layer.__dict__["_modules"]
        spec = DecoderLayerSpec(
            attention.qkv,
            attention.o_group,
            mlp,
            modules["input_layernorm"].variance_epsilon,
            modules["post_attention_layernorm"].variance_epsilon,
            modules["self_attn"].head_dim,
        )
    return spec


def _layer_plan(
    layer: torch.nn.Module, family: Family, attention_module: torch.nn.Module, mlp_module: torch.nn.Module
) -> tuple[tuple[Any, DecoderLayerSpec | None], list[Any]]:
    """``((attention plan, node spec or None), objects to keep alive)``: what :func:`planned` keeps on the layer.

    The attention and MLP modules' own plans decide; the layer keeps their answer under the union of their stamps,
    so a call compares one stamp instead of looking up two plans and checking the spec against both."""
    attention = attention_plan(family, attention_module)
    spec = _spec(layer, attention, mlp_plan(family, mlp_module))
    keep = [attention_module, mlp_module, *group_objects(attention_module, family.qkv + family.o)]
    return (attention, spec), keep + group_objects(mlp_module, family.mlp)


def _layer_stamp(family: Family, attention_module: torch.nn.Module, mlp_module: torch.nn.Module) -> tuple[Any, ...]:
    """What :func:`attention_plan` and :func:`mlp_plan` stamp, together, and which modules they were asked about (their
    plans live on them): equal stamps give the same plans."""
    return (
        id(attention_module),
        id(mlp_module),
        torch.is_grad_enabled(),
        attention_module.config._attn_implementation,
        group_stamp(attention_module, family.qkv + family.o),
        group_stamp(mlp_module, family.mlp),
    )


def decoder_layer_forward(family: Family, upstream_class: type, returns_tuple: bool = False) -> Callable[..., Any]:
    """The fused forward for ``upstream_class`` (a Llama-shaped decoder layer; its installed signature, shown as its
    own).

    Args:
        family: The layer's family (its attention and MLP patches make the plans this forward reads).
        upstream_class: The upstream decoder-layer class.
        returns_tuple: Upstream's layer returns ``(hidden_states,)`` (transformers 4.53–4.55), not the tensor.
    """
    upstream = upstream_layer_forward(upstream_class)
    signature = inspect.signature(upstream)
    reader = ArgumentReader(signature)
    attention_reader = ArgumentReader(inspect.signature(family.upstream_class("Attention").forward))
    # What upstream's layer hands its attention module besides the hidden states; of that, what the attention
    # forward passes on to the attention function (the rest it reads itself).
    handed = [name for name in reader.named if name != "hidden_states"]
    passed_on = tuple(name for name in handed if name not in attention_reader.named and name not in _CACHE_NAMES)
    cache_names = tuple(name for name in handed if name in _CACHE_NAMES)

    def forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        if compiling():
            # Traced through the per-module patches, whose custom ops the compiler sees.
            return upstream(self, *args, **kwargs)
        named, extra = reader.read(self, args, kwargs)
        out = _fused(self, named, extra)
        if out is None:
            return upstream(self, **named, **extra)
        return (out,) if returns_tuple else out

    def _fused(self: torch.nn.Module, named: dict[str, Any], extra: dict[str, Any]) -> torch.Tensor | None:
        hidden_states = named["hidden_states"]
        position_embeddings = named.get("position_embeddings")
        if (
            position_embeddings is None
            or named.get("output_attentions")
            or any(named[name] is not None for name in cache_names)
            or any(name in extra for name in _CACHE_NAMES)
            or any(_GLOBAL_HOOKS)
            or hidden_states.dim() != 3
        ):
            return None
        modules = self.__dict__["_modules"]
        attention_module, mlp_module = modules["self_attn"], modules["mlp"]
        input_norm, post_norm = modules["input_layernorm"], modules["post_attention_layernorm"]
        if not (
            type(input_norm).forward is rms_norm_forward
            and type(post_norm).forward is rms_norm_forward
            and _plain(attention_module)
            and _plain(mlp_module)
            and _plain(input_norm)
            and _plain(post_norm)
        ):
            return None
        cos, sin = position_embeddings
        if cos.shape[-1] != attention_module.head_dim or cos.requires_grad or sin.requires_grad:
            return None
        attention, spec = planned(
            self,
            _layer_stamp(family, attention_module, mlp_module),
            lambda: _layer_plan(self, family, attention_module, mlp_module),
        )
        if spec is None:
            return None
        mask = named.get("attention_mask")
        options = {name: named[name] for name in passed_on}
        options.update(extra)
        options.update(attention.extra)
        dropout = attention_module.attention_dropout if attention_module.training else 0.0
        scaling = attention_module.scaling
        function = attention.attention
        batch, seq = hidden_states.shape[0], hidden_states.shape[1]

        def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
            out, _ = function(attention_module, query, key, value, mask, dropout=dropout, scaling=scaling, **options)
            return out.reshape(batch, seq, -1).contiguous()

        run = functools.partial(
            lora_decoder_layer,
            spec,
            cos=cos,
            sin=sin,
            attend=attend,
            input_weight=input_norm.weight,
            post_weight=post_norm.weight,
            dtype=autocast_dtype(hidden_states),
        )
        if listening() and _plain(self) and not any(tensor.requires_grad for tensor in spec.frozen):
            # The checkpointer's recompute (autograd on) would come back here and make this same call: a trainable
            # frozen weight would send it elsewhere, and a hook on the layer would have to run again.
            offer(hidden_states, run, functools.partial(run, output=False))
        return run(hidden_states)

    forward.__signature__ = signature
    forward.__doc__ = f"``{upstream_class.__name__}.forward`` as one fused autograd node where every part is fused."
    return forward


def layer_programs(model: torch.nn.Module) -> dict[str, int]:
    """How many decoder layers of ``model`` run as one fused node under their current plan (``fused_layers``), and
    how many of those hold a straight-line program (:mod:`fastft.kernels.lora_layer_program`) for some plan key
    (``programs``): one only after the layer's first call under that key. ``fastft bench`` records it in each fastft
    row."""
    fused = programs = 0
    for module in model.modules():
        plan = module.__dict__.get(PLAN_ATTRIBUTE)
        value = None if plan is None else plan.value
        if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], DecoderLayerSpec):
            fused += 1
            table = value[1].programs or {}
            programs += any(isinstance(program, LayerProgram) for program in table.values())
    return {"fused_layers": fused, "programs": programs}


__all__ = ["decoder_layer_forward", "layer_programs", "returns_tuple", "upstream_layer_forward"]
