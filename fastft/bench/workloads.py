"""What ``fastft bench`` measures: the workloads (model, dtype, tokens) per device, and the models they load."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

# LoRA on every projection of a Llama block, the same for every system.
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# A mixture-of-experts model: LoRA on the attention, and one adapter per expert on the experts' two stacked 3-D
# parameters through peft's target_parameters (transformers 5.x's fused layout), the same for every system.
MOE_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MOE_TARGET_PARAMETERS = ("experts.gate_up_proj", "experts.down_proj")
RANK, ALPHA = 16, 16
# The model families write_random_model builds (MODEL_SHAPES' "model_type").
MOE_MODEL_TYPES = ("qwen3_moe",)
VLM_MODEL_TYPES = ("qwen2_5_vl",)
# A vision-language model: LoRA on the language model's seven projections, never on the vision tower's blocks (whose
# MLP has its own gate / up / down_proj): fastft's default switches, written as the peft pattern every system gets.
VLM_TARGET_PATTERN = r"^(?!.*visual).*\.(?:self_attn|mlp)\.(?:q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)$"


def _qwen2_5_vl(
    hidden: int,
    intermediate: int,
    layers: int,
    heads: int,
    kv_heads: int,
    vocab: int,
    tied: bool,
    image: int,
    rope: tuple[float, list[int]] = (1000000.0, [16, 24, 24]),
    **tower: object,
) -> dict[str, object]:
    """A Qwen2.5-VL shape: the given language model (RoPE theta and M-RoPE sections ``rope``) and Qwen2.5-VL's vision
    tower (the same in every size but for its output width; ``tower`` overrides its fields), with a square ``image``
    px a side per example."""
    return dict(
        model_type="qwen2_5_vl",
        text_config=dict(
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            vocab_size=vocab,
            max_position_embeddings=128000,
            rope_parameters=dict(rope_type="default", rope_theta=rope[0], mrope_section=rope[1]),
            tie_word_embeddings=tied,
        ),
        vision_config={
            "depth": 32,
            "hidden_size": 1280,
            "intermediate_size": 3420,
            "num_heads": 16,
            "out_hidden_size": hidden,
            "fullatt_block_indexes": [7, 15, 23, 31],
            **tower,
        },
        tie_word_embeddings=tied,
        image_size=(image, image),
    )


# Random-weight shapes for the GPU workloads (no downloads on the GPU machine). max_position_embeddings is raised so
# the longest-sequence search is limited by memory, not by the config. "model_type" picks the transformers classes;
# every other key is the config's.
MODEL_SHAPES: dict[str, dict[str, object]] = {
    "llama-3.2-1b": dict(
        model_type="llama",
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=True,
        rope_theta=500000.0,
        max_position_embeddings=262144,
    ),
    "llama-3-8b": dict(
        model_type="llama",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=False,
        rope_theta=500000.0,
        max_position_embeddings=262144,
    ),
    # Qwen3-30B-A3B's layer (128 experts of 768, top-8, 32 query / 4 key-value heads of 128, its vocabulary and
    # untied head) with 8 of its 48 layers: 5.61e9 parameters, 11.2 GB in bf16 (embeddings and head 0.62e9; each
    # layer 0.60e9 of experts, 0.019e9 of attention). Eight leave an 80 GB card room for stock peft, which folds
    # B·A into every expert's weight each forward and keeps that copy for backward (1.2 GB a layer), and for 8192
    # tokens of activations without checkpointing; with fewer, the 151936-row head would outweigh the layers.
    "qwen3-30b-a3b-8l": dict(
        model_type="qwen3_moe",
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        num_hidden_layers=8,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        vocab_size=151936,
        tie_word_embeddings=False,
        rope_theta=1000000.0,
        max_position_embeddings=262144,
    ),
    # Qwen2.5-VL-7B: its language model (28 layers, hidden 3584, GQA 28 / 4, M-RoPE sections 16 / 24 / 24) and vision
    # tower (32 blocks of 1280, windowed but for 4 full-attention blocks, 14 px patches merged 2 x 2); one 448 x 448
    # image per example is 1024 patches, 256 image tokens. 8.3e9 parameters, 16.6 GB in bf16.
    "qwen2.5-vl-7b": _qwen2_5_vl(3584, 18944, 28, 28, 4, 152064, tied=False, image=448),
    # Qwen2.5-VL-3B's layer, vocabulary (tied head) and whole vision tower with 2 of its 36 text layers, for the CPU:
    # 1.1e9 parameters (the tower 0.67e9), one 224 x 224 image (64 image tokens) per example.
    "qwen2.5-vl-3b-2l": _qwen2_5_vl(2048, 11008, 2, 16, 2, 151936, tied=True, image=224),
    # The harness's own check (tests, ``--quick``): seconds per step on a CPU.
    "tiny": dict(
        model_type="llama",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        tie_word_embeddings=False,
        rope_theta=10000.0,
        max_position_embeddings=1024,
    ),
    # The MoE path's check (tests, ``--quick --workloads tiny-moe-fp32-2x32``): 8 experts, top-2, GQA.
    "tiny-moe": dict(
        model_type="qwen3_moe",
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=256,
        tie_word_embeddings=False,
        rope_theta=10000.0,
        max_position_embeddings=1024,
    ),
    # The vision-language path's check (``--quick --workloads tiny-vlm-fp32-2x48``): a 16 x 16 image is 4 tokens.
    "tiny-vlm": _qwen2_5_vl(
        64,
        96,
        2,
        4,
        2,
        151936,
        tied=False,
        image=16,
        rope=(10000.0, [2, 3, 3]),
        depth=2,
        hidden_size=32,
        intermediate_size=48,
        num_heads=2,
        patch_size=4,
        window_size=16,
        fullatt_block_indexes=[1],
    ),
}

EMBEDDED_MODEL = "smollm2-135m"


@dataclass(frozen=True)
class Workload:
    """One training step to measure: ``batch`` x ``seq`` tokens through ``model`` in ``dtype`` (``quant``: ``"nf4"``
    for a 4-bit base, else ``"none"``). ``model`` is the embedded model's alias or a key of ``MODEL_SHAPES``."""

    name: str
    model: str
    dtype: str
    batch: int
    seq: int
    quant: str = "none"

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def is_moe(model: str) -> bool:
    """Whether ``model`` (a key of ``MODEL_SHAPES``, or the embedded model's alias) is a mixture-of-experts shape."""
    return MODEL_SHAPES.get(model, {}).get("model_type") in MOE_MODEL_TYPES


