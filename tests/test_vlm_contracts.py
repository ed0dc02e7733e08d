"""Vision-language batch contracts: a batch whose image placeholder tokens, pixel values or image grid disagree is
refused before the forward with a ShapeContractError naming the example, the expected and the actual counts (tiny
Qwen2.5-VL through FastModel; Gemma 3's and mllama's rows on their real configs); an image given to a text-only model
is refused by name; a correct batch passes and trains to stock transformers + peft's loss."""

from __future__ import annotations

import pytest
import torch
from conftest import randomize_lora_b, save_tiny_llama
from parity import assert_lora_step_matches
from vlm_tiny import MERGE, PATCH, TEMPORAL, image_batch, save_tiny_vlm, stock_vlm_peft, tiny_image_processor

from fastft import FastModel, ShapeContractError
from fastft.contracts import VISION_RULES, guard_vision_inputs

pytestmark = [
    pytest.mark.lane,
    pytest.mark.filterwarnings("ignore:.*must be `None` or an integer within the vocabulary"),
    pytest.mark.filterwarnings("ignore:fastft.from_pretrained.*processor could not be built"),
]
pytest.importorskip("transformers.models.qwen2_5_vl.modeling_qwen2_5_vl", reason="this transformers has no Qwen2.5-VL")

IMAGE_PAD = 5  # <|image_pad|> in the tiny vocabulary (vlm_tiny.SPECIAL)
TOKENS = 6  # a 16 x 24 image: 4 x 6 patches of 4 px, merged 2 x 2
ROWS = 4 * 6  # pixel rows per image (t·h·w)
PATCH_DIM = 3 * TEMPORAL * PATCH**2


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    return save_tiny_vlm(tmp_path_factory.mktemp("qwen2_5_vl"))


@pytest.fixture(scope="module")
def batch(vlm_dir):
    from transformers import AutoTokenizer

    inputs = image_batch(AutoTokenizer.from_pretrained(vlm_dir), tiny_image_processor())
    assert inputs["image_grid_thw"].tolist() == [[1, 4, 6]] * 2 and inputs["pixel_values"].shape == (2 * ROWS, 96)
    return {key: value for key, value in inputs.items() if key != "labels"}


@pytest.fixture(scope="module")
def model(vlm_dir):
    loaded, _ = FastModel.from_pretrained(str(vlm_dir), max_seq_length=128, dtype=torch.float32)
    return loaded.eval()


def _image_span(batch, row: int) -> tuple[int, int]:
    positions = (batch["input_ids"][row] == IMAGE_PAD).nonzero().flatten()
    return int(positions[0]), int(positions[-1]) + 1


def _with_ids(batch, input_ids):
    changed = dict(batch, input_ids=input_ids)
    if "mm_token_type_ids" in batch:
        changed["mm_token_type_ids"] = (input_ids == IMAGE_PAD).int()
    return changed


def _refused(model, inputs, *fragments: str) -> str:
    with pytest.raises(ShapeContractError) as raised:
        model(**inputs)
    message = str(raised.value)
    for fragment in fragments:
        assert fragment in message, message
    return message


def test_a_correct_batch_passes_and_matches_stock_loss(vlm_dir, batch):
    ours, _ = FastModel.from_pretrained(str(vlm_dir), max_seq_length=128, dtype=torch.float32)
    ours = FastModel.get_peft_model(ours, r=4, lora_alpha=8, use_gradient_checkpointing=False)
    randomize_lora_b(ours, std=0.1)
    from transformers import AutoTokenizer

    labelled = image_batch(AutoTokenizer.from_pretrained(vlm_dir), tiny_image_processor())
    assert_lora_step_matches(ours.train(), stock_vlm_peft(ours, vlm_dir).train(), "lora_A", **labelled)


def test_too_few_placeholder_tokens_in_an_example(model, batch):
    start, stop = _image_span(batch, 1)
    ids = batch["input_ids"].clone()
    ids[1, stop - 1] = ids[1, stop]  # the last <|image_pad|> of example 1 becomes <|vision_end|>
    _refused(model, _with_ids(batch, ids), "example 1", f"expected {TOKENS} tokens for image 1", f"got {TOKENS - 1}")


def test_too_many_placeholder_tokens_in_an_example(model, batch):
    start, stop = _image_span(batch, 0)
    ids = batch["input_ids"].clone()
    ids[0, stop] = IMAGE_PAD  # example 0's <|vision_end|> becomes one more <|image_pad|>
    _refused(model, _with_ids(batch, ids), "example 0", f"expected {TOKENS} tokens for image 0", f"got {TOKENS + 1}")


