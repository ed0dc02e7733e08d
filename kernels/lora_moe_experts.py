"""LoRA-MoE: the experts of a mixture-of-experts MLP with LoRA on every expert's gate | up and down, fused.

For the router's choice ``top_k_index [T, k]`` with weights ``top_k_weights [T, k]``, each token's output is
``Σ_j w_j · down_e(act(gate_e(x)) · up_e(x))`` over its k experts ``e``, as transformers 5's ``Qwen3MoeExperts``,
``MixtralExperts`` and ``GptOssExperts`` compute it, without their Python loop over experts: the rows are sorted by
expert once (:mod:`fastft.kernels.moe_route`) and every projection is one grouped GEMM over all experts
(:mod:`fastft.kernels.moe_grouped_gemm`, LoRA in its epilogue, the router weight in the down GEMM's), the gated
activation reads the packed gate | up rows in place (:mod:`fastft.kernels.moe_gate_act`), and the LoRA gradients are
per-expert sums (:mod:`fastft.kernels.moe_grouped_outer`). The math and the custom ops are in
:mod:`fastft.kernels.lora_moe_math`.

Weights (transformers 5's fused layout, per expert ``e``):

- ``gate_up_proj [E, 2I, H]``: gate's I rows then up's (Qwen3-MoE, Mixtral), or, with ``interleaved=True``, gate and
  up alternating row by row (gpt-oss, whose ``[E, H, 2I]`` parameter is passed as ``gate_up_proj.transpose(1, 2)``);
  LoRA ``A [E, r, H]``, ``B [E, 2I, r]`` (B's rows in the weight's row order); optional bias ``[E, 2I]``.
- ``down_proj [E, H, I]`` (gpt-oss's ``[E, I, H]`` as ``down_proj.transpose(1, 2)``); LoRA ``A [E, r, I]``,
  ``B [E, H, r]``; optional bias ``[E, H]``.

transformers 4.x's per-expert modules come as :class:`~fastft.kernels.moe_expert_table.ExpertTable` weights in place of
the 3-D tensors (gate's and up's ``[I, H]`` as the two parts of gate | up, down's ``[H, I]``): the grouped GEMMs read
each expert's tensor through its address, no copy; their adapters come per call as stacks of the same shapes.

A patch holds a :class:`LoRAMoEExperts` per layer (shapes checked once) and calls it with the router's outputs.
Gradients flow to x, to the router weights (as in the stock layer, where they are multiplied into the output) and to
every A and B; the base weights and biases are frozen.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from fastft.kernels import dispatch, lora_moe_math
from fastft.kernels.custom_ops import compiling, direct_apply, math_backward
from fastft.kernels.errors import ShapeContractError
from fastft.kernels.lora_moe_math import Config, Saved, Weights, cast
from fastft.kernels.lora_projection import FLOAT_DTYPES, LoRAWeights, autocast_dtype, autocast_off, x_dtype_error
from fastft.kernels.moe_expert_table import ExpertTable
from fastft.kernels.moe_gate_act import ACTIVATIONS
from fastft.kernels.moe_route import check_router

# gpt-oss's defaults (GptOssConfig.swiglu_alpha / swiglu_limit).
GPT_OSS_ALPHA = 1.702
GPT_OSS_LIMIT = 7.0


def _shape_of(t: torch.Tensor) -> list[int]:
    return list(t.shape)


class LoRAMoEExperts:
    """The experts of one MoE layer with their LoRA adapters: checked once, applied per call.

    Args:
        gate_up: ``gate_up_proj [E, 2I, H]`` (a tensor, or an :class:`ExpertTable` of per-expert tensors) with
            optional LoRA ``A [E, r, H]`` / ``B [E, 2I, r]``, scale and bias
            ``[E, 2I]``; ``quant_state`` must be None (no 4-bit experts yet).
        down: ``down_proj [E, H, I]`` with optional LoRA ``A [E, r, I]`` / ``B [E, H, r]``, scale and bias ``[E, H]``.
        activation: ``"silu"`` (SwiGLU: Qwen3-MoE, Mixtral) or ``"gpt_oss"`` (gpt-oss's clamped SwiGLU
            ``(clamp(up) + 1) · g · sigmoid(alpha · g)`` with ``g = min(gate, limit)``).
        interleaved: gate and up rows alternate in ``gate_up_proj`` (gpt-oss) instead of gate's half then up's.
        alpha: gpt-oss's ``swiglu_alpha``.
        limit: gpt-oss's ``swiglu_limit``.
        name: The module named in errors (a patch passes the experts module's qualified name).

    Raises:
        ValueError: An unknown activation, a non-finite scale / alpha / limit, A without B, or 4-bit weights.
        ShapeContractError: Expert tensors that do not fit each other (transposed ones named as such), LoRA A / B or
            biases of the wrong shape, an odd number of gate | up rows.
        TypeError: Weights, adapters or biases of a dtype the kernels do not take.
    """

    def __init__(
        self,
        gate_up: LoRAWeights,
        down: LoRAWeights,
        activation: str = "silu",
        *,
        interleaved: bool = False,
        alpha: float = GPT_OSS_ALPHA,
        limit: float = GPT_OSS_LIMIT,
        name: str = "lora_moe_experts",
    ) -> None:
        if not isinstance(activation, str) or activation not in ACTIVATIONS:
            accepted = ", ".join(repr(a) for a in ACTIVATIONS)
            raise ValueError(
                f"{name}: activation must be one of {accepted} (silu: Qwen3-MoE / Mixtral's SwiGLU; gpt_oss: "
                f"gpt-oss's clamped SwiGLU), got {activation!r}."
            )
        for label, value in (("alpha", alpha), ("limit", limit)):
            if not math.isfinite(float(value)):
                raise ValueError(f"{name}: {label} must be finite, got {value!r}.")
        experts, inter, hidden = _check_bases(name, gate_up, down)
        _check_adapter(f"{name}.gate_up_proj", gate_up, experts, 2 * inter, hidden)
        _check_adapter(f"{name}.down_proj", down, experts, hidden, inter)
        _check_bias(f"{name}.gate_up_proj", gate_up.bias, experts, 2 * inter)
        _check_bias(f"{name}.down_proj", down.bias, experts, hidden)
        config = Config(
            activation, bool(interleaved), float(alpha), float(limit), float(gate_up.scale), float(down.scale)
        )
        values = {
            "name": name,
            "gate_up": gate_up,
            "down": down,
            "num_experts": experts,
            "hidden_size": hidden,
            "intermediate_size": inter,
            "config": config,
            "adapters": (gate_up.lora_a, gate_up.lora_b, down.lora_a, down.lora_b),
            "_frozen": tuple(t for t in (gate_up.weight, down.weight, gate_up.bias, down.bias) if t is not None),
            "tables": tuple(w for w in (gate_up.weight, down.weight) if isinstance(w, ExpertTable)),
        }
        for key, value in values.items():
            object.__setattr__(self, key, value)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"LoRAMoEExperts is immutable; build a new one instead of setting {name!r}.")

    def __repr__(self) -> str:
        return (
            f"LoRAMoEExperts({self.name}: E={self.num_experts}, H={self.hidden_size}, I={self.intermediate_size}, "
            f"{self.config.activation}{', interleaved' if self.config.interleaved else ''})"
        )

    def __call__(
        self,
        x: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
        adapters: tuple[torch.Tensor | None, ...] | None = None,
    ) -> torch.Tensor:
        """Apply the experts to ``x [..., H]`` (``T`` tokens) routed by ``top_k_index`` / ``top_k_weights [T, k]``.

        ``adapters``: ``(A_gate_up, B_gate_up, A_down, B_down)`` for this call in place of the ones checked at
        construction, of the same shapes: a patch passes fresh views of peft's stacked parameters each call, so a
        parameter whose data was swapped (``model.to(...)``) is read as it is now.

        Returns:
            ``[..., H]``: every token's router-weighted sum of its experts' outputs, in x's dtype.

        Raises:
            TypeError: x not float32 / float16 / bfloat16 or not the experts' dtype; integer weights; float indices.
            ShapeContractError: x's last dim is not H; index / weights not ``[T, k]``; top-k above E; an expert
                index outside ``[0, E)``.
            ValueError: A base weight or bias requires grad while autograd is on.
        """
        dtype = autocast_dtype(x)
        if dtype is not None:
            with autocast_off(x):
                return self(x.to(dtype), top_k_index, top_k_weights, adapters)
        self._check_call(x, top_k_index, top_k_weights)
        if adapters is None:
            adapters = self.adapters
        if compiling():
            if self.tables:
                raise NotImplementedError(
                    f"{self.name}: per-expert weights (an address table) have no custom op for torch.compile; run "
                    "the experts' own forward while compiling (a patched model does)."
                )
            return lora_moe_math.op(x, top_k_index, top_k_weights, **self.op_arguments(adapters))[0]
        return _apply(x, top_k_index, top_k_weights, self, *adapters)

    def _check_call(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> None:
        if x.dtype not in FLOAT_DTYPES:
            raise x_dtype_error(self.name, x)
        weight = self.gate_up.weight
        if x.dtype != weight.dtype:
            raise TypeError(
                f"{self.name}: x is {x.dtype} but the expert weights are {weight.dtype}; the grouped GEMMs take one "
                "dtype: cast the activations (or load the model) to the experts' dtype."
            )
        if x.dim() == 0 or x.shape[-1] != self.hidden_size:
            raise ShapeContractError(
                f"{self.name}: x must be [..., hidden] = [..., {self.hidden_size}] for experts gate_up_proj of shape "
                f"{_shape_of(weight)}, got x of shape {_shape_of(x)}; pass the hidden states the router saw."
            )
        for table in self.tables:
            # A table built before model.to / .half() / param.data = ... would read freed memory.
            table.check_current()
        check_router(self.name, x.numel() // self.hidden_size, self.num_experts, top_k_index, top_k_weights)
        if torch.is_grad_enabled():
            for t in self._frozen:
                if t.requires_grad:
                    raise ValueError(
                        f"{self.name}: an expert base weight or bias of shape {_shape_of(t)} requires grad, but the "
                        "fused kernels treat them as frozen and would give it no gradient; freeze it "
                        "(requires_grad_(False)) for LoRA, or run the experts' own forward to train it."
                    )

    def op_arguments(self, adapters: tuple[torch.Tensor | None, ...] | None = None) -> dict[str, Any]:
        """The custom op ``fastft::lora_moe_experts``'s arguments after ``(x, top_k_index, top_k_weights)``
        (``adapters``: as for a call)."""
        gate_up, down, config = self.gate_up, self.down, self.config
        has = (gate_up.lora_a is not None, down.lora_a is not None)
        a1, b1, a2, b2 = self.adapters if adapters is None else adapters
        return {
            "gate_up_proj": gate_up.weight,
            "down_proj": down.weight,
            "lora_a": [a for a, h in zip((a1, a2), has, strict=True) if h],
            "lora_b": [b for b, h in zip((b1, b2), has, strict=True) if h],
            "biases": [b for b in (gate_up.bias, down.bias) if b is not None],
            "layout": [*has, gate_up.bias is not None, down.bias is not None, config.interleaved],
            "scales": [config.gate_up_scale, config.down_scale],
            "activation": config.activation,
            "alpha": config.alpha,
            "limit": config.limit,
        }

    def weights(self, dtype: torch.dtype, adapters: tuple[torch.Tensor | None, ...]) -> Weights:
        """The call's :class:`~fastft.kernels.lora_moe_math.Weights`, adapters cast to the activations' dtype."""
        a1, b1, a2, b2 = (cast(t, dtype) for t in adapters)
        return Weights(self.gate_up.weight, self.down.weight, self.gate_up.bias, self.down.bias, a1, b1, a2, b2)


def _check_bases(name: str, gate_up: LoRAWeights, down: LoRAWeights) -> tuple[int, int, int]:
    for label, projection in (("gate_up_proj", gate_up), ("down_proj", down)):
        if not isinstance(projection, LoRAWeights):
            raise TypeError(f"{name}: {label} must be a LoRAWeights, got {type(projection).__name__}.")
        if projection.quant_state is not None or projection.weight.dtype not in FLOAT_DTYPES:
            raise ValueError(
                f"{name}.{label}: the grouped expert kernels take dense float32 / float16 / bfloat16 expert weights, "
                f"got {projection.weight.dtype}{' with a quant_state' if projection.quant_state is not None else ''}; "
                "4-bit experts are not supported yet: load the experts in 16 bit."
            )
        if projection.weight.dim() != 3:
            raise ShapeContractError(
                f"{name}.{label}: expert weights must be 3-D [experts, out, in], got {_shape_of(projection.weight)}; "
                "pass the experts module's stacked parameter."
            )
    w1, w2 = gate_up.weight, down.weight
    if w1.dtype != w2.dtype:
        raise TypeError(f"{name}: gate_up_proj is {w1.dtype} but down_proj is {w2.dtype}; load both in one dtype.")
    e, two_i, h = w1.shape
    if w2.shape[0] != e:
        raise ShapeContractError(
            f"{name}.down_proj: must hold one matrix per expert like gate_up_proj ({e} experts, {_shape_of(w1)}), got "
            f"{_shape_of(w2)}; both tensors must come from the same experts module."
        )
    _, d1, d2 = w2.shape
    if two_i % 2 == 0 and (d1, d2) == (h, two_i // 2):
        return e, two_i // 2, h
    if (h, two_i) == (2 * d1, d2):
        raise ShapeContractError(
            f"{name}: gate_up_proj {_shape_of(w1)} and down_proj {_shape_of(w2)} are both transposed: this is "
            f"gpt-oss's storage ([E, H, 2I] and [E, I, H]); the kernels expect [E, 2I, H] = [{e}, {h}, {two_i}] and "
            f"[E, H, I] = [{e}, {two_i}, {d1}]: pass gate_up_proj.transpose(1, 2) and down_proj.transpose(1, 2) "
            "(views, no copy), with interleaved=True for gpt-oss's alternating gate / up columns."
        )
    if (two_i, h) == (d1, 2 * d2):
        raise ShapeContractError(
            f"{name}.gate_up_proj: must be [E, 2·I, H] = [{e}, {2 * d2}, {d1}] for down_proj {_shape_of(w2)}, got "
            f"{_shape_of(w1)}, the transposed layout [E, H, 2·I]; pass gate_up_proj.transpose(1, 2) (a view)."
        )
    if two_i % 2 == 0 and (d1, d2) == (two_i // 2, h):
        raise ShapeContractError(
            f"{name}.down_proj: must be [E, H, I] = [{e}, {h}, {two_i // 2}] for gate_up_proj {_shape_of(w1)}, got "
            f"{_shape_of(w2)}, the transposed layout [E, I, H]; pass down_proj.transpose(1, 2) (a view)."
        )
    if two_i % 2:
        raise ShapeContractError(
            f"{name}.gate_up_proj: must be [E, 2·I, H] with gate's and up's rows, got {_shape_of(w1)} with an odd "
            f"number ({two_i}) of rows; pass the packed gate_up_proj, not gate_proj or up_proj alone."
        )
    raise ShapeContractError(
        f"{name}.down_proj: must be [E, H, I] = [{e}, {h}, {two_i // 2}] for gate_up_proj {_shape_of(w1)} "
        f"([E, 2·I, H]), got {_shape_of(w2)}; the two tensors do not come from one experts module."
    )


def _check_adapter(where: str, projection: LoRAWeights, experts: int, out_f: int, in_f: int) -> None:
    a, b = projection.lora_a, projection.lora_b
    if (a is None) != (b is None):
        raise ValueError(f"{where}: pass both lora_a and lora_b, or neither (got only one).")
    if a is None:
        return
    for label, t in (("A", a), ("B", b)):
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{where}: LoRA {label} must be float32 / float16 / bfloat16, got {t.dtype}.")
    if a.dim() != 3 or a.shape[0] != experts or a.shape[2] != in_f:
        raise ShapeContractError(
            f"{where}: LoRA A must be [experts, r, in] = [{experts}, r, {in_f}] (one A per expert), got "
            f"{_shape_of(a)}; peft's flat [r · E, in] lora_A reshapes to it as weight.view(E, r, in)."
        )
    rank = a.shape[1]
    if tuple(b.shape) != (experts, out_f, rank):
        raise ShapeContractError(
            f"{where}: LoRA B must be [experts, out, r] = [{experts}, {out_f}, {rank}] for A of shape {_shape_of(a)}, "
            f"got {_shape_of(b)}; peft's flat [out, r · E] lora_B is weight.view(out, r, E).permute(2, 0, 1)."
        )
    if not math.isfinite(float(projection.scale)):
        raise ValueError(f"{where}: the LoRA scale must be finite, got {projection.scale!r}.")


def _check_bias(where: str, bias: torch.Tensor | None, experts: int, out_f: int) -> None:
    if bias is None:
        return
    if not isinstance(bias, torch.Tensor) or bias.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{where}: the bias must be a float32 / float16 / bfloat16 tensor [experts, out] or None.")
    if tuple(bias.shape) != (experts, out_f):
        raise ShapeContractError(
            f"{where}: the bias must be [experts, out] = [{experts}, {out_f}], got {_shape_of(bias)}; pass the "
            "experts module's own bias in the weight's row order."
        )


class LoRAMoEExpertsFunction(torch.autograd.Function):
    """Eager autograd node of :class:`LoRAMoEExperts`: ``(x, top_k_index, top_k_weights, experts, A1, B1, A2, B2)``,
    the adapters None where a projection has none."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
        experts: LoRAMoEExperts,
        *adapters: torch.Tensor | None,
    ) -> torch.Tensor:
        x2d = x.reshape(-1, x.shape[-1])
        weights = experts.weights(x.dtype, adapters)
        out, saved = lora_moe_math.forward(experts.config, x2d, top_k_index, top_k_weights, weights)
        ctx.experts = experts
        ctx.x_shape = x.shape
        ctx.adapter_dtypes = tuple(None if a is None else a.dtype for a in adapters)
        # The adapters as forward used them (cast to x's dtype once), so backward does not cast them again.
        ctx.save_for_backward(x2d, top_k_weights, *saved, *weights[4:])
        return out.view(*x.shape[:-1], out.shape[1])

    @staticmethod
    @math_backward
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x2d, top_k_weights, order, offsets, xa1, gate_up, xa2, *adapters = ctx.saved_tensors
        experts = ctx.experts
        needs = ctx.needs_input_grad
        wants = (bool(needs[0]), bool(needs[2]), bool(needs[4] or needs[5]), bool(needs[6] or needs[7]))
        weights = experts.weights(x2d.dtype, tuple(adapters))
        saved = Saved(order, offsets, xa1, gate_up, xa2)
        grad_x, grad_w, grads = lora_moe_math.backward(
            experts.config, grad.reshape(-1, grad.shape[-1]), x2d, top_k_weights, saved, weights, wants
        )
        # The gate | up gradient went over the saved buffer: a second backward through this node (retain_graph)
        # fails on autograd's version check instead of reading gradients as activations.
        dispatch.mark_overwritten(gate_up)
        if grad_x is not None:
            grad_x = grad_x.view(ctx.x_shape)
        dtypes = ctx.adapter_dtypes
        typed = [None if g is None or d is None else g.to(d) for g, d in zip(grads, dtypes, strict=True)]
        return (grad_x, None, grad_w, None, *typed)


