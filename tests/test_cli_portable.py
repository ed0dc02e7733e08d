"""An adapter of the embedded model names its base by the hub id users know, its model card names that base, and
fastft loads it back without the hub (the id maps to the embedded copy it was trained on)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from fastft.base_names import EMBEDDED_HUB_IDS, embedded_alias, public_base_name

HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_embedded_alias_and_hub_id_map_both_ways():
    assert public_base_name("smollm2-135m") == HUB_ID == EMBEDDED_HUB_IDS["smollm2-135m"]
    assert public_base_name("./my-model") is None
    assert embedded_alias(HUB_ID) == "smollm2-135m"
    assert embedded_alias("HuggingFaceTB/SmolLM2-360M-Instruct") is None


def test_an_embedded_model_adapter_names_the_hub_id_and_reloads_offline(tmp_path):
    data = tmp_path / "two.jsonl"
    data.write_text("".join(json.dumps({"text": f"example {i} of a tiny set"}) + "\n" for i in range(2)))
    output = tmp_path / "run"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "FASTFT_DISABLE_TRITON": "1"}
    env.update(TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "fastft.cli", "train", "--output", str(output), "--data", str(data)]
    command += ["--max-steps", "1", "--seq-len", "32", "--batch-size", "2", "--r", "4", "--lora-alpha", "4"]
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]

    config = json.loads((output / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == HUB_ID
    card = (output / "README.md").read_text()
    assert f"base_model: {HUB_ID}" in card and f"LoRA adapter for [{HUB_ID}](https://huggingface.co/{HUB_ID})" in card
    assert "None" not in card and "AutoPeftModelForCausalLM.from_pretrained" in card

    # Offline, the hub id resolves to the embedded copy: the adapter loads back through fastft.
    load = (
        "import sys; from fastft import FastModel; "
        "model, tokenizer = FastModel.from_pretrained(sys.argv[1]); "
        "print(type(model).__name__, model.peft_config['default'].base_model_name_or_path)"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", load, str(output)], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=900
    )
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    kind, base = loaded.stdout.split()[-2:]
    assert "Peft" in kind and base == HUB_ID, loaded.stdout