def test_placeholders_without_an_image(model, batch):
    ids = batch["input_ids"].clone()
    last_text = int((batch["attention_mask"][1] == 1).nonzero()[-3])
    ids[1, last_text] = IMAGE_PAD  # a stray placeholder in example 1's text, after its image
    _refused(model, _with_ids(batch, ids), "example 1", "expected no more <|image_pad|> tokens", "got 1 more")


def test_an_image_without_placeholders(model, batch):
    ids = batch["input_ids"].clone()
    start, stop = _image_span(batch, 1)
    ids[1, start:stop] = ids[1, stop]
    _refused(
        model, _with_ids(batch, ids), f"expected {2 * TOKENS} <|image_pad|> tokens", f"got {TOKENS}", "image 1 has none"
    )


def test_pixel_rows_disagreeing_with_the_grid(model, batch):
    inputs = dict(batch, pixel_values=batch["pixel_values"][:-4])
    _refused(model, inputs, f"expected {2 * ROWS} rows", f"got {2 * ROWS - 4}", "image_grid_thw")


def test_a_wrong_patch_dimension(model, batch):
    inputs = dict(batch, pixel_values=batch["pixel_values"][:, : PATCH_DIM - 8])
    _refused(model, inputs, f"expected shape [patches, {PATCH_DIM}]", f"got [{2 * ROWS}, {PATCH_DIM - 8}]")


def test_a_grid_not_divisible_by_the_merge_size(model, batch):
    grid = torch.tensor([[1, 4, 6], [1, 3, 8]])  # 24 rows each, but 3 rows of patches do not merge 2 x 2
    _refused(model, dict(batch, image_grid_thw=grid), "image 1", f"spatial_merge_size={MERGE}")


def test_image_tokens_cut_by_truncation(vlm_dir, batch):
    # Rows swapped, so the unpadded (longest) row, whose image truncation cuts, is example 1; the padded one loses
    # its image whole, so the cut image is the first left in order.
    swapped = {key: value.flip(0) for key, value in batch.items() if key not in ("pixel_values", "image_grid_thw")}
    swapped["pixel_values"] = torch.cat([batch["pixel_values"][ROWS:], batch["pixel_values"][:ROWS]])
    swapped["image_grid_thw"] = batch["image_grid_thw"]
    start, _ = _image_span(swapped, 1)
    cut = start + 2  # what a tokenizer truncating at max_length=cut leaves: two of the image's six tokens
    truncated = {
        key: value[:, :cut] if key not in ("pixel_values", "image_grid_thw") else value
        for key, value in swapped.items()
    }
    assert not (truncated["input_ids"][0] == IMAGE_PAD).any()  # example 0's image (left-padded) went whole
    short, _ = FastModel.from_pretrained(str(vlm_dir), max_seq_length=cut, dtype=torch.float32)
    _refused(
        short,
        truncated,
        "example 1",
        f"expected {TOKENS} tokens for image 0",
        "got 2",
        f"max_seq_length={cut}",
        "truncation cut the image",
    )


def test_pixel_values_to_a_text_only_model_are_refused(tmp_path_factory, word_tokenizer):
    folder = save_tiny_llama(tmp_path_factory, word_tokenizer)
    text, _ = FastModel.from_pretrained(str(folder), max_seq_length=64, dtype=torch.float32)
    peft_model = FastModel.get_peft_model(text, r=4, use_gradient_checkpointing=False)
    inputs = {"input_ids": torch.tensor([[4, 5, 6, 7]]), "pixel_values": torch.zeros(4, PATCH_DIM)}
    for candidate in (text, peft_model):
        _refused(candidate, inputs, "pixel_values of shape [4, 96]", "text-only model", "(llama)")
    assert peft_model(input_ids=inputs["input_ids"]).logits.shape[:2] == (1, 4)


class _Backbone(torch.nn.Module):
    def forward(self, **kwargs):
        return kwargs


class _Holder(torch.nn.Module):
    """A model's outer shell (config + backbone under base_model_prefix) to put a family's row to work without
    building the family's model: the guard reads only the config and the batch."""

    base_model_prefix = "model"

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = _Backbone()


