"""Qwen2.5-VL end to end through fastft: TRL's SFTTrainer trains a tiny random model on image + text batches, the
trained adapter generates with an image token for token as transformers + peft does, and the merged model saved by
``FastModel.save_merged`` reloads in stock ``AutoModelForImageTextToText`` with fastft's logits and generation.

The batches are made by hand as Qwen2.5-VL's processor makes them (``<|image_pad|>`` expanded to the image's merged
patch count, pixel values and grid from the image processor): the processor itself needs torchvision, which this
torch has no wheel for."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import randomize_lora_b, relative_error
from vlm_tiny import MERGE, PATCH, SPECIAL, image, image_batch, save_tiny_vlm, tiny_image_processor

from fastft import FastModel

pytestmark = [
    pytest.mark.lane,
    pytest.mark.filterwarnings("ignore:.*must be `None` or an integer within the vocabulary"),
    pytest.mark.filterwarnings("ignore:fastft.from_pretrained.*processor could not be built"),
]
qwen2_5_vl = pytest.importorskip(
    "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl", reason="this transformers has no Qwen2.5-VL"
)
STEPS = 3
WORDS = ("the cat in a hat", "a tin hat", "the hat in the tin", "a cat", "the tin cat in a hat", "in the hat")


def _five() -> bool:
    import transformers
    from packaging.version import Version

    return Version(transformers.__version__) >= Version("5")


def _examples(tokenizer, count: int) -> list[dict]:
    """``count`` examples, one image each, tokenized as the processor would (placeholder expanded)."""
    processor = tiny_image_processor()
    rows = []
    for index in range(count):
        pixels = processor(images=[image(10 + index)], return_tensors="pt")
        grid = pixels["image_grid_thw"][0]
        pads = "<|image_pad|>" * int(grid.prod() // MERGE**2)
        text = f"<|im_start|>user\n<|vision_start|>{pads}<|vision_end|>{WORDS[index % len(WORDS)]}<|im_end|>\n"
        rows.append(
            {
                "input_ids": tokenizer(text)["input_ids"],
                "pixel_values": pixels["pixel_values"].tolist(),
                "image_grid_thw": grid.tolist(),
            }
        )
    return rows


class _ImageCollator:
    """Right-padded input_ids, labels on the text only, every example's pixel rows and grid in example order."""

    def __init__(self, tokenizer) -> None:
        self.pad = tokenizer.pad_token_id
        self.special = torch.tensor([tokenizer.convert_tokens_to_ids(token) for token in SPECIAL])
        self.image = tokenizer.convert_tokens_to_ids("<|image_pad|>")

    def __call__(self, examples: list[dict]) -> dict[str, torch.Tensor]:
        longest = max(len(example["input_ids"]) for example in examples)
        ids = torch.full((len(examples), longest), self.pad)
        mask = torch.zeros_like(ids)
        for row, example in enumerate(examples):
            ids[row, : len(example["input_ids"])] = torch.tensor(example["input_ids"])
            mask[row, : len(example["input_ids"])] = 1
        labels = ids.masked_fill(torch.isin(ids, self.special) | (mask == 0), -100)
        batch = {
            "input_ids": ids,
            "attention_mask": mask,
            "labels": labels,
            "pixel_values": torch.cat([torch.tensor(example["pixel_values"]) for example in examples]),
            "image_grid_thw": torch.tensor([example["image_grid_thw"] for example in examples]),
        }
        if _five():
            batch["mm_token_type_ids"] = (ids == self.image).int()
        return batch


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    return save_tiny_vlm(tmp_path_factory.mktemp("qwen2_5_vl"))


