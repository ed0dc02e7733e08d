"""An adapter of the embedded model names its base by the hub id users know, its model card names that base, fastft
loads it back without the hub (the id maps to the embedded copy it was trained on), and plain peft + transformers
load it wherever that base is in the Hugging Face cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from fastft.loading.base_names import EMBEDDED_HUB_IDS, embedded_alias, public_base_name

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

    # On a machine without fastft, where the base is in the Hugging Face cache (a cache built here from the embedded
    # weights, read offline), plain peft + transformers load the adapter by its base's hub id.
    from safetensors.torch import load_file

    from fastft.loading.embedded import materialise_gguf, resolve_alias

    revision = "0" * 40
    repo = tmp_path / "hub" / f"models--{HUB_ID.replace('/', '--')}"
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    # The embedded GGUF as dense safetensors (what the train run above loaded), linked in as the hub cache does.
    for file in materialise_gguf(*resolve_alias("smollm2-135m", None)).iterdir():
        (snapshot / file.name).symlink_to(file)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    plain = (
        "import sys, torch; from peft import AutoPeftModelForCausalLM; "
        "model = AutoPeftModelForCausalLM.from_pretrained(sys.argv[1]); "
        "assert not any(name.split('.')[0] == 'fastft' for name in sys.modules), 'fastft was imported'; "
        "a = model.base_model.model.model.layers[0].self_attn.q_proj.lora_A['default'].weight; "
        "torch.save(a.detach().float(), sys.argv[2]); "
        "print(model(input_ids=torch.tensor([[1, 2, 3]])).logits.shape)"
    )
    saved = tmp_path / "lora_a.pt"
    hub_env = {key: value for key, value in env.items() if key != "FASTFT_DISABLE_TRITON"}
    hub_env["HF_HUB_CACHE"] = str(tmp_path / "hub")
    loaded = subprocess.run(
        [sys.executable, "-c", plain, str(output), str(saved)],
        capture_output=True,
        text=True,
        env=hub_env,
        cwd=tmp_path,
        timeout=900,
    )
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    assert "torch.Size([1, 3, 49152])" in loaded.stdout, loaded.stdout
    weights = load_file(output / "adapter_model.safetensors")
    key = next(name for name in weights if "layers.0.self_attn.q_proj.lora_A" in name)
    assert torch.equal(torch.load(saved), weights[key].float())
