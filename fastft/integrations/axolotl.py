"""fastft as an Axolotl plugin: the model Axolotl loads trains on fastft's fused path.

Enable it in the Axolotl config::

    plugins:
      - fastft.integrations.axolotl.FastftPlugin
    adapter: lora            # or qlora; fastft's fused path serves LoRA adapters
    gradient_checkpointing: true
    # fastft_gradient_checkpointing: offload   # optional: fastft's own mode instead of following Axolotl's

The plugin calls :func:`fastft.apply` at three of Axolotl's hooks: ``post_model_build`` (the bare model, before
Axolotl turns checkpointing on and adds the adapter, so that its checkpointing request runs fastft's checkpointer),
``post_model_load`` (the final model with its adapter: the LoRA contracts are checked, nothing is patched twice) and
``post_trainer_create`` (the trainer's model, in case Axolotl's trainer holds another object). Written against
Axolotl 0.19.0's ``BasePlugin``; needs ``axolotl`` (and so pydantic) installed.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from axolotl.integrations.base import BasePlugin, PluginManager
from pydantic import BaseModel, Field, model_validator

from fastft.integrations.apply_model import apply

logger = logging.getLogger("fastft.integrations")

# Axolotl adapter names whose layers are peft LoRA layers (fastft.apply refuses the others).
LORA_ADAPTERS = ("lora", "qlora")
ARGS = "fastft.integrations.axolotl.FastftArgs"


class FastftArgs(BaseModel):
    """The plugin's fields in the Axolotl config (merged into Axolotl's own schema)."""

    fastft_apply: bool = Field(
        default=True,
        json_schema_extra={"description": "Put the model on fastft's fused path (false: the plugin does nothing)."},
    )
    fastft_gradient_checkpointing: bool | Literal["recompute", "offload", "unsloth", "sqrt", "sqrt-offload"] | None = (
        Field(
            default=None,
            json_schema_extra={
                "description": (
                    "fastft's checkpointing mode. Unset: follow Axolotl's gradient_checkpointing (true runs fastft's "
                    "checkpointer in recompute mode). A mode here is kept over Axolotl's and the trainer's requests."
                )
            },
        )
    )

    @model_validator(mode="before")
    @classmethod
    def refuse_other_adapters(cls, data: Any) -> Any:
        """Refuse, when the config is read, an adapter type fastft.apply would refuse once the model is loaded."""
        if isinstance(data, dict) and data.get("fastft_apply", True):
            adapter = data.get("adapter")
            if adapter is not None and not _lora_like(adapter):
                raise ValueError(
                    f"fastft plugin: adapter: {adapter!r} is not served by fastft's fused path, which trains LoRA "
                    f"adapters ({' or '.join(LORA_ADAPTERS)}, or a plugin's LoRA-like adapter). Use adapter: lora, or "
                    "set fastft_apply: false (or drop fastft.integrations.axolotl.FastftPlugin from plugins) to "
                    "train it without fastft."
                )
        return data


def _lora_like(adapter: str) -> bool:
    if adapter in LORA_ADAPTERS:
        return True
    # A plugin's adapter that Axolotl loads through its LoRA loader (AdapterCapabilities.lora_like) is peft LoRA.
    capability = PluginManager.get_instance().get_adapter_capability(adapter)
    return bool(capability is not None and capability.lora_like)


class FastftPlugin(BasePlugin):
    """Axolotl plugin that runs :func:`fastft.apply` on the model Axolotl builds (see the module docstring)."""

    def get_input_args(self) -> str:
        """The dotted path of :class:`FastftArgs`, which Axolotl merges into its config schema."""
        return ARGS

    @staticmethod
    def _apply(cfg: Any, model: Any) -> None:
        if not _setting(cfg, "fastft_apply", True):
            return
        apply(model, use_gradient_checkpointing=_setting(cfg, "fastft_gradient_checkpointing", None))

    def post_model_build(self, cfg: Any, model: Any) -> None:
        """Patch the bare model before Axolotl turns checkpointing on and adds the adapter."""
        self._apply(cfg, model)

    def post_model_load(self, cfg: Any, model: Any) -> None:
        """Check the final model (adapter included); a no-op for what ``post_model_build`` already patched."""
        self._apply(cfg, model)

    def post_trainer_create(self, cfg: Any, trainer: Any) -> None:
        """Make sure the model the trainer holds is the patched one."""
        self._apply(cfg, trainer.model)


def _setting(cfg: Any, name: str, default: Any) -> Any:
    # Axolotl passes a DictDefault, which answers None for a key the config does not set.
    value = cfg.get(name) if hasattr(cfg, "get") else getattr(cfg, name, None)
    return default if value is None else value


__all__ = ["FastftArgs", "FastftPlugin", "LORA_ADAPTERS"]
