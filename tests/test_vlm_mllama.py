"""Llama 3.2 Vision (Mllama) through FastModel: loaded as the image-text-to-text model with its processor, the language
model's self- and cross-attention layers on the fused path, the vision model and projector stock; loss and LoRA
gradients equal to transformers + peft for a batch with images (cross-attention active), on both kernel paths and in
every checkpointing mode; 4-bit leaves the vision side and the cross-attention projections 16-bit; the adapter loads
in plain peft; greedy generation with an image matches stock."""

from __future__ import annotations

import pytest
import torch
from conftest import lane_cases, randomize_lora_b, save_tiny_llama
from parity import (
    assert_vlm_adapter_loads_in_peft,
    assert_vlm_generation_matches,
    assert_vlm_step_matches,
    count,
    graph_nodes,
)
from parity import stock_vlm as _stock
from parity import vlm_lora as _ours
from vlm_tiny_mllama import (
    CROSS_ATTENTION_LAYERS,
    IMAGE_SIZES,
    IMAGE_TOKEN,
    TEXT_LAYERS,
    image,
    image_batch,
    save_tiny_mllama,
    tiny_processor,
    tiny_tokenizer,
)

from fastft import FastModel
from fastft.registry import patch_report

pytestmark = pytest.mark.lane
mllama = pytest.importorskip("transformers.models.mllama.modeling_mllama", reason="this transformers has no Mllama")
SELF_LAYERS = TEXT_LAYERS - len(CROSS_ATTENTION_LAYERS)


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    return save_tiny_mllama(tmp_path_factory.mktemp("mllama"))


@pytest.fixture(scope="module")
def batch(vlm_dir):
    from transformers import AutoTokenizer

    return image_batch(tiny_processor(AutoTokenizer.from_pretrained(vlm_dir)))


def _assert_step_matches(model, stock, batch, required=".cross_attn.k_proj.") -> None:
    """One step of each equal; ``required``: some adapter that must have trained. The cross-attention's k / v read
    only the image, so their gradients are non-zero (asserted for every adapter) only with the image in the loss."""
    assert_vlm_step_matches(model, stock, batch, required)


@pytest.mark.parametrize("checkpointing", lane_cases([True, False, "offload"]))
def test_loss_and_lora_gradients_with_an_image_match_stock_peft(vlm_dir, batch, kernel_path, checkpointing):
    model = _ours(vlm_dir, checkpointing)
    _assert_step_matches(model, _stock(model, vlm_dir), batch)
    assert model.get_base_model().fastft_fused_loss_calls == 1


def test_a_text_only_batch_skips_the_cross_attention_as_stock_does(vlm_dir, batch):
    model = _ours(vlm_dir)
    stock = _stock(model, vlm_dir)
    text = {key: batch[key] for key in ("input_ids", "attention_mask", "labels")}
    # Without an image upstream skips the cross-attention layers whole (MLP too), so their adapters get no gradient:
    # compare the rest.
    skipped = tuple(f".language_model.layers.{index}." for index in CROSS_ATTENTION_LAYERS)
    for candidate in (model, stock):
        for name, parameter in candidate.named_parameters():
            if any(layer in name for layer in skipped):
                parameter.requires_grad_(False)
    _assert_step_matches(model, stock, text, required=".self_attn.")


def test_vision_adapters_match_stock_peft(vlm_dir, batch):
    model = _ours(vlm_dir, finetune_vision_layers=True)
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    for part in (".vision_model.transformer.layers.", ".vision_model.global_transformer.", ".multi_modal_projector."):
        assert any(part in name for name in names), part
    _assert_step_matches(model, _stock(model, vlm_dir), batch)


def test_the_image_reaches_the_loss(vlm_dir, batch):
    model = _ours(vlm_dir)
    with torch.no_grad():
        other = dict(batch, pixel_values=batch["pixel_values"].flip(0))
        assert (model(**other).logits - model(**batch).logits).abs().max() > 1e-4


