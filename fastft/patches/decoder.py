"""The decoder bodies every fused family shares: RMSNorm, the gated MLP, attention and the causal-LM loss.

A family (Llama, Mistral, Qwen2, Qwen3, ...) differs from Llama in a few steps, not in its forward: a bias on q / k / v
(read into :class:`~fastft.kernels.LoRAWeights` by :mod:`fastft.patches.lora_layers`), a per-head ``q_norm`` /
``k_norm`` between the projection and RoPE, the sliding window handed to the attention function. :class:`Family`
names those steps; :func:`attention_forward` builds the one attention forward from them and from the upstream
signature, so it takes its arguments exactly as upstream does in every transformers version a record covers (the
5.24 ``cache``, the 5.0–5.23 ``past_key_values``, the 4.56–4.57 ``past_key_values`` + ``cache_position``, the
4.53–4.55 ``past_key_value``).

Each family module defines its subclasses as plain ``class`` statements (so a patched model pickles and
``inspect.getmodule`` names the family module) with ``forward = ...`` from here, and registers them with
:func:`register_family`. The attention function (eager / sdpa / flash) and the KV cache stay upstream's.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch

from fastft.kernels import LoRAGroup, apply_rope, rms_norm
from fastft.kernels.custom_ops import compiling
from fastft.kernels.lora_mlp_math import GATES
from fastft.kernels.lora_qkv_rope import lora_qkv_rope
from fastft.patches.arguments import ArgumentReader
from fastft.patches.causal_lm import head_reason
from fastft.patches.fused_groups import fused_mlp, fused_o_group, fused_packed_qkv, fused_qkv
from fastft.patches.lora_layers import group_weights
from fastft.patches.plans import group_objects, group_stamp, planned
from fastft.registry import PatchRecord, register

# The gated MLP activations the fused path has kernels for (config name -> lora_mlp's activation).
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


def _no_window(module: torch.nn.Module) -> dict[str, Any]:
    return {}


RotaryTables = Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class Family:
    """What a decoder family does differently from Llama.

    Attributes:
        name: The patch-name prefix (``"qwen3"`` gives ``qwen3.attention``).
        model_type: ``config.model_type`` of its models.
        upstream: The transformers modeling module (``transformers.models.qwen3.modeling_qwen3``).
        prefix: Its class-name prefix (``"Qwen3"``: ``Qwen3Attention``, ``Qwen3MLP`` ...).
        head_norms: Whether attention normalises q and k per head (``q_norm`` / ``k_norm``) before RoPE.
        attention_kwargs: Extra keyword arguments upstream hands its attention function (the sliding window).
        activation_attr: The config attribute naming the MLP activation (Gemma: ``hidden_activation``).
        qkv: The q, k, v projection names, or the one packed projection (Phi-3's ``("qkv_proj",)``), whose output
            splits at heads · head_dim, kv_heads · head_dim, kv_heads · head_dim.
        mlp: The gate, up, down projection names, or a packed gate_up and down (``("gate_up_proj", "down_proj")``).
        o: The output projection's name.
        rotary_tables: ``(module, cos, sin) -> (cos, sin)``: turns the tables the rotary embedding hands the
            attention into Llama's ``[batch, seq, head_dim]`` ones, which the fused RoPE takes. gpt-oss's half-width
            tables are repeated (:func:`repeat_half_tables`); Qwen2.5-VL's ``[3, batch, seq, head_dim]`` M-RoPE
            tables are recomposed by its sections. None: the tables are Llama's already.
        call_kwargs: Extra keyword arguments for the attention function read from the module on every call
            (gpt-oss's learned sinks, ``s_aux``), so a parameter swapped after the plan was made is still the one
            used.
        class_names: Part to upstream class name where a family's classes do not follow ``prefix + part``
            (Qwen2.5-VL's text MLP is ``Qwen2MLP``).
        position_ids_to_attention: Hand the forward's ``position_ids`` on to the attention function, as upstream
            does where flash attention reads packed rows' boundaries from them.
        returns_cache: The attention forward returns ``(output, weights, cache)``, as Qwen2.5-VL's does in
            transformers 4.53–4.55, instead of ``(output, weights)``.
    """

    name: str
    model_type: str
    upstream: ModuleType
    prefix: str
    head_norms: bool = False
    attention_kwargs: Callable[[torch.nn.Module], dict[str, Any]] = _no_window
    activation_attr: str = "hidden_act"
    qkv: tuple[str, ...] = ("q_proj", "k_proj", "v_proj")
    mlp: tuple[str, ...] = ("gate_proj", "up_proj", "down_proj")
    o: tuple[str, ...] = field(default=("o_proj",))
    rotary_tables: RotaryTables | None = None
    call_kwargs: Callable[[torch.nn.Module], dict[str, Any]] | None = None
    class_names: tuple[tuple[str, str], ...] = ()
    position_ids_to_attention: bool = False
    returns_cache: bool = False

    def upstream_class(self, part: str) -> type:
        """The upstream class of one part (``"RMSNorm"``, ``"Attention"``, ``"MLP"``, ``"ForCausalLM"``)."""
        return getattr(self.upstream, dict(self.class_names).get(part, f"{self.prefix}{part}"))


def repeat_half_tables(
    module: torch.nn.Module, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """A :attr:`Family.rotary_tables` for half-width tables (gpt-oss rotates the ``(x1, x2)`` halves of each head with
    them): repeated to full width they give exactly Llama's ``rotate_half`` rotation."""
    return torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)


def rms_norm_forward(self: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """A Llama-style RMSNorm (``weight · x̂`` cast back to x's dtype) through the fused kernel, dX and dW included."""
    return rms_norm(hidden_states, self.weight, self.variance_epsilon)


def gemma_rms_norm_forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A Gemma-style RMSNorm (``(1 + weight) · x̂`` in fp32, then cast) through the fused kernel."""
    return rms_norm(x, self.weight, self.eps, offset=1.0, cast_before_weight=False)


def mlp_activation(config: Any, attr: str = "hidden_act") -> str | None:
    """lora_mlp's name for the config's gated-MLP activation, or None when no fused kernel computes it."""
    return ACTIVATIONS.get(getattr(config, attr, None))


def _mlp_runner(family: Family, module: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """``run(x)``: the MLP fused, or through the projections' own forwards when the fused kernel cannot serve them."""
    activation = mlp_activation(module.config, family.activation_attr)
    weights = group_weights(module, family.mlp)
    if not isinstance(weights, str):
        return fused_mlp(family.mlp, weights, activation)
    gate_kernel = GATES[activation]
    if len(family.mlp) == 2:
        gate_up_name = family.mlp[0]

        def unfused(x: torch.Tensor) -> torch.Tensor:
            gate, up = getattr(module, gate_up_name)(x).chunk(2, dim=-1)
            return module.down_proj(gate_kernel(gate, up))
    else:

        def unfused(x: torch.Tensor) -> torch.Tensor:
            return module.down_proj(gate_kernel(module.gate_proj(x), module.up_proj(x)))

    return unfused


def _mlp_plan(family: Family, module: torch.nn.Module) -> tuple[Any, list[Any]]:
    """``(run, keep)``: :func:`_mlp_runner`'s ``run``, and what the kept plan keeps alive."""
    return _mlp_runner(family, module), group_objects(module, family.mlp)


def gated_mlp_forward(family: Family) -> Callable[..., torch.Tensor]:
    """The family's gated MLP (SwiGLU or GeGLU, by its config; gate and up separate or packed) as one fused LoRA-MLP
    node; a layer the fused kernel cannot serve runs its projections' own forwards around the gate kernel. The
    forward takes the upstream MLP's signature (``(self, x)``, Phi-3's ``(self, hidden_states)``).

    What runs is decided once and kept in a :mod:`plan <fastft.patches.plans>` until a projection's stamp changes.
    """
    signature = inspect.signature(family.upstream_class("MLP").forward)
    reader = ArgumentReader(signature)
    input_name = reader.named[0]

    def forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> torch.Tensor:
        x = args[0] if len(args) == 1 and not kwargs else reader.read(self, args, kwargs)[0][input_name]
        # While the tracer runs, no plan: it reads the modules itself and guards on what it read.
        return mlp_plan(family, self)(x)

    forward.__signature__ = signature
    forward.__doc__ = f"``{family.prefix}MLP.forward`` as one fused LoRA-MLP node."
    return forward


def _interface(family: Family, module: torch.nn.Module) -> Callable[..., Any]:
    functions = family.upstream.ALL_ATTENTION_FUNCTIONS
    name = module.config._attn_implementation
    eager = family.upstream.eager_attention_forward
    if hasattr(functions, "get_interface"):
        return functions.get_interface(name, eager)
    # transformers 4.x looks the function up by name.
    return eager if name == "eager" else functions[name]


def qkv_widths(module: torch.nn.Module) -> tuple[int, int, int]:
    """q, k and v widths of an attention module, from its config: heads · head_dim, then kv_heads · head_dim twice."""
    config = module.config
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return (
        config.num_attention_heads * module.head_dim,
        kv_heads * module.head_dim,
        kv_heads * module.head_dim,
    )


def _qkv_runner(family: Family, module: torch.nn.Module) -> Callable[[torch.Tensor], tuple[torch.Tensor, ...]]:
    """``run(hidden_states) -> (q, k, v)``, each ``[..., out_i]``: fused, or the projections' own forwards."""
    weights = group_weights(module, family.qkv)
    if len(family.qkv) == 1:
        widths = qkv_widths(module)
        if isinstance(weights, str):
            name = family.qkv[0]
            split = list(widths)
            return lambda hidden_states: getattr(module, name)(hidden_states).split(split, dim=-1)
        return fused_packed_qkv(family.qkv, weights, widths)
    if isinstance(weights, str):
        names = family.qkv
        return lambda hidden_states: tuple(getattr(module, name)(hidden_states) for name in names)
    return fused_qkv(family.qkv, weights)


def _o_runner(family: Family, module: torch.nn.Module) -> tuple[Callable[[torch.Tensor], torch.Tensor], Any]:
    """``(run, group)``: ``run(attn_output)``, and the fused :class:`LoRAGroup` it calls (None when unfused)."""
    weights = group_weights(module, family.o)
    if isinstance(weights, str):
        name = family.o[0]
        return (lambda attn_output: getattr(module, name)(attn_output)), None
    group = fused_o_group(family.o, weights)
    return (lambda attn_output: group(attn_output)[0]), group


class _AttentionPlan:
    """What an attention module decided: how q / k / v and o run, its attention function, its extra arguments, and,
    where q and k go straight from the fused projection to RoPE (no per-head norms), the one node that does both."""

    __slots__ = ("attention", "extra", "o", "o_group", "qkv", "rotary")

    def __init__(self, family: Family, module: torch.nn.Module) -> None:
        self.qkv = _qkv_runner(family, module)
        self.o, self.o_group = _o_runner(family, module)
        self.attention = _interface(family, module)
        self.extra = family.attention_kwargs(module)
        fused = isinstance(self.qkv, LoRAGroup) and not family.head_norms
        self.rotary = functools.partial(lora_qkv_rope, self.qkv) if fused else None


def _attention_plan(family: Family, module: torch.nn.Module) -> tuple[_AttentionPlan, list[Any]]:
    return _AttentionPlan(family, module), group_objects(module, family.qkv + family.o)


def attention_plan(family: Family, module: torch.nn.Module) -> _AttentionPlan:
    """The attention module's kept plan (decided again when grad mode, the attention implementation or a projection's
    stamp changed); while ``torch.compile`` traces, a fresh one."""
    if compiling():
        return _AttentionPlan(family, module)
    stamp = (torch.is_grad_enabled(), module.config._attn_implementation, group_stamp(module, family.qkv + family.o))
    return planned(module, stamp, lambda: _attention_plan(family, module))


def mlp_plan(family: Family, module: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """The MLP module's kept ``run(x)``: a :class:`~fastft.kernels.LoRAMLP` when fused."""
    if compiling():
        # Traced, the plan is not kept: what it would keep alive (a walk over the modules) is not looked at, which
        # also keeps that walk out of the compiled layer's guards.
        return _mlp_runner(family, module)
    stamp = (torch.is_grad_enabled(), group_stamp(module, family.mlp))
    return planned(module, stamp, lambda: _mlp_plan(family, module))


def update_cache(
    cache: Any,
    layer_idx: int,
    key: torch.Tensor,
    value: torch.Tensor,
    takes_cache_position: bool,
    cache_name: str,
    extra: dict[str, Any],
    cache_kwargs: dict[str, Any],
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cache.update`` the way the installed transformers' attention calls it: with ``cache_kwargs`` where the
    attention takes ``cache_position`` (before 5.24), with the layer's own kwargs where the argument is ``cache``
    (5.24 hands them to the cache, as upstream's forward does), else with the key and value alone."""
    if takes_cache_position:
        return cache.update(key, value, layer_idx, cache_kwargs)
    if cache_name == "cache":
        return cache.update(key, value, layer_idx, kwargs=extra)
    return cache.update(key, value, layer_idx)


def _project(
    family: Family, module: torch.nn.Module, run: Callable[..., Any], hidden_states: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    hidden_shape = (*hidden_states.shape[:-1], -1, module.head_dim)
    query, key, value = (t.view(hidden_shape) for t in run(hidden_states))
    if family.head_norms:
        # Over head_dim, per head, before RoPE; q_norm / k_norm are the family's RMSNorm, so its patch (the fused
        # kernel with dW) serves them too.
        query, key = module.q_norm(query), module.k_norm(key)
    return query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)


def _rotate(
    query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    rotary = cos.shape[-1]
    if rotary == query.shape[-1]:
        return apply_rope(query, key, cos, sin)
    # Partial rotary (Phi-4-mini's partial_rotary_factor): the first `rotary` dims turn, the rest pass through.
    query_rot, key_rot = apply_rope(query[..., :rotary], key[..., :rotary], cos, sin)
    return torch.cat([query_rot, query[..., rotary:]], dim=-1), torch.cat([key_rot, key[..., rotary:]], dim=-1)


# What the KV cache argument is called: 5.24's name, 4.56–5.23's, 4.53–4.55's.
_CACHE_NAMES = ("cache", "past_key_values", "past_key_value")


def attention_forward(family: Family, upstream_class: type) -> Callable[..., Any]:
    """The fused attention forward for ``upstream_class`` (its installed signature, shown as its own).

    What runs (fused or not, the attention function, the sliding window) is decided once and kept in a
    :mod:`plan <fastft.patches.plans>` until a projection's stamp, grad mode or the attention implementation changes.
    """
    signature = inspect.signature(upstream_class.forward)
    reader = ArgumentReader(signature)
    takes_cache_position = "cache_position" in signature.parameters
    cache_name = next((name for name in _CACHE_NAMES if name in signature.parameters), None)
    # 4.56–4.57 still take the pre-4.56 name, and 5.24 the pre-5.24 one, through a deprecation shim; so does this.
    old_names = tuple(name for name in _CACHE_NAMES if name != cache_name)
    rotary_tables, call_kwargs = family.rotary_tables, family.call_kwargs
    position_ids_to_attention, returns_cache = family.position_ids_to_attention, family.returns_cache

    def forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        named, extra = reader.read(self, args, kwargs)
        hidden_states = named["hidden_states"]
        cos, sin = named["position_embeddings"]
        if rotary_tables is not None:
            cos, sin = rotary_tables(self, cos, sin)
        cache = named.get(cache_name) if cache_name else None
        for name in old_names:
            shim = extra.pop(name, None)
            cache = shim if cache is None else cache
        if call_kwargs is not None:
            extra.update(call_kwargs(self))

        plan = attention_plan(family, self)
        if plan.rotary is not None and hidden_states.dim() == 3 and cos.shape[-1] == self.head_dim:
            query, key, value = plan.rotary(hidden_states, cos, sin, self.head_dim)
        else:
            query, key, value = _project(family, self, plan.qkv, hidden_states)
            query, key = _rotate(query, key, cos, sin)
        if cache is not None:
            # RoPE-aware caches take sin / cos, the static cache its positions.
            cache_kwargs = {"sin": sin, "cos": cos, "cache_position": named.get("cache_position")}
            key, value = update_cache(
                cache, self.layer_idx, key, value, takes_cache_position, cache_name, extra, cache_kwargs
            )
        attn_output, attn_weights = plan.attention(
            self,
            query,
            key,
            value,
            named.get("attention_mask"),
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            **plan.extra,
            **extra,
            # Not in `extra`: the cache above takes upstream's **kwargs, which never held them.
            **({"position_ids": named.get("position_ids")} if position_ids_to_attention else {}),
        )
        attn_output = attn_output.reshape(*hidden_states.shape[:-1], -1).contiguous()
        if returns_cache:
            return plan.o(attn_output), attn_weights, cache
        return plan.o(attn_output), attn_weights

    forward.__signature__ = signature
    forward.__doc__ = f"``{upstream_class.__name__}.forward`` with the fused LoRA-QKV, RoPE and LoRA-O kernels."
    return forward


def swap_class(upstream_class: type, fast_class: type) -> Callable[[torch.nn.Module], int]:
    """A record's ``apply``: every module whose type is exactly ``upstream_class`` becomes ``fast_class``."""

    def apply(model: torch.nn.Module) -> int:
        count = 0
        for module in model.modules():
            # Exact type: a user's own subclass of the upstream module keeps its forward.
            if type(module) is upstream_class:
                module.__class__ = fast_class
                count += 1
        return count

    return apply


def model_type_only(model_type: str) -> Callable[[torch.nn.Module], str | None]:
    """A record's ``applies_to`` for one architecture."""

    def applies_to(model: torch.nn.Module) -> str | None:
        found = getattr(getattr(model, "config", None), "model_type", None)
        if found != model_type:
            return f"model_type {found!r} is not {model_type}"
        return None

    return applies_to


def _gated_mlp_only(family: Family) -> Callable[[torch.nn.Module], str | None]:
    family_only = model_type_only(family.model_type)

    def applies_to(model: torch.nn.Module) -> str | None:
        reason = family_only(model)
        if reason:
            return reason
        activation = getattr(model.config, family.activation_attr, None)
        if mlp_activation(model.config, family.activation_attr) is None:
            return (
                f"{family.activation_attr} {activation!r} has no fused gate kernel "
                f"(fused: {', '.join(sorted(ACTIVATIONS))})"
            )
        return None

    return applies_to


def _causal_lm_only(model_type: str, upstream_class: type) -> Callable[[torch.nn.Module], str | None]:
    family_only = model_type_only(model_type)

    def applies_to(model: torch.nn.Module) -> str | None:
        reason = family_only(model)
        if reason:
            return reason
        if not any(type(module) is upstream_class for module in model.modules()):
            return f"no {upstream_class.__name__} head (a bare backbone has no loss)"
        return None

    return applies_to


def group_fallbacks(fast_classes: tuple[type, ...], groups: Mapping[str, tuple[str, ...]]):
    """A record's ``fallbacks``: which patched modules would run a group through the stock projections in training,
    and why."""

    def fallbacks(model: torch.nn.Module) -> dict[str, str]:
        found = {}
        for name, module in model.named_modules():
            if type(module) not in fast_classes:
                continue
            for suffix, names in groups.items():
                weights = group_weights(module, names, training=True)
                if isinstance(weights, str):
                    found[f"{name}{suffix}"] = weights
        return found

    return fallbacks


def loss_fallbacks(fast_class: type) -> Callable[[torch.nn.Module], dict[str, str]]:
    """A record's ``fallbacks`` for the fused loss: an LM head it cannot serve."""

    def fallbacks(model: torch.nn.Module) -> dict[str, str]:
        found = {}
        for name, module in model.named_modules():
            if type(module) is fast_class:
                reason = head_reason(module)
                if reason:
                    found[name or "lm_head"] = reason
        return found

    return fallbacks


@dataclass(frozen=True)
class FastClasses:
    """A family's subclasses: each changes ``forward`` only. ``mlp``: None for a family without a dense gated MLP
    (Mixtral's layers are all mixture-of-experts). ``decoder_layer``: the layer as one fused node
    (:mod:`fastft.patches.fused_layer`), for Llama-shaped layers."""

    rms_norm: type
    attention: type
    mlp: type | None
    causal_lm: type
    decoder_layer: type | None = None


@dataclass(frozen=True)
class VersionRange:
    """One transformers range of a family's records and the upstream signatures it was written against."""

    transformers: str
    attention_fingerprint: str
    causal_lm_fingerprint: str
    rms_norm_fingerprint: str = "(self, hidden_states)"
    mlp_fingerprint: str = "(self, x)"
    decoder_layer_fingerprint: str | None = None


def register_family(family: Family, classes: FastClasses, ranges: tuple[VersionRange, ...]) -> None:
    """Register a family's four patches (RMSNorm, attention, MLP, causal-LM loss), one record per version range.

    Args:
        family: The family.
        classes: Its subclasses.
        ranges: The transformers ranges the records were tested against (a lane's version starts each one, and it
            ends before the next minor release no lane has run), each with the upstream signatures of that range.
    """
    module = family.upstream.__name__
    model_types = (family.model_type,)
    applies = model_type_only(family.model_type)
    causal_lm = family.upstream_class("ForCausalLM")
    groups = {".qkv" if len(family.qkv) > 1 else f".{family.qkv[0]}": family.qkv, f".{family.o[0]}": family.o}
    for versions in ranges:
        pinned = {"transformers": versions.transformers}
        parts = (
            ("rms_norm", "RMSNorm", classes.rms_norm, versions.rms_norm_fingerprint, applies, None, ()),
            (
                "attention",
                "Attention",
                classes.attention,
                versions.attention_fingerprint,
                applies,
                group_fallbacks((classes.attention,), groups),
                ("qkv", "o"),
            ),
            (
                "mlp",
                "MLP",
                classes.mlp,
                versions.mlp_fingerprint,
                _gated_mlp_only(family),
                group_fallbacks((classes.mlp,), {"": family.mlp}),
                ("gate_up", "down"),
            ),
            (
                "causal_lm_loss",
                "ForCausalLM",
                classes.causal_lm,
                versions.causal_lm_fingerprint,
                _causal_lm_only(family.model_type, causal_lm),
                loss_fallbacks(classes.causal_lm),
                (),
            ),
        )
        if classes.mlp is None:
            parts = tuple(part for part in parts if part[0] != "mlp")
        if classes.decoder_layer is not None and versions.decoder_layer_fingerprint is not None:
            layer = ("decoder_layer", "DecoderLayer", classes.decoder_layer, versions.decoder_layer_fingerprint)
            parts += ((*layer, _gated_mlp_only(family), None, ()),)
        for part, suffix, fast_class, fingerprint, applies_to, fallbacks, gemm_groups in parts:
            upstream_class = family.upstream_class(suffix)
            register(
                PatchRecord(
                    name=f"{family.name}.{part}",
                    target=f"{module}.{upstream_class.__name__}.forward",
                    versions=pinned,
                    fingerprint=fingerprint,
                    applies_to=applies_to,
                    apply=swap_class(upstream_class, fast_class),
                    replacement=fast_class,
                    fallbacks=fallbacks,
                    gemm_groups=gemm_groups,
                    model_types=model_types,
                )
            )


__all__ = [
    "Family",
    "FastClasses",
    "VersionRange",
    "attention_forward",
    "attention_plan",
    "mlp_plan",
    "gemma_rms_norm_forward",
    "mlp_activation",
    "gated_mlp_forward",
    "qkv_widths",
    "register_family",
    "repeat_half_tables",
    "rms_norm_forward",
    "swap_class",
]
