"""Llama patches (RMSNorm, attention with fused LoRA-QKV / RoPE / LoRA-O, fused LoRA-MLP, fused causal-LM loss)
against stock transformers + peft, in every version lane."""

from __future__ import annotations

import inspect

import pytest
import torch
from conftest import OpRecorder, lane_cases, trl_logprobs_status
from parity import assert_parity, lora_model, make_batch, save_family
from transformers.models.llama import modeling_llama as upstream

from fastft import FastModel, patch_report
from fastft.kernels.errors import ShapeContractError
from fastft.patches import llama as llama_patches
from fastft.registry import records, select, signature_fingerprint

pytestmark = pytest.mark.lane

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
    return save_family(folder, "llama", tokenizer, **overrides)


def _patched_types(model) -> set[str]:
    return {type(module).__name__ for module in model.modules() if type(module).__name__.startswith("FastLlama")}


@pytest.mark.parametrize("shape", lane_cases(["smollm2-9-3", *sorted(set(SHAPES) - {"smollm2-9-3"})]))
def test_parity_with_stock_left_padded(shape, kernel_path, smol_tokenizer, tmp_path):
    folder = _save_model(tmp_path, smol_tokenizer, **SHAPES[shape])
    patched, stock = lora_model(folder, patch=True), lora_model(folder, patch=False)
    assert len(_patched_types(patched)) == 5 and not _patched_types(stock)
    assert_parity(patched, stock, make_batch(patched.config.vocab_size, batch=2, seq=13, pad=5))


@pytest.mark.parametrize("seq", lane_cases([7, 1, 63]))
def test_parity_at_sequence_lengths(seq, kernel_path, smol_tokenizer, tmp_path):
    folder = _save_model(tmp_path, smol_tokenizer)
    patched, stock = lora_model(folder, patch=True), lora_model(folder, patch=False)
    # Through the interpreter most kernels run one program per token (RoPE, RMSNorm, the loss rows), and two rows of 63
    # tokens took a minute. One row of 63 still spans two of the interpreter's 32-row GEMM tiles, the second ragged,
    # and positions up to 62; two rows sharing a tile are checked at length 7 (and left-padded, above).
    batch = 1 if (kernel_path, seq) == ("triton", 63) else 2
    assert_parity(patched, stock, make_batch(patched.config.vocab_size, batch=batch, seq=seq))


def test_parity_with_4bit_base(kernel_path, smol_tokenizer, tmp_path):
    folder = _save_model(tmp_path, smol_tokenizer)
    patched = lora_model(folder, patch=True, load_in_4bit=True)
    stock = lora_model(folder, patch=False, load_in_4bit=True)
    assert type(patched.get_base_model().model.layers[0].self_attn.q_proj.base_layer).__name__ == "Linear4bit"
    assert_parity(patched, stock, make_batch(patched.config.vocab_size, batch=2, seq=11, pad=3))


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_parity_for_each_attention_implementation(attn_implementation, smol_tokenizer, tmp_path):
    folder = _save_model(tmp_path, smol_tokenizer)
    patched = lora_model(folder, patch=True, attn_implementation=attn_implementation)
    stock = lora_model(folder, patch=False, attn_implementation=attn_implementation)
    assert patched.config._attn_implementation == attn_implementation
    assert_parity(patched, stock, make_batch(patched.config.vocab_size, batch=2, seq=9, pad=2))


def test_generation_with_kv_cache_matches_stock(smol_tokenizer, tmp_path):
    folder = _save_model(tmp_path, smol_tokenizer)
    outputs = []
    for patch in (True, False):
        model, _ = FastModel.from_pretrained(folder, max_seq_length=128, patch=patch)
        FastModel.for_inference(model)
        batch = make_batch(model.config.vocab_size, batch=2, seq=6, pad=2)
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
        "llama.decoder_layer": "applied",
        "checkpoint.offload": "applied",
        "trl.fused_logprobs": trl_logprobs_status(),
    }
    assert rows["llama.rms_norm"]["modules"] == 2 * layers + 1
    assert rows["checkpoint.offload"]["modules"] == layers
    assert rows["llama.attention"]["modules"] == layers
    assert rows["llama.mlp"]["modules"] == layers
    assert rows["llama.causal_lm_loss"]["modules"] == 1
    assert rows["llama.decoder_layer"]["modules"] == layers
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


def test_patched_modules_change_the_class_forward_only(tiny_llama_dir):
    model, _ = FastModel.from_pretrained(str(tiny_llama_dir), max_seq_length=64)
    layer = model.model.layers[0]
    # The layer's class is swapped (one fused node where every part is fused), never an instance's forward: transformers
    # >= 5.23 wraps the subclass's forward for checkpointing, as it wraps upstream's.
    assert type(layer) is llama_patches.FastLlamaDecoderLayer and "forward" not in vars(layer)
    assert isinstance(layer, upstream.LlamaDecoderLayer)
    for fast_class in (llama_patches.FastLlamaRMSNorm, llama_patches.FastLlamaMLP, llama_patches.FastLlamaDecoderLayer):
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


def test_the_fused_loss_checks_its_labels_before_the_backbone_and_reads_nothing_after(
    smol_tokenizer, tmp_path, monkeypatch
):
    """On a GPU, reading a tensor's value waits for every kernel queued before it: checked after the backbone, the
    labels would drain the whole forward before the backward could be launched. The check starts before the
    backbone's first operator, and the loss reads no value; bad labels raise as before."""
    from fastft.kernels import cross_entropy

    folder = _save_model(tmp_path, smol_tokenizer)
    patched = lora_model(folder, patch=True)
    batch = make_batch(patched.config.vocab_size, batch=2, seq=9, pad=2)
    inputs = {key: batch[key] for key in ("input_ids", "attention_mask", "labels")}
    checks, reads = [], []
    check_head_inputs = cross_entropy.check_head_inputs

    def watched(*args, **kwargs):
        checks.append(kwargs.get("started"))
        with OpRecorder() as inside:
            result = check_head_inputs(*args, **kwargs)
        reads.append(inside.ops.count("_local_scalar_dense"))
        return result

    monkeypatch.setattr(cross_entropy, "check_head_inputs", watched)
    with OpRecorder() as recorder:
        patched(**inputs).loss.backward()
    assert len(checks) == 1 and checks[0] is not None and reads == [0]
    first_read, embedding = recorder.ops.index("_local_scalar_dense"), recorder.ops.index("embedding")
    assert first_read < embedding, recorder.ops[: embedding + 1]
    wrong = inputs["labels"].clone()
    wrong[1, 4] = patched.config.vocab_size
    with pytest.raises(ShapeContractError, match=rf"labels must lie in \[0, {patched.config.vocab_size}\)"):
        patched(**{**inputs, "labels": wrong})
