"""Where LoRA goes on a mixture-of-experts model, for the expert layout the installed transformers loaded.

Attention gets its q / k / v / o adapters as on a dense model, and the dense MLPs some MoE models keep (Qwen3-MoE's
``mlp_only_layers``) theirs. The experts get one adapter per expert through peft's own mechanism for the layout, so
the adapter loads in plain peft:

* fused 3-D experts (transformers 5.x): ``target_parameters`` on ``experts.gate_up_proj`` and ``experts.down_proj``
  (peft's ``ParamWrapper``; its ``lora_A`` holds the E per-expert A's stacked, its ``lora_B`` the B's);
* per-expert modules (transformers 4.x): ``target_modules`` on each expert's gate / up / down ``nn.Linear``
  (``gate_proj`` / ``up_proj`` / ``down_proj``, or Mixtral's ``w1`` / ``w3`` / ``w2``).

The router is left frozen unless asked for (``train_router=True``): a LoRA on it changes which experts each token
reaches, which a fine-tune on a small dataset rarely wants, and stock peft recipes leave it alone too.
"""

from __future__ import annotations

import dataclasses

import torch
from peft import LoraConfig

from fastft.contracts.moe import _EXPERT_NAMES, moe_blocks


@dataclasses.dataclass(frozen=True)
class MoETargets:
    """The expert (and router) part of an MoE model's LoRA targets.

    Attributes:
        modules: ``target_modules`` names of the experts (per-expert layout: their projections).
        parameters: ``target_parameters`` of the experts (fused layout: the 3-D expert tensors).
        router_modules: ``target_modules`` of the router when asked for (a ``Linear`` router).
        router_parameters: ``target_parameters`` of the router when asked for (a router's weight parameter).
        layout: ``"fused"`` or ``"per-expert"``.
    """

    modules: tuple[str, ...]
    parameters: tuple[str, ...]
    router_modules: tuple[str, ...]
    router_parameters: tuple[str, ...]
    layout: str


def peft_takes_parameters() -> bool:
    """Whether the installed peft can put LoRA on parameters (``LoraConfig.target_parameters``, peft 0.17+)."""
    return "target_parameters" in getattr(LoraConfig, "__dataclass_fields__", {})


def moe_targets(model: torch.nn.Module, train_router: bool = False) -> MoETargets | None:
    """The LoRA targets of ``model``'s experts (and router, when ``train_router``), or None for a dense model.

    Raises:
        ValueError: Fused 3-D experts under a peft without ``target_parameters``, or MoE blocks of both layouts.
    """
    blocks = list(moe_blocks(model))
    if not blocks:
        return None
    layouts = {block.layout for block in blocks}
    if len(layouts) != 1:
        raise ValueError(
            f"fastft.get_peft_model: {type(model).__name__} mixes fused and per-expert MoE blocks "
            f"({sorted(layouts)}); fastft puts LoRA on one layout per model. Load the model with one transformers "
            "release's classes."
        )
    layout = layouts.pop()
    modules: list[str] = []
    parameters: list[str] = []
    router_modules: list[str] = []
    router_parameters: list[str] = []
    for block in blocks:
        router_key = "gate" if "gate" in block.block._modules else "router"
        if layout == "fused":
            for name in ("gate_up_proj", "down_proj"):
                key = f"experts.{name}"
                if key not in parameters:
                    parameters.append(key)
        else:
            for expert in block.experts:
                for names in _EXPERT_NAMES:
                    if all(name in expert._modules for name in names):
                        modules += [name for name in names if name not in modules]
                        break
        if train_router and block.router is not None:
            if isinstance(block.router, torch.nn.Linear):
                if router_key not in router_modules:
                    router_modules.append(router_key)
            elif f"{router_key}.weight" not in router_parameters:
                router_parameters.append(f"{router_key}.weight")
    if (parameters or router_parameters) and not peft_takes_parameters():
        import peft

        raise ValueError(
            f"fastft.get_peft_model: {type(model).__name__} stores its experts as 3-D parameters "
            f"({', '.join(parameters + router_parameters)}), which peft {peft.__version__} cannot put LoRA on; "
            "install peft>=0.17 (LoraConfig.target_parameters), or pass target_modules for the attention only."
        )
    return MoETargets(tuple(modules), tuple(parameters), tuple(router_modules), tuple(router_parameters), layout)


__all__ = ["MoETargets", "moe_targets", "peft_takes_parameters"]