def is_vlm(model: str) -> bool:
    """Whether ``model`` (a key of ``MODEL_SHAPES``) is a vision-language shape (its steps take an image)."""
    return MODEL_SHAPES.get(model, {}).get("model_type") in VLM_MODEL_TYPES


def lora_targets(model: str) -> dict[str, object]:
    """What every system puts LoRA on for ``model``: ``target_modules`` (a list, or for a vision-language model a
    peft pattern) and ``target_parameters`` (the experts); a vision-language model also gets its ``image_size``."""
    if is_vlm(model):
        return {"target_modules": VLM_TARGET_PATTERN, "target_parameters": [], "image_size": list(_image(model))}
    if is_moe(model):
        return {"target_modules": list(MOE_TARGET_MODULES), "target_parameters": list(MOE_TARGET_PARAMETERS)}
    return {"target_modules": list(TARGET_MODULES), "target_parameters": []}


def _image(model: str) -> tuple[int, int]:
    return tuple(MODEL_SHAPES[model]["image_size"])  # type: ignore[arg-type]


def _gpu_workloads() -> list[Workload]:
    workloads = []
    for model in ("llama-3.2-1b", "llama-3-8b", "qwen3-30b-a3b-8l"):
        # No NF4 for the MoE shape: fastft refuses load_in_4bit on transformers 5.x's 3-D experts.
        quants = ("none",) if is_moe(model) else ("none", "nf4")
        for quant in quants:
            for batch, seq in ((4, 2048), (1, 8192)):
                tag = "nf4" if quant == "nf4" else "bf16"
                workloads.append(Workload(f"{model}-{tag}-{batch}x{seq}", model, "bfloat16", batch, seq, quant))
    # Issue 33's: 4 x (one 448 x 448 image, 256 tokens, and 1,024 text tokens).
    workloads.append(Workload("qwen2.5-vl-7b-bf16-4x1280", "qwen2.5-vl-7b", "bfloat16", 4, 1280))
    return workloads


