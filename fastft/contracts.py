"""Shape contracts: what each projection expects, checked early, with errors that name the module.

Every check raises :class:`ShapeContractError` (a ``ValueError``) whose message names the module (its qualified name
in the transformers model, e.g. ``model.layers.0.self_attn.q_proj``), the expected and the actual shape, and what to
change. ``FastModel`` runs them at ``from_pretrained``, ``get_peft_model`` and ``load_adapter``; two of them also
stay on the model as forward pre-hooks (a 4-bit weight's quant_state, and ``max_seq_length``), because what they
guard can change after loading.

Module names are relative to the transformers model (``PeftModel`` wrappers and LoRA ``base_layer`` levels are left
out), so they read the same as in ``model.named_modules()`` of the model ``from_pretrained`` returned.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

# The class lives in the kernel layer, which sits above this one and raises it too (a packed 4-bit weight
# without its quant_state); defining it there keeps one class for both layers.
from fastft.kernels.errors import ShapeContractError

__all__ = [
    "AttentionShape",
    "ShapeContractError",
    "attention_shape",
    "check_adapter_tensors",
    "check_config",
    "check_lora",
    "check_model",
    "check_projections",
    "check_quant_states",
    "guard_4bit",
    "guard_max_seq_length",
]

_DDP_FIX = (
    "Use DistributedDataParallel, one process per GPU, which keeps each process's quantised weights intact: "
    "`torchrun --nproc_per_node=N train.py` or `accelerate launch train.py` (fastft picks each process's GPU "
    "from LOCAL_RANK)."
)


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
        """Expected ``[out, in]`` weight shape of each attention projection."""
        return {
            "q_proj": (self.heads * self.head_dim, self.hidden),
            "k_proj": (self.kv_heads * self.head_dim, self.hidden),
            "v_proj": (self.kv_heads * self.head_dim, self.hidden),
            "o_proj": (self.hidden, self.heads * self.head_dim),
        }

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
    heads = getattr(text, "num_attention_heads", None)
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


def _base_model(model: torch.nn.Module) -> torch.nn.Module:
    # PeftModel -> the transformers model, so names read as in model.named_modules() before wrapping.
    getter = getattr(model, "get_base_model", None)
    return getter() if callable(getter) else model


def _base_layer(module: torch.nn.Module) -> torch.nn.Module:
    getter = getattr(module, "get_base_layer", None)
    return getter() if callable(getter) else module


def _features(module: torch.nn.Module) -> tuple[int, int] | None:
    """``(in, out)`` of a linear-like base layer; bnb's packed Linear4bit keeps the logical sizes in attributes."""
    base = _base_layer(module)
    if hasattr(base, "in_features") and hasattr(base, "out_features"):
        return int(base.in_features), int(base.out_features)
    if isinstance(base, torch.nn.Embedding):
        return base.num_embeddings, base.embedding_dim
    if hasattr(base, "in_channels") and hasattr(base, "out_channels"):
        return int(base.in_channels), int(base.out_channels)
    if type(base).__name__ == "Conv1D":  # transformers' GPT-2 layer stores its weight as [in, out]
        return int(base.weight.shape[0]), int(base.weight.shape[1])
    return None


