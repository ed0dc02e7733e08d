"""Every fused family beside Llama (Mistral, Qwen2, Qwen3, Phi-3, Gemma 3) against stock transformers + peft, in every
version lane: loss and LoRA gradients, generation, the fused graph, the report, and the stock path on an unknown
transformers.

Llama's own deeper checks (attention implementations, odd head shapes, pickling) are in test_patches_llama.py; the
families share its attention, MLP and loss bodies (fastft.patches.decoder), so here each family runs the checks
that see what it does differently (bias, per-head norms, sliding windows, its GQA shape, Phi-3's packed projections
and partial rotary, Gemma's 1 + w norms, GeGLU and logit soft-cap)."""

from __future__ import annotations

import importlib
import warnings

import pytest
import torch
from conftest import lane_cases, randomize_lora_b, relative_error, trl_logprobs_status
from parity import (
    FAMILY_VOCAB,
    LOSS_TOLERANCE,
    assert_parity,
    count,
    graph_nodes,
    greedy_tokens,
    lora_model,
    make_batch,
    norms_per_layer,
    qkv_node,
    save_family,
    served,
)
from transformers import OlmoConfig, OlmoForCausalLM

from fastft import FastModel, patch_report, registry
from fastft.registry import records, select, signature_fingerprint

pytestmark = pytest.mark.lane

FAMILIES = ["mistral", "qwen2", "qwen3", "phi3", "gemma3"]
PARTS = ("rms_norm", "attention", "mlp", "causal_lm_loss")
# Families whose decoder layer is Llama-shaped: it runs as one fused node (fastft.patches.fused_layer).
FUSED_LAYER_FAMILIES = {"mistral", "qwen2"}


def parts(family: str) -> tuple[str, ...]:
    return PARTS + (("decoder_layer",) if family in FUSED_LAYER_FAMILIES else ())


LAYERS = 2


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory, smol_tokenizer) -> tuple[str, str]:
    """``(family, folder)``: a saved tiny random model of the family, loaded by each test as a user would."""
    folder = tmp_path_factory.mktemp(request.param)
    return request.param, save_family(folder, request.param, smol_tokenizer)


def test_parity_with_stock_left_padded(family, kernel_path):
    _, folder = family
    patched, stock = lora_model(folder, patch=True), lora_model(folder, patch=False)
    assert_parity(patched, stock, make_batch(patched.config.vocab_size, batch=2, seq=13, pad=5))


def test_parity_without_checkpointing(family):
    # The offloaded checkpointer (the default above) recomputes each layer in backward; without it the fused nodes
    # run once. Both paths of the kernels are covered above; the torch reference suffices for this one.
    _, folder = family
    patched = lora_model(folder, patch=True, checkpointing=False)
    stock = lora_model(folder, patch=False, checkpointing=False)
    assert_parity(patched, stock, make_batch(patched.config.vocab_size, batch=2, seq=13, pad=5))


@pytest.mark.parametrize("seq", lane_cases([7, 1, 63]))
def test_parity_at_sequence_lengths(family, seq):
    _, folder = family
    patched, stock = lora_model(folder, patch=True), lora_model(folder, patch=False)
    assert_parity(patched, stock, make_batch(patched.config.vocab_size, batch=2, seq=seq))


# bitsandbytes differs by lane, the kernels do not: the lanes check the 4-bit base through the torch reference.
@pytest.mark.parametrize("kernel_path", lane_cases(["reference", "triton"]), indirect=True)
def test_parity_with_4bit_base(family, kernel_path):
    _, folder = family
    patched = lora_model(folder, patch=True, load_in_4bit=True)
    stock = lora_model(folder, patch=False, load_in_4bit=True)
    assert type(patched.get_base_model().model.layers[0].self_attn.o_proj.base_layer).__name__ == "Linear4bit"
    assert_parity(patched, stock, make_batch(patched.config.vocab_size, batch=2, seq=11, pad=3))