def test_report_says_the_language_model_is_fused_and_the_vision_model_stock(vlm_dir, batch):
    model = _ours(vlm_dir)
    rows = {row["name"]: row for row in patch_report(model)}
    # Two norms per layer, the cross-attention's per-head q / k norms, the final norm.
    norms = 2 * TEXT_LAYERS + 2 * len(CROSS_ATTENTION_LAYERS) + 1
    modules = {"rms_norm": norms, "attention": SELF_LAYERS, "cross_attention": 1, "mlp": TEXT_LAYERS}
    for part in ("rms_norm", "attention", "cross_attention", "mlp", "causal_lm_loss"):
        row = rows[f"mllama.{part}"]
        assert row["status"] == "applied" and not row["fallbacks"], row
        assert row["modules"] == modules.get(part, 1), row
    base = model.get_base_model()
    kinds = {type(m).__name__ for m in base.model.language_model.modules()}
    assert {"FastMllamaTextSelfAttention", "FastMllamaTextCrossAttention", "FastMllamaTextMLP"} <= kinds
    for stock_side in (base.model.vision_model, base.model.multi_modal_projector):
        assert not any(type(m).__module__.startswith("fastft.") for m in stock_side.modules())
    names = graph_nodes(model(**batch).loss)
    # Self-attention: q | k | v with RoPE in one node; cross-attention: q, then k | v (two inputs), no RoPE.
    assert count(names, "LoRAQKVRoPE") == SELF_LAYERS, sorted(set(names))
    assert count(names, "LoRAQKVFunction") == 2 * len(CROSS_ATTENTION_LAYERS), sorted(set(names))
    assert count(names, "LoRAO") == count(names, "LoRAMLP") == TEXT_LAYERS, sorted(set(names))


def test_cross_attention_with_dropout_falls_back_by_name(vlm_dir, batch):
    model, _ = FastModel.from_pretrained(str(vlm_dir), max_seq_length=128, dtype=torch.float32)
    model = FastModel.get_peft_model(model, r=4, lora_dropout=0.1, use_gradient_checkpointing=False)
    fallbacks = {row["name"]: row["fallbacks"] for row in patch_report(model)}["mllama.cross_attention"]
    layer = f"model.language_model.layers.{CROSS_ATTENTION_LAYERS[0]}.cross_attn"
    assert set(fallbacks) == {f"{layer}.q_proj", f"{layer}.kv", f"{layer}.o_proj"}, fallbacks
    assert all("dropout" in reason for reason in fallbacks.values())
    model.train()
    assert torch.isfinite(model(**batch).loss)


def test_processor_is_returned_with_the_model_length(vlm_dir):
    model, processor = FastModel.from_pretrained(str(vlm_dir), max_seq_length=96, dtype=torch.float32)
    assert type(processor).__name__ == "MllamaProcessor" and processor.tokenizer.model_max_length == 96
    assert type(model).__name__ == "FastMllamaForConditionalGeneration"


def test_without_a_processor_the_tokenizer_comes_back_with_a_warning(vlm_dir, monkeypatch):
    import transformers

    def refuse(*args, **kwargs):
        raise ImportError("MllamaImageProcessor requires the PIL library")

    monkeypatch.setattr(transformers.AutoProcessor, "from_pretrained", refuse)
    monkeypatch.setattr("fastft.loading.image_processor.image_only_processor", refuse)
    with pytest.warns(UserWarning, match="could not be built.*PIL library.*returning its tokenizer instead"):
        _, tokenizer = FastModel.from_pretrained(str(vlm_dir), max_seq_length=96, dtype=torch.float32)
    assert tokenizer.model_max_length == 96
    assert tokenizer.convert_tokens_to_ids(IMAGE_TOKEN) == tiny_tokenizer().convert_tokens_to_ids(IMAGE_TOKEN)


