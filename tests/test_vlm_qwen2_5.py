"""Qwen2.5-VL through FastModel: loaded as the image-text-to-text model with its processor, the language model on the
fused path (M-RoPE included), the vision tower stock; loss and LoRA gradients equal to transformers + peft for a
batch with images, on both kernel paths and in every checkpointing mode; 4-bit leaves the tower 16-bit; the
adapter loads in plain peft; greedy generation with an image matches stock."""

from __future__ import annotations

import pytest
import torch
from conftest import lane_cases, randomize_lora_b, relative_error, save_tiny_llama
from parity import assert_vlm_adapter_loads_in_peft, assert_vlm_generation_matches, count, graph_nodes
from parity import assert_vlm_step_matches as _assert_step_matches
from parity import stock_vlm as _stock
from parity import vlm_lora as _ours
from vlm_tiny import image_batch, save_tiny_vlm, tiny_image_processor, tiny_tokenizer

from fastft import FastModel
from fastft.registry import patch_report

pytestmark = [
    pytest.mark.lane,
    # The tiny config's ids stand in for Qwen's 151k-token vocabulary; transformers 5.x says so on every load.
    pytest.mark.filterwarnings("ignore:.*must be `None` or an integer within the vocabulary"),
    pytest.mark.filterwarnings("ignore:fastft.from_pretrained.*processor could not be built"),
]
qwen2_5_vl = pytest.importorskip(
    "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl", reason="this transformers has no Qwen2.5-VL"
)
LAYERS = 2


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    return save_tiny_vlm(tmp_path_factory.mktemp("qwen2_5_vl"))


@pytest.fixture(scope="module")
def batch(vlm_dir):
    from transformers import AutoTokenizer

    return image_batch(AutoTokenizer.from_pretrained(vlm_dir), tiny_image_processor())


@pytest.mark.parametrize("checkpointing", lane_cases([True, False, "offload"]))
def test_loss_and_lora_gradients_with_an_image_match_stock_peft(vlm_dir, batch, kernel_path, checkpointing):
    model = _ours(vlm_dir, checkpointing)
    _assert_step_matches(model, _stock(model, vlm_dir), batch)
    assert model.get_base_model().fastft_fused_loss_calls == 1


def test_vision_tower_adapters_match_stock_peft(vlm_dir, batch):
    model = _ours(vlm_dir, finetune_vision_layers=True)
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    assert any(".visual.blocks." in name for name in names) and any(".visual.merger." in name for name in names)
    _assert_step_matches(model, _stock(model, vlm_dir), batch)


def test_the_image_reaches_the_loss(vlm_dir, batch):
    model = _ours(vlm_dir)
    with torch.no_grad():
        other = dict(batch, pixel_values=batch["pixel_values"].flip(0))
        # The tiny random model's image features are small, but far above fp32 rounding.
        assert (model(**other).logits - model(**batch).logits).abs().max() > 1e-4


def test_report_says_the_language_model_is_fused_and_the_vision_tower_stock(vlm_dir, batch):
    model = _ours(vlm_dir)
    rows = {row["name"]: row for row in patch_report(model)}
    for part in ("rms_norm", "attention", "mlp", "causal_lm_loss"):
        row = rows[f"qwen2_5_vl.{part}"]
        assert row["status"] == "applied" and not row["fallbacks"], row
    base = model.get_base_model()
    language = {type(m).__name__ for m in base.model.language_model.modules()}
    assert {"FastQwen2_5_VLAttention", "FastQwen2_5_VLMLP", "FastQwen2_5_VLRMSNorm"} <= language
    # The vision blocks share the RMSNorm class with the language model: theirs stay upstream's.
    assert not any(type(m).__module__.startswith("fastft.") for m in base.model.visual.modules())
    names = graph_nodes(model(**batch).loss)
    assert count(names, "LoRAQKV") == count(names, "LoRAO") == count(names, "LoRAMLP") == LAYERS, sorted(set(names))


