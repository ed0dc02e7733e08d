"""Gemma 3 with its vision tower through FastModel: loaded as ``Gemma3ForConditionalGeneration`` with its processor, the
language model on the fused path (sliding and global layers, q / k norms, GeGLU), the SigLIP tower and projector
stock; loss and LoRA gradients equal to transformers + peft for a batch with images (two image blocks attending to
themselves both ways), on both kernel paths and in every checkpointing mode; the head's own loss rules in each
release; 4-bit leaves the tower 16-bit; the adapter loads in plain peft; greedy generation with an image matches
stock; a text-only Gemma 3 still loads as text."""

from __future__ import annotations

import pytest
import torch
from conftest import lane_cases, randomize_lora_b, relative_error
from parity import assert_vlm_adapter_loads_in_peft, assert_vlm_generation_matches, count, graph_nodes
from parity import assert_vlm_step_matches as _assert_step_matches
from parity import stock_vlm as _stock
from parity import vlm_lora as _ours
from vlm_tiny_gemma3 import IMAGE_TOKENS, image, image_batch, save_tiny_gemma3, tiny_image_processor, tiny_tokenizer

from fastft import FastModel
from fastft.registry import patch_report

pytestmark = [pytest.mark.lane]
gemma3 = pytest.importorskip("transformers.models.gemma3.modeling_gemma3", reason="this transformers has no Gemma 3")
LAYERS = 2
PARTS = ("rms_norm", "attention", "mlp", "causal_lm_loss")


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    return save_tiny_gemma3(tmp_path_factory.mktemp("gemma3"))


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
    assert any(".vision_tower." in name and ".self_attn." in name for name in names)
    assert any(".vision_tower." in name and ".mlp.fc" in name for name in names)
    # The projector is a bare weight matrix (no nn.Linear): nothing there for LoRA to wrap.
    assert not any(".multi_modal_projector." in name for name in names)
    _assert_step_matches(model, _stock(model, vlm_dir), batch)


def test_labels_on_padding_follow_the_installed_heads_loss(vlm_dir, batch):
    """Through 5.12 at least the head drops predictions of tokens its attention mask hides; by 5.23 it scores them.
    Labels left on the padding tell the two apart, and the fused loss must do what the installed head does."""
    from fastft.patches.gemma3_vision import head_loss

    padded = dict(batch, labels=batch["labels"].where(batch["attention_mask"] == 1, batch["input_ids"]))
    model = _ours(vlm_dir)
    stock = _stock(model, vlm_dir)
    stock.train()
    with torch.no_grad():
        with_pad, without_pad = stock(**padded).loss, stock(**batch).loss
    assert head_loss() in ("masked", "standard")
    assert (relative_error(with_pad, without_pad) < 1e-7) == (head_loss() == "masked")
    _assert_step_matches(model, stock, padded)


def test_attended_labels_read_the_masks_last_columns():
    from fastft.patches.gemma3_vision import attended_labels

    labels = torch.tensor([[5, 6, 7, 8], [1, 2, 3, 4]])
    # A mask longer than the labels (a prefix-tuning prefix) is cropped on the left, as upstream crops it.
    mask = torch.tensor([[1, 1, 0, 0, 1, 1], [0, 0, 1, 1, 1, 1]])
    assert attended_labels(labels, mask).tolist() == [[-100, -100, 7, 8], [1, 2, 3, 4]]


def test_a_head_whose_loss_is_unrecognised_keeps_the_stock_loss(vlm_dir, batch, monkeypatch):
    from fastft.patches import gemma3_vision

    monkeypatch.setattr(gemma3_vision, "head_loss", lambda: None)
    model = _ours(vlm_dir)
    row = next(row for row in patch_report(model) if row["name"] == "gemma3_vision.causal_lm_loss")
    assert row["status"] == "not applicable" and "cannot reproduce it" in row["reason"], row
    assert type(model.get_base_model()) is gemma3.Gemma3ForConditionalGeneration
    _assert_step_matches(model, _stock(model, vlm_dir), batch)


