"""LoRA wiring: the projections a model's adapters go on, ``FastModel.get_peft_model``, and trained weights kept in
fp32 over an fp16 base so a gradient scaler can unscale them."""

from __future__ import annotations

import difflib
import logging
from typing import Any

import torch
from peft import LoraConfig, PeftModel
from peft import get_peft_model as _peft_get_peft_model
from transformers import PreTrainedModel

from fastft.checkpointing import modes as checkpoint
from fastft.contracts import check_lora, check_moe_layout, check_projections, check_quant_states, guard_4bit
from fastft.contracts.moe import moe_blocks
from fastft.loading import distributed
from fastft.loading.compile import compile_layers
from fastft.loading.moe_targets import moe_targets
from fastft.loading.vision_targets import VisionLoRA, target_pattern, vision_towers
from fastft.registry import apply_patches

# fastft.model's, the name users' logging configurations know.
logger = logging.getLogger("fastft.model")

DEFAULT_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Phi-3 / Phi-4-mini pack q | k | v and gate | up into one projection each.
PACKED_TARGET_MODULES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def default_target_modules(model: torch.nn.Module) -> tuple[str, ...]:
    """The attention and MLP projections of ``model``'s architecture: Llama's seven, or the packed four; on a
    mixture-of-experts model those of the seven it has (its experts' come from :func:`moe_targets`)."""
    available = linear_leaf_names(model)
    if {"qkv_proj", "gate_up_proj"} & available and not {"q_proj", "gate_proj"} & available:
        return PACKED_TARGET_MODULES
    if any(True for _ in moe_blocks(model)):
        return tuple(name for name in DEFAULT_TARGET_MODULES if name in available)
    return DEFAULT_TARGET_MODULES


def is_sequence_classifier(model: torch.nn.Module) -> bool:
    """Whether ``model`` (or the base model of a ``PeftModel``) is a ``...ForSequenceClassification``."""
    return type(base_model(model)).__name__.endswith("ForSequenceClassification")


def base_model(model: torch.nn.Module) -> PreTrainedModel:
    return model.get_base_model() if isinstance(model, PeftModel) else model


def linear_leaf_names(model: torch.nn.Module) -> set[str]:
    return {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}