@pytest.fixture(scope="module")
def trained(vlm_dir, tmp_path_factory):
    """The tiny VLM with LoRA on the language model and the vision tower, after STEPS of SFTTrainer on images."""
    from datasets import Dataset
    from trl import SFTTrainer

    from fastft.training.trl import sft_config

    model, processing = FastModel.from_pretrained(str(vlm_dir), max_seq_length=64, dtype=torch.float32)
    # The processor where this transformers builds one, else the tokenizer (with a warning); the batches here are
    # made by hand either way.
    tokenizer = getattr(processing, "tokenizer", processing)
    model = FastModel.get_peft_model(model, r=4, lora_alpha=8, finetune_vision_layers=True)
    randomize_lora_b(model, std=0.1)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    visual = model.get_base_model().model.visual
    images_seen = []
    handle = visual.register_forward_hook(lambda module, args, output: images_seen.append(args[0].shape[0]))
    out = tmp_path_factory.mktemp("sft")
    args = sft_config(
        str(out),
        torch.float32,
        64,
        max_steps=STEPS,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        remove_unused_columns=False,
        dataset_kwargs={"skip_prepare_dataset": True},
        report_to=[],
    )
    trainer = SFTTrainer(
        model=model,
        processing_class=tokenizer,
        train_dataset=Dataset.from_list(_examples(tokenizer, 2 * STEPS)),
        data_collator=_ImageCollator(tokenizer),
        args=args,
    )
    # The kernels' own parity is the family tests' business; here the torch reference path keeps the run short.
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FASTFT_DISABLE_TRITON", "1")
        result = trainer.train()
    handle.remove()
    return {
        "model": model,
        "processing": processing,
        "tokenizer": tokenizer,
        "result": result,
        "before": before,
        "images": images_seen,
    }


def test_sft_trainer_trains_on_image_batches(trained):
    model, result = trained["model"], trained["result"]
    assert result.global_step == STEPS and torch.isfinite(torch.tensor(result.training_loss))
    # Every step's batch went through the vision tower: two images of 24 patch rows each.
    assert trained["images"] == [48] * STEPS
    changed = {
        n for n, p in model.named_parameters() if p.requires_grad and not torch.equal(p.detach(), trained["before"][n])
    }
    assert any(".visual." in n for n in changed) and any(".language_model." in n for n in changed)
    # trl >= 1.15 scores through its own fused LM head, which fastft answers with its fused log-prob kernel; older
    # trl calls the model's forward, whose loss is fastft's fused cross-entropy. One of them ran every step.
    head = model.get_base_model()
    assert head.fastft_fused_loss_calls + head.fastft_fused_logprob_calls >= STEPS


def _prompt(vlm_dir) -> dict[str, torch.Tensor]:
    """Two left-padded prompts with an image each, without labels (generation's input)."""
    from transformers import AutoTokenizer

    batch = image_batch(AutoTokenizer.from_pretrained(vlm_dir), tiny_image_processor())
    return {key: value for key, value in batch.items() if key != "labels"}