def test_the_image_and_its_bidirectional_block_reach_the_logits(vlm_dir, batch):
    model = _ours(vlm_dir)
    stock = _stock(model, vlm_dir)
    model.eval()
    stock.eval()
    inputs = {key: value for key, value in batch.items() if key != "labels"}
    with torch.no_grad():
        logits = model(**inputs).logits
        assert relative_error(logits, stock(**inputs).logits) <= 1e-5
        other = dict(inputs, pixel_values=inputs["pixel_values"].flip(0))
        assert (model(**other).logits - logits).abs().max() > 1e-3
        # Without token_type_ids the image tokens attend causally: the parity above covers the bidirectional mask.
        causal = {key: value for key, value in inputs.items() if key != "token_type_ids"}
        assert (model(**causal).logits - logits).abs().max() > 1e-3


def test_report_says_the_language_model_is_fused_and_the_vision_side_stock(vlm_dir, batch):
    model = _ours(vlm_dir)
    rows = {row["name"]: row for row in patch_report(model)}
    for part in PARTS:
        row = rows[f"gemma3_vision.{part}"]
        assert row["status"] == "applied" and not row["fallbacks"], row
    # Six norms per layer (input, post-attention, pre- / post-feedforward, q_norm, k_norm) and the final one.
    assert rows["gemma3_vision.rms_norm"]["modules"] == 6 * LAYERS + 1
    assert not any(name.startswith("gemma3.") for name in rows), "the text family's records are for gemma3_text"
    base = model.get_base_model()
    language = {type(m).__name__ for m in base.model.language_model.modules()}
    assert {"FastGemma3Attention", "FastGemma3MLP", "FastGemma3RMSNorm"} <= language
    for side in (base.model.vision_tower, base.model.multi_modal_projector):
        assert not any(type(m).__module__.startswith("fastft.") for m in side.modules())
    model.train()
    names = graph_nodes(model(**batch).loss)
    assert count(names, "LoRAQKV") == count(names, "LoRAO") == count(names, "LoRAMLP") == LAYERS, sorted(set(names))


def test_the_processor_is_returned_and_makes_the_test_batch(vlm_dir, batch):
    model, processor = FastModel.from_pretrained(str(vlm_dir), max_seq_length=96, dtype=torch.float32)
    assert type(model).__name__ == "FastGemma3ForConditionalGeneration"
    assert type(processor).__name__ == "Gemma3Processor" and processor.tokenizer.model_max_length == 96
    made = processor(
        text=[f"<bos>a{IMAGE_TOKENS['boi_token']}tin{IMAGE_TOKENS['boi_token']}the hat in a tin"],
        images=[[image(2), image(3)]],
        return_tensors="pt",
        add_special_tokens=False,
    )
    assert made["input_ids"][0].tolist() == batch["input_ids"][1].tolist()
    assert made["token_type_ids"][0].tolist() == batch["token_type_ids"][1].tolist()
    assert torch.equal(made["pixel_values"], batch["pixel_values"][1:])


def test_without_a_processor_the_tokenizer_comes_back_with_a_warning(vlm_dir, monkeypatch):
    import transformers

    def refuse(*args, **kwargs):
        raise ImportError("Gemma3ImageProcessor requires the PIL library")

    monkeypatch.setattr(transformers.AutoProcessor, "from_pretrained", refuse)
    # Nor without a video processor (the fallback that serves Qwen-VL without torchvision).
    monkeypatch.setattr("fastft.loading.image_processor.image_only_processor", refuse)
    with pytest.warns(UserWarning, match="processor could not be built.*requires the PIL library"):
        _, tokenizer = FastModel.from_pretrained(str(vlm_dir), max_seq_length=96, dtype=torch.float32)
    assert tokenizer.model_max_length == 96 and tokenizer.image_token == IMAGE_TOKENS["image_token"]


