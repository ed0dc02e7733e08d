"""fastft bench's vision-language workloads (issue 33, point 7): the image + text batch every system gets, the
workload lists, and a quick run of a tiny Qwen2.5-VL through stock transformers + peft and fastft."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from fastft.bench import worker
from fastft.bench.workloads import MODEL_SHAPES, VLM_TARGET_PATTERN, is_vlm, lora_targets, select_workloads

vlm_inputs = worker._load("vlm_inputs")


def _config(patch: int = 14, merge: int = 2) -> SimpleNamespace:
    vision = SimpleNamespace(patch_size=patch, spatial_merge_size=merge, temporal_patch_size=2, in_channels=3)
    return SimpleNamespace(
        vision_config=vision,
        image_token_id=151655,
        vision_start_token_id=151652,
        vision_end_token_id=151653,
        video_token_id=151656,
    )


@pytest.mark.parametrize("five", [False, True])
def test_batch_is_the_processors_layout(five: bool) -> None:
    config = _config()
    inputs = vlm_inputs.batch(config, 3, 320, [224, 224], "cpu", five)
    ids, labels = inputs["input_ids"], inputs["labels"]
    # 224 px = 16 patches of 14 a side; merged 2 x 2: 64 image tokens per example, between its two markers.
    assert ids.shape == labels.shape == (3, 320)
    assert ((ids == config.image_token_id).sum(dim=1) == 64).all()
    assert (ids[:, vlm_inputs.PREFIX] == config.vision_start_token_id).all()
    assert (ids[:, vlm_inputs.PREFIX + 65] == config.vision_end_token_id).all()
    assert inputs["pixel_values"].shape == (3 * 16 * 16, 3 * 2 * 14 * 14)
    assert inputs["image_grid_thw"].tolist() == [[1, 16, 16]] * 3
    # Labels never fall on the image block, and are the ids everywhere else; no random text id is a special one.
    block = torch.zeros_like(ids, dtype=torch.bool)
    block[:, vlm_inputs.PREFIX : vlm_inputs.PREFIX + 66] = True
    assert (labels[block] == -100).all() and torch.equal(labels[~block], ids[~block])
    assert (ids[~block] < config.vision_start_token_id).all()
    assert ("mm_token_type_ids" in inputs) is five
    if five:
        assert torch.equal(inputs["mm_token_type_ids"].bool(), ids == config.image_token_id)
    # Seeded: the same batch in every process and system.
    again = vlm_inputs.batch(config, 3, 320, [224, 224], "cpu", five)
    assert all(torch.equal(inputs[key], again[key]) for key in inputs)


def test_batch_refuses_what_cannot_hold_the_image() -> None:
    with pytest.raises(ValueError, match=r"224 x 200 image is not a whole number of merged patches of 28 px"):
        vlm_inputs.batch(_config(), 1, 320, [224, 200], "cpu", True)
    with pytest.raises(ValueError, match=r"64 image tokens.*at least 75"):
        vlm_inputs.batch(_config(), 1, 74, [224, 224], "cpu", True)


def test_vlm_workloads_are_listed_and_named_only_on_cpu() -> None:
    assert "qwen2.5-vl-7b-bf16-4x1280" in [w.name for w in select_workloads("cuda", False, None)]
    assert not any(is_vlm(w.model) for w in select_workloads("cpu", False, None))
    (cpu,) = select_workloads("cpu", False, ["qwen2.5-vl-3b-2l-fp32-1x320"])
    assert lora_targets(cpu.model) == {
        "target_modules": VLM_TARGET_PATTERN,
        "target_parameters": [],
        "image_size": [224, 224],
    }
    # The 7B workload: 256 image tokens and 1,024 text tokens per example.
    shape = MODEL_SHAPES["qwen2.5-vl-7b"]
    config = _config(shape["vision_config"].get("patch_size", 14))
    assert vlm_inputs.image_tokens(config, *shape["image_size"])[2] == 256


def test_quick_vlm_run_gives_every_system_the_same_adapters_and_loss(tmp_path) -> None:
    command = [sys.executable, "-m", "fastft.cli", "bench", "--quick", "--device", "cpu", "--rounds", "1", "--steps"]
    command += ["1", "--workloads", "tiny-vlm-fp32-2x48", "--systems", "transformers+peft", "fastft"]
    command += ["--output-dir", str(tmp_path), "--no-plot", "--readme", str(tmp_path / "README.md")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    record = json.loads((tmp_path / "bench-cpu-quick.json").read_text())
    runs = {run["system"]: run for run in record["runs"]}
    layers = MODEL_SHAPES["tiny-vlm"]["text_config"]["num_hidden_layers"]
    # Seven projections per language-model layer, none in the vision tower, in both systems.
    assert runs["transformers+peft"]["adapters"] == runs["fastft"]["adapters"] == 7 * layers
    for row in record["summary"]:
        assert row["same_inputs"] and row["same_lora"] and row["loss_agrees"]
    assert runs["fastft"]["loss"] == pytest.approx(runs["transformers+peft"]["loss"], rel=1e-5)
    # The stock loss keeps the 151,936-wide logits for backward; fastft's fused loss does not.
    assert runs["fastft"]["saved_bytes"] < 0.1 * runs["transformers+peft"]["saved_bytes"]
    assert "fastft_patches" in runs["fastft"] and runs["fastft"]["fastft_patches"]


def test_committed_cpu_memory_table_is_its_json() -> None:
    """bench/README.md's vision-language memory rows, rebuilt from bench/results/vlm-cpu/bench-cpu.json."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    record = json.loads((root / "bench" / "results" / "vlm-cpu" / "bench-cpu.json").read_text())
    readme = (root / "bench" / "README.md").read_text()
    rows = {row["system"]: row for row in record["summary"]}
    names = {
        "transformers+peft": "transformers + peft",
        "fastft": "fastft",
        "transformers+peft+gc": "transformers + peft + gc",
        "fastft+offload": 'fastft `"offload"`',
    }
    bases = {"transformers+peft": "transformers+peft", "fastft": "transformers+peft"}
    for system, label in names.items():
        row = rows[system]
        ratio = f"{row['saved_bytes'] / rows[bases.get(system, 'transformers+peft+gc')]['saved_bytes']:.3f}"
        cells = f"{ratio} | |" if system in bases else f"| {ratio} |"
        line = f"| {label} | {row['saved_bytes'] / 1e6:.1f} | {cells} {row['peak_rss_bytes'] / 1e6:.0f} |"
        assert line in readme, line
        assert row["adapters"] == 14 and row["loss_agrees"]
