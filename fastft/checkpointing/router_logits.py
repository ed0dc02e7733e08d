"""When a checkpointed layer must run as plain autograd: while an MoE model's router logits are being recorded.

A checkpointed layer's first pass runs without grad, so router logits recorded during it would reach the auxiliary
load-balancing loss detached; stock gradient checkpointing keeps their gradient. How transformers records them:

- 5.x: forward hooks collect them into a context variable (``output_capturing._active_collector``) while the model's
  forward runs; trl >= 1.15 asks for them itself, calling the backbone for its own load-balancing loss.
- 4.56-4.57: the sparse block's (Qwen3-MoE, Mixtral) or the router's (gpt-oss) ``forward`` is swapped for a capture
  wrapper for the call.
- 4.53: the layers return them, which fastft's MoE causal-LM forward handles (:mod:`fastft.patches.moe`).
"""

from __future__ import annotations

import logging

import torch

try:
    from transformers.utils.output_capturing import _active_collector as _OUTPUT_COLLECTOR
except ImportError:  # transformers 4.x
    _OUTPUT_COLLECTOR = None
_WARNED: list[bool] = []
# fastft.checkpoint's logger: the name the checkpointing modes log under.
logger = logging.getLogger("fastft.checkpoint")


def warn_plain_for_router_logits() -> None:
    """Say once that layers run without checkpointing while router logits are recorded, and what that costs."""
    if not _WARNED:
        _WARNED.append(True)
        logger.warning(
            "fastft: router logits are being recorded (output_router_logits, or trl's load-balancing loss), so the "
            "MoE layers run without activation checkpointing while they are: the auxiliary loss needs their "
            "gradient. More activation memory; set output_router_logits=False (trl: router_aux_loss_coef=0) to "
            "train with checkpointing."
        )


def layer_routers(layer: torch.nn.Module) -> tuple[torch.nn.Module, ...]:
    """The modules whose outputs carry ``layer``'s router logits, looked up once per layer: each sparse block and its
    router, as the block holds it and unwrapped from peft. Empty where transformers 5's collector says it instead."""
    if _OUTPUT_COLLECTOR is not None:
        return ()
    from fastft.contracts.moe import moe_blocks

    found: list[torch.nn.Module] = []
    for block in moe_blocks(layer):
        children = block.block._modules
        for router in (block.block, children.get("gate", children.get("router")), block.router):
            if router is not None and all(router is not seen for seen in found):
                found.append(router)
    return tuple(found)


def _captured(router: torch.nn.Module) -> bool:
    # The capture wrapper of transformers 4.56-4.57, known by its code object (other libraries that set an instance
    # forward, accelerate's device hooks among them, are not this).
    forward = router.__dict__.get("forward")
    code = getattr(forward, "__code__", None)
    return code is not None and code.co_name == "wrapped_forward" and "transformers" in code.co_filename


def recording_router_logits(routers: tuple[torch.nn.Module, ...] = ()) -> bool:
    """Whether the running forward records router logits (the layer then runs as plain autograd; a warning says so
    once).

    Args:
        routers: The layer's :func:`layer_routers`.
    """
    if routers and any(_captured(router) for router in routers):
        warn_plain_for_router_logits()
        return True
    collected = None if _OUTPUT_COLLECTOR is None else _OUTPUT_COLLECTOR.get()
    if not collected or "router_logits" not in collected:
        return False
    warn_plain_for_router_logits()
    return True


__all__ = ["layer_routers", "recording_router_logits", "warn_plain_for_router_logits"]
