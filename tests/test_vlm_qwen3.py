"""Qwen3-VL through FastModel: loaded as the image-text-to-text model (the tokenizer back, with a warning, where its
processor cannot be built), the language model on the fused path (per-head q / k norms, interleaved M-RoPE), the
vision tower and its DeepStack mergers stock; loss and LoRA gradients equal to transformers + peft for a batch with
images (DeepStack running), on both kernel paths and in every checkpointing mode; 4-bit leaves the tower 16-bit; the
adapter loads in plain peft; greedy generation with an image matches stock. A transformers without the family
(< 4.57) refuses it by name, with the release it needs."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import lane_cases, randomize_lora_b
from parity import assert_vlm_adapter_loads_in_peft, assert_vlm_generation_matches, count, graph_nodes
from parity import assert_vlm_step_matches as _assert_step_matches
from parity import stock_vlm as _stock
from parity import vlm_lora as _ours
from vlm_tiny import image_batch, tiny_image_processor, tiny_tokenizer
from vlm_tiny_qwen3 import DEEPSTACK, TEXT_LAYERS, save_tiny_qwen3_vl

from fastft import FastModel
from fastft.registry import patch_report

try:
    from transformers.models.qwen3_vl import modeling_qwen3_vl as qwen3_vl
except ImportError:
    qwen3_vl = None

pytestmark = [
    pytest.mark.lane,
    # The tiny config's ids stand in for Qwen's 151k-token vocabulary; transformers 5.x says so on every load.
    pytest.mark.filterwarnings("ignore:.*must be `None` or an integer within the vocabulary"),
    pytest.mark.filterwarnings("ignore:fastft.from_pretrained.*processor could not be built"),
]
family = pytest.mark.skipif(qwen3_vl is None, reason="this transformers has no Qwen3-VL (added in 4.57)")


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    if qwen3_vl is None:
        pytest.skip("this transformers has no Qwen3-VL (added in 4.57)")
    return save_tiny_qwen3_vl(tmp_path_factory.mktemp("qwen3_vl"))


@pytest.fixture(scope="module")
def batch(vlm_dir):
    from transformers import AutoTokenizer

    return image_batch(AutoTokenizer.from_pretrained(vlm_dir), tiny_image_processor())


def _deepstack_calls(model) -> list[dict]:
    """Record what the text model receives on each call: how many DeepStack feature sets, for how many positions."""
    calls = []

    def record(module, args, kwargs):
        embeds, masks = kwargs.get("deepstack_visual_embeds"), kwargs.get("visual_pos_masks")
        calls.append({"layers": len(embeds or ()), "positions": None if masks is None else int(masks.sum())})

    model.get_base_model().model.language_model.register_forward_pre_hook(record, with_kwargs=True)
    return calls


@family
@pytest.mark.parametrize("checkpointing", lane_cases([True, False, "offload"]))
def test_loss_and_lora_gradients_with_an_image_match_stock_peft(vlm_dir, batch, kernel_path, checkpointing):
    model = _ours(vlm_dir, checkpointing)
    calls = _deepstack_calls(model)
    _assert_step_matches(model, _stock(model, vlm_dir), batch)
    assert model.get_base_model().fastft_fused_loss_calls == 1
    # DeepStack ran: the image tokens got the tower's intermediate features after the first text layers.
    image_tokens = int(batch["image_grid_thw"].prod(-1).sum()) // 4
    assert calls[0] == {"layers": len(DEEPSTACK), "positions": image_tokens}


@family
def test_vision_tower_and_deepstack_adapters_match_stock_peft(vlm_dir, batch):
    model = _ours(vlm_dir, finetune_vision_layers=True)
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    for part in (".visual.blocks.", ".visual.merger.", ".visual.deepstack_merger_list.", ".language_model."):
        assert any(part in name for name in names), part
    _assert_step_matches(model, _stock(model, vlm_dir), batch)


@family
def test_deepstack_features_reach_the_loss(vlm_dir, batch):
    model = _ours(vlm_dir)
    with torch.no_grad():
        logits = model(**batch).logits
        for merger in model.get_base_model().model.visual.deepstack_merger_list:
            merger.linear_fc2.bias.zero_()
            merger.linear_fc2.weight.zero_()
        # The tiny model's DeepStack features are scaled up (vlm_tiny_qwen3): far above fp32 rounding.
        assert (model(**batch).logits - logits).abs().max() > 1e-3


@family
def test_image_tokens_get_interleaved_mrope_positions(vlm_dir, batch):
    """The batch really exercises M-RoPE: its image tokens' height and width positions differ from the temporal
    ones, so a rotation that took every pair from one axis (or Qwen2.5-VL's contiguous sections) would differ."""
    model = _ours(vlm_dir)
    inner = model.get_base_model().model
    rope_kwargs = {k: batch[k] for k in ("image_grid_thw", "attention_mask", "mm_token_type_ids") if k in batch}
    positions, _ = inner.get_rope_index(batch["input_ids"], **rope_kwargs)
    image = batch["input_ids"] == model.config.image_token_id
    temporal, height, width = positions[0][image], positions[1][image], positions[2][image]
    assert not torch.equal(height, temporal) and not torch.equal(width, temporal) and not torch.equal(height, width)


@family
def test_report_says_the_language_model_is_fused_and_the_vision_tower_stock(vlm_dir, batch):
    model = _ours(vlm_dir)
    rows = {row["name"]: row for row in patch_report(model)}
    for part in ("rms_norm", "attention", "mlp", "causal_lm_loss"):
        row = rows[f"qwen3_vl.{part}"]
        assert row["status"] == "applied" and not row["fallbacks"], row
        assert ".Qwen3VLText" in row["target"] or part == "causal_lm_loss", row
    base = model.get_base_model()
    language = {type(m).__name__ for m in base.model.language_model.modules()}
    assert {"FastQwen3VLTextAttention", "FastQwen3VLTextMLP", "FastQwen3VLTextRMSNorm"} <= language
    assert not any(type(m).__module__.startswith("fastft.") for m in base.model.visual.modules())
    names = graph_nodes(model(**batch).loss)
    layers = TEXT_LAYERS
    assert count(names, "LoRAQKV") == count(names, "LoRAO") == count(names, "LoRAMLP") == layers, sorted(set(names))
    # Per layer two layer norms and the per-head q / k norms, and the final norm; all but the first layer's input norm
    # (nothing before it trains: frozen embeddings and norm weight) are autograd nodes.
    assert count(names, "RMSNormFunction") == 4 * layers, sorted(set(names))


@family
def test_processor_is_returned_with_the_model_length(vlm_dir, monkeypatch):
    import transformers

    processor = type("Processor", (), {})()
    processor.tokenizer = tiny_tokenizer()
    monkeypatch.setattr(transformers.AutoProcessor, "from_pretrained", lambda *a, **k: processor)
    model, returned = FastModel.from_pretrained(str(vlm_dir), max_seq_length=96, dtype=torch.float32)
    assert returned is processor and processor.tokenizer.model_max_length == 96
    assert type(model).__name__ == "FastQwen3VLForConditionalGeneration"


@family
def test_without_torchvision_the_processor_comes_back_without_videos(vlm_dir):
    import importlib.util

    if importlib.util.find_spec("torchvision") is not None:
        pytest.skip("torchvision is installed, so Qwen3-VL's whole processor builds")
    # Qwen3-VL's processor needs torchvision for its video processor, which this torch has no wheel of: fastft builds
    # the same processor class over the image processor and tokenizer alone, and says so.
    with pytest.warns(UserWarning, match="without a video processor.*pip install torchvision"):
        _, processor = FastModel.from_pretrained(str(vlm_dir), max_seq_length=96, dtype=torch.float32)
    assert type(processor).__name__ == "Qwen3VLProcessor"
    tokenizer = processor.tokenizer
    assert tokenizer.model_max_length == 96 and tokenizer.convert_tokens_to_ids("<|image_pad|>") == 5


@family
def test_without_any_processor_the_tokenizer_comes_back_with_a_warning(vlm_dir, monkeypatch):
    import transformers

    def refuse(*args, **kwargs):
        raise ImportError("this test: no processor can be built")

    monkeypatch.setattr(transformers.AutoProcessor, "from_pretrained", refuse)
    monkeypatch.setattr("fastft.loading.image_processor.image_only_processor", refuse)
    with pytest.warns(UserWarning, match="returning its tokenizer instead.*pip install torchvision"):
        _, tokenizer = FastModel.from_pretrained(str(vlm_dir), max_seq_length=96, dtype=torch.float32)
    assert tokenizer.model_max_length == 96 and tokenizer.convert_tokens_to_ids("<|image_pad|>") == 5


@family
def test_4bit_quantises_the_language_model_only(vlm_dir, batch):
    pytest.importorskip("bitsandbytes")
    model, _ = FastModel.from_pretrained(str(vlm_dir), max_seq_length=128, dtype=torch.float32, load_in_4bit=True)
    kinds = {name: type(m).__name__ for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    vision = {name: kind for name, kind in kinds.items() if ".visual." in name}
    language = {name: kind for name, kind in kinds.items() if ".language_model." in name}
    assert any(".deepstack_merger_list." in name for name in vision) and any(".merger." in name for name in vision)
    assert set(vision.values()) == {"Linear"}
    assert language and set(language.values()) == {"Linear4bit"}
    assert kinds["lm_head"] == "Linear"
    model = FastModel.get_peft_model(model, r=4, lora_alpha=8, use_gradient_checkpointing=False)
    randomize_lora_b(model, std=0.1)
    loss = model(**batch).loss
    loss.backward()
    assert torch.isfinite(loss) and model.get_base_model().fastft_fused_loss_calls == 1
    assert all(p.grad is not None for n, p in model.named_parameters() if "lora_" in n)


@family
def test_adapter_loads_in_plain_peft(vlm_dir, batch, tmp_path):
    assert_vlm_adapter_loads_in_peft(_ours(vlm_dir, finetune_vision_layers=True), vlm_dir, batch, tmp_path)


@family
def test_greedy_generation_with_an_image_matches_stock(vlm_dir, batch):
    model = _ours(vlm_dir)
    assert_vlm_generation_matches(model, _stock(model, vlm_dir), batch, pad_token_id=0)


@family
def test_switches_pick_qwen3_vl_modules(vlm_dir):
    def adapted(**switches):
        model, _ = FastModel.from_pretrained(str(vlm_dir), max_seq_length=128, dtype=torch.float32)
        model = FastModel.get_peft_model(model, r=4, use_gradient_checkpointing=False, **switches)
        return {name.rsplit(".lora_A", 1)[0] for name, _ in model.named_parameters() if "lora_A" in name}

    vision_mlp = adapted(finetune_language_layers=False, finetune_vision_layers=True, finetune_attention_modules=False)
    assert vision_mlp and all(".visual." in name for name in vision_mlp)
    assert {name.rsplit(".", 2)[-2] for name in vision_mlp} == {"mlp", "merger", str(DEEPSTACK[0]), str(DEEPSTACK[1])}
    assert all(name.endswith((".linear_fc1", ".linear_fc2")) for name in vision_mlp)
    vision_attention = adapted(finetune_language_layers=False, finetune_vision_layers=True, finetune_mlp_modules=False)
    assert {name.rsplit(".", 1)[-1] for name in vision_attention} == {"qkv", "proj"}
    language = adapted()
    assert all(".language_model." in name for name in language) and len(language) == 7 * TEXT_LAYERS


def test_a_transformers_without_qwen3_vl_names_the_release_it_needs(tmp_path):
    if qwen3_vl is not None:
        pytest.skip("this transformers has Qwen3-VL")
    # The config.json a Qwen3-VL checkpoint ships, written by hand: this transformers has no class to write it.
    config = {"model_type": "qwen3_vl", "architectures": ["Qwen3VLForConditionalGeneration"], "text_config": {}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ImportError, match=r"qwen3_vl model.*needs transformers >= 4\.57") as caught:
        FastModel.from_pretrained(str(tmp_path), max_seq_length=64)
    assert "does not recognize this architecture" in str(caught.value.__cause__)


@family
def test_a_vision_language_model_refuses_a_text_task(vlm_dir):
    with pytest.raises(ValueError, match="vision-language model \\(qwen3_vl\\)"):
        FastModel.from_pretrained(str(vlm_dir), task="sequence-classification")


@family
def test_a_batch_longer_than_max_seq_length_is_refused_by_name(vlm_dir, batch):
    from fastft import ShapeContractError

    model, _ = FastModel.from_pretrained(str(vlm_dir), max_seq_length=16, dtype=torch.float32)
    length = batch["input_ids"].shape[1]
    with pytest.raises(ShapeContractError, match=f"max_seq_length=16 tokens per sequence, got {length}"):
        model(**{key: value for key, value in batch.items() if key != "labels"})
