"""Files and folders fastft writes get the permissions the user's umask gives (0644 / 0755 under umask 022),
atomic writes through 0600 / 0700 temporary files included."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

import pytest
from conftest import lora_model

from fastft import FastModel
from fastft.export.file_modes import as_if_created, current_umask


@pytest.fixture
def umask():
    def set_mask(mask: int) -> int:
        os.umask(mask)
        return mask

    previous = os.umask(0o022)
    yield set_mask
    os.umask(previous)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_temporary_files_and_folders_take_the_umask(umask, tmp_path):
    umask(0o027)
    assert current_umask() == 0o027
    descriptor, name = tempfile.mkstemp(dir=tmp_path)
    os.close(descriptor)
    folder = Path(tempfile.mkdtemp(dir=tmp_path))
    (folder / "inner").mkdir(mode=0o700)
    (folder / "inner" / "weights.bin").write_bytes(b"x")
    os.chmod(folder / "inner" / "weights.bin", 0o600)
    assert _mode(Path(name)) == 0o600 and _mode(folder) == 0o700
    as_if_created(name)
    as_if_created(folder, recursive=True)
    assert _mode(Path(name)) == 0o640
    assert _mode(folder) == _mode(folder / "inner") == 0o750
    assert _mode(folder / "inner" / "weights.bin") == 0o640


def test_merged_folder_and_gguf_are_readable_by_others(umask, tiny_llama_dir, tmp_path):
    model, tokenizer = lora_model(tiny_llama_dir, use_gradient_checkpointing=False)
    FastModel.for_inference(model)
    merged = FastModel.save_merged(model, tokenizer, tmp_path / "merged", dtype="float32")
    gguf_file = FastModel.save_gguf(model, tokenizer, tmp_path / "tiny.gguf", quantization="f32")
    assert _mode(Path(merged)) == 0o755
    files = [path for path in Path(merged).rglob("*") if path.is_file()]
    assert any(path.suffix == ".safetensors" for path in files)
    assert {path.name: _mode(path) for path in files} == {path.name: 0o644 for path in files}
    assert _mode(Path(gguf_file)) == 0o644