def test_phi3_packed_split_where_hidden_times_kv_over_heads_squared_is_not_an_integer(smol_tokenizer, tmp_path):
    # 320 · 8 / 40² = 1.6: a split derived from the hidden size (the GPT-NeoX failure class) cannot even be formed;
    # the config's widths (q 320, k / v 64 each) are what the packed qkv_proj splits at.
    shape = dict(hidden_size=320, num_attention_heads=40, num_key_value_heads=8)
    folder = save_family(tmp_path, "phi3", smol_tokenizer, **shape)
    patched, stock = lora_model(folder, patch=True), lora_model(folder, patch=False)
    assert patched.get_base_model().model.layers[0].self_attn.qkv_proj.base_layer.out_features == 320 + 2 * 64
    assert_parity(patched, stock, make_batch(patched.config.vocab_size, batch=2, seq=9, pad=2))


def test_greedy_generation_with_kv_cache_matches_stock(family):
    _, folder = family
    tokens = greedy_tokens(folder, patch=True)
    assert tokens.shape == (2, 14)
    assert torch.equal(tokens, greedy_tokens(folder, patch=False))


def test_one_fused_node_per_layer_and_group_and_every_row_applied(family):
    name, folder = family
    model = lora_model(folder, patch=True, checkpointing=False)
    rows = {row["name"]: row for row in patch_report(model)}
    assert {row: rows[row]["status"] for row in rows} == {
        **{f"{name}.{part}": "applied" for part in parts(name)},
        "checkpoint.offload": "applied",
        "trl.fused_logprobs": trl_logprobs_status(),
    }
    assert all(row["fallbacks"] == {} for row in rows.values()), rows
    norms = norms_per_layer(name) * LAYERS
    assert rows[f"{name}.rms_norm"]["modules"] == norms + 1
    batch = make_batch(model.config.vocab_size, batch=2, seq=12, pad=3)
    inputs = {key: batch[key] for key in ("input_ids", "attention_mask", "labels")}
    names = graph_nodes(model(**inputs).loss)
    assert served(names, qkv_node(name)) == LAYERS
    assert served(names, "LoRAOFunction") == LAYERS
    assert served(names, "LoRAMLP") == LAYERS
    assert count(names, "FusedLinearCrossEntropy") == 1
    # The first norm has no node where the embeddings need no gradient (transformers 4.x without checkpointing).
    assert served(names, "RMSNormFunction") in (norms, norms + 1)
    # Nothing of the stock LoRA path: peft's lora_B(lora_A(x)) * scaling would leave Mm / Addmm nodes.
    assert count(names, "MmBackward") == 0 and count(names, "AddmmBackward") == 0, sorted(set(names))


def test_unknown_transformers_version_runs_stock_with_one_warning(family, monkeypatch):
    name, folder = family
    monkeypatch.setattr(registry, "_WARNED", set())
    monkeypatch.setattr(importlib.import_module("transformers"), "__version__", "9.0.0")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, _ = FastModel.from_pretrained(folder, max_seq_length=64)
    messages = [str(w.message) for w in caught if "fastft" in str(w.message)]
    assert len(messages) == 1 and f"{name}.attention" in messages[0], messages
    rows = {row["name"]: row for row in patch_report(model)}
    for part in parts(name):
        row = rows[f"{name}.{part}"]
        assert row["status"] == "skipped" and "9.0.0" in row["reason"], row
    assert not any(type(module).__name__.startswith("Fast") for module in model.modules())
    patched = FastModel.get_peft_model(model, r=8, lora_alpha=16)
    randomize_lora_b(patched)
    assert_parity(patched, lora_model(folder, patch=False), make_batch(model.config.vocab_size, batch=2, seq=9, pad=2))


