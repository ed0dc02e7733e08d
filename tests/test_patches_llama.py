"""Llama patches (RMSNorm, attention with fused LoRA-QKV / RoPE / LoRA-O, fused LoRA-MLP, fused causal-LM loss)
against stock transformers + peft, in every version lane."""

from __future__ import annotations

import inspect

import pytest
import torch
from conftest import randomize_lora_b, relative_error, tiny_llama_config
from transformers import LlamaForCausalLM
from transformers.models.llama import modeling_llama as upstream

from fastft import FastModel, patch_report
from fastft.patches import llama as llama_patches
from fastft.registry import records, select, signature_fingerprint

pytestmark = pytest.mark.lane

LOSS_TOLERANCE = 1e-5
GRAD_TOLERANCE = 1e-4
ZERO_GRAD_SCALE = 1e-5
SHAPES = {
    "mha": dict(num_attention_heads=4, num_key_value_heads=4),
    "gqa-4-2": dict(num_attention_heads=4, num_key_value_heads=2),
    "gqa-8-2": dict(num_attention_heads=8, num_key_value_heads=2),
    "smollm2-9-3": dict(hidden_size=72, num_attention_heads=9, num_key_value_heads=3),
    # hidden · kv / heads² = 320 · 8 / 1600 is not an integer: no formula may assume it is.
    "40-8-hidden-320": dict(hidden_size=320, num_attention_heads=40, num_key_value_heads=8),
    "explicit-head-dim": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32),
}


