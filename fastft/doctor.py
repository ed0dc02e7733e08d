"""``fastft doctor``: what fastft sees on this machine, and what it would patch."""

from __future__ import annotations

import contextlib
import os
import warnings

import torch

import fastft.patches  # noqa: F401  (registers the built-in patches)
from fastft.registry import STRICT_ENV, apply_patches, format_report, patch_report, records, strict_mode
from fastft.training.train import device_name, versions


def tiny_llama() -> torch.nn.Module:
    """A two-layer random Llama with GQA (4 heads, 2 kv heads), built without downloads."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    return LlamaForCausalLM(config)


def _with_lora(model: torch.nn.Module) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    return get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=targets))


def _train_step(model: torch.nn.Module) -> str:
    """One forward and backward with labels, on the GPU in its training dtype if there is one; the device's name."""
    from fastft.loading.dtypes import resolve_dtype

    if torch.cuda.is_available():
        model.to(device="cuda", dtype=resolve_dtype(None))
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.data = parameter.data.float()
    device = next(model.parameters()).device
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0)).to(device)
    model.train()
    autocast = torch.autocast("cuda", dtype=resolve_dtype(None)) if device.type == "cuda" else contextlib.nullcontext()
    with autocast:
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return device_name() if device.type == "cuda" else "cpu"


def kernel_path() -> str:
    """Which implementation fastft's kernels take on this machine's default device, and why."""
    from fastft.kernels import dispatch

    probe = torch.empty(0, device="cuda" if torch.cuda.is_available() else "cpu")
    if dispatch.use_triton(probe):
        return "triton interpreter (TRITON_INTERPRET=1; slow, for checking)" if not probe.is_cuda else "triton"
    if not dispatch.HAS_TRITON:
        return "torch reference (triton is not installed: pip install 'fastft[cuda]' on a GPU machine)"
    if os.environ.get("FASTFT_DISABLE_TRITON", "0") == "1":
        return "torch reference (FASTFT_DISABLE_TRITON=1)"
    return "torch reference (no CUDA device)"


def report() -> str:
    """The doctor's report as text: versions, device, and the patch report of a tiny Llama."""
    lines = ["fastft doctor", ""]
    for name, version in versions().items():
        lines.append(f"  {name:<13} {version or 'not installed'}")
    lines += ["", f"  device        {device_name()}"]
    if torch.cuda.is_available():
        from fastft.kernels import targets

        capability = targets.capability(0)
        # is_bf16_supported() says yes on a T4 (it emulates bf16); tensor cores for bf16 start at 8.0.
        bf16 = "yes" if capability >= 80 else "no (emulated only below compute capability 8.0: fp16 is used)"
        lines.append(f"  capability    sm_{capability}, bf16 {bf16}")
    lines.append(f"  TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '0')}")
    lines.append(f"  kernels       {kernel_path()}")
    lines += ["", "patch report (tiny Llama, 4 heads / 2 kv heads, LoRA r=8 on the seven projections):"]
    with warnings.catch_warnings():
        # A skip is shown in the report itself, with its reason; under FASTFT_STRICT=1 the doctor still reports.
        warnings.simplefilter("ignore", UserWarning)
        model = tiny_llama()
        apply_patches(model, strict=False)
        # With LoRA, as a user trains: a bare model's trainable base weights would send every layer to the stock path.
        model = _with_lora(model)
        # One step, so that every fused group has chosen its GEMM (tuned on first use on a GPU) for the report.
        device = _train_step(model)
        rows = patch_report(model)
    lines.append(format_report(rows))
    lines.append(f"  (GEMM paths from one LoRA forward and backward of the tiny Llama on {device})")
    lines += ["", "registered patches and the versions each record was tested against:"]
    for name, group in records().items():
        for record in group:
            lines.append(f"  {name:<22} {record.tested()}")
    if strict_mode():
        skipped = any(row["status"] == "skipped" for row in rows)
        outcome = "loading a Llama here raises PatchSkippedError" if skipped else "no patch is skipped here"
        lines.append(f"  {STRICT_ENV}={os.environ[STRICT_ENV]}: a skipped patch is an error; {outcome}")
    return "\n".join(lines)
