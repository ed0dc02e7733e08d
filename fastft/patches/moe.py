"""Qwen3-MoE and Mixtral: their attention, norms, dense MLPs, loss and experts on the fused path.

Attention is Qwen3's (per-head q / k norms) or Mistral's (a sliding window from the config), so the bodies in
:mod:`fastft.patches.decoder` serve them unchanged; Qwen3-MoE's dense layers (``mlp_only_layers``) are a gated MLP.
The sparse block runs its router as upstream does and its experts as one fused grouped-expert LoRA node: transformers
5.x's 3-D expert parameters through :mod:`fastft.patches.moe_experts`, 4.x's per-expert modules through
:mod:`fastft.patches.moe_experts_4x` (address tables, no copy). What the kernels cannot serve runs upstream's
experts, through peft's own LoRA (:mod:`fastft.loading.moe_targets`), and the patch report says which block and why.

The training loss goes through the fused linear cross-entropy unless router logits are asked for
(``output_router_logits``, from the call or the config): the auxiliary load-balancing loss needs them, so that call
runs upstream's own forward, loss included, and runs its layers without fastft's checkpointing, whose first pass
would hand the auxiliary loss router logits without their gradient (a warning says so once).

Records cover the four transformers ranges the lanes test; their signatures were read from each range's release.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from transformers.models.mixtral import modeling_mixtral as mixtral
from transformers.models.qwen3_moe import modeling_qwen3_moe as qwen3_moe

from fastft.checkpointing import modes as checkpointing
from fastft.checkpointing.layer import plain_layers
from fastft.checkpointing.router_logits import warn_plain_for_router_logits
from fastft.patches import moe_experts_4x
from fastft.patches.causal_lm import FusedLossState, causal_lm_forward
from fastft.patches.decoder import (
    Family,
    FastClasses,
    VersionRange,
    attention_forward,
    gated_mlp_forward,
    model_type_only,
    register_family,
    rms_norm_forward,
    swap_class,
)
from fastft.patches.llama import (
    ATTENTION_5,
    ATTENTION_453,
    ATTENTION_456,
    _config_window,
    renamed_cache,
)
from fastft.patches.moe_experts import experts_reason, experts_runner
from fastft.patches.qwen import _layer_window
from fastft.registry import PatchRecord, register

QWEN3_MOE = Family(
    name="qwen3_moe",
    model_type="qwen3_moe",
    upstream=qwen3_moe,
    prefix="Qwen3Moe",
    head_norms=True,
    attention_kwargs=_layer_window,
)
MIXTRAL = Family(
    name="mixtral", model_type="mixtral", upstream=mixtral, prefix="Mixtral", attention_kwargs=_config_window
)


def moe_causal_lm_forward(upstream_class: type) -> Callable[..., Any]:
    """``upstream_class.forward`` (an MoE ``...ForCausalLM``) with the fused loss, except where router logits are
    wanted: then upstream's own forward, whose auxiliary loss reads them."""
    fused = causal_lm_forward(upstream_class)
    upstream = upstream_class.forward
    signature = inspect.signature(upstream)

    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        wanted = signature.bind_partial(self, *args, **kwargs).arguments.get("output_router_logits")
        if wanted is None:
            wanted = getattr(self.config, "output_router_logits", False)
        if not wanted:
            return fused(self, *args, **kwargs)
        if self.training and torch.is_grad_enabled() and checkpointing.get_mode(self) is not None:
            warn_plain_for_router_logits()
            with plain_layers():
                return upstream(self, *args, **kwargs)
        return upstream(self, *args, **kwargs)

    forward.__signature__ = signature
    forward.__doc__ = (
        f"``{upstream_class.__name__}.forward`` with the fused loss (upstream's when router logits are on)."
    )
    return forward