def test_bf16_loads_the_vision_model_in_bf16_too(vlm_dir):
    model, _ = FastModel.from_pretrained(str(vlm_dir), max_seq_length=128, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_4bit_quantises_the_language_model_but_its_cross_attention(vlm_dir, batch):
    pytest.importorskip("bitsandbytes")
    model, _ = FastModel.from_pretrained(str(vlm_dir), max_seq_length=128, dtype=torch.float32, load_in_4bit=True)
    kinds = {name: type(m).__name__ for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    vision = {name: kind for name, kind in kinds.items() if ".vision_model." in name or "projector" in name}
    cross = {name: kind for name, kind in kinds.items() if ".cross_attn." in name}
    language = {name: kind for name, kind in kinds.items() if ".language_model." in name and name not in cross}
    assert vision and set(vision.values()) == {"Linear"}
    assert len(cross) == 4 and set(cross.values()) == {"Linear"}
    assert len(language) == 4 * SELF_LAYERS + 3 * TEXT_LAYERS and set(language.values()) == {"Linear4bit"}
    assert kinds["lm_head"] == "Linear"
    model = FastModel.get_peft_model(model, r=4, lora_alpha=8, use_gradient_checkpointing=False)
    randomize_lora_b(model, std=0.1)
    assert not any(row["fallbacks"] for row in patch_report(model) if row["name"].startswith("mllama."))
    loss = model(**batch).loss
    loss.backward()
    assert torch.isfinite(loss) and model.get_base_model().fastft_fused_loss_calls == 1
    assert all(p.grad is not None and p.grad.norm() > 0 for n, p in model.named_parameters() if "lora_" in n)


def test_adapter_loads_in_plain_peft(vlm_dir, batch, tmp_path):
    assert_vlm_adapter_loads_in_peft(_ours(vlm_dir, finetune_vision_layers=True), vlm_dir, batch, tmp_path)


def test_greedy_generation_with_an_image_matches_stock(vlm_dir, batch):
    model = _ours(vlm_dir)
    assert_vlm_generation_matches(model, _stock(model, vlm_dir), batch, pad_token_id=2)


def test_switches_choose_self_and_cross_attention_together(vlm_dir, tmp_path_factory, word_tokenizer):
    model, _ = FastModel.from_pretrained(str(vlm_dir), max_seq_length=128, dtype=torch.float32)
    peft_model = FastModel.get_peft_model(model, r=4, finetune_mlp_modules=False, use_gradient_checkpointing=False)
    adapted = {name.split(".lora_A")[0] for name, _ in peft_model.named_parameters() if "lora_A" in name}
    assert adapted and all(".language_model." in name for name in adapted)
    kinds = {name.split(".")[-2] for name in adapted}
    assert kinds == {"self_attn", "cross_attn"}, kinds
    assert len(adapted) == 4 * TEXT_LAYERS

    model, _ = FastModel.from_pretrained(str(vlm_dir), max_seq_length=128, dtype=torch.float32)
    peft_model = FastModel.get_peft_model(
        model,
        r=4,
        finetune_language_layers=False,
        finetune_vision_layers=True,
        finetune_attention_modules=False,
        use_gradient_checkpointing=False,
    )
    adapted = {name.split(".lora_A")[0] for name, _ in peft_model.named_parameters() if "lora_A" in name}
    assert adapted and all(".mlp.fc" in name or name.endswith("multi_modal_projector") for name in adapted), adapted
    assert any(name.endswith("multi_modal_projector") for name in adapted)
    text, _ = FastModel.from_pretrained(str(save_tiny_llama(tmp_path_factory, word_tokenizer)), max_seq_length=128)
    with pytest.raises(ValueError, match="is not one"):
        FastModel.get_peft_model(text, finetune_vision_layers=True)


def test_a_batch_longer_than_max_seq_length_is_refused_by_name(vlm_dir, batch):
    from fastft import ShapeContractError

    model, _ = FastModel.from_pretrained(str(vlm_dir), max_seq_length=16, dtype=torch.float32)
    length = batch["input_ids"].shape[1]
    with pytest.raises(ShapeContractError, match=f"max_seq_length=16 tokens per sequence, got {length}"):
        model(**{key: value for key, value in batch.items() if key != "labels"})


# The tiny chat template with image parts, Llama 3.2 Vision's way: one <|image|> where each image part stands.
VISION_TEMPLATE = (
    "{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<|image|>{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|eot_id|>{% endfor %}"
)


def test_the_collator_lays_out_the_cross_attention_mask_and_trains_like_stock(vlm_dir):
    """VisionDataCollator with Mllama's processor: images given per example (as it wants them), its per-token
    cross_attention_mask laid out like the ids, image and prompt tokens unlabelled; fastft's step equals stock's."""
    from transformers import AutoTokenizer

    from fastft import VisionDataCollator

    tokenizer = AutoTokenizer.from_pretrained(vlm_dir)
    tokenizer.chat_template = VISION_TEMPLATE
    processor = tiny_processor(tokenizer)
    processor.chat_template = VISION_TEMPLATE

    def chat(picture, question, answer):
        user = [{"type": "image", "image": picture}, {"type": "text", "text": question}]
        return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]}

    examples = [
        chat(image(1, IMAGE_SIZES[0]), "the cat in a hat", "a hat"),
        chat(image(2, IMAGE_SIZES[1]), "a tin", "the tin in the hat"),
    ]
    batch = VisionDataCollator(processor)(examples)
    ids, labels = batch["input_ids"], batch["labels"]
    assert batch["cross_attention_mask"].shape[:2] == ids.shape
    # Padding (on the right, after re-layout) sees no tile; each row's real tokens after its image see some.
    padded = batch["attention_mask"] == 0
    assert padded.any() and not batch["cross_attention_mask"][padded].any()
    image_id = tokenizer.convert_tokens_to_ids("<|image|>")
    assert ((ids == image_id).sum(dim=1) == 1).all() and (labels[ids == image_id] == -100).all()
    assert (labels != -100).any(dim=1).all()
    model = _ours(vlm_dir)
    assert_vlm_step_matches(model, _stock(model, vlm_dir), batch, ".cross_attn.k_proj.")