WORKLOADS: dict[str, list[Workload]] = {
    "cpu": [
        Workload("smollm2-135m-fp32-2x512", EMBEDDED_MODEL, "float32", 2, 512),
        Workload("smollm2-135m-bf16-2x512", EMBEDDED_MODEL, "bfloat16", 2, 512),
        Workload("qwen2.5-vl-3b-2l-fp32-1x320", "qwen2.5-vl-3b-2l", "float32", 1, 320),
    ],
    "cuda": _gpu_workloads(),
    "quick": [
        Workload("tiny-fp32-2x32", "tiny", "float32", 2, 32),
        Workload("tiny-moe-fp32-2x32", "tiny-moe", "float32", 2, 32),
        Workload("tiny-vlm-fp32-2x48", "tiny-vlm", "float32", 2, 48),
    ],
}
# Run only when named with --workloads: the quick run's default stays the one dense check, the CPU's the embedded
# model.
NAMED_ONLY = ("tiny-moe-fp32-2x32", "tiny-vlm-fp32-2x48", "qwen2.5-vl-3b-2l-fp32-1x320")


def select_workloads(device: str, quick: bool, names: list[str] | None) -> list[Workload]:
    """The workloads of ``device`` (``quick``: the tiny check), narrowed to ``names`` when given (``NAMED_ONLY``
    workloads run only when named).

    Raises:
        ValueError: A name in ``names`` is not a workload of that device; the message lists the valid ones.
    """
    pool = WORKLOADS["quick" if quick else device]
    if not names:
        return [workload for workload in pool if workload.name not in NAMED_ONLY]
    known = {workload.name: workload for workload in pool}
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ValueError(
            f"fastft bench: unknown workload(s) {unknown} for device {device!r}; choose from {sorted(known)}"
        )
    return [known[name] for name in names]


def write_random_model(shape: str, folder: Path, dtype: str, device: str) -> Path:
    """Write the model of ``MODEL_SHAPES[shape]`` (a Llama, a Qwen3-MoE or a Qwen2.5-VL, by its ``model_type``) with
    seeded random weights, and a small tokenizer, to ``folder``.

    Reuses ``folder`` when its ``fastft-bench.json`` says it holds this shape and dtype. The weights are initialised
    on ``device`` (seconds for 8B parameters on a GPU, minutes on a CPU) and saved as safetensors.

    Raises:
        ValueError: A shape whose ``model_type`` is not ``"llama"``, ``"qwen3_moe"`` or ``"qwen2_5_vl"``.
    """
    import torch
    import transformers

    stamp = {"shape": shape, "dtype": dtype, **MODEL_SHAPES[shape]}
    marker = folder / "fastft-bench.json"
    if marker.exists() and json.loads(marker.read_text()) == stamp:
        return folder
    fields = dict(MODEL_SHAPES[shape])
    model_type = fields.pop("model_type")
    fields.pop("image_size", None)
    classes = {
        "llama": ("LlamaConfig", "LlamaForCausalLM"),
        "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
        "qwen2_5_vl": ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration"),
    }
    if model_type not in classes:
        raise ValueError(
            f"fastft.bench.workloads: shape {shape!r} has model_type {model_type!r}; write_random_model builds "
            f"{sorted(classes)}: set one of those in MODEL_SHAPES"
        )
    config_class, model_class = (getattr(transformers, name) for name in classes[model_type])
    folder.mkdir(parents=True, exist_ok=True)
    config = config_class(**fields, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    torch.manual_seed(0)
    with torch.device(device):
        model = model_class(config).to(getattr(torch, dtype))
    model.save_pretrained(folder, safe_serialization=True)
    del model
    write_tokenizer(folder)
    marker.write_text(json.dumps(stamp))
    return folder


def write_tokenizer(folder: Path) -> None:
    """A minimal fast tokenizer (word level, three special tokens) so loaders that want one find one; benchmark
    inputs are random token ids, never text."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<s>": 0, "</s>": 1, "<pad>": 2, "<unk>": 3}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    tokenizer.save_pretrained(folder)
