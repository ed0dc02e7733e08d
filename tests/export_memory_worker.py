"""Peak host memory of ``save_merged``, ``save_gguf`` and training checkpoints on a 767 MB model
(``tests/test_export.py``).

Run as ``python export_memory_worker.py exports|checkpoints TOKENIZER_DIR OUT`` in a process of its own, so nothing
else the test session allocated blurs the figure.

``exports`` builds a random Llama (6 layers, hidden 1024, SmolLM2's 49k vocabulary, untied head: 192M float32
parameters, 767 MB; its embeddings three times a decoder layer), adds LoRA adapters with non-zero B, and measures the
resident-set growth of each export over the resident size just before it, with the kernel's peak counter reset
(``fastft.bench.measure``). It then reloads the merged folder with plain transformers and compares its logits with
peft's own merge of the same model. Everything it measured goes to ``OUT/memory.json``.

``checkpoints`` saves the same model as a folder, runs ``fastft train`` on it for three steps with a checkpoint after
each, and measures each checkpoint save the same way (``OUT/checkpoints.json``).
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import torch
from conftest import randomize_lora_b, tiny_llama_config
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

import fastft.export.gguf_export  # noqa: F401  (imported before measuring: a module's first import is not the save's memory)
import fastft.export.merged_save  # noqa: F401
from fastft import FastModel
from fastft.bench.measure import peak_rss_bytes, reset_peak_rss, resident_bytes
from fastft.export.merge import merge_plan
from fastft.export.shards import BLOCK_ELEMENTS


def _measure(work) -> dict:
    gc.collect()
    reset = reset_peak_rss()
    before = resident_bytes()
    work()
    peak = peak_rss_bytes()
    return {"reset_ok": reset, "before": before, "peak": peak, "growth": peak - before}


def _config(tokenizer) -> LlamaConfig:
    return tiny_llama_config(
        tokenizer,
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=6,
        num_attention_heads=16,
        num_key_value_heads=4,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        initializer_range=0.02,  # transformers' default: these random weights need not predict anything
    )


def exports(tokenizer_dir: Path, out: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = _config(tokenizer)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model = FastModel.get_peft_model(model, r=8, lora_alpha=16, use_gradient_checkpointing=False)
    randomize_lora_b(model)
    model.eval()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.get_base_model().parameters())
    layer = model.get_base_model().model.layers[0]
    layer_bytes = sum(tensor.numel * 4 for tensor in merge_plan(layer).tensors)

    merged_dir, gguf_file = out / "merged", out / "model-f16.gguf"
    merged = _measure(
        lambda: FastModel.save_merged(model, tokenizer, merged_dir, dtype=torch.float32, max_shard_size="100MB")
    )
    gguf = _measure(lambda: FastModel.save_gguf(model, tokenizer, gguf_file, quantization="f16"))

    ids = torch.randint(0, config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    reloaded = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32)
    with torch.no_grad():
        actual = reloaded(ids).logits
    del reloaded
    # peft's own merge, loaded into a plain (unpatched) model: an independent reference.
    state = model.merge_and_unload().state_dict()
    reference = LlamaForCausalLM(config)
    reference.load_state_dict(state)
    reference.eval()
    with torch.no_grad():
        expected = reference(ids).logits
    record = {
        "weight_bytes": weight_bytes,
        "layer_merged_bytes": layer_bytes,
        "block_bytes": BLOCK_ELEMENTS * 4,
        "save_merged": merged,
        "save_gguf": gguf,
        "gguf_bytes": gguf_file.stat().st_size,
        "shards": sorted(path.name for path in merged_dir.glob("*.safetensors")),
        "logits_max_abs_diff": (actual - expected).abs().max().item(),
        "logits_max_abs": expected.abs().max().item(),
    }
    (out / "memory.json").write_text(json.dumps(record, indent=2) + "\n")


def checkpoints(tokenizer_dir: Path, out: Path) -> None:
    """``fastft train`` on the same model, each trainer checkpoint's resident-set growth measured."""
    from transformers import Trainer

    from fastft.training.train import TrainOptions, run

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = _config(tokenizer)
    torch.manual_seed(0)
    model_dir = out / "base"
    LlamaForCausalLM(config).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    layer_bytes = sum(p.numel() * 4 for p in LlamaDecoderLayer(config, layer_idx=0).parameters())
    saves = []
    real = Trainer._save_checkpoint

    def measured(self, *args, **kwargs):
        saves.append(_measure(lambda: real(self, *args, **kwargs)))

    Trainer._save_checkpoint = measured
    run(
        TrainOptions(
            output=str(out / "run"),
            model=str(model_dir),
            max_steps=3,
            save_steps=1,
            seq_len=128,
            batch_size=1,
            r=8,
            warmup_steps=0,
        )
    )
    written = sum(path.stat().st_size for path in (out / "run").glob("checkpoint-*/*") if path.is_file())
    record = {
        "layer_merged_bytes": layer_bytes,
        "block_bytes": BLOCK_ELEMENTS * 4,
        "checkpoints": saves,
        "checkpoint_bytes": written,
    }
    (out / "checkpoints.json").write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    {"exports": exports, "checkpoints": checkpoints}[sys.argv[1]](Path(sys.argv[2]), Path(sys.argv[3]))
