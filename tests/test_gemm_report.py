"""patch_report and fastft doctor name the GEMM each fused LoRA group ran (cuBLAS or Triton) and why."""

from __future__ import annotations

import pytest
import torch

from fastft.kernels import gemm_tuner


@pytest.fixture(autouse=True)
def _fresh_choices(monkeypatch):
    monkeypatch.delenv(gemm_tuner.GEMM_ENV, raising=False)
    gemm_tuner.reset()
    yield
    gemm_tuner.reset()


def test_patch_report_and_doctor_show_the_gemm_path_per_group(tiny_llama_dir):
    from fastft import FastModel, patch_report
    from fastft.doctor import report

    text = report()
    for group in ("qkv", "o", "gate_up", "down"):
        assert f"    GEMM {group}: torch matmul (the torch reference path: CPU tensors)" in text
    assert "GEMM paths from one LoRA forward and backward of the tiny Llama on cpu" in text

    gemm_tuner.reset()
    model, _ = FastModel.from_pretrained(tiny_llama_dir)
    model = FastModel.get_peft_model(model, r=4, lora_alpha=8, use_gradient_checkpointing=False)
    rows = {row["name"]: row for row in patch_report(model)}
    assert set(rows["llama.attention"]["gemm"]) == {"qkv", "o"}
    assert rows["llama.mlp"]["gemm"]["down"].startswith("not run yet; torch matmul")
    model(input_ids=torch.tensor([[1, 2, 3]])).logits.sum().backward()
    rows = {row["name"]: row for row in patch_report(model)}
    assert rows["llama.mlp"]["gemm"] == {
        "gate_up": "torch matmul (the torch reference path: CPU tensors)",
        "down": "torch matmul (the torch reference path: CPU tensors)",
    }
    assert rows["llama.rms_norm"]["gemm"] == {}