def _greedy(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(**inputs, max_new_tokens=8, do_sample=False, pad_token_id=0)


def test_trained_adapter_generates_with_an_image_as_stock_peft(trained, vlm_dir, tmp_path):
    from peft import PeftModel

    model = trained["model"]
    model.save_pretrained(tmp_path / "adapter")
    stock = PeftModel.from_pretrained(
        qwen2_5_vl.Qwen2_5_VLForConditionalGeneration.from_pretrained(str(vlm_dir)), str(tmp_path / "adapter")
    ).eval()
    FastModel.for_inference(model)
    inputs = _prompt(vlm_dir)
    try:
        ours, theirs = _greedy(model, inputs), _greedy(stock, inputs)
    finally:
        FastModel.for_training(model)
    assert ours.shape[1] == inputs["input_ids"].shape[1] + 8
    assert torch.equal(ours, theirs)


def _logits(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).logits.float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_merged_save_reloads_in_stock_transformers(trained, vlm_dir, tmp_path, dtype):
    from safetensors import safe_open

    image_text_to_text = getattr(__import__("transformers"), "AutoModelForImageTextToText", None)
    if image_text_to_text is None:
        pytest.skip("this transformers has no AutoModelForImageTextToText")
    model = trained["model"]
    folder = FastModel.save_merged(model, trained["processing"], tmp_path / "merged", dtype=dtype)
    # The architecture and tensor names transformers' own save_pretrained writes for this model in this version
    # (the hub's model.layers.* / visual.* on 4.x and 5.24; 4.57 keeps architectures in text_config only).
    reference = tmp_path / "stock"
    qwen2_5_vl.Qwen2_5_VLForConditionalGeneration.from_pretrained(str(vlm_dir)).save_pretrained(reference)
    config, stock_config = (json.loads((where / "config.json").read_text()) for where in (folder, reference))
    assert _architectures(config) == _architectures(stock_config) == ["Qwen2_5_VLForConditionalGeneration"]
    assert "quantization_config" not in config
    # The saved dtype, at the top and in the text and vision configs that name one.
    saved = str(dtype).removeprefix("torch.")
    assert _dtype_of(config) == saved
    assert {_dtype_of(config.get(part) or {}) for part in ("text_config", "vision_config")} <= {saved, None}
    with safe_open(str(folder / "model.safetensors"), "pt") as weights:
        names = set(weights.keys())
        assert {weights.get_tensor(name).dtype for name in names} == {dtype}
    with safe_open(str(reference / "model.safetensors"), "pt") as weights:
        assert names == set(weights.keys())
    # The image processor's config is there, written by the processor or, where only the tokenizer came back,
    # copied from the checkpoint (read as a file: 5.x's AutoImageProcessor wants torchvision for its default backend).
    assert json.loads((folder / "preprocessor_config.json").read_text())["patch_size"] == PATCH
    stock = image_text_to_text.from_pretrained(folder, **{_dtype_kwarg(): torch.float32}).eval()
    assert type(stock) is qwen2_5_vl.Qwen2_5_VLForConditionalGeneration
    inputs = _prompt(vlm_dir)
    FastModel.for_inference(model)
    try:
        ours = _logits(model, inputs)
        generated = _greedy(model, inputs)
    finally:
        FastModel.for_training(model)
    theirs = _logits(stock, inputs)
    # float32 holds the merged weights exactly; float16 rounds each weight to 11 significant bits.
    assert relative_error(theirs, ours) <= (1e-5 if dtype == torch.float32 else 5e-3)
    if dtype == torch.float32:
        assert torch.equal(_greedy(stock, inputs), generated)


def _dtype_of(config: dict) -> str | None:
    return config.get("dtype") or config.get("torch_dtype")


def _architectures(config: dict) -> list[str] | None:
    return config.get("architectures") or config.get("text_config", {}).get("architectures")


def _dtype_kwarg() -> str:
    from fastft.loading.dtypes import _DTYPE_KWARG

    return _DTYPE_KWARG


def test_gguf_export_of_the_trained_vlm_writes_the_language_model_and_its_mmproj(trained, tmp_path):
    import gguf

    model, tokenizer = trained["model"], trained["tokenizer"]
    files = FastModel.save_gguf(model, tokenizer, tmp_path / "model.gguf")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["mmproj-model-f16.gguf", "model.gguf"]
    assert gguf.GGUFReader(files.model).fields["general.architecture"].contents() == "qwen2vl"
    assert gguf.GGUFReader(files.mmproj).fields["clip.projector_type"].contents() == "qwen2.5vl_merger"


def test_merged_save_of_a_4bit_qlora_vlm_reloads_in_stock_transformers(vlm_dir, tmp_path):
    pytest.importorskip("bitsandbytes")
    image_text_to_text = getattr(__import__("transformers"), "AutoModelForImageTextToText", None)
    if image_text_to_text is None:
        pytest.skip("this transformers has no AutoModelForImageTextToText")
    model, processing = FastModel.from_pretrained(
        str(vlm_dir), max_seq_length=64, dtype=torch.float32, load_in_4bit=True
    )
    model = FastModel.get_peft_model(model, r=4, lora_alpha=8, finetune_vision_layers=True)
    randomize_lora_b(model, std=0.1)
    FastModel.for_inference(model)
    inputs = _prompt(vlm_dir)
    ours = _logits(model, inputs)
    # The language model's NF4 weights dequantised, the 16-bit vision tower as it was, every adapter merged.
    # Given the tokenizer alone, the merged folder still gets the checkpoint's image processor config.
    tokenizer = getattr(processing, "tokenizer", processing)
    folder = FastModel.save_merged(model, tokenizer, tmp_path / "merged", dtype=torch.float32)
    assert "quantization_config" not in json.loads((folder / "config.json").read_text())
    preprocessor = "preprocessor_config.json"
    assert (folder / preprocessor).read_text() == (vlm_dir / preprocessor).read_text()
    stock = image_text_to_text.from_pretrained(folder, **{_dtype_kwarg(): torch.float32}).eval()
    assert relative_error(_logits(stock, inputs), ours) <= 1e-5