def _save_model(folder, tokenizer, **overrides) -> str:
    torch.manual_seed(0)
    LlamaForCausalLM(tiny_llama_config(tokenizer, **overrides)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def _lora(folder: str, patch: bool, **load_kwargs):
    model, _ = FastModel.from_pretrained(folder, max_seq_length=128, patch=patch, **load_kwargs)
    model = FastModel.get_peft_model(model, r=8, lora_alpha=16)
    randomize_lora_b(model)
    return model


def _batch(vocab: int, batch: int, seq: int, pad: int = 0) -> dict[str, torch.Tensor]:
    """Random tokens with the first ``pad`` positions of row 0 left-padded, random targets (no shift) so a
    single-token sequence has a loss too, and labels (shifted by the model) for the causal-LM loss."""
    generator = torch.Generator().manual_seed(seq * 31 + batch)
    input_ids = torch.randint(3, vocab, (batch, seq), generator=generator)
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[0, :pad] = 0
    targets = torch.randint(3, vocab, (batch, seq), generator=generator).masked_fill(mask == 0, -100)
    labels = input_ids.masked_fill(mask == 0, -100)
    return {"input_ids": input_ids, "attention_mask": mask, "targets": targets, "labels": labels}


def _loss_and_grads(model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The model's own causal-LM loss (the fused one on a patched model) plus a loss on every position's logits
    (a single-token row has no causal-LM target), so both heads and the attention at every position are checked."""
    model.zero_grad(set_to_none=True)
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    logits = model(**inputs).logits
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch["targets"].flatten())
    if batch["input_ids"].shape[1] > 1:
        loss = loss + model(**inputs, labels=batch["labels"]).loss
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    return loss.detach(), grads


def _assert_parity(patched, stock, batch) -> None:
    loss, grads = _loss_and_grads(patched, batch)
    stock_loss, stock_grads = _loss_and_grads(stock, batch)
    assert torch.isfinite(loss)
    assert relative_error(loss, stock_loss) <= LOSS_TOLERANCE, (loss.item(), stock_loss.item())
    assert grads.keys() == stock_grads.keys() and any("lora_A" in name for name in grads)
    # With one key per query, softmax has zero derivative and q / k gradients are rounding noise on both sides:
    # gradients that small are compared on the scale of the largest one instead of their own.
    floor = ZERO_GRAD_SCALE * max(grad.norm().item() for grad in stock_grads.values())
    for name, grad in grads.items():
        expected = stock_grads[name]
        if expected.norm().item() < floor:
            assert grad.norm().item() < floor, f"{name}: {grad.norm().item():.2e} where stock is ~0"
            continue
        error = relative_error(grad, expected)
        assert error <= GRAD_TOLERANCE, f"{name}: relative error {error:.2e}"


def _patched_types(model) -> set[str]:
    return {type(module).__name__ for module in model.modules() if type(module).__name__.startswith("FastLlama")}


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_parity_with_stock_left_padded(shape, kernel_path, smol_tokenizer, tmp_path):
    folder = _save_model(tmp_path, smol_tokenizer, **SHAPES[shape])
    patched, stock = _lora(folder, patch=True), _lora(folder, patch=False)
    assert len(_patched_types(patched)) == 4 and not _patched_types(stock)
    _assert_parity(patched, stock, _batch(patched.config.vocab_size, batch=2, seq=13, pad=5))


@pytest.mark.parametrize("seq", [1, 7, 63])
def test_parity_at_sequence_lengths(seq, kernel_path, smol_tokenizer, tmp_path):
    folder = _save_model(tmp_path, smol_tokenizer)
    patched, stock = _lora(folder, patch=True), _lora(folder, patch=False)
    _assert_parity(patched, stock, _batch(patched.config.vocab_size, batch=2, seq=seq))


def test_parity_with_4bit_base(kernel_path, smol_tokenizer, tmp_path):
    folder = _save_model(tmp_path, smol_tokenizer)
    patched = _lora(folder, patch=True, load_in_4bit=True)
    stock = _lora(folder, patch=False, load_in_4bit=True)
    assert type(patched.get_base_model().model.layers[0].self_attn.q_proj.base_layer).__name__ == "Linear4bit"
    _assert_parity(patched, stock, _batch(patched.config.vocab_size, batch=2, seq=11, pad=3))


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_parity_for_each_attention_implementation(attn_implementation, smol_tokenizer, tmp_path):
    folder = _save_model(tmp_path, smol_tokenizer)
    patched = _lora(folder, patch=True, attn_implementation=attn_implementation)
    stock = _lora(folder, patch=False, attn_implementation=attn_implementation)
    assert patched.config._attn_implementation == attn_implementation
    _assert_parity(patched, stock, _batch(patched.config.vocab_size, batch=2, seq=9, pad=2))


def test_generation_with_kv_cache_matches_stock(smol_tokenizer, tmp_path):
    folder = _save_model(tmp_path, smol_tokenizer)
    outputs = []
    for patch in (True, False):
        model, _ = FastModel.from_pretrained(folder, max_seq_length=128, patch=patch)
        FastModel.for_inference(model)
        batch = _batch(model.config.vocab_size, batch=2, seq=6, pad=2)
        with torch.no_grad():
            outputs.append(
                model.generate(
                    input_ids=batch["input_ids"],
                    attention_mask=batch["attention_mask"],
                    max_new_tokens=8,
                    do_sample=False,
                    use_cache=True,
                    pad_token_id=model.config.pad_token_id,
                )
            )
    assert outputs[0].shape == (2, 14)
    assert torch.equal(outputs[0], outputs[1])


def test_report_lists_every_patch_as_applied(tiny_llama_dir):
    model, _ = FastModel.from_pretrained(str(tiny_llama_dir), max_seq_length=64)
    layers = model.config.num_hidden_layers
    rows = {row["name"]: row for row in patch_report(FastModel.get_peft_model(model))}
    assert {name: row["status"] for name, row in rows.items()} == {
        "llama.rms_norm": "applied",
        "llama.attention": "applied",
        "llama.mlp": "applied",
        "llama.causal_lm_loss": "applied",
        "checkpoint.offload": "applied",
    }
    assert rows["llama.rms_norm"]["modules"] == 2 * layers + 1
    assert rows["checkpoint.offload"]["modules"] == layers
    assert rows["llama.attention"]["modules"] == layers
    assert rows["llama.mlp"]["modules"] == layers
    assert rows["llama.causal_lm_loss"]["modules"] == 1
    assert all(row["fallbacks"] == {} for row in rows.values())
    assert "transformers" in rows["llama.rms_norm"]["tested"]


def test_patch_false_keeps_every_stock_module(tiny_llama_dir):
    model, _ = FastModel.from_pretrained(str(tiny_llama_dir), max_seq_length=64, patch=False)
    assert not _patched_types(model)
    assert {row["status"] for row in patch_report(model)} == {"disabled"}


def test_a_non_silu_mlp_is_not_applicable(smol_tokenizer, tmp_path):
    folder = _save_model(tmp_path, smol_tokenizer, hidden_act="gelu")
    model, _ = FastModel.from_pretrained(folder, max_seq_length=64)
    rows = {row["name"]: row for row in patch_report(model)}
    assert rows["llama.mlp"]["status"] == "not applicable"
    assert "gelu" in rows["llama.mlp"]["reason"]
    assert rows["llama.rms_norm"]["status"] == "applied"
    assert type(model.model.layers[0].mlp) is upstream.LlamaMLP


def test_installed_transformers_selects_one_record_per_patch_and_its_signature_matches():
    for name, group in records().items():
        if not name.startswith("llama."):
            continue
        record, reason = select(name, group)
        assert record is not None, f"{name}: {reason}"
        # The replacement must take its arguments exactly as the upstream object it stands in for.
        upstream_forward = getattr(upstream, record.target.rsplit(".", 2)[-2]).forward
        assert signature_fingerprint(upstream_forward) == record.fingerprint
        assert signature_fingerprint(record.replacement.forward) == record.fingerprint, name


def test_patched_modules_never_replace_the_decoder_layer_forward(tiny_llama_dir):
    model, _ = FastModel.from_pretrained(str(tiny_llama_dir), max_seq_length=64)
    layer = model.model.layers[0]
    assert type(layer) is upstream.LlamaDecoderLayer and "forward" not in vars(layer)
    for fast_class in (llama_patches.FastLlamaRMSNorm, llama_patches.FastLlamaMLP):
        assert set(vars(fast_class)) - {"__module__", "__doc__", "__qualname__", "__firstlineno__"} <= {
            "forward",
            "__static_attributes__",
        }
    assert inspect.getmodule(type(layer.self_attn)) is llama_patches


def test_a_patched_model_deep_copies_and_pickles(tiny_llama_dir, tmp_path):
    import copy
    import pickle

    model, _ = FastModel.from_pretrained(str(tiny_llama_dir), max_seq_length=64)
    ids = torch.randint(3, model.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
            assert type(clone.model.layers[0].self_attn) is type(model.model.layers[0].self_attn)
            assert torch.equal(clone(input_ids=ids).logits, expected)