def sparse_block_forward(self: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """transformers 5.x's sparse MoE block (Qwen3-MoE, Mixtral) with its experts on the fused grouped-expert path
    where :mod:`fastft.patches.moe_experts` can serve them; the router runs as upstream's."""
    batch, seq, hidden = hidden_states.shape
    jitter = getattr(self, "jitter_noise", 0)
    if self.training and jitter > 0:
        # Mixtral's router jitter, drawn and applied as upstream does.
        hidden_states *= torch.empty_like(hidden_states).uniform_(1.0 - jitter, 1.0 + jitter)
    flat = hidden_states.view(-1, hidden)
    _, weights, index = self.gate(flat)
    run = experts_runner(self)
    out = self.experts(flat, index, weights) if run is None else run(flat, index, weights)
    return out.reshape(batch, seq, hidden)


def sparse_block_forward_4x(upstream: Callable[..., Any]) -> Callable[..., Any]:
    """transformers 4.x's sparse MoE block forward (Qwen3-MoE, Mixtral; 4.53 - 4.57) with its per-expert modules on
    the fused grouped-expert path where :mod:`fastft.patches.moe_experts_4x` can serve them, else ``upstream``.

    The routing is upstream's, step for step: Mixtral's router jitter in training (drawn before the router, in place
    on the input, as upstream does), ``self.gate`` called as a module (4.56 - 4.57 record router logits by wrapping
    the block, and hooks on the router still run), softmax in float32, top-k, renormalised (Mixtral always, Qwen3-MoE
    when ``norm_topk_prob``), cast to the hidden states' dtype. Returns ``(hidden_states, router_logits)`` as upstream.
    """

    def forward(self: torch.nn.Module, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        run = moe_experts_4x.experts_runner(self, hidden_states)
        if run is None:
            return upstream(self, hidden_states)
        batch, seq, hidden = hidden_states.shape
        jitter = getattr(self, "jitter_noise", 0)
        if self.training and jitter > 0:
            hidden_states *= torch.empty_like(hidden_states).uniform_(1.0 - jitter, 1.0 + jitter)
        flat = hidden_states.view(-1, hidden)
        router_logits = self.gate(flat)
        weights = torch.nn.functional.softmax(router_logits, dim=1, dtype=torch.float)
        weights, index = torch.topk(weights, self.top_k, dim=-1)
        # Qwen3-MoE renormalises when its config says so; Mixtral's block has no such switch and always does.
        if getattr(self, "norm_topk_prob", True):
            weights /= weights.sum(dim=-1, keepdim=True)
        out = run(flat, index, weights.to(flat.dtype))
        return out.reshape(batch, seq, hidden), router_logits

    forward.__doc__ = sparse_block_forward_4x.__doc__
    return forward


class FastQwen3MoeSparseMoeBlock4(qwen3_moe.Qwen3MoeSparseMoeBlock):
    """``Qwen3MoeSparseMoeBlock`` with its per-expert modules as one fused grouped-expert LoRA node (transformers
    4.x)."""

    forward = sparse_block_forward_4x(qwen3_moe.Qwen3MoeSparseMoeBlock.forward)


class FastMixtralSparseMoeBlock4(mixtral.MixtralSparseMoeBlock):
    """``MixtralSparseMoeBlock`` with its per-expert modules as one fused grouped-expert LoRA node (transformers
    4.x)."""

    forward = sparse_block_forward_4x(mixtral.MixtralSparseMoeBlock.forward)


class FastQwen3MoeSparseMoeBlock(qwen3_moe.Qwen3MoeSparseMoeBlock):
    """``Qwen3MoeSparseMoeBlock`` with its experts as one fused grouped-expert LoRA node (transformers 5.x)."""

    forward = sparse_block_forward


class FastMixtralSparseMoeBlock(mixtral.MixtralSparseMoeBlock):
    """``MixtralSparseMoeBlock`` with its experts as one fused grouped-expert LoRA node (transformers 5.x)."""

    forward = sparse_block_forward


class FastQwen3MoeRMSNorm(qwen3_moe.Qwen3MoeRMSNorm):
    """``Qwen3MoeRMSNorm`` (layer norms and per-head q_norm / k_norm) through the fused RMSNorm kernel."""

    forward = rms_norm_forward


class FastQwen3MoeMLP(qwen3_moe.Qwen3MoeMLP):
    """``Qwen3MoeMLP`` (the dense layers of ``mlp_only_layers``) as one fused LoRA-MLP node."""

    forward = gated_mlp_forward(QWEN3_MOE)


class FastQwen3MoeAttention(qwen3_moe.Qwen3MoeAttention):
    """``Qwen3MoeAttention`` with the fused LoRA-QKV, per-head q / k RMSNorm, RoPE and LoRA-O kernels."""

    forward = attention_forward(QWEN3_MOE, qwen3_moe.Qwen3MoeAttention)


class FastQwen3MoeForCausalLM(FusedLossState, qwen3_moe.Qwen3MoeForCausalLM):
    """``Qwen3MoeForCausalLM`` whose training loss goes through the fused linear cross-entropy."""

    forward = moe_causal_lm_forward(qwen3_moe.Qwen3MoeForCausalLM)


class FastMixtralRMSNorm(mixtral.MixtralRMSNorm):
    """``MixtralRMSNorm`` through the fused RMSNorm kernel."""

    forward = rms_norm_forward


class FastMixtralAttention(mixtral.MixtralAttention):
    """``MixtralAttention`` with the fused LoRA-QKV, RoPE and LoRA-O kernels (its sliding window passed on)."""

    forward = attention_forward(MIXTRAL, mixtral.MixtralAttention)


class FastMixtralForCausalLM(FusedLossState, mixtral.MixtralForCausalLM):
    """``MixtralForCausalLM`` whose training loss goes through the fused linear cross-entropy."""

    forward = moe_causal_lm_forward(mixtral.MixtralForCausalLM)


# The MoE heads' signatures (Qwen3-MoE and Mixtral share them): output_router_logits besides Llama's arguments.
CAUSAL_LM_453 = (
    "(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None, inputs_embeds=None, "
    "labels=None, use_cache=None, output_attentions=None, output_hidden_states=None, output_router_logits=None, "
    "cache_position=None, logits_to_keep=0, **kwargs)"
)
CAUSAL_LM_456 = (
    "(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None, inputs_embeds=None, "
    "labels=None, use_cache=None, output_router_logits=None, cache_position=None, logits_to_keep=0, **kwargs)"
)
CAUSAL_LM_5 = (
    "(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None, inputs_embeds=None, "
    "labels=None, use_cache=None, output_router_logits=None, logits_to_keep=0, **kwargs)"
)


def moe_ranges() -> tuple[VersionRange, ...]:
    """The four transformers ranges the lanes test, with the MoE heads' signatures."""
    return (
        VersionRange(">=4.53.3,<4.56", ATTENTION_453, CAUSAL_LM_453),
        VersionRange(">=4.56,<4.58", ATTENTION_456, CAUSAL_LM_456),
        VersionRange(">=5.5.4,<5.24", ATTENTION_5, CAUSAL_LM_5),
        VersionRange(">=5.24,<5.25", renamed_cache(ATTENTION_5), renamed_cache(CAUSAL_LM_5)),
    )


register_family(
    QWEN3_MOE,
    FastClasses(FastQwen3MoeRMSNorm, FastQwen3MoeAttention, FastQwen3MoeMLP, FastQwen3MoeForCausalLM),
    moe_ranges(),
)
register_family(
    MIXTRAL, FastClasses(FastMixtralRMSNorm, FastMixtralAttention, None, FastMixtralForCausalLM), moe_ranges()
)


def experts_only_on_5(family: Family) -> Callable[[torch.nn.Module], str | None]:
    """A sparse-block record's ``applies_to``: the family's models on transformers 5.x."""
    family_only = model_type_only(family.model_type)

    def applies_to(model: torch.nn.Module) -> str | None:
        reason = family_only(model)
        if reason:
            return reason
        import transformers
        from packaging.version import Version

        if Version(transformers.__version__) < Version("5"):
            return (
                "transformers 4.x keeps one module per expert: upstream's experts run, with peft's LoRA on each "
                "expert's projections"
            )
        return None

    return applies_to


def experts_fallbacks(
    fast_class: type, reason: Callable[[torch.nn.Module, str], str | None] = experts_reason
) -> Callable[[torch.nn.Module], dict[str, str]]:
    """A sparse-block record's ``fallbacks``: each patched block whose experts run upstream's way, and why."""

    def fallbacks(model: torch.nn.Module) -> dict[str, str]:
        found = {}
        for name, module in model.named_modules():
            if type(module) is fast_class:
                why = reason(module, name)
                if why:
                    found[f"{name}.experts"] = why
        return found

    return fallbacks


# The sparse blocks: transformers 4.x's per-expert modules (its block returns the router logits too) and 5.x's 3-D
# experts. Both ranges' block forward is (self, hidden_states).
for _family, _fast4, _fast5 in (
    (QWEN3_MOE, FastQwen3MoeSparseMoeBlock4, FastQwen3MoeSparseMoeBlock),
    (MIXTRAL, FastMixtralSparseMoeBlock4, FastMixtralSparseMoeBlock),
):
    _upstream = _family.upstream_class("SparseMoeBlock")
    for _versions, _fast, _reason in (
        (">=4.53.3,<4.56", _fast4, moe_experts_4x.experts_reason),
        (">=4.56,<4.58", _fast4, moe_experts_4x.experts_reason),
        (">=5.5.4,<5.24", _fast5, experts_reason),
        (">=5.24,<5.25", _fast5, experts_reason),
    ):
        register(
            PatchRecord(
                name=f"{_family.name}.experts",
                target=f"{_family.upstream.__name__}.{_upstream.__name__}.forward",
                versions={"transformers": _versions},
                fingerprint="(self, hidden_states)",
                applies_to=model_type_only(_family.model_type),
                apply=swap_class(_upstream, _fast),
                replacement=_fast,
                fallbacks=experts_fallbacks(_fast, _reason),
                model_types=(_family.model_type,),
            )
        )