def check_projections(model: torch.nn.Module) -> int:
    """Check every attention module's q/k/v/o projections against the sizes its config implies.

    An attention module is any module with ``q_proj``, ``k_proj``, ``v_proj`` and ``o_proj`` children; its own
    ``config`` is used when it has one (multimodal models), else the model's. In/out features are read from the
    module attributes, which works for ``nn.Linear``, bitsandbytes ``Linear4bit`` (whose weight is packed) and
    peft's LoRA wrappers (their base layer).

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
        if not all(key in children for key in ("q_proj", "k_proj", "v_proj", "o_proj")):
            continue
        config = getattr(module, "config", None) or model_config
        if config is None:
            continue
        shape = check_config(config, source=f"{type(base).__name__}.config")
        for proj, (out_expected, in_expected) in shape.projections().items():
            features = _features(children[proj])
            if features is None:
                continue
            in_actual, out_actual = features
            if (out_actual, in_actual) != (out_expected, in_expected):
                raise ShapeContractError(
                    f"{name}.{proj}: expected weight [out, in] = [{out_expected}, {in_expected}] from the config "
                    f"({shape.describe()}), got [{out_actual}, {in_actual}]. The module does not match the config: "
                    "fix config.json (set head_dim explicitly when hidden_size != num_attention_heads x head_dim, and "
                    "num_key_value_heads to the k/v heads the weights have), or load the weights this config was "
                    "saved with."
                )
        checked += 1
    return checked


def _weight(entry: torch.nn.Module | torch.Tensor) -> torch.Tensor:
    # LoRA keeps A and B as nn.Linear / nn.Conv modules; AdaLoRA keeps them as bare parameters.
    return entry if isinstance(entry, torch.Tensor) else entry.weight


def check_lora(model: torch.nn.Module) -> int:
    """Check every LoRA pair against the base layer it wraps: A is ``[r, in]``, B is ``[out, r]``.

    Embedding LoRA (``lora_embedding_A`` ``[r, num_embeddings]``, ``lora_embedding_B`` ``[embedding_dim, r]``) and
    convolution LoRA (first two dims of the kernels) are checked the same way.

    Args:
        model: A ``PeftModel`` (a model without LoRA layers passes trivially).

    Returns:
        The number of (layer, adapter) pairs checked.

    Raises:
        ShapeContractError: A LoRA weight whose shape does not fit its base layer or its rank.
    """
    checked = 0
    for name, module in _base_model(model).named_modules():
        ranks = getattr(module, "r", None)
        if not isinstance(ranks, dict) or not hasattr(module, "lora_A"):
            continue
        features = _features(module)
        if features is None:
            continue
        in_features, out_features = features
        for adapter, rank in ranks.items():
            pairs = []
            if adapter in module.lora_A:
                pairs = [("lora_A", _weight(module.lora_A[adapter])), ("lora_B", _weight(module.lora_B[adapter]))]
            elif adapter in getattr(module, "lora_embedding_A", {}):
                pairs = [
                    ("lora_embedding_A", module.lora_embedding_A[adapter]),
                    ("lora_embedding_B", module.lora_embedding_B[adapter]),
                ]
            for kind, weight in pairs:
                expected = (rank, in_features) if kind.endswith("A") else (out_features, rank)
                actual = tuple(weight.shape[:2])
                if actual != expected:
                    raise ShapeContractError(
                        f"{name}.{kind}[{adapter!r}]: expected [{expected[0]}, {expected[1]}] (r={rank}, base layer "
                        f"in={in_features}, out={out_features}), got {list(weight.shape)}. LoRA A must be [r, in] and "
                        "B [out, r] of the layer they wrap: rebuild the adapter with FastModel.get_peft_model, or load "
                        "an adapter trained for this base model."
                    )
            checked += bool(pairs)
    return checked


def _linear4bit_class() -> type | None:
    # No bnb import means no bnb module can exist in the model, so don't pay for importing it.
    if "bitsandbytes" not in sys.modules:
        return None
    from bitsandbytes.nn import Linear4bit

    return Linear4bit


def _linear4bit_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    linear4bit = _linear4bit_class()
    if linear4bit is None:
        return []
    return [(name, module) for name, module in _base_model(model).named_modules() if isinstance(module, linear4bit)]


def _lost_quant_state_message(name: str, module: torch.nn.Module) -> str:
    weight = module.weight
    return (
        f"{name}: expected a 4-bit weight for [out, in] = [{module.out_features}, {module.in_features}] carrying its "
        f"bitsandbytes quant_state, got a {type(weight).__name__} of packed {weight.dtype} bytes "
        f"{list(weight.shape)} with no quant_state, which cannot be used as a weight. Rebuilding the parameter "
        "(module.weight = torch.nn.Parameter(module.weight.data), p.detach(), nn.DataParallel replication) drops it: "
        "keep the original Params4bit, reload with FastModel.from_pretrained(..., load_in_4bit=True), and for "
        f"several GPUs: {_DDP_FIX}"
    )


def check_quant_states(model: torch.nn.Module) -> int:
    """Check that every bitsandbytes ``Linear4bit`` weight carries a quant_state of the layer's shape.

    Args:
        model: A transformers model or a ``PeftModel``.

    Returns:
        The number of 4-bit layers checked.

    Raises:
        ShapeContractError: A packed weight without quant_state, or one whose quant_state is for another shape.
    """
    modules = _linear4bit_modules(model)
    for name, module in modules:
        state = getattr(module.weight, "quant_state", None)
        if state is None:
            raise ShapeContractError(_lost_quant_state_message(name, module))
        expected = (module.out_features, module.in_features)
        actual = tuple(getattr(state, "shape", None) or ())
        if actual != expected:
            raise ShapeContractError(
                f"{name}: expected the 4-bit weight's quant_state.shape [out, in] = {list(expected)}, got "
                f"{list(actual)}: the packed bytes and their quantisation statistics belong to different layers. "
                "Reload the model with FastModel.from_pretrained(..., load_in_4bit=True)."
            )
    return len(modules)


class _QuantStateGuard:
    """Forward pre-hook of one ``Linear4bit``: refuse to run without a quant_state.

    bitsandbytes' own forward would try ``fix_4bit_weight_quant_state_from_module`` (every version from 0.46 to
    0.50): it silently re-attaches ``module.quant_state`` when the module still has one, and otherwise warns
    ("FP4 quantization state not initialized") and fails in an assert or in ``matmul_4bit`` without naming the
    layer. A re-attached state is only right if nothing else changed, so fastft refuses instead. A module-level
    class rather than a closure, so the model still pickles and deep-copies.
    """

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, module: torch.nn.Module, args: tuple) -> None:
        if getattr(module.weight, "quant_state", None) is None:
            raise ShapeContractError(_lost_quant_state_message(self.name, module))


class _RefuseReplication:
    """Stands in for ``Module._replicate_for_data_parallel`` on a 4-bit module (an instance attribute).

    ``torch.nn.parallel.replicate`` (what ``nn.DataParallel`` runs on every forward with several GPUs) broadcasts
    the parameters as plain tensors, which drops Params4bit's quant_state, and then calls this on every submodule;
    raising here stops it before any replica computes with packed bytes.
    """

    def __init__(self, name: str, shape: tuple[int, int]) -> None:
        self.name = name
        self.shape = shape

    def __call__(self) -> torch.nn.Module:
        raise ShapeContractError(
            f"{self.name}: nn.DataParallel cannot replicate a 4-bit layer: its replicas would get the packed bytes "
            f"without the quant_state that makes them a [{self.shape[0]}, {self.shape[1]}] weight. {_DDP_FIX}"
        )


def guard_4bit(model: torch.nn.Module) -> int:
    """Keep every bitsandbytes ``Linear4bit`` from computing without its quant_state.

    Registers a forward pre-hook per 4-bit layer that raises :class:`ShapeContractError` naming the layer when its
    weight has lost the quant_state (hooks are copied into ``nn.DataParallel`` replicas too), and makes
    ``nn.DataParallel`` replication of the layer raise, pointing to DDP. Calling it again on the same model adds
    nothing.

    Args:
        model: A transformers model or a ``PeftModel``.

    Returns:
        The number of 4-bit layers guarded.
    """
    modules = _linear4bit_modules(model)
    for name, module in modules:
        if isinstance(module.__dict__.get("_replicate_for_data_parallel"), _RefuseReplication):
            continue
        module.register_forward_pre_hook(_QuantStateGuard(name))
        module._replicate_for_data_parallel = _RefuseReplication(name, (module.out_features, module.in_features))
    return len(modules)


def check_model(model: torch.nn.Module) -> None:
    """Run the static contracts on a loaded model: config, projections, 4-bit quant_states and LoRA pairs.

    Args:
        model: A transformers model or a ``PeftModel``.

    Raises:
        ShapeContractError: The first contract that fails.
    """
    config = getattr(_base_model(model), "config", None)
    if config is not None:
        check_config(config, source=type(_base_model(model)).__name__ + ".config")
    check_projections(model)
    check_quant_states(model)
    check_lora(model)


def _longest_segment(position_ids: torch.Tensor) -> int:
    """Longest run of consecutive positions in each row: the longest sequence when several are packed in a row."""
    rows = position_ids.reshape(-1, position_ids.shape[-1])
    starts = torch.ones_like(rows, dtype=torch.bool)
    starts[:, 1:] = rows[:, 1:] != rows[:, :-1] + 1
    longest = 0
    for row in starts:
        edges = torch.cat([row.nonzero().flatten(), row.new_tensor([row.numel()], dtype=torch.long)])
        longest = max(longest, int(edges.diff().max()))
    return longest


class _MaxSeqLengthGuard:
    """Forward pre-hook (with kwargs) of the decoder backbone: refuse inputs longer than ``max_seq_length``."""

    def __init__(self, name: str, max_seq_length: int) -> None:
        self.name = name
        self.max_seq_length = max_seq_length

    def __call__(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        embeds = kwargs.get("inputs_embeds")
        if isinstance(input_ids, torch.Tensor):
            what, tensor, length = "input_ids", input_ids, input_ids.shape[-1]
        elif isinstance(embeds, torch.Tensor) and embeds.dim() >= 2:
            what, tensor, length = "inputs_embeds", embeds, embeds.shape[-2]
        else:
            return
        if length <= self.max_seq_length:
            return
        position_ids = kwargs.get("position_ids")
        if isinstance(position_ids, torch.Tensor) and position_ids.shape[-1] == length:
            # Padding-free batches put several sequences in one row; each restarts its positions at 0.
            length = _longest_segment(position_ids)
            if length <= self.max_seq_length:
                return
            what += " (longest packed sequence, from position_ids)"
        raise ShapeContractError(
            f"{self.name} ({type(module).__name__}): expected at most max_seq_length={self.max_seq_length} tokens per "
            f"sequence, got {length} in {what} of shape {list(tensor.shape)}. Truncate when tokenizing "
            f"(tokenizer(..., truncation=True) stops at tokenizer.model_max_length; with trl, "
            f"SFTConfig(max_length={self.max_seq_length})), or load with a larger max_seq_length "
            f"(FastModel.from_pretrained(..., max_seq_length={length}))."
        )


def guard_max_seq_length(model: torch.nn.Module, max_seq_length: int) -> torch.nn.Module:
    """Make every forward with a sequence longer than ``max_seq_length`` raise :class:`ShapeContractError`.

    The check is a forward pre-hook on the decoder backbone (the module named by ``base_model_prefix``, e.g.
    ``model`` in ``LlamaForCausalLM``), so it also fires when a trainer calls the backbone directly (trl >= 1.15
    does, for its fused LM head). It looks at the length of this call's input only (``input_ids`` or
    ``inputs_embeds``, sequence dimension): generation with a KV cache feeds one token per step and is not limited.
    A row that packs several sequences (padding-free batches with ``position_ids`` restarting at 0) is judged by
    its longest sequence. Calling it again replaces the limit.

    Args:
        model: A transformers model or a ``PeftModel``.
        max_seq_length: The longest sequence accepted.

    Returns:
        The module the hook is on.
    """
    base = _base_model(model)
    prefix = getattr(base, "base_model_prefix", "")
    backbone = getattr(base, prefix, None) if prefix else None
    if not isinstance(backbone, torch.nn.Module):
        backbone, prefix = base, type(base).__name__
    for hook in backbone._forward_pre_hooks.values():
        if isinstance(hook, _MaxSeqLengthGuard):
            hook.max_seq_length = max_seq_length
            return backbone
    backbone.register_forward_pre_hook(_MaxSeqLengthGuard(prefix, max_seq_length), with_kwargs=True)
    return backbone


_LORA_SUFFIX = re.compile(
    r"^(?P<module>.+)\.(?P<kind>lora_A\.weight|lora_B\.weight|lora_B\.bias|lora_embedding_A|lora_embedding_B|"
    r"lora_magnitude_vector(?:\.weight)?)$"
)
_WRAPPER_LEVELS = re.compile(r"\.(?:base_layer|original_module|modules_to_save\.[^.]+)(?=\.)")
_ADAPTER_PREFIX = "base_model.model."


def _rank_for(module: str, rank: int, rank_pattern: Mapping[str, int]) -> int:
    # peft matches rank_pattern keys as regexes against the end of the module name.
    for pattern, value in rank_pattern.items():
        if re.match(rf"(.*\.)?{pattern}$", module):
            return int(value)
    return rank


def _base_tensor_shapes(base: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    shapes = {}
    # remove_duplicate=False: a tied lm_head.weight is listed under its own name too.
    for name, tensor in [*base.named_parameters(remove_duplicate=False), *base.named_buffers()]:
        if "lora_" in name:
            continue
        state = getattr(tensor, "quant_state", None)
        shape = tuple(state.shape) if state is not None and getattr(state, "shape", None) else tuple(tensor.shape)
        shapes.setdefault(_WRAPPER_LEVELS.sub("", name), shape)
    return shapes


def check_adapter_tensors(
    model: torch.nn.Module, tensors: Mapping[str, torch.Tensor], adapter_config: Mapping[str, Any]
) -> int:
    """Check a saved LoRA adapter's tensors against the base model before peft loads them.

    Keys are those of ``adapter_model.safetensors`` (``base_model.model.<module>.lora_A.weight`` and so on). LoRA
    tensors must fit their base layer and the rank the adapter config gives that layer (``r``, or its
    ``rank_pattern``); full tensors (``modules_to_save``, saved embedding layers) must equal the base tensor's shape.

    Args:
        model: The base model (a transformers model or a ``PeftModel``).
        tensors: Adapter tensors by key (only ``.shape`` is read).
        adapter_config: The adapter's ``adapter_config.json``.

    Returns:
        The number of tensors checked.

    Raises:
        ShapeContractError: A tensor that does not fit, or one whose module or parameter the base model lacks.
    """
    base = _base_model(model)
    base_shapes = _base_tensor_shapes(base)
    modules = dict(base.named_modules())
    default_rank = int(adapter_config.get("r", 8))
    rank_pattern = adapter_config.get("rank_pattern") or {}
    fix = "Load the adapter on the base model it was trained on (adapter_config.json: base_model_name_or_path)."
    for key, tensor in tensors.items():
        actual = list(tensor.shape)
        path = key[len(_ADAPTER_PREFIX) :] if key.startswith(_ADAPTER_PREFIX) else key
        match = _LORA_SUFFIX.match(path)
        if match is None:
            expected = base_shapes.get(_WRAPPER_LEVELS.sub("", path))
            if expected is None:
                raise ShapeContractError(
                    f"{key}: expected a parameter of the base model at {path}, but {type(base).__name__} has none "
                    f"(tensor shape {actual}). {fix}"
                )
            if tuple(actual) != expected:
                raise ShapeContractError(f"{key}: expected {list(expected)} (base model's {path}), got {actual}. {fix}")
            continue
        module_name, kind = match.group("module"), match.group("kind")
        module = modules.get(_WRAPPER_LEVELS.sub("", module_name + ".").rstrip("."))
        features = _features(module) if module is not None else None
        if features is None:
            raise ShapeContractError(
                f"{key}: expected a linear or embedding layer {module_name} in the base model, but "
                f"{type(base).__name__} has {'no such module' if module is None else type(module).__name__} "
                f"(tensor shape {actual}). {fix}"
            )
        in_features, out_features = features
        rank = _rank_for(module_name, default_rank, rank_pattern)
        if kind in ("lora_A.weight", "lora_embedding_A"):
            expected_shape, got = [rank, in_features], actual[:2]
        elif kind in ("lora_B.weight", "lora_embedding_B"):
            expected_shape, got = [out_features, rank], actual[:2]
        else:  # a bias or a DoRA magnitude: one value per output feature
            expected_shape, got = [out_features], [tensor.numel()]
        if got != expected_shape:
            raise ShapeContractError(
                f"{key}: expected {expected_shape} ({module_name}: in={in_features}, out={out_features}; "
                f"r={rank} from adapter_config.json), got {actual}. The adapter was trained for another model size "
                f"or its adapter_config.json does not match its weights. {fix}"
            )
    return len(tensors)