def _gemma3_config():
    from transformers import Gemma3Config

    return Gemma3Config(
        text_config=dict(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, head_dim=16),
        vision_config=dict(image_size=16, patch_size=4, hidden_size=16, num_hidden_layers=1, num_attention_heads=2),
        mm_tokens_per_image=4,
        image_token_index=9,
    )


def test_gemma3_row_counts_mm_tokens_per_image():
    pytest.importorskip("transformers.models.gemma3")
    config = _gemma3_config()
    holder = _Holder(config)
    guard_vision_inputs(holder, max_seq_length=32)
    row = [1, 2, 9, 9, 9, 9, 3, 4]
    pixels = torch.zeros(2, 3, 16, 16)
    holder.model(input_ids=torch.tensor([row, row]), pixel_values=pixels)  # one image each: passes
    short = [1, 2, 9, 9, 9, 3, 4, 4]
    with pytest.raises(
        ShapeContractError, match=r"example 1: .*expected 4 tokens for image 1 \(mm_tokens_per_image=4\), got 3"
    ):
        holder.model(input_ids=torch.tensor([row, short]), pixel_values=pixels)
    with pytest.raises(ShapeContractError, match=r"expected shape \[images, 3, 16, 16\].*got \[2, 3, 16, 12\]"):
        holder.model(input_ids=torch.tensor([row, row]), pixel_values=pixels[..., :12])


def test_mllama_row_counts_one_token_per_image():
    pytest.importorskip("transformers.models.mllama")
    from transformers import MllamaConfig

    config = MllamaConfig(
        text_config=dict(
            vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, cross_attention_layers=[1]
        ),
        vision_config=dict(
            image_size=16,
            patch_size=4,
            hidden_size=16,
            num_hidden_layers=1,
            num_global_layers=1,
            attention_heads=2,
            max_num_tiles=4,
            intermediate_layers_indices=[0],
        ),
        image_token_index=7,
    )
    holder = _Holder(config)
    guard_vision_inputs(holder, max_seq_length=32)
    pixels = torch.zeros(2, 2, 4, 3, 16, 16)
    ids = torch.tensor([[1, 2], [3, 0]])  # example 0: two images; example 1: one (0 pads)
    mask = torch.ones(2, 2, 4, dtype=torch.long)
    inputs = dict(pixel_values=pixels, aspect_ratio_ids=ids, aspect_ratio_mask=mask)
    holder.model(input_ids=torch.tensor([[7, 7, 1, 2], [7, 1, 2, 3]]), **inputs)
    with pytest.raises(ShapeContractError, match=r"example 1: expected 1 <\|image\|> tokens .*got 2"):
        holder.model(input_ids=torch.tensor([[7, 7, 1, 2], [7, 7, 2, 3]]), **inputs)
    with pytest.raises(ShapeContractError, match=r"aspect_ratio_ids: expected shape \[2, 2\].*got \[2, 1\]"):
        holder.model(input_ids=torch.tensor([[7, 7, 1, 2], [7, 1, 2, 3]]), **dict(inputs, aspect_ratio_ids=ids[:, :1]))


def test_every_row_names_its_placeholder():
    assert {"qwen2_5_vl", "qwen3_vl", "gemma3", "mllama"} <= set(VISION_RULES)
    assert VISION_RULES["qwen2_5_vl"].in_order and not VISION_RULES["mllama"].in_order


def test_a_batch_without_images_costs_no_check(model, batch):
    text_only = {key: batch[key] for key in ("input_ids", "attention_mask")}
    with torch.no_grad():
        assert model(**text_only).logits.shape[:2] == tuple(batch["input_ids"].shape)


def _takes_type_ids(model) -> bool:
    import inspect

    return "mm_token_type_ids" in inspect.signature(model.model.forward).parameters


def test_images_without_mm_token_type_ids_are_refused_where_the_model_reads_them(model, batch):
    if not _takes_type_ids(model):
        pytest.skip("this transformers' Qwen2.5-VL builds M-RoPE positions from input_ids (no mm_token_type_ids)")
    without = {key: value for key, value in batch.items() if key != "mm_token_type_ids"}
    _refused(model, without, "expected mm_token_type_ids of shape", "got None", "text positions")
    types = batch["mm_token_type_ids"].clone()
    start, _ = _image_span(batch, 1)
    types[1, start] = 0
    _refused(
        model, dict(batch, mm_token_type_ids=types), "example 1", f"its {TOKENS} <|image_pad|> tokens", f"{TOKENS - 1}"
    )