def test_gemma3_soft_capped_loss_matches_stock_and_the_cap_is_applied(smol_tokenizer, tmp_path, kernel_path):
    folder = save_family(tmp_path, "gemma3", smol_tokenizer)
    patched = lora_model(folder, patch=True, checkpointing=False)
    stock = lora_model(folder, patch=False, checkpointing=False)
    assert patched.config.final_logit_softcapping == 4.0
    batch = make_batch(patched.config.vocab_size, batch=2, seq=13, pad=5)
    inputs = {key: batch[key] for key in ("input_ids", "attention_mask", "labels")}
    head = patched.get_base_model()
    calls = head.fastft_fused_loss_calls

    def losses() -> tuple[torch.Tensor, torch.Tensor]:
        return patched(**inputs).loss.detach(), stock(**inputs).loss.detach()

    capped, stock_capped = losses()
    assert head.fastft_fused_loss_calls == calls + 1
    assert relative_error(capped, stock_capped) <= LOSS_TOLERANCE, (capped.item(), stock_capped.item())
    for model in (patched, stock):
        model.config.final_logit_softcapping = None
    uncapped, stock_uncapped = losses()
    assert head.fastft_fused_loss_calls == calls + 2
    assert relative_error(uncapped, stock_uncapped) <= LOSS_TOLERANCE, (uncapped.item(), stock_uncapped.item())
    # The cap really changed the loss (by a few percent here), so matching stock above means the fused loss capped.
    assert relative_error(capped, uncapped) > 1e-2, (capped.item(), uncapped.item())


def test_every_family_record_matches_the_installed_signatures():
    for name, group in records().items():
        if group[0].model_types in ((), (registry.OTHER_ARCHITECTURES,)):
            continue
        record, reason = select(name, group)
        assert record is not None, f"{name}: {reason}"
        module_name, class_name, _ = record.target.rsplit(".", 2)
        upstream_forward = getattr(importlib.import_module(module_name), class_name).forward
        assert signature_fingerprint(upstream_forward) == record.fingerprint, name
        # The replacement takes its arguments exactly as the upstream object it stands in for (a record that only
        # reports why a part stays upstream's, gpt-oss's attention, replaces nothing).
        if record.replacement is not None:
            assert signature_fingerprint(record.replacement.forward) == record.fingerprint, name


def _save_olmo(folder, tokenizer) -> str:
    # OLMo: no fused family, a standard causal-LM head (logits = lm_head(h), then ForCausalLMLoss) in every lane.
    config = OlmoConfig(
        vocab_size=FAMILY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=128,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    OlmoForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def test_an_architecture_without_patches_warns_once_and_keeps_the_fused_loss(smol_tokenizer, tmp_path, monkeypatch):
    monkeypatch.setattr(registry, "_WARNED", set())
    folder = _save_olmo(tmp_path, smol_tokenizer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, _ = FastModel.from_pretrained(folder, max_seq_length=64)
    messages = [str(w.message) for w in caught if "fastft" in str(w.message)]
    assert len(messages) == 1, messages
    assert "'olmo'" in messages[0] and "OlmoForCausalLM" in messages[0] and "stock" in messages[0]
    rows = {row["name"]: row for row in patch_report(model)}
    assert rows[registry.ARCHITECTURE_ROW]["status"] == "not applicable"
    assert "olmo" in rows[registry.ARCHITECTURE_ROW]["reason"]
    # Its head is the standard one (logits = lm_head(h), then ForCausalLMLoss): the fused loss serves it.
    assert rows["generic.causal_lm_loss"]["status"] == "applied"
    # No other family's rows: they are not this model's business.
    assert not any(name.split(".")[0] in ("llama", *FAMILIES) for name in rows)

    def lora(patch: bool):
        loaded, _ = FastModel.from_pretrained(folder, max_seq_length=64, patch=patch)
        peft_model = FastModel.get_peft_model(loaded, r=8, lora_alpha=16)
        randomize_lora_b(peft_model)
        return peft_model

    patched = lora(True)
    assert_parity(patched, lora(False), make_batch(FAMILY_VOCAB, batch=2, seq=13, pad=5))
    assert patched.get_base_model().fastft_fused_loss_calls == 1


def test_a_head_that_rewrites_its_logits_keeps_the_stock_loss():
    from transformers.models.cohere import modeling_cohere
    from transformers.models.llama import modeling_llama

    from fastft.patches.generic import standard_head_reason

    # Cohere multiplies its logits by logit_scale after the LM head: the fused loss would compute another loss.
    assert "logits" in standard_head_reason(modeling_cohere.CohereForCausalLM)
    assert standard_head_reason(modeling_llama.LlamaForCausalLM) is None