def test_mrope_tables_rotate_as_upstream():
    from fastft.kernels import apply_rope
    from fastft.patches.qwen2_5_vl import mrope_tables

    upstream = getattr(qwen2_5_vl, "apply_multimodal_rotary_pos_emb", None)
    if upstream is None:
        pytest.skip("transformers 5.24 recomposes the tables in the rotary embedding (covered by the parity tests)")
    section, head_dim = [2, 3, 3], 16
    module = torch.nn.Module()
    module.config = type("Config", (), {"rope_scaling": {"type": "mrope", "mrope_section": section}})()
    generator = torch.Generator().manual_seed(0)
    angles = torch.rand(3, 2, 5, head_dim // 2, generator=generator) * 6
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    q, k = torch.randn(2, 4, 5, head_dim, generator=generator), torch.randn(2, 2, 5, head_dim, generator=generator)
    expected = upstream(q, k, cos, sin, section)
    actual = apply_rope(q, k, *mrope_tables(module, cos, sin))
    for a, e in zip(actual, expected, strict=True):
        assert relative_error(a, e) <= 1e-6


def test_processor_is_returned_with_the_model_length(vlm_dir, monkeypatch):
    import transformers

    processor = type("Processor", (), {})()
    processor.tokenizer = tiny_tokenizer()
    monkeypatch.setattr(transformers.AutoProcessor, "from_pretrained", lambda *a, **k: processor)
    model, returned = FastModel.from_pretrained(str(vlm_dir), max_seq_length=96, dtype=torch.float32)
    assert returned is processor and processor.tokenizer.model_max_length == 96
    assert type(model).__name__ == "FastQwen2_5_VLForConditionalGeneration"


def test_without_a_processor_the_tokenizer_comes_back_with_a_warning(vlm_dir, monkeypatch):
    import transformers

    def refuse(*args, **kwargs):
        raise ImportError("Qwen2VLVideoProcessor requires the Torchvision library")

    monkeypatch.setattr(transformers.AutoProcessor, "from_pretrained", refuse)
    # Nor without its video processor (tests/test_vlm_collator.py covers the processor built that way).
    monkeypatch.setattr("fastft.loading.image_processor.image_only_processor", refuse)
    with pytest.warns(UserWarning, match="returning its tokenizer instead.*pip install torchvision"):
        _, tokenizer = FastModel.from_pretrained(str(vlm_dir), max_seq_length=96, dtype=torch.float32)
    assert tokenizer.model_max_length == 96 and tokenizer.convert_tokens_to_ids("<|image_pad|>") == 5


def test_4bit_quantises_the_language_model_only(vlm_dir, batch):
    pytest.importorskip("bitsandbytes")
    model, _ = FastModel.from_pretrained(str(vlm_dir), max_seq_length=128, dtype=torch.float32, load_in_4bit=True)
    kinds = {name: type(m).__name__ for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    vision = {name: kind for name, kind in kinds.items() if ".visual." in name}
    language = {name: kind for name, kind in kinds.items() if ".language_model." in name}
    assert vision and set(vision.values()) == {"Linear"}
    assert language and set(language.values()) == {"Linear4bit"}
    assert kinds["lm_head"] == "Linear"
    model = FastModel.get_peft_model(model, r=4, lora_alpha=8, use_gradient_checkpointing=False)
    randomize_lora_b(model, std=0.1)
    loss = model(**batch).loss
    loss.backward()
    assert torch.isfinite(loss) and model.get_base_model().fastft_fused_loss_calls == 1
    assert all(p.grad is not None for n, p in model.named_parameters() if "lora_" in n)


def test_adapter_loads_in_plain_peft(vlm_dir, batch, tmp_path):
    assert_vlm_adapter_loads_in_peft(_ours(vlm_dir), vlm_dir, batch, tmp_path)


def test_greedy_generation_with_an_image_matches_stock(vlm_dir, batch):
    model = _ours(vlm_dir)
    assert_vlm_generation_matches(model, _stock(model, vlm_dir), batch, pad_token_id=0)


def test_switches_are_checked(vlm_dir, tmp_path_factory, word_tokenizer):
    model, _ = FastModel.from_pretrained(str(vlm_dir), max_seq_length=128, dtype=torch.float32)
    with pytest.raises(ValueError, match="select no layer"):
        FastModel.get_peft_model(model, finetune_language_layers=False, finetune_vision_layers=False)
    with pytest.raises(ValueError, match="target_modules too"):
        FastModel.get_peft_model(model, target_modules=["q_proj"], finetune_mlp_modules=False)
    peft_model = FastModel.get_peft_model(model, r=4, finetune_mlp_modules=False, use_gradient_checkpointing=False)
    adapted = {name.rsplit(".", 1)[0] for name, _ in peft_model.named_parameters() if "lora_A" in name}
    assert adapted and all(".self_attn." in name and ".language_model." in name for name in adapted)
    text, _ = FastModel.from_pretrained(str(save_tiny_llama(tmp_path_factory, word_tokenizer)), max_seq_length=128)
    with pytest.raises(ValueError, match="is not one"):
        FastModel.get_peft_model(text, finetune_vision_layers=True)


def test_a_vision_language_model_refuses_a_text_task(vlm_dir):
    with pytest.raises(ValueError, match="vision-language model"):
        FastModel.from_pretrained(str(vlm_dir), task="sequence-classification")


def test_a_batch_longer_than_max_seq_length_is_refused_by_name(vlm_dir, batch):
    from fastft import ShapeContractError

    model, _ = FastModel.from_pretrained(str(vlm_dir), max_seq_length=16, dtype=torch.float32)
    length = batch["input_ids"].shape[1]
    with pytest.raises(ShapeContractError, match=f"max_seq_length=16 tokens per sequence, got {length}"):
        model(**{key: value for key, value in batch.items() if key != "labels"})


def test_load_vision_in_4bit_quantises_the_tower_too_and_is_refused_alone(vlm_dir, batch, tiny_llama_dir):
    pytest.importorskip("bitsandbytes")
    model, _ = FastModel.from_pretrained(
        str(vlm_dir), max_seq_length=128, dtype=torch.float32, load_in_4bit=True, load_vision_in_4bit=True
    )
    kinds = {name: type(m).__name__ for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    vision = {name: kind for name, kind in kinds.items() if ".visual." in name}
    assert vision and set(vision.values()) == {"Linear4bit"}
    assert kinds["lm_head"] == "Linear"
    model = FastModel.get_peft_model(model, r=4, lora_alpha=8, use_gradient_checkpointing=False)
    loss = model(**batch).loss
    loss.backward()
    assert torch.isfinite(loss)
    with pytest.raises(ValueError, match="load_vision_in_4bit=True quantises.*pass it with load_in_4bit=True"):
        FastModel.from_pretrained(str(vlm_dir), max_seq_length=128, load_vision_in_4bit=True)
    with pytest.raises(ValueError, match="has no vision tower that fastft loads"):
        FastModel.from_pretrained(str(tiny_llama_dir), load_in_4bit=True, load_vision_in_4bit=True)
