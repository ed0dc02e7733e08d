"""``fastft train`` with a vision-language model: a tiny random Qwen2.5-VL trained on CPU on the shapes demo and on a
JSONL file of image chats, through fastft's collator; the adapter loads in plain peft; data and settings a
vision-language run cannot use are refused before training, by example."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch
from conftest import save_tiny_llama
from vlm_chat import chat_processor, save_chat_vlm

from fastft.cli import main

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*must be `None` or an integer within the vocabulary"),
    pytest.mark.filterwarnings("ignore:fastft.from_pretrained.*processor could not be built"),
]
qwen2_5_vl = pytest.importorskip(
    "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl", reason="this transformers has no Qwen2.5-VL"
)
STEPS = 8


@pytest.fixture(autouse=True)
def _cpu_run(monkeypatch, tmp_path):
    # The reference kernels (the Triton interpreter would take minutes a step; the kernels are checked elsewhere), and
    # the demo drawn into this test's own cache.
    monkeypatch.setenv("FASTFT_DISABLE_TRITON", "1")
    monkeypatch.setenv("FASTFT_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    return save_chat_vlm(tmp_path_factory.mktemp("chat-vlm"))


def _train(model, output, *extra):
    return main(
        ["train", "--model", str(model), "--output", str(output), "--seq-len", "64", "--r", "4", "--warmup-steps", "0"]
        + list(extra)
    )


def test_train_on_the_demo_learns_and_saves_a_plain_peft_adapter(vlm_dir, tmp_path, capsys, monkeypatch):
    from peft import PeftModel
    from safetensors.torch import load_file

    from fastft.demo.vision import vision_demo_path
    from fastft.training import train
    from fastft.training.vision_data import VisionDataCollator

    trainers = []

    def keep(*args, **kwargs):
        trainers.append(build(*args, **kwargs))
        return trainers[-1]

    build = train._trainer
    monkeypatch.setattr(train, "_trainer", keep)
    output = tmp_path / "run"
    args = ("--max-steps", str(STEPS), "--batch-size", "4", "--lr", "1e-2")
    assert _train(vlm_dir, output, *args) == 0, capsys.readouterr().err
    trainer = trainers[0]
    assert isinstance(trainer.data_collator, VisionDataCollator)
    # trl scored every step through fastft's fused log-prob kernel, the fused decoder layers under it.
    assert trainer.model.get_base_model().fastft_fused_logprob_calls == STEPS
    metrics = json.loads((output / "metrics.json").read_text())
    losses = [row["loss"] for row in metrics["steps"]]
    assert metrics["completed"] and metrics["global_step"] == STEPS and len(losses) == STEPS
    assert all(math.isfinite(loss) for loss in losses)
    assert max(losses) - min(losses) > 1e-3, losses
    assert metrics["loss_fell"], losses
    # The demo was drawn into the cache and is what trained.
    assert vision_demo_path().parent == tmp_path / "cache" / "demo" / "shapes-v1"

    config = json.loads((output / "adapter_config.json").read_text())
    assert "language_model" in config["target_modules"] and "visual" not in config["target_modules"]
    base = qwen2_5_vl.Qwen2_5_VLForConditionalGeneration.from_pretrained(str(vlm_dir))
    plain = PeftModel.from_pretrained(base, str(output)).eval()
    saved = load_file(output / "adapter_model.safetensors")
    loaded = {name: value for name, value in plain.state_dict().items() if "lora_" in name}
    assert len(loaded) == len(saved) > 0
    assert all(torch.equal(loaded[name.replace(".weight", ".default.weight")], value) for name, value in saved.items())
    assert any(value.abs().max() > 0 for name, value in saved.items() if "lora_B" in name)

    rows = [json.loads(line) for line in vision_demo_path().read_text().splitlines()[:2]]
    for row in rows:
        for part in row["messages"][0]["content"]:
            if part["type"] == "image":
                part["image"] = str(vision_demo_path().parent / part["image"])
    batch = VisionDataCollator(chat_processor(vlm_dir))(rows)
    batch.pop("labels")
    with torch.no_grad():
        tuned = plain(**batch).logits
        with plain.disable_adapter():
            untuned = plain(**batch).logits
    assert torch.isfinite(tuned).all() and (tuned - untuned).abs().max() > 1e-4


def _jsonl(folder, rows):
    path = folder / "chats.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _image_rows(folder, count=4):
    from fastft.demo.vision import draw

    (folder / "pictures").mkdir(parents=True)
    rng = random.Random(0)
    rows = []
    for index in range(count):
        draw("circle" if index % 2 else "square", "blue", rng).save(folder / "pictures" / f"{index}.png")
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Which shape?"}]},
                    {
                        "role": "assistant",
                        "content": [{"type": "text", "text": "A circle." if index % 2 else "A square."}],
                    },
                ],
                "images": [f"pictures/{index}.png"],
            }
        )
    return rows


def test_train_on_a_jsonl_of_image_chats_with_relative_paths(vlm_dir, tmp_path, capsys):
    folder = tmp_path / "data"
    folder.mkdir()
    data = _jsonl(folder, _image_rows(folder))
    output = tmp_path / "run"
    # Run from elsewhere: the image paths are read from the data file's folder, not the working directory.
    assert _train(vlm_dir, output, "--data", str(data), "--max-steps", "2", "--batch-size", "2") == 0
    assert capsys.readouterr().out.count("fastft train: 2 steps") == 1
    assert (output / "adapter_model.safetensors").is_file()


def test_a_missing_image_is_named_before_training(vlm_dir, tmp_path, capsys):
    folder = tmp_path / "data"
    folder.mkdir()
    rows = _image_rows(folder)
    rows[1]["images"] = ["pictures/missing.png"]
    data = _jsonl(folder, rows)
    assert _train(vlm_dir, tmp_path / "run", "--data", str(data), "--max-steps", "1") == 2
    error = capsys.readouterr().err
    assert "example 1, image 0: the file" in error and "missing.png' does not exist" in error
    assert not (tmp_path / "run").exists()


def test_an_image_cut_by_seq_len_is_refused_by_example(vlm_dir, tmp_path):
    from fastft import ShapeContractError

    folder = tmp_path / "data"
    folder.mkdir()
    rows = _image_rows(folder, 2)
    rows[1]["messages"][0]["content"].insert(0, {"type": "text", "text": "word " * 40})
    data = _jsonl(folder, rows)
    with pytest.raises(ShapeContractError, match="example 1 is .* tokens and its image tokens run to position"):
        _train(vlm_dir, tmp_path / "run", "--data", str(data), "--max-steps", "1", "--batch-size", "2")


def test_images_for_a_text_model_and_other_methods_are_refused(
    vlm_dir, tmp_path, tmp_path_factory, word_tokenizer, capsys
):
    folder = tmp_path / "data"
    folder.mkdir()
    data = _jsonl(folder, _image_rows(folder, 2))
    text_model = save_tiny_llama(tmp_path_factory, word_tokenizer)
    assert _train(text_model, tmp_path / "text", "--data", str(data), "--max-steps", "1") == 2
    assert "holds images, and --model" in capsys.readouterr().err
    assert _train(vlm_dir, tmp_path / "dpo", "--method", "dpo", "--max-steps", "1") == 2
    assert "--method sft only" in capsys.readouterr().err
    instructions = folder / "instructions.jsonl"
    instructions.write_text(json.dumps({"instruction": "Name a shape.", "response": "A circle."}) + "\n")
    assert _train(vlm_dir, tmp_path / "text-rows", "--data", str(instructions), "--max-steps", "1") == 2
    assert "a vision-language model trains on chats: a 'messages' column" in capsys.readouterr().err
