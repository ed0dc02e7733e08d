"""Attention sizes from a config, and q / k / v / o projections checked against them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fastft.contracts._layers import _base_model, _features
from fastft.kernels.errors import ShapeContractError


@dataclass(frozen=True)
class AttentionShape:
    """The projection widths a config implies.

    Attributes:
        hidden: ``hidden_size``.
        heads: ``num_attention_heads``.
        kv_heads: ``num_key_value_heads`` (``heads`` when the config has none).
        head_dim: ``config.head_dim`` when set, else ``hidden // heads``.
    """

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int

    def projections(self) -> dict[str, tuple[int, int]]:
        """Expected ``[out, in]`` weight shape of each attention projection, separate (q / k / v) or packed (Phi-3's
        ``qkv_proj``: q's rows, then k's, then v's)."""
        return {
            "q_proj": (self.heads * self.head_dim, self.hidden),
            "k_proj": (self.kv_heads * self.head_dim, self.hidden),
            "v_proj": (self.kv_heads * self.head_dim, self.hidden),
            "qkv_proj": ((self.heads + 2 * self.kv_heads) * self.head_dim, self.hidden),
            "o_proj": (self.hidden, self.heads * self.head_dim),
        }

    def mismatch(self, where: str, proj: str, expected: tuple[int, int], actual: tuple[int, int]) -> str:
        """The message for a projection whose ``[out, in]`` is not the config's: both shapes and the fix."""
        rule = ""
        if proj == "qkv_proj":
            rule = (
                f" (out = (num_attention_heads + 2 x num_key_value_heads) x head_dim = ({self.heads} + 2 x "
                f"{self.kv_heads}) x {self.head_dim}, split as q {self.heads * self.head_dim}, k / v "
                f"{self.kv_heads * self.head_dim} each)"
            )
        return (
            f"{where}: expected weight [out, in] = [{expected[0]}, {expected[1]}] from the config "
            f"({self.describe()}){rule}, got [{actual[0]}, {actual[1]}]. The weights do not match the config: fix "
            "config.json (set head_dim explicitly when hidden_size != num_attention_heads x head_dim, and "
            "num_key_value_heads to the k/v heads the weights have), or load the weights this config was saved "
            "with."
        )

    def describe(self) -> str:
        """The config values the shapes come from, for error messages."""
        return (
            f"hidden_size={self.hidden}, num_attention_heads={self.heads}, num_key_value_heads={self.kv_heads}, "
            f"head_dim={self.head_dim}"
        )


def _text_config(config: Any) -> Any:
    # Multimodal configs keep the language model's sizes in a sub-config.
    getter = getattr(config, "get_text_config", None)
    return getter() if callable(getter) else config


def attention_shape(config: Any) -> AttentionShape:
    """Read the attention sizes from a transformers config.

    ``head_dim`` is taken from the config when it is set and only otherwise derived as ``hidden_size //
    num_attention_heads``: models such as Gemma or Qwen3 have ``hidden_size != heads * head_dim``.

    Args:
        config: A ``PretrainedConfig`` (or a multimodal one with a text config).

    Returns:
        The sizes.

    Raises:
        ShapeContractError: ``hidden_size`` or ``num_attention_heads`` is missing or not positive.
    """
    text = _text_config(config)
    hidden = getattr(text, "hidden_size", None)
    # Mllama's vision config names it attention_heads; transformers 5.x maps num_attention_heads onto it, 4.x does not.
    heads = getattr(text, "num_attention_heads", None) or getattr(text, "attention_heads", None)
    if not isinstance(hidden, int) or not isinstance(heads, int) or hidden < 1 or heads < 1:
        raise ShapeContractError(
            f"config ({type(text).__name__}): expected positive int hidden_size and num_attention_heads, got "
            f"hidden_size={hidden!r}, num_attention_heads={heads!r}. Fix config.json of the model."
        )
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or hidden // heads
    return AttentionShape(hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim)


def check_config(config: Any, source: str = "the model") -> AttentionShape:
    """Check that the config's attention sizes can work, before any weight is loaded.

    transformers 5.x builds a model with ``num_attention_heads=4, num_key_value_heads=3`` and only fails in the first
    forward ("size of tensor a (4) must match ... (3)"); this refuses it up front.

    Args:
        config: A ``PretrainedConfig``.
        source: Where the config came from (path or hub id), for the message.

    Returns:
        The attention sizes.

    Raises:
        ShapeContractError: ``num_attention_heads`` is not a multiple of ``num_key_value_heads``.
    """
    shape = attention_shape(config)
    if shape.heads % shape.kv_heads:
        divisors = [n for n in range(1, shape.heads + 1) if shape.heads % n == 0]
        raise ShapeContractError(
            f"model.layers.*.self_attn (config of {source}): expected num_attention_heads to be a multiple of "
            f"num_key_value_heads, so that each key/value head serves the same number of query heads (q_proj out "
            f"[{shape.heads} x {shape.head_dim}] against k_proj/v_proj out [{shape.kv_heads} x {shape.head_dim}]); "
            f"got num_attention_heads={shape.heads}, num_key_value_heads={shape.kv_heads}. Fix config.json: "
            f"num_key_value_heads must divide {shape.heads} (one of {divisors})."
        )
    return shape


def check_projections(model: torch.nn.Module) -> int:
    """Check every attention module's q/k/v/o projections against the sizes its config implies.

    An attention module is any module with ``q_proj``, ``k_proj``, ``v_proj`` (or a packed ``qkv_proj``) and
    ``o_proj`` children; its own ``config`` is used when it has one (multimodal models), else the model's. In/out
    features are read from the module attributes, which works for ``nn.Linear``, bitsandbytes ``Linear4bit``
    (whose weight is packed) and peft's LoRA wrappers (their base layer).

    Args:
        model: A transformers model or a ``PeftModel``.

    Returns:
        The number of attention modules checked.

    Raises:
        ShapeContractError: A projection whose ``[out, in]`` differs from the config's, or an invalid config.
    """
    base = _base_model(model)
    model_config = getattr(base, "config", None)
    checked = 0
    for name, module in base.named_modules():
        children = dict(module.named_children())
        separate = all(key in children for key in ("q_proj", "k_proj", "v_proj"))
        if "o_proj" not in children or not (separate or "qkv_proj" in children):
            continue
        config = getattr(module, "config", None) or model_config
        if config is None:
            continue
        shape = check_config(config, source=f"{type(base).__name__}.config")
        for proj, expected in shape.projections().items():
            if proj not in children:
                continue
            features = _features(children[proj])
            if features is None:
                continue
            in_actual, out_actual = features
            if (out_actual, in_actual) != expected:
                raise ShapeContractError(shape.mismatch(f"{name}.{proj}", proj, expected, (out_actual, in_actual)))
        checked += 1
    return checked