def test_4bit_quantises_the_language_model_only(vlm_dir, batch):
    pytest.importorskip("bitsandbytes")
    model, _ = FastModel.from_pretrained(str(vlm_dir), max_seq_length=128, dtype=torch.float32, load_in_4bit=True)
    kinds = {name: type(m).__name__ for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    vision = {name: kind for name, kind in kinds.items() if ".vision_tower." in name}
    language = {name: kind for name, kind in kinds.items() if ".language_model." in name}
    assert vision and set(vision.values()) == {"Linear"}
    assert language and set(language.values()) == {"Linear4bit"}
    assert kinds["lm_head"] == "Linear"
    projector = model.model.multi_modal_projector.mm_input_projection_weight
    assert projector.dtype == torch.float32
    model = FastModel.get_peft_model(model, r=4, lora_alpha=8, use_gradient_checkpointing=False)
    randomize_lora_b(model, std=0.1)
    model.train()
    loss = model(**batch).loss
    loss.backward()
    assert torch.isfinite(loss) and model.get_base_model().fastft_fused_loss_calls == 1
    assert all(p.grad is not None for n, p in model.named_parameters() if "lora_" in n)


def test_dtype_applies_to_the_tower_and_the_language_model(vlm_dir):
    model, _ = FastModel.from_pretrained(str(vlm_dir), max_seq_length=128, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_adapter_loads_in_plain_peft(vlm_dir, batch, tmp_path):
    assert_vlm_adapter_loads_in_peft(_ours(vlm_dir), vlm_dir, batch, tmp_path)


def test_greedy_generation_with_an_image_matches_stock(vlm_dir, batch):
    model = _ours(vlm_dir)
    assert_vlm_generation_matches(model, _stock(model, vlm_dir), batch, pad_token_id=0)


def test_switches_choose_the_language_model_or_the_tower(vlm_dir):
    def adapted(**switches):
        model, _ = FastModel.from_pretrained(str(vlm_dir), max_seq_length=128, dtype=torch.float32)
        peft_model = FastModel.get_peft_model(model, r=4, use_gradient_checkpointing=False, **switches)
        return {name.split(".lora_A")[0] for name, _ in peft_model.named_parameters() if "lora_A" in name}

    attention = adapted(finetune_mlp_modules=False)
    assert attention and all(".self_attn." in name and ".language_model." in name for name in attention)
    tower = adapted(finetune_language_layers=False, finetune_vision_layers=True)
    assert {name.rsplit(".", 1)[-1] for name in tower} == {"q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"}
    assert all(".vision_tower." in name for name in tower)
    model, _ = FastModel.from_pretrained(str(vlm_dir), max_seq_length=128, dtype=torch.float32)
    with pytest.raises(ValueError, match="select no layer"):
        FastModel.get_peft_model(model, finetune_language_layers=False, finetune_vision_layers=False)


def test_a_text_only_gemma3_still_loads_as_text(tmp_path):
    """``Gemma3ForCausalLM`` (model_type gemma3_text) keeps the text family's patches and returns its tokenizer."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    tokenizer = tiny_tokenizer()
    config = Gemma3TextConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    Gemma3ForCausalLM(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    model, returned = FastModel.from_pretrained(str(tmp_path), max_seq_length=64, dtype=torch.float32)
    assert type(model).__name__ == "FastGemma3ForCausalLM" and returned.model_max_length == 64
    assert not hasattr(returned, "image_processor")
    rows = {row["name"]: row["status"] for row in patch_report(model)}
    assert all(rows[f"gemma3.{part}"] == "applied" for part in PARTS)
    assert not any(name.startswith("gemma3_vision.") for name in rows)


def test_a_batch_longer_than_max_seq_length_is_refused_by_name(vlm_dir, batch):
    from fastft import ShapeContractError

    model, _ = FastModel.from_pretrained(str(vlm_dir), max_seq_length=16, dtype=torch.float32)
    length = batch["input_ids"].shape[1]
    with pytest.raises(ShapeContractError, match=f"max_seq_length=16 tokens per sequence, got {length}"):
        model(**{key: value for key, value in batch.items() if key != "labels"})


def test_a_reward_model_task_loads_the_classification_head_where_transformers_maps_one(vlm_dir):
    """task="sequence-classification" on a Gemma 3 checkpoint: the text classification model where the installed
    transformers maps gemma3 to one (4.57 and later), else the vision-language refusal naming the task."""
    from transformers import AutoModelForSequenceClassification, Gemma3Config

    if Gemma3Config in AutoModelForSequenceClassification._model_mapping:
        model, _ = FastModel.from_pretrained(
            str(vlm_dir), max_seq_length=64, dtype=torch.float32, task="sequence-classification"
        )
        assert type(model).__name__.endswith("Gemma3ForSequenceClassification") and model.config.num_labels == 1
    else:
        with pytest.raises(ValueError, match="is a vision-language model.*task='sequence-classification'"):
            FastModel.from_pretrained(
                str(vlm_dir), max_seq_length=64, dtype=torch.float32, task="sequence-classification"
            )