def _cast_floats(value: Any, dtype: torch.dtype) -> Any:
    """``value`` with its floating-point tensors (alone, or in a plain tuple, list or dict) cast to ``dtype``."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() and value.dtype != dtype else value
    # Exact types only: a named tuple or a ModelOutput would not survive being rebuilt from its items.
    if type(value) in (tuple, list):
        return type(value)(_cast_floats(item, dtype) for item in value)
    if type(value) is dict:
        return {key: _cast_floats(item, dtype) for key, item in value.items()}
    return value


class _Fp32Copy:
    """Forward hooks of a ``modules_to_save`` copy kept in fp32 inside an fp16 model.

    Without autocast (CPU, or generation after training) its floating inputs are raised to fp32, since an fp32 Linear
    refuses fp16 activations; under autocast its ops pick their dtype themselves. Its floating outputs go back to the
    model's dtype, so the layers after it see what they would without the upcast, and a trained embedding does not
    turn the whole residual stream into fp32.
    """

    def __init__(self, model_dtype: torch.dtype) -> None:
        self.model_dtype = model_dtype

    def before(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        weight = next(module.parameters(), None)
        if weight is None or torch.is_autocast_enabled(weight.device.type):
            return None
        return _cast_floats(args, torch.float32), _cast_floats(kwargs, torch.float32)

    def after(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        return _cast_floats(output, self.model_dtype)


def keep_trainable_fp32(model: torch.nn.Module) -> list[str]:
    """Make the trained weights of a model with an fp16 base fp32, so fp16 training with a gradient scaler works.

    torch's ``GradScaler`` refuses fp16 gradients ("Attempting to unscale FP16 gradients"), and fp16 weights would
    lose small optimizer updates to rounding. peft already makes LoRA A and B fp32, but not the ``modules_to_save``
    copies (a trained ``embed_tokens`` or ``lm_head``), and trl's ``SFTTrainer`` casts every trained weight of a 4-bit
    model to bf16 when it is built. This casts each trained weight that is not fp32 back to fp32 in place (the
    Parameter objects stay the same) and gives each ``modules_to_save`` copy hooks that hand its outputs on in fp16.
    Over an fp32 base (CPU training) trained weights in a lower precision only lose accuracy, so they are made fp32
    too (trl casts the adapters of a 4-bit model to bf16, which over an fp32 base also breaks a classifier head's
    ``modules_to_save`` copy: "expected m1 and m2 to have the same dtype"). A bf16 base is left as it is. Calling
    it again is harmless.

    :meth:`FastModel.get_peft_model` and :meth:`FastModel.load_adapter` (with ``is_trainable=True``) call it;
    ``fastft train`` calls it again once the trainer is built. Call it yourself after building a trl trainer
    (``SFTTrainer``, ``DPOTrainer``, ...) around a 4-bit fp16 or fp32 model to undo trl's bf16 cast.

    Args:
        model: A ``PeftModel`` (or any module) whose trained weights have ``requires_grad`` set.

    Returns:
        The names of the parameters that were cast.
    """
    from peft.utils.other import ModulesToSaveWrapper

    frozen = {p.dtype for p in model.parameters() if not p.requires_grad and p.is_floating_point()}
    if torch.float16 not in frozen and frozen != {torch.float32}:
        return []
    cast = []
    for name, parameter in model.named_parameters():
        if parameter.requires_grad and parameter.is_floating_point() and parameter.dtype != torch.float32:
            # .data, not a new Parameter: tied weights and anything already holding the Parameter keep seeing it.
            parameter.data = parameter.data.to(torch.float32)
            cast.append(name)
    # An fp32 copy over an fp16 base takes and gives fp16 activations; over an fp32 base it needs no hooks.
    wrappers = model.modules() if torch.float16 in frozen else ()
    for wrapper in wrappers:
        if not isinstance(wrapper, ModulesToSaveWrapper):
            continue
        for copy in wrapper.modules_to_save.values():
            trained = any(p.requires_grad for p in copy.parameters())
            if not trained or getattr(copy, "_fastft_fp32_copy", False):
                continue
            hooks = _Fp32Copy(torch.float16)
            copy.register_forward_pre_hook(hooks.before, with_kwargs=True)
            copy.register_forward_hook(hooks.after, with_kwargs=True)
            copy._fastft_fp32_copy = True
    if cast:
        logger.info("fastft: %d trained weights cast to fp32 over the %s base", len(cast), "/".join(map(str, frozen)))
    return cast


def check_base(model: torch.nn.Module) -> None:
    # Every entry point that receives a base model: projections against the config, 4-bit weights with their
    # quant_state, the per-forward 4-bit guards and the nn.DataParallel refusal (adding them again is a no-op).
    check_projections(model)
    check_moe_layout(model)
    check_quant_states(model)
    guard_4bit(model)
    distributed.guard_data_parallel(base_model(model))


def _named_targets(
    model: torch.nn.Module,
    target_modules: list[str] | tuple[str, ...] | None,
    experts: Any,
    lora_dropout: float,
    lora_kwargs: dict[str, Any],
) -> list[str]:
    """The layer names LoRA goes on (the architecture's defaults, or ``target_modules``, plus a mixture-of-experts
    model's experts and router), each checked to be a linear layer of ``model``; ``lora_kwargs`` gets the experts'
    ``target_parameters``."""
    targets = list(default_target_modules(model) if target_modules is None else target_modules)
    if experts is not None:
        # An explicit list adapts what it names; the router, when asked for, is added to it all the same.
        explicit = target_modules is not None
        expert_modules = () if explicit else experts.modules
        expert_parameters = () if explicit else experts.parameters
        targets += [name for name in (*expert_modules, *experts.router_modules) if name not in targets]
        wanted = [*expert_parameters, *experts.router_parameters]
        if wanted and "target_parameters" not in lora_kwargs:
            lora_kwargs["target_parameters"] = wanted
        if lora_kwargs.get("target_parameters") and lora_dropout:
            # peft raises this itself, but only after it has wrapped some of the model's layers.
            raise ValueError(
                f"fastft.get_peft_model: lora_dropout={lora_dropout} cannot apply to the experts' 3-D parameters "
                f"({', '.join(lora_kwargs['target_parameters'])}): peft's LoRA on parameters takes no dropout. Use "
                "lora_dropout=0.0, or target_modules=[...] for the attention alone. The model was left without "
                "adapters."
            )
    available = linear_leaf_names(model)
    if not targets:
        raise ValueError(
            f"fastft.get_peft_model: target_modules is empty; pass names from {sorted(available)}, or leave "
            "target_modules=None for every attention and MLP projection."
        )
    missing = [name for name in targets if name not in available]
    if missing:
        hints = [
            f"{name!r} -> did you mean {close[0]!r}?"
            for name in missing
            if (close := difflib.get_close_matches(str(name), sorted(available), n=1))
        ]
        raise ValueError(
            f"fastft.get_peft_model: target_modules {missing} are not linear layers of "
            f"{type(model).__name__}; {' '.join(hints) + ' ' if hints else ''}Its linear layers are "
            f"{sorted(available)}: pass names from that list, or leave target_modules=None for every attention "
            "and MLP projection. The model was left without adapters."
        )
    return targets


def get_peft_model(
    model: PreTrainedModel,
    r: int = 16,
    lora_alpha: int = 16,
    lora_dropout: float = 0.0,
    target_modules: list[str] | tuple[str, ...] | None = None,
    use_gradient_checkpointing: bool | str = "offload",
    random_state: int = 3407,
    compile: bool = False,
    train_router: bool = False,
    finetune_language_layers: bool = True,
    finetune_vision_layers: bool = False,
    finetune_attention_modules: bool = True,
    finetune_mlp_modules: bool = True,
    **lora_kwargs: Any,
) -> PeftModel:
    """Add LoRA adapters and set up the model for training.

    Args:
        model: A model from :meth:`from_pretrained`.
        r: LoRA rank.
        lora_alpha: LoRA scale numerator; the update is scaled by ``lora_alpha / r``.
        lora_dropout: Dropout on the LoRA input.
        target_modules: Names of the linear layers to adapt (one name may be given as a string); ``None`` means
            every attention and MLP projection of the architecture (q/k/v/o/gate/up/down, or Phi-3's packed
            qkv/o/gate_up/down). On a mixture-of-experts model ``None`` also puts one adapter on every expert, by
            peft's mechanism for the layout the installed transformers loaded (:mod:`fastft.loading.moe_targets`:
            ``target_parameters`` on 5.x's fused 3-D experts, the experts' own projections on 4.x); a list given
            here adapts what it names, plus whatever ``target_parameters`` names.
        use_gradient_checkpointing: ``False``, ``True`` (recompute: each layer's input kept on the device and the
            layer run again in backward, on the fused path), ``"offload"`` (alias ``"unsloth"``: the inputs parked
            in pinned host memory), ``"sqrt"`` (one layer input in every ``ceil(sqrt(layers))`` kept, the others
            replayed in backward) or ``"sqrt-offload"`` (``"sqrt"`` with the kept inputs parked in host memory).
        random_state: Seed for the adapter initialisation; the caller's RNG state is left untouched.
        compile: Regional compilation (:mod:`fastft.loading.compile`): every decoder layer runs one ``torch.compile``-d
            forward, compiled on the first step (its time is reported by ``fastft train``) and shared by all
            layers; fastft's kernels are custom ops inside it, checkpointing stays around it. Off by default,
            on CUDA too: on an H100 it measured slower than eager (``bench/results/h100-2026-11-26/``).
        train_router: Mixture-of-experts models: also a LoRA on each block's router (off by default: it changes
            which experts each token reaches). Refused on a dense model.
        finetune_language_layers: Vision-language models (``target_modules=None``): LoRA on the language model's
            layers (default on). These run fastft's fused kernels.
        finetune_vision_layers: Vision-language models: LoRA on the vision tower's blocks and its merger (default
            off: the tower is pre-trained on far more images than a fine-tune brings, and runs upstream's modules).
        finetune_attention_modules: Vision-language models: LoRA on the attention projections of the sides chosen
            above (q / k / v / o; the tower's ``qkv`` / ``proj``); default on.
        finetune_mlp_modules: Vision-language models: LoRA on the MLP projections of the sides chosen above
            (gate / up / down; the merger's two linear layers); default on. On a vision-language model the four
            switches become one ``target_modules`` pattern of full module paths (saved in the adapter, read the same
            by plain peft); on a text model, or with ``target_modules`` given, they must stay at their defaults.
        **lora_kwargs: Passed to ``peft.LoraConfig`` (e.g. ``use_rslora``, ``modules_to_save``).

    Returns:
        A ``peft.PeftModel``; its ``save_pretrained`` writes a standard peft adapter. Its trained weights are
        fp32 over an fp16 base (LoRA A and B, and ``modules_to_save`` copies; see :func:`keep_trainable_fp32`),
        so fp16 training with a gradient scaler can unscale their gradients.

    Raises:
        ShapeContractError: A projection that does not fit the config, a 4-bit weight without its quant_state,
            or a LoRA weight that does not fit its base layer.
        ValueError: A bad argument (``r`` < 1, ``lora_alpha`` <= 0, ``lora_dropout`` outside [0, 1), ...), a model
            that already has adapters, or a target module the model lacks (the message lists its linear layers
            and the closest name). Each is raised before the model is changed.
    """
    if isinstance(model, PeftModel):
        raise ValueError(
            "fastft.get_peft_model: this model already has LoRA adapters; call get_peft_model once, on the "
            "model from FastModel.from_pretrained."
        )
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise ValueError(
            f"fastft.get_peft_model: r must be a positive int, got {r!r}; use r=8 or r=16 (the usual LoRA ranks; "
            "a higher rank trains more parameters)."
        )
    if isinstance(lora_alpha, bool) or not isinstance(lora_alpha, (int, float)) or not lora_alpha > 0:
        raise ValueError(
            f"fastft.get_peft_model: lora_alpha must be a positive number, got {lora_alpha!r}; the update is "
            f"scaled by lora_alpha / r, so use lora_alpha=r (scale 1, here lora_alpha={r}) or 2 * r."
        )
    if isinstance(lora_dropout, bool) or not isinstance(lora_dropout, (int, float)) or not 0 <= lora_dropout < 1:
        raise ValueError(
            f"fastft.get_peft_model: lora_dropout must be in [0, 1), got {lora_dropout!r}; use 0.0 (the fused "
            "kernels' path) or a small value such as 0.05."
        )
    mode = checkpoint.resolve_mode(use_gradient_checkpointing)
    if not isinstance(compile, bool):
        raise ValueError(
            f"fastft.get_peft_model: compile must be True (regional compilation of the decoder layers) or False, "
            f"got {compile!r}."
        )
    if not isinstance(train_router, bool):
        raise ValueError(f"fastft.get_peft_model: train_router must be True or False, got {train_router!r}.")
    experts = moe_targets(model, train_router)
    if train_router and experts is None:
        raise ValueError(
            f"fastft.get_peft_model: train_router=True, but {type(model).__name__} has no mixture-of-experts "
            "router; leave train_router out for a dense model."
        )
    switches = VisionLoRA(
        finetune_language_layers, finetune_vision_layers, finetune_attention_modules, finetune_mlp_modules
    )
    vision = bool(vision_towers(model))
    if switches != VisionLoRA() and (not vision or target_modules is not None):
        raise ValueError(
            f"fastft.get_peft_model: the finetune_* switches ({switches}) choose the layers of a vision-language "
            f"model when target_modules is None; {type(model).__name__} "
            f"{'is not one' if not vision else 'was given target_modules too'}. Leave the switches out and name the "
            "layers in target_modules, or leave target_modules out."
        )
    if isinstance(target_modules, str):
        # peft reads a string as a regular expression over full module names, where "q_proj" matches nothing;
        # a single layer name is what is meant here.
        target_modules = [target_modules]
    if vision and target_modules is None:
        targets: list[str] | str = target_pattern(model, switches)[0]
    else:
        targets = _named_targets(model, target_modules, experts, lora_dropout, lora_kwargs)
    check_base(model)
    if not hasattr(model, "_fastft_patch_report"):
        apply_patches(model)
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    task_type = "SEQ_CLS" if is_sequence_classifier(model) else "CAUSAL_LM"
    if lora_kwargs.setdefault("task_type", task_type) != task_type:
        raise ValueError(
            f"fastft.get_peft_model: task_type={lora_kwargs['task_type']!r} does not fit {type(model).__name__}, "
            f"which takes {task_type!r} (leave task_type out: it follows the model; for a reward model load "
            "it with FastModel.from_pretrained(..., task='sequence-classification'))."
        )
    config = LoraConfig(
        r=r,
        lora_alpha=lora_alpha,
        lora_dropout=lora_dropout,
        target_modules=targets,
        bias=lora_kwargs.pop("bias", "none"),
        **lora_kwargs,
    )
    devices = list(range(torch.cuda.device_count()))
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(random_state)
        peft_model = _peft_get_peft_model(model, config)
    keep_trainable_fp32(peft_model)
    check_lora(peft_model)
    checkpoint.set_mode(model, mode)
    model.config.use_cache = False
    if compile:
        compile_layers(model)
    peft_model.train()
    return peft_model
