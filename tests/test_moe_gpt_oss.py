"""gpt-oss: experts stored transposed with gate / up interleaved, biases and a clamped SwiGLU, on the fused
grouped-expert path (transformers 5.x); norms, attention (learned sinks, half-width rotary tables, per-layer
windows) and loss fused. Parity with
transformers + peft on both kernel paths, in every checkpointing mode."""

from __future__ import annotations

import pytest
import torch
from conftest import lane_cases, randomize_lora_b, relative_error
from parity import assert_backbone_router_logits_match, assert_moe_step_matches, count, graph_nodes, stock_like

from fastft import FastModel
from fastft.registry import patch_report

pytestmark = pytest.mark.lane
gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss", reason="this transformers has no gpt-oss")

E, VOCAB = 4, 256


def _five() -> bool:
    import transformers
    from packaging.version import Version

    return Version(transformers.__version__) >= Version("5")


@pytest.fixture(scope="module")
def oss_dir(tmp_path_factory, word_tokenizer):
    from transformers import GptOssConfig

    config = GptOssConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=E,
        num_experts_per_tok=2,
        max_position_embeddings=128,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=8,
    )
    torch.manual_seed(0)
    model = gpt_oss.GptOssForCausalLM(config).float()
    with torch.no_grad():
        # Non-zero sinks and biases, so a path that dropped either would show.
        for name, parameter in model.named_parameters():
            if "sinks" in name or "bias" in name:
                parameter.normal_(0, 0.1)
    folder = tmp_path_factory.mktemp("gpt-oss")
    model.save_pretrained(folder)
    word_tokenizer.save_pretrained(folder)
    return folder


def _ours(folder, checkpointing=False):
    model, tokenizer = FastModel.from_pretrained(str(folder), max_seq_length=64, dtype=torch.float32)
    model = FastModel.get_peft_model(model, r=4, lora_alpha=8, use_gradient_checkpointing=checkpointing)
    randomize_lora_b(model, std=0.1)
    return model, tokenizer


@pytest.mark.parametrize("checkpointing", lane_cases([True, False, "offload", "sqrt"]))
def test_loss_and_lora_gradients_match_stock_peft(oss_dir, kernel_path, checkpointing):
    model, _ = _ours(oss_dir, checkpointing)
    ids = torch.randint(4, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    assert_moe_step_matches(model, stock_like(model, oss_dir), input_ids=ids, labels=ids)


@pytest.mark.parametrize("checkpointing", [True, "offload"])
def test_router_logits_from_the_backbone_keep_their_gradient_under_checkpointing(oss_dir, checkpointing):
    assert_backbone_router_logits_match(oss_dir, checkpointing, VOCAB)


def test_report_says_what_runs_fused(oss_dir):
    model, _ = _ours(oss_dir)
    rows = {row["name"]: row for row in patch_report(model)}
    assert rows["gpt_oss.rms_norm"]["status"] == rows["gpt_oss.causal_lm_loss"]["status"] == "applied"
    assert rows["gpt_oss.attention"]["status"] == "applied" and not rows["gpt_oss.attention"]["fallbacks"]
    # One fused q / k / v + RoPE node and one LoRA-O node per layer behind the loss.
    ids = torch.randint(4, VOCAB, (1, 12), generator=torch.Generator().manual_seed(2))
    names = graph_nodes(model(input_ids=ids, labels=ids).loss)
    assert count(names, "LoRAQKV") == count(names, "LoRAO") == 2, sorted(set(names))
    if _five():
        assert rows["gpt_oss.experts"]["status"] == "applied" and not rows["gpt_oss.experts"]["fallbacks"]
    else:
        assert rows["gpt_oss.experts"]["status"] == "not applicable"


def test_merged_save_reloads_and_matches(oss_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    model, tokenizer = _ours(oss_dir)
    FastModel.save_merged(model, tokenizer, tmp_path / "merged", dtype=torch.float32)
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"))
    ids = torch.randint(4, VOCAB, (1, 10), generator=torch.Generator().manual_seed(4))
    model.eval()
    with torch.no_grad():
        assert relative_error(merged(input_ids=ids).logits, model(input_ids=ids).logits) <= 1e-5


@pytest.mark.skipif(
    not _five(),
    reason="transformers 4.x's MXFP4 loader reads the experts only as MXFP4 blocks, which no checkpoint here has",
)
def test_an_mxfp4_checkpoint_is_dequantised_on_load_with_a_warning(oss_dir, tmp_path, monkeypatch, caplog):
    import json
    import shutil

    from transformers import AutoModelForCausalLM

    folder = tmp_path / "mxfp4"
    shutil.copytree(oss_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (folder / "config.json").write_text(json.dumps(config))
    seen = {}
    load = AutoModelForCausalLM.from_pretrained.__func__

    def spy(cls, *args, **kwargs):
        seen.update(kwargs)
        return load(cls, *args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", classmethod(spy))
    with caplog.at_level("WARNING"):
        model, _ = FastModel.from_pretrained(str(folder), max_seq_length=64, dtype=torch.float32)
    # MXFP4 experts do not train: fastft asks transformers for 16-bit ones, and says so.
    assert seen["quantization_config"].dequantize is True
    assert any("stores its experts in MXFP4" in record.getMessage() for record in caplog.records)
    experts = model.model.layers[0].mlp.experts
    assert type(experts).__name__ == "GptOssExperts" and experts.gate_up_proj.dtype == torch.float32


def test_greedy_generation_with_the_cache_matches_stock(oss_dir):
    # The KV cache and the per-layer windows on the fused attention: 12 tokens past an 8-token window.
    model, _ = _ours(oss_dir)
    stock = stock_like(model, oss_dir)
    ids = torch.randint(4, VOCAB, (1, 6), generator=torch.Generator().manual_seed(3))
    outputs = []
    for candidate in (model, stock):
        candidate.eval()
        with torch.no_grad():
            outputs.append(candidate.generate(input_ids=ids, max_new_tokens=12, do_sample=False, pad_token_id=0))
    assert torch.equal(outputs[0], outputs[1])
