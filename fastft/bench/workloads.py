"""What ``fastft bench`` measures: the workloads (model, dtype, tokens) per device, and the models they load."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

# LoRA on every projection of a Llama block, the same for every system.
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
RANK, ALPHA = 16, 16

# Random-weight shapes for the GPU workloads (no downloads on the GPU machine). max_position_embeddings is raised so
# the longest-sequence search is limited by memory, not by the config.
MODEL_SHAPES: dict[str, dict[str, object]] = {
    "llama-3.2-1b": dict(
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
    # The harness's own check (tests, ``--quick``): seconds per step on a CPU.
    "tiny": dict(
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


def _gpu_workloads() -> list[Workload]:
    workloads = []
    for model in ("llama-3.2-1b", "llama-3-8b"):
        for dtype, quant in (("bfloat16", "none"), ("bfloat16", "nf4")):
            for batch, seq in ((4, 2048), (1, 8192)):
                tag = "nf4" if quant == "nf4" else "bf16"
                workloads.append(Workload(f"{model}-{tag}-{batch}x{seq}", model, dtype, batch, seq, quant))
    return workloads


WORKLOADS: dict[str, list[Workload]] = {
    "cpu": [
        Workload("smollm2-135m-fp32-2x512", EMBEDDED_MODEL, "float32", 2, 512),
        Workload("smollm2-135m-bf16-2x512", EMBEDDED_MODEL, "bfloat16", 2, 512),
    ],
    "cuda": _gpu_workloads(),
    "quick": [Workload("tiny-fp32-2x32", "tiny", "float32", 2, 32)],
}


def select_workloads(device: str, quick: bool, names: list[str] | None) -> list[Workload]:
    """The workloads of ``device`` (``quick``: the tiny check), narrowed to ``names`` when given.

    Raises:
        ValueError: A name in ``names`` is not a workload of that device; the message lists the valid ones.
    """
    pool = WORKLOADS["quick" if quick else device]
    if not names:
        return list(pool)
    known = {workload.name: workload for workload in pool}
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ValueError(
            f"fastft bench: unknown workload(s) {unknown} for device {device!r}; choose from {sorted(known)}"
        )
    return [known[name] for name in names]


def write_random_model(shape: str, folder: Path, dtype: str, device: str) -> Path:
    """Write a Llama of ``MODEL_SHAPES[shape]`` with seeded random weights, and a small tokenizer, to ``folder``.

    Reuses ``folder`` when its ``fastft-bench.json`` says it holds this shape and dtype. The weights are initialised
    on ``device`` (seconds for 8B parameters on a GPU, minutes on a CPU) and saved as safetensors.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    stamp = {"shape": shape, "dtype": dtype, **MODEL_SHAPES[shape]}
    marker = folder / "fastft-bench.json"
    if marker.exists() and json.loads(marker.read_text()) == stamp:
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(**MODEL_SHAPES[shape], bos_token_id=0, eos_token_id=1, pad_token_id=2)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(getattr(torch, dtype))
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
