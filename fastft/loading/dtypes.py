"""The compute dtype a model loads and trains in, and its 4-bit (bitsandbytes NF4) quantisation config."""

from __future__ import annotations

import warnings
from typing import Any

import torch
import transformers
from packaging.version import Version

from fastft.kernels.targets import capability

# The classifier heads transformers' sequence-classification models name: trained whole (peft's modules_to_save),
# so never quantised.
_CLASSIFIER_HEADS = ["score", "classifier"]

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}
# The name merged_save and older code import.
_DTYPES = DTYPES
# transformers < 4.56 names the load dtype torch_dtype; 4.56 added dtype and 5.x warns on torch_dtype.
_DTYPE_KWARG = "dtype" if Version(transformers.__version__).release >= (4, 56) else "torch_dtype"
# bf16 tensor cores start with Ampere. torch.cuda.is_bf16_supported() cannot decide this: it also counts emulation
# and so says True on a T4, where bf16 matmuls run several times slower than fp16.
_BF16_TENSOR_CORES = 80


def _dtype_refusal(dtype: Any, caller: str) -> ValueError:
    name = str(dtype).removeprefix("torch.").lower()
    why = ""
    if "64" in name or name == "double":
        why = (
            " float64 is not a training dtype here: the kernels, bitsandbytes and the trainers compute in 32 bits at "
            "most."
        )
    elif "8" in name:
        why = (
            " 8-bit compute (fp8, int8) is not supported; to save memory, load the base in 4-bit (load_in_4bit=True), "
            "which computes in the dtype you pass."
        )
    return ValueError(
        f"{caller}: dtype={dtype!r} is not one of {sorted(DTYPES)}, torch.bfloat16, torch.float16, torch.float32 or "
        f"None.{why} Pass dtype='bf16' (GPUs of compute capability 8.0 and newer), 'fp16' (older GPUs) or 'fp32' "
        "(CPU), or dtype=None to pick automatically."
    )


def resolve_dtype(dtype: torch.dtype | str | None, caller: str = "fastft") -> torch.dtype:
    """Pick the compute dtype.

    GPUs below compute capability 8.0 (T4, V100, RTX 20xx) have no bf16 tensor cores, so they train in fp16: that
    is the automatic choice there, and an explicit bf16 becomes fp16 with a warning. The decision is made on the compute
    capability, never on ``torch.cuda.is_bf16_supported()``, which also counts emulation and says True on a T4.

    Args:
        dtype: A torch dtype, a name such as ``"bf16"`` or ``"float16"``, or ``None`` for automatic: bf16 on GPUs of
            compute capability 8.0 and newer, fp16 on older GPUs, float32 on CPU.
        caller: What the error message names as the entry point (e.g. ``"fastft.from_pretrained"``).

    Returns:
        The torch dtype.

    Raises:
        ValueError: An unknown dtype name, or a dtype that is not a float type; the message lists the accepted ones.
    """
    if dtype is None:
        if torch.cuda.is_available():
            return torch.bfloat16 if capability() >= _BF16_TENSOR_CORES else torch.float16
        return torch.float32
    if isinstance(dtype, str):
        if dtype.lower() not in DTYPES:
            raise _dtype_refusal(dtype, caller)
        resolved = DTYPES[dtype.lower()]
    elif dtype in (torch.float32, torch.float16, torch.bfloat16):
        resolved = dtype
    else:
        raise _dtype_refusal(dtype, caller)
    if resolved == torch.bfloat16 and torch.cuda.is_available():
        cc = capability()
        if cc < _BF16_TENSOR_CORES:
            warnings.warn(
                f"fastft: dtype={dtype!r} asks for bf16, but {torch.cuda.get_device_name()} (compute capability "
                f"{cc // 10}.{cc % 10}) has no bf16 tensor cores: they start at compute capability 8.0 (A100, A10, L4, "
                "RTX 30xx), and below it bf16 runs emulated, several times slower. Using fp16 instead: the model "
                "computes in fp16, fastft.trl.sft_config and `fastft train` train with fp16 autocast and a gradient "
                "scaler, and the LoRA adapters stay in fp32. Pass dtype=None or 'fp16' to choose this without the "
                "warning.",
                UserWarning,
                stacklevel=2,
            )
            return torch.float16
    return resolved


def quantization_config(dtype: torch.dtype, task: str = "causal-lm", skip_modules: list[str] | None = None) -> Any:
    """bitsandbytes NF4 with double quantisation computing in ``dtype``; ``skip_modules`` (or a classifier's head)
    stay unquantised."""
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as error:
        raise ImportError(
            "fastft: load_in_4bit=True needs bitsandbytes. Install it with: pip install 'fastft[cuda]' "
            "(or pip install bitsandbytes)."
        ) from error
    from transformers import BitsAndBytesConfig

    if skip_modules is None and task == "sequence-classification":
        skip_modules = list(_CLASSIFIER_HEADS)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=dtype,
        **({"llm_int8_skip_modules": skip_modules} if skip_modules is not None else {}),
    )


def guard_bnb_cpu_repack(model: torch.nn.Module, dtype: torch.dtype) -> None:
    # On CPUs with AVX512-BF16, bitsandbytes' Linear4bit repacks its weight in place on the first no-grad eval
    # forward and from then on computes in bf16, whatever the compute dtype; the repack also asserts
    # out_features % 32 == 0 and in_features % blocksize == 0. Keep the generic path (the requested dtype,
    # any shape) unless the user asked for bf16 and the layer fits the kernel.
    for module in model.modules():
        if type(module).__name__ != "Linear4bit":
            continue
        blocksize = getattr(getattr(module.weight, "quant_state", None), "blocksize", 64)
        if dtype != torch.bfloat16 or module.out_features % 32 or module.in_features % blocksize:
            module.support_avx512bf16_for_cpu = False
