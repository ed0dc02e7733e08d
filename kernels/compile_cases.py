"""The launches the static GPU check (:mod:`fastft.kernels.compile_check`) walks: the model shapes and, per model,
rank, dtype and base, each public kernel call forward and backward on ``meta`` tensors, so the launch arguments the
check records are the launchers' own."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from fastft.kernels.lora_projection import LoRAWeights

TOKENS = 8192


@dataclass(frozen=True)
class Model:
    """The shapes a model gives the kernels."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int


MODELS = {
    "SmolLM2-135M": Model(576, 9, 3, 64, 1536, 49152),
    "Llama-3.2-1B": Model(2048, 32, 8, 64, 8192, 128256),
    "Llama-3-8B": Model(4096, 32, 8, 128, 14336, 128256),
}


def _meta(shape: tuple[int, ...], dtype: torch.dtype, grad: bool = False) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta", requires_grad=grad)


def _backward(outputs: Any, inputs: list[torch.Tensor]) -> None:
    outputs = [o for o in (outputs if isinstance(outputs, tuple | list) else (outputs,)) if o.requires_grad]
    torch.autograd.grad(outputs, inputs, [torch.empty_like(o) for o in outputs], allow_unused=True)


def _nf4_weight(out_features: int, in_features: int, dtype: torch.dtype) -> LoRAWeights:
    """A packed NF4 weight as ``load_in_4bit`` stores it (blocksize 64, double quantisation), on meta."""
    n = out_features * in_features
    blocks = -(-n // 64)
    state2 = SimpleNamespace(absmax=_meta((-(-blocks // 256),), torch.float32), code=_meta((256,), torch.float32))
    state2.blocksize = 256
    quant_state = SimpleNamespace(
        quant_type="nf4",
        shape=torch.Size([out_features, in_features]),
        blocksize=64,
        dtype=dtype,
        absmax=_meta((blocks,), torch.uint8),
        nested=True,
        state2=state2,
        offset=_meta((), torch.float32),
    )
    return LoRAWeights(_meta(((n + 1) // 2, 1), torch.uint8), quant_state=quant_state)


def _projection(out_f: int, in_f: int, rank: int, dtype: torch.dtype, nf4: bool, bias: bool = False) -> LoRAWeights:
    base = _nf4_weight(out_f, in_f, dtype) if nf4 else LoRAWeights(_meta((out_f, in_f), dtype))
    return LoRAWeights(
        base.weight,
        _meta((rank, in_f), dtype, True),
        _meta((out_f, rank), dtype, True),
        2.0,
        base.quant_state,
        _meta((out_f,), dtype) if bias else None,
    )


def groups(model: Model, rank: int, dtype: torch.dtype, nf4: bool) -> Iterator[tuple[str, Callable[[], None]]]:
    from fastft.kernels import LoRAGroup, lora_mlp, lora_o, lora_qkv
    from fastft.kernels.lora_qkv_rope import lora_qkv_rope

    q_width, kv_width = model.heads * model.head_dim, model.kv_heads * model.head_dim

    def qkv(bias: bool) -> Callable[[], None]:
        def run() -> None:
            x = _meta((1, TOKENS, model.hidden), dtype, True)
            widths = (q_width, kv_width, kv_width)
            projections = [_projection(w, model.hidden, rank, dtype, nf4, bias) for w in widths]
            _backward(lora_qkv(x, *projections), [x])

        return run

    def qkv_rope() -> None:
        # The attention's fused node: the q | k | v group, then RoPE in place on its buffers and, in backward, into
        # transposed gradient buffers (strides the plain apply_rope call does not see).
        x = _meta((1, TOKENS, model.hidden), dtype, True)
        widths = (q_width, kv_width, kv_width)
        projections = [_projection(w, model.hidden, rank, dtype, nf4) for w in widths]
        group = LoRAGroup("lora_qkv", ("q_proj", "k_proj", "v_proj"), projections, "qkv")
        cos, sin = _meta((1, TOKENS, model.head_dim), dtype), _meta((1, TOKENS, model.head_dim), dtype)
        _backward(lora_qkv_rope(group, x, cos, sin, model.head_dim), [x])

    def o() -> None:
        x = _meta((1, TOKENS, q_width), dtype, True)
        _backward(lora_o(x, _projection(model.hidden, q_width, rank, dtype, nf4)), [x])

    def mlp() -> None:
        x = _meta((1, TOKENS, model.hidden), dtype, True)
        gate, up = (_projection(model.intermediate, model.hidden, rank, dtype, nf4) for _ in range(2))
        down = _projection(model.hidden, model.intermediate, rank, dtype, nf4)
        _backward(lora_mlp(x, gate, up, down), [x])

    # The biased q / k / v (Qwen2 / Qwen2.5) last: the kernels' HAS_BIAS variant; the others are the unbiased one.
    yield from (
        ("lora_qkv", qkv(False)),
        ("lora_o", o),
        ("lora_mlp", mlp),
        ("lora_qkv bias", qkv(True)),
        ("lora_qkv_rope", qkv_rope),
    )


def others(model: Model, dtype: torch.dtype) -> Iterator[tuple[str, Callable[[], None]]]:
    from fastft.kernels import (
        apply_rope,
        dequantize_nf4,
        fused_linear_cross_entropy,
        fused_linear_logprobs,
        geglu,
        rms_norm,
        swiglu,
    )

    def norm() -> None:
        x, w = _meta((1, TOKENS, model.hidden), dtype, True), _meta((model.hidden,), dtype, True)
        _backward(rms_norm(x, w, 1e-5), [x, w])

    def norm_gemma() -> None:
        x, w = _meta((1, TOKENS, model.hidden), dtype, True), _meta((model.hidden,), dtype, True)
        _backward(rms_norm(x, w, 1e-6, offset=1.0, cast_before_weight=False), [x, w])

    def rope(tables: bool) -> Callable[[], None]:
        def run() -> None:
            q = _meta((1, TOKENS, model.heads, model.head_dim), dtype, True).transpose(1, 2)
            k = _meta((1, TOKENS, model.kv_heads, model.head_dim), dtype, True).transpose(1, 2)
            rows = (TOKENS, model.head_dim) if tables else (1, TOKENS, model.head_dim)
            cos, sin = _meta(rows, dtype), _meta(rows, dtype)
            positions = _meta((1, TOKENS), torch.int64) if tables else None
            _backward(apply_rope(q, k, cos, sin, position_ids=positions), [q, k])

        return run

    def glu() -> None:
        gate, up = (_meta((1, TOKENS, model.intermediate), dtype, True) for _ in range(2))
        _backward(swiglu(gate * 1, up * 1), [gate, up])

    def geglu_gate() -> None:
        gate, up = (_meta((1, TOKENS, model.intermediate), dtype, True) for _ in range(2))
        _backward(geglu(gate * 1, up * 1), [gate, up])

    def loss() -> None:
        hidden = _meta((TOKENS, model.hidden), dtype, True)
        weight = _meta((model.vocab, model.hidden), dtype)
        _backward(fused_linear_cross_entropy(hidden, weight, _meta((TOKENS,), torch.int64)), [hidden])

    def loss_softcap() -> None:
        hidden = _meta((TOKENS, model.hidden), dtype, True)
        weight = _meta((model.vocab, model.hidden), dtype)
        labels = _meta((TOKENS,), torch.int64)
        _backward(fused_linear_cross_entropy(hidden, weight, labels, softcap=30.0), [hidden])

    def logprobs(outputs: tuple[str, ...], bias: bool = False, **options: float) -> Callable[[], None]:
        def run() -> None:
            hidden = _meta((TOKENS, model.hidden), dtype, True)
            weight = _meta((model.vocab, model.hidden), dtype)
            head_bias = _meta((model.vocab,), dtype) if bias else None
            targets = _meta((TOKENS,), torch.int64)
            out = fused_linear_logprobs(hidden, weight, targets, bias=head_bias, outputs=outputs, **options)
            _backward(tuple(t for t in (out.log_probs, out.entropy) if t is not None), [hidden])

        return run

    def nf4() -> None:
        weight = _nf4_weight(model.intermediate, model.hidden, dtype)
        dequantize_nf4(weight.weight, weight.quant_state, dtype=dtype)

    def moe_table() -> None:
        # transformers 4.x's per-expert modules: every expert's gate, up and down its own tensor, read through address
        # tables (the TABLE variant: gate | up split along the rows forward and along K in backward).
        from fastft.kernels.lora_moe_experts import LoRAMoEExperts
        from fastft.kernels.moe_expert_table import ExpertTable

        experts, top_k, rank, hidden, inter = 8, 2, 16, model.hidden, model.intermediate
        gate, up = ([_meta((inter, hidden), dtype) for _ in range(experts)] for _ in range(2))
        down = [_meta((hidden, inter), dtype) for _ in range(experts)]
        a1, b1 = _meta((experts, 2 * rank, hidden), dtype, True), _meta((experts, 2 * inter, 2 * rank), dtype, True)
        a2, b2 = _meta((experts, rank, inter), dtype, True), _meta((experts, hidden, rank), dtype, True)
        layer = LoRAMoEExperts(
            LoRAWeights(ExpertTable([gate, up]), a1, b1, 2.0), LoRAWeights(ExpertTable([down]), a2, b2, 2.0), "silu"
        )
        x = _meta((TOKENS, hidden), dtype, True)
        weights = _meta((TOKENS, top_k), dtype, True)
        out = layer(x, _meta((TOKENS, top_k), torch.int64), weights)
        _backward(out, [x, weights, a1, b1, a2, b2])

    def moe(gpt_oss: bool) -> Callable[[], None]:
        # The model's widths as 8 experts with top-2 routing and rank-16 adapters on each expert. gpt-oss's layout
        # is the transposed storage passed as views (strided weights), with biases and interleaved gate / up.
        def run() -> None:
            from fastft.kernels.lora_moe_experts import LoRAMoEExperts

            experts, top_k, rank, hidden, inter = 8, 2, 16, model.hidden, model.intermediate
            if gpt_oss:
                gate_up = _meta((experts, hidden, 2 * inter), dtype).transpose(1, 2)
                down = _meta((experts, inter, hidden), dtype).transpose(1, 2)
                biases = (_meta((experts, 2 * inter), dtype), _meta((experts, hidden), dtype))
            else:
                gate_up, down = _meta((experts, 2 * inter, hidden), dtype), _meta((experts, hidden, inter), dtype)
                biases = (None, None)
            a1, b1 = _meta((experts, rank, hidden), dtype, True), _meta((experts, 2 * inter, rank), dtype, True)
            a2, b2 = _meta((experts, rank, inter), dtype, True), _meta((experts, hidden, rank), dtype, True)
            layer = LoRAMoEExperts(
                LoRAWeights(gate_up, a1, b1, 2.0, bias=biases[0]),
                LoRAWeights(down, a2, b2, 2.0, bias=biases[1]),
                "gpt_oss" if gpt_oss else "silu",
                interleaved=gpt_oss,
            )
            x = _meta((TOKENS, hidden), dtype, True)
            weights = _meta((TOKENS, top_k), dtype, True)
            out = layer(x, _meta((TOKENS, top_k), torch.int64), weights)
            _backward(out, [x, weights, a1, b1, a2, b2])

        return run

    yield from (
        ("rms_norm", norm),
        ("rms_norm gemma", norm_gemma),
        ("apply_rope", rope(False)),
        ("apply_rope position_ids", rope(True)),
        ("swiglu", glu),
        ("geglu", geglu_gate),
        ("fused_linear_cross_entropy", loss),
        ("fused_linear_cross_entropy softcap", loss_softcap),
        ("fused_linear_logprobs", logprobs(("entropy",))),
        ("fused_linear_logprobs log_probs only", logprobs(())),
        (
            "fused_linear_logprobs all outputs, bias, softcap, scale, temperature",
            logprobs(
                ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1"),
                bias=True,
                softcap=30.0,
                logit_scale=0.5,
                temperature=0.7,
            ),
        ),
        ("dequantize_nf4", nf4),
        ("lora_moe_experts", moe(False)),
        ("lora_moe_experts gpt_oss", moe(True)),
        ("lora_moe_experts per-expert tables", moe_table),
    )


__all__ = ["MODELS", "TOKENS", "Model", "groups", "others"]