_apply = direct_apply(LoRAMoEExpertsFunction)


def lora_moe_experts(
    x: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up: LoRAWeights,
    down: LoRAWeights,
    activation: str = "silu",
    *,
    interleaved: bool = False,
    alpha: float = GPT_OSS_ALPHA,
    limit: float = GPT_OSS_LIMIT,
) -> torch.Tensor:
    """A mixture-of-experts MLP with per-expert LoRA on gate | up and down, fused (:class:`LoRAMoEExpertsFunction`).

    Builds (and checks) a :class:`LoRAMoEExperts` per call; code that calls it every step should hold one instead.

    Args:
        x: Hidden states ``[..., H]`` (``T`` tokens), in the experts' dtype.
        top_k_index: ``[T, k]`` expert indices in ``[0, E)``.
        top_k_weights: ``[T, k]`` router weights (they get a gradient).
        gate_up: ``gate_up_proj [E, 2I, H]`` with optional per-expert LoRA and bias (see :class:`LoRAMoEExperts`).
        down: ``down_proj [E, H, I]`` with optional per-expert LoRA and bias.
        activation: ``"silu"`` or ``"gpt_oss"``.
        interleaved: gate / up rows alternate (gpt-oss).
        alpha: gpt-oss's ``swiglu_alpha``.
        limit: gpt-oss's ``swiglu_limit``.

    Returns:
        ``[..., H]``: ``Σ_j top_k_weights[t, j] · down_e(act(gate_e(x_t)) · up_e(x_t))`` with ``e = top_k_index[t, j]``.

    Raises:
        ShapeContractError, TypeError, ValueError: As :class:`LoRAMoEExperts` and its call.
    """
    experts = LoRAMoEExperts(gate_up, down, activation, interleaved=interleaved, alpha=alpha, limit=limit)
    return experts(x, top_k_index, top_k_weights)


__all__ = ["GPT_OSS_ALPHA", "GPT_OSS_LIMIT", "LoRAMoEExperts", "LoRAMoEExpertsFunction", "lora_moe_experts"]
