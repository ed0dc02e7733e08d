"""Triton kernels with a plain-torch reference for each (installed as ``fastft.kernels``).

This layer knows tensors only: it never imports transformers or peft. Each kernel comes as a public function (the
autograd-aware entry point), its plain-torch reference, and the ``torch.autograd.Function`` behind it; see
:mod:`fastft.kernels.dispatch` for which implementation a call takes (CUDA: Triton; CPU: the reference, or Triton
through the interpreter when ``TRITON_INTERPRET=1`` was set before import).

==============================  ==============================================================================
``rms_norm(x, weight, eps)``    Llama RMSNorm; gradients for x and weight.
``apply_rope(q, k, cos, sin)``  rotate-half rotary embedding of q [b, h, s, d] and k [b, kv, s, d] in one launch;
                                ``position_ids=`` indexes cos/sin tables for packed rows; ``inplace=``.
``swiglu(gate, up)``            ``silu(gate) * up``; backward writes the gradients over the saved inputs.
``geglu(gate, up)``             ``gelu_tanh(gate) * up`` (Gemma's ``gelu_pytorch_tanh``), backward in place too.
``fused_linear_cross_entropy``  ``(hidden, weight, labels, *, ignore_index, num_items_in_batch, chunk_size)``:
                                causal-LM loss of ``hidden @ weight.T`` without the [tokens, vocab] logits.
``fused_linear_logprobs``       ``(hidden, weight, targets, *, bias, temperature, softcap, logit_scale, outputs)``:
                                per-token log p(target), entropy and logging statistics (:class:`LogProbOutputs`)
                                of ``hidden @ weight.T``, again without the [tokens, vocab] logits.
``dequantize_nf4(packed, qs)``  bitsandbytes NF4 weight to dense [out, in], bit-identical to bitsandbytes.
``nf4_linear(x, packed, qs)``   ``x @ W.T`` over an NF4 weight, dequantised again in backward (never saved).
``lora_qkv(x, q, k, v)``        q, k, v projections with LoRA (:class:`LoRAWeights`) in one GEMM launch, the
                                low-rank term in its epilogue; 16-bit or NF4 bases; hand-written backward.
``lora_o(x, o)``                one projection with LoRA, the same way (attention's o_proj).
``lora_mlp(x, gate, up, down)`` Llama's SwiGLU MLP with LoRA on all three projections; H recomputed in backward;
                                ``activation="gelu_tanh"`` for Gemma's GeGLU MLP.
``lora_gate_up_mlp``            the same over a packed gate_up projection (Phi-3): ``(x, gate_up, down)``.
``lora_packed_qkv``             a packed q | k | v projection (Phi-3) in one launch, split at the given widths.
``lora_qkv_rope``               a q | k | v :class:`LoRAGroup` and RoPE in one autograd node: ``(group, x, cos,
                                sin, head_dim)`` gives q, k, v per head ``[b, h, s, d]``, q and k rotated.
``LoRAGroup``                   one to three projections of the same input, checked once and applied per call
                                (``group(x)`` returns one output per projection): what a patch holds per layer.
``LoRAMLP(gate_up, down, act)`` the fused LoRA-MLP over two :class:`LoRAGroup` s, checked once.
``LoRAMoEExperts``              a mixture-of-experts layer's experts ``(gate_up [E, 2I, H], down [E, H, I])`` with
                                per-expert LoRA and biases, SwiGLU or gpt-oss's clamped one, checked once; called with
                                ``(x, top_k_index, top_k_weights)``: grouped GEMMs over the expert-sorted tokens.
``lora_moe_experts``            the same as a function (builds a :class:`LoRAMoEExperts` per call).
==============================  ==============================================================================

The LoRA groups, the MLP and the MoE experts are also the custom ops ``fastft::lora_group`` / ``fastft::lora_mlp`` /
``fastft::lora_moe_experts`` (with their ``_backward`` ops), which they call while ``torch.compile`` traces them;
eager calls take the cheaper ``autograd.Function``.
"""

from fastft.kernels.cross_entropy import (
    FusedLinearCrossEntropyFunction,
    fused_linear_cross_entropy,
    linear_cross_entropy_reference,
)
from fastft.kernels.errors import ShapeContractError
from fastft.kernels.geglu import GeGLUFunction, geglu, geglu_reference
from fastft.kernels.linear_logprobs import (
    FusedLinearLogProbsFunction,
    LogProbOutputs,
    fused_linear_logprobs,
    linear_logprobs_reference,
)
from fastft.kernels.lora_group import LoRAGroup
from fastft.kernels.lora_mlp import LoRAMLP, LoRAMLPFunction, lora_gate_up_mlp, lora_mlp
from fastft.kernels.lora_moe_experts import LoRAMoEExperts, LoRAMoEExpertsFunction, lora_moe_experts
from fastft.kernels.lora_o import LoRAOFunction, lora_o
from fastft.kernels.lora_packed_qkv import LoRAPackedQKVFunction, lora_packed_qkv
from fastft.kernels.lora_projection import LoRAWeights, release_buffers
from fastft.kernels.lora_qkv import LoRAQKVFunction, lora_qkv
from fastft.kernels.lora_qkv_rope import LoRAQKVRoPEFunction, lora_qkv_rope
from fastft.kernels.nf4 import NF4LinearFunction, dequantize_nf4, dequantize_nf4_reference, nf4_linear
from fastft.kernels.rms_norm import RMSNormFunction, rms_norm, rms_norm_reference
from fastft.kernels.rope import RoPEFunction, apply_rope, rope_reference
from fastft.kernels.swiglu import SwiGLUFunction, swiglu, swiglu_reference

__all__ = [
    "FusedLinearCrossEntropyFunction",
    "FusedLinearLogProbsFunction",
    "GeGLUFunction",
    "LoRAMLPFunction",
    "LoRAMoEExperts",
    "LoRAMoEExpertsFunction",
    "LoRAOFunction",
    "LoRAPackedQKVFunction",
    "LoRAQKVFunction",
    "LoRAQKVRoPEFunction",
    "LoRAWeights",
    "LoRAGroup",
    "LoRAMLP",
    "LogProbOutputs",
    "NF4LinearFunction",
    "RMSNormFunction",
    "RoPEFunction",
    "ShapeContractError",
    "SwiGLUFunction",
    "apply_rope",
    "dequantize_nf4",
    "dequantize_nf4_reference",
    "fused_linear_cross_entropy",
    "fused_linear_logprobs",
    "geglu",
    "geglu_reference",
    "linear_cross_entropy_reference",
    "linear_logprobs_reference",
    "lora_gate_up_mlp",
    "lora_mlp",
    "lora_moe_experts",
    "lora_o",
    "lora_packed_qkv",
    "lora_qkv",
    "lora_qkv_rope",
    "nf4_linear",
    "release_buffers",
    "rms_norm",
    "rms_norm_reference",
    "rope_reference",
    "swiglu",
    "swiglu_reference",
]
