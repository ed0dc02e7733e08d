"""Time fastft's fused LoRA-QKV (forward + backward) against peft's unfused path and the bare base GEMM; write JSON.

Usage::

    python bench/lora.py                                   # CUDA when present: Llama-3-8B and Llama-3.2-1B q/k/v,
                                                           # 8192 tokens, bf16 and NF4 (bf16 compute)
    python bench/lora.py --device cpu --shapes tiny --tokens 256 --repeats 3   # the harness on CPU (fp32, NF4)

Three systems run the same q / k / v projections of one ``[tokens, hidden]`` input ``x`` (which requires grad, as
the hidden states of a model do), each step one forward and one backward with fixed upstream gradients:

- ``fused``: :func:`fastft.kernels.lora_qkv.lora_qkv` over :class:`~fastft.kernels.lora_projection.LoRAWeights`
  built from the very parameters peft made (so both systems share base weights, A and B);
- ``peft``: real peft (``get_peft_model`` with ``LoraConfig(r, lora_alpha=16, lora_dropout=0)``) on a small module
  holding ``q_proj`` / ``k_proj`` / ``v_proj`` as ``nn.Linear`` (or bitsandbytes ``Linear4bit`` for NF4): three
  projections, each ``base(x) + lora_B(lora_A(x)) * scaling``;
- ``floor``: ``x @ [Wq; Wk; Wv]ᵀ`` forward and its ``dX`` backward, the frozen base GEMM and nothing else (for NF4,
  the same GEMM over the already dequantised dense weight). ``fused / floor`` says how close the fusion comes to
  the cost of the base projection alone.

The LoRA weights are kept in the compute dtype (``autocast_adapter_dtype=False``, no autocast), so every system
multiplies in the same dtype. Timing: on CUDA a pair of ``torch.cuda.Event`` around ``--inner`` back-to-back steps,
synchronised before and after; on CPU ``time.perf_counter``. The systems alternate (fused, peft, floor, fused, ...)
for ``--repeats`` rounds after ``--warmup`` steps each, and the JSON keeps every sample and the medians. The same run
checks correctness: the relative error of fused against peft (outputs, dX, every dA and dB) and of both against a
float64 computation of the same function. Peak memory per system is ``torch.cuda.max_memory_allocated`` over one
step (CUDA); on every device the bytes autograd keeps for backward beyond the inputs and weights.

With NF4 bases the run also times ``fused`` with the base decoded inside the GEMM (``FASTFT_NF4_DEQUANT=kernel``)
against the default reused buffer, and records which was faster under ``nf4_decode``.

On CPU fastft runs its torch reference path, not the Triton kernel (``"fastft_path": "reference"`` in the JSON), so
CPU times check the harness and say nothing about the kernel.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":
    # Run as a script, this folder is sys.path[0]; keep it off the path so nothing here can shadow an installed
    # package (bitsandbytes imports the PyPI `kernels`).
    _here = Path(__file__).resolve().parent
    sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != _here]

import argparse
import functools
import gc
import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from fastft.environment import describe_device, device_slug, package_versions
from fastft.kernels import dispatch
from fastft.kernels.lora_projection import NF4_DEQUANT_ENV, LoRAWeights, release_buffers
from fastft.kernels.lora_qkv import lora_qkv
from fastft.measure import SavedTensorBytes

RESULTS = Path(__file__).resolve().parent / "results"
SYSTEMS = ("fused", "peft", "floor")
PROJECTIONS = ("q_proj", "k_proj", "v_proj")
# What the fused path must reach on a GPU (issue 5): at most 15 % over the base GEMM, at least 1.5x faster than peft.
TARGET_FUSED_OVER_FLOOR = 1.15
TARGET_PEFT_OVER_FUSED = 1.5
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class Shape:
    """The q / k / v projections of one attention layer and the tokens of one micro-batch."""

    hidden: int
    q_out: int
    kv_out: int
    rank: int
    tokens: int


SHAPES = {
    # 32 heads / 8 kv heads of 128: q 4096 wide, k and v 1024.
    "llama-3-8b": Shape(hidden=4096, q_out=4096, kv_out=1024, rank=16, tokens=8192),
    # 32 heads / 8 kv heads of 64: q 2048 wide, k and v 512.
    "llama-3.2-1b": Shape(hidden=2048, q_out=2048, kv_out=512, rank=16, tokens=8192),
    # GQA at a size the CPU harness check (and the test suite) can afford.
    "tiny": Shape(hidden=128, q_out=128, kv_out=64, rank=16, tokens=256),
}
GPU_SHAPES = ("llama-3-8b", "llama-3.2-1b")
CPU_SHAPES = ("tiny",)


class _QKV(torch.nn.Module):
    """The q / k / v projections peft wraps, and nothing else of an attention layer."""

    def __init__(self, q_proj: torch.nn.Module, k_proj: torch.nn.Module, v_proj: torch.nn.Module) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = q_proj, k_proj, v_proj

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)


@dataclass
class Workload:
    """One shape and weight format, built once: the three systems' steps and what correctness compares."""

    x: torch.Tensor
    # dQ, dK, dV for fused and peft; the floor gets the same values as one [tokens, q + 2 kv] gradient.
    upstream: list[torch.Tensor]
    floor_upstream: list[torch.Tensor]
    lora_params: dict[str, torch.Tensor]
    # Dense [out, in] base weights in the compute dtype (dequantised for NF4): the floor's and float64 reference's.
    dense: list[torch.Tensor]
    scales: list[float]
    forward: dict[str, Callable[[], tuple[torch.Tensor, ...]]]
    # Storages that exist whatever the system does (inputs, weights, upstream gradients): not counted as saved.
    resident: tuple[torch.Tensor, ...]
    # The class peft wrapped q_proj in (its bitsandbytes Linear4bit for NF4, lora.Linear otherwise).
    peft_layer: str


def _linear(
    weights: str, dense: torch.Tensor, dtype: torch.dtype, device: torch.device
) -> tuple[torch.nn.Module, torch.Tensor]:
    """A bias-free base layer holding ``dense`` (``[out, in]``): ``nn.Linear`` or an NF4 ``Linear4bit``, and the
    dense weight the floor multiplies by (for NF4, bitsandbytes' own dequantisation of the packed weight)."""
    out_features, in_features = dense.shape
    if weights != "nf4":
        layer = torch.nn.Linear(in_features, out_features, bias=False, device=device, dtype=dtype)
        with torch.no_grad():
            layer.weight.copy_(dense)
        layer.weight.requires_grad_(False)
        return layer, layer.weight.detach()
    import bitsandbytes as bnb
    import bitsandbytes.functional as bnbf

    layer = bnb.nn.Linear4bit(
        in_features, out_features, bias=False, compute_dtype=dtype, compress_statistics=True, quant_type="nf4"
    )
    # Quantised from the compute dtype, as a bf16 checkpoint loaded with load_in_4bit is (quant_state.dtype = dtype);
    # double quantisation and blocksize 64 are QLoRA's settings.
    layer.weight = bnb.nn.Params4bit(
        dense.to(dtype), requires_grad=False, blocksize=64, compress_statistics=True, quant_type="nf4", module=layer
    )
    layer = layer.to(device)
    packed = layer.weight
    return layer, bnbf.dequantize_4bit(packed.data, packed.quant_state).to(dtype)


def build_workload(shape: Shape, weights: str, dtype: torch.dtype, device: torch.device, seed: int) -> Workload:
    """Random base weights, peft's LoRA model over them, and the fused and floor steps over the same tensors."""
    from peft import LoraConfig, get_peft_model

    gen = torch.Generator().manual_seed(seed)
    widths = (shape.q_out, shape.kv_out, shape.kv_out)
    layers, dense = [], []
    for width in widths:
        layer, dense_weight = _linear(weights, torch.randn(width, shape.hidden, generator=gen) * 0.02, dtype, device)
        layers.append(layer)
        dense.append(dense_weight.contiguous())
    config = LoraConfig(r=shape.rank, lora_alpha=16, target_modules=list(PROJECTIONS), lora_dropout=0.0, bias="none")
    base = _QKV(*layers)
    # transformers marks a model it loaded in 4 bit; peft reads that mark to wrap Linear4bit in its bitsandbytes LoRA
    # layer (peft.tuners.lora.bnb.Linear4bit), and without it falls back to the generic lora.Linear.
    base.is_loaded_in_4bit = weights == "nf4"
    model = get_peft_model(base, config, autocast_adapter_dtype=False)
    model.train()

    lora_params, scales, fused_weights = {}, [], []
    with torch.no_grad():
        for name, width in zip(PROJECTIONS, widths, strict=True):
            module = getattr(model.base_model.model, name)
            a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
            # peft leaves adapters of a 4-bit base in fp32; keep every system in the compute dtype. B is made
            # non-zero (its default zero would hide every dA error), A unit-scale per input feature.
            a.data = (torch.randn(shape.rank, shape.hidden, generator=gen) / math.sqrt(shape.hidden)).to(device, dtype)
            b.data = (torch.randn(width, shape.rank, generator=gen) * 0.02).to(device, dtype)
            lora_params[f"{name}.lora_A"], lora_params[f"{name}.lora_B"] = a, b
            scale = float(module.scaling["default"])
            scales.append(scale)
            fused_weights.append(LoRAWeights(module.base_layer.weight, a, b, scale))

    x = torch.randn(shape.tokens, shape.hidden, generator=gen).to(device, dtype).requires_grad_()
    upstream = [torch.randn(shape.tokens, width, generator=gen).to(device, dtype) for width in widths]
    # The floor's operands, concatenated once outside the timed step: one GEMM forward, one backward.
    w_cat = torch.cat(dense, dim=0)
    dy_cat = torch.cat(upstream, dim=1)

    def floor_forward() -> tuple[torch.Tensor, ...]:
        return (x @ w_cat.t(),)

    forward = {
        "fused": lambda: lora_qkv(x, *fused_weights),
        "peft": lambda: model(x),
        "floor": floor_forward,
    }
    resident = (x, w_cat, dy_cat, *dense, *upstream, *lora_params.values(), *model.parameters())
    peft_layer = f"{type(model.base_model.model.q_proj).__module__}.{type(model.base_model.model.q_proj).__name__}"
    return Workload(x, upstream, [dy_cat], lora_params, dense, scales, forward, resident, peft_layer)


def clear_grads(workload: Workload) -> None:
    """Drop the gradients of x and every LoRA parameter (so none accumulates, and their memory is free)."""
    workload.x.grad = None
    for param in workload.lora_params.values():
        param.grad = None


def make_step(workload: Workload, system: str) -> Callable[[], None]:
    """One forward + backward of ``system``; gradients are cleared first so none accumulates across steps."""
    forward = workload.forward[system]
    upstream = workload.floor_upstream if system == "floor" else workload.upstream

    def step() -> None:
        clear_grads(workload)
        outputs = forward()
        torch.autograd.backward(list(outputs), list(upstream))

    return step


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.double()
    return ((actual.double() - expected).norm() / expected.norm()).item()


def _results(workload: Workload, system: str) -> dict[str, torch.Tensor]:
    """Outputs (concatenated), dX and every LoRA gradient of one step of ``system``."""
    clear_grads(workload)
    outputs = workload.forward[system]()
    torch.autograd.backward(list(outputs), list(workload.upstream))
    found = {"output": torch.cat([out.detach() for out in outputs], dim=-1), "grad_x": workload.x.grad.clone()}
    for name, param in workload.lora_params.items():
        found[f"grad_{name}"] = param.grad.clone()
    return found


def _float64_results(workload: Workload) -> dict[str, torch.Tensor]:
    """The same function as the fused and peft systems, every operand upcast to float64, by autograd."""
    x = workload.x.detach().double().requires_grad_()
    params = {name: p.detach().double().requires_grad_() for name, p in workload.lora_params.items()}
    outputs = []
    for name, weight, scale in zip(PROJECTIONS, workload.dense, workload.scales, strict=True):
        a, b = params[f"{name}.lora_A"], params[f"{name}.lora_B"]
        outputs.append(x @ weight.double().t() + scale * (x @ a.t()) @ b.t())
    torch.autograd.backward(outputs, [g.double() for g in workload.upstream])
    found = {"output": torch.cat([out.detach() for out in outputs], dim=-1), "grad_x": x.grad}
    for name, param in params.items():
        found[f"grad_{name}"] = param.grad
    return found


def _compare(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> dict[str, Any]:
    errors = {name: _relative_error(actual[name], expected[name]) for name in expected}
    lora = [value for name, value in errors.items() if name.startswith("grad_") and name != "grad_x"]
    return {
        "output": errors["output"],
        "grad_x": errors["grad_x"],
        "grad_lora_max": max(lora),
        "max": max(errors.values()),
        "per_tensor": errors,
    }


def check_correctness(workload: Workload) -> dict[str, Any]:
    """Relative errors of fused against peft, and of each against float64, on one step's outputs and gradients."""
    fused, peft = _results(workload, "fused"), _results(workload, "peft")
    exact = _float64_results(workload)
    return {
        "fused_vs_peft": _compare(fused, peft),
        "fused_vs_float64": _compare(fused, exact),
        "peft_vs_float64": _compare(peft, exact),
    }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_ms(step: Callable[[], None], device: torch.device, inner: int) -> float:
    """Milliseconds per step over ``inner`` back-to-back steps, the device idle before and synchronised after."""
    _sync(device)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            step()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / inner
    begin = time.perf_counter()
    for _ in range(inner):
        step()
    return (time.perf_counter() - begin) * 1e3 / inner


def time_systems(
    steps: dict[str, Callable[[], None]], device: torch.device, repeats: int, warmup: int, inner: int
) -> dict[str, list[float]]:
    """Every sample of every system, the systems alternating round by round so drift hits them alike."""
    for step in steps.values():
        for _ in range(warmup):
            step()
    _sync(device)
    samples: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            samples[name].append(_time_ms(step, device, inner))
    return samples


def peak_memory(step: Callable[[], None], device: torch.device, before: Callable[[], None]) -> dict[str, int] | None:
    """``max_memory_allocated`` over one step (CUDA only): absolute, and above what was allocated when it began."""
    if device.type != "cuda":
        return None
    before()
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    start = torch.cuda.memory_allocated(device)
    step()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    return {"peak_allocated_bytes": peak, "peak_above_start_bytes": peak - start}


def saved_bytes(forward: Callable[[], tuple[torch.Tensor, ...]], resident: tuple[torch.Tensor, ...]) -> int:
    """Bytes autograd keeps for backward over one forward, each storage once, inputs and weights not counted."""
    with SavedTensorBytes(exclude=resident) as saved:
        outputs = forward()
    del outputs
    return saved.bytes


def _before_memory_step(workload: Workload, system: str) -> None:
    # The previous system's gradients would otherwise be freed inside the measured step.
    clear_grads(workload)
    if system == "fused":
        # The fused NF4 path keeps one dequantisation buffer across calls; free it so this step pays for it, as a
        # model's first layer does (peft / bitsandbytes allocate theirs on every call).
        release_buffers()


NF4_KERNEL_DECODE = "fused_nf4_decoded_in_kernel"


def _with_nf4_decode(step: Callable[[], Any], mode: str) -> Callable[[], Any]:
    """``step`` run with ``FASTFT_NF4_DEQUANT=mode`` (read by fastft on every call), the environment restored after."""

    def wrapped() -> Any:
        previous = os.environ.get(NF4_DEQUANT_ENV)
        os.environ[NF4_DEQUANT_ENV] = mode
        try:
            return step()
        finally:
            if previous is None:
                os.environ.pop(NF4_DEQUANT_ENV, None)
            else:
                os.environ[NF4_DEQUANT_ENV] = previous

    return wrapped


def run_one(
    name: str, shape: Shape, weights: str, dtype: torch.dtype, device: torch.device, settings: dict
) -> dict[str, Any]:
    """Build one workload, check it, time the three systems and measure their memory; the JSON-ready row."""
    workload = build_workload(shape, weights, dtype, device, settings["seed"])
    probe = workload.x
    correctness = check_correctness(workload)
    steps = {system: make_step(workload, system) for system in SYSTEMS}
    steps["fused"] = _with_nf4_decode(steps["fused"], "buffer")
    decode_check = None
    if weights == "nf4":
        # The question for 4-bit bases: decode into one reused buffer, or inside the GEMM? Time both.
        steps[NF4_KERNEL_DECODE] = _with_nf4_decode(make_step(workload, "fused"), "kernel")
        with torch.no_grad():
            buffered = _with_nf4_decode(workload.forward["fused"], "buffer")()
            decoded = _with_nf4_decode(workload.forward["fused"], "kernel")()
        decode_check = max(_relative_error(d, b) for d, b in zip(decoded, buffered, strict=True))
    samples = time_systems(steps, device, settings["repeats"], settings["warmup"], settings["inner"])
    medians = {system: statistics.median(values) for system, values in samples.items()}

    memory = {
        system: peak_memory(steps[system], device, functools.partial(_before_memory_step, workload, system))
        for system in SYSTEMS
    }
    saved = {system: saved_bytes(workload.forward[system], workload.resident) for system in SYSTEMS}

    m, k, n = shape.tokens, shape.hidden, shape.q_out + 2 * shape.kv_out
    base_flops = 2 * 2 * m * k * n  # x Wᵀ forward and dY W backward
    row = {
        "shape": name,
        "dims": asdict(shape),
        "weights": weights,
        "compute_dtype": str(dtype).removeprefix("torch."),
        "lora_scale": workload.scales[0],
        "peft_layer": workload.peft_layer,
        "fastft_path": "triton" if dispatch.use_triton(probe) else "reference",
        "ms": medians,
        "samples_ms": samples,
        "fused_over_floor": medians["fused"] / medians["floor"],
        "peft_over_fused": medians["peft"] / medians["fused"],
        "base_flops": base_flops,
        "base_tflop_per_s": {system: base_flops / (ms * 1e-3) / 1e12 for system, ms in medians.items()},
        "memory": memory,
        "saved_for_backward_bytes": saved,
        "correctness": correctness,
    }
    if weights == "nf4":
        row["nf4_decode"] = {
            "buffer_ms": medians["fused"],
            "in_kernel_ms": medians[NF4_KERNEL_DECODE],
            "faster": "buffer" if medians["fused"] <= medians[NF4_KERNEL_DECODE] else "in_kernel",
            "in_kernel_vs_buffer_relative_error": decode_check,
        }
    # The targets are about the Triton kernel on a GPU; a reference-path or CPU run neither meets nor misses them.
    row["meets_targets"] = (
        {
            "fused_over_floor": row["fused_over_floor"] <= TARGET_FUSED_OVER_FLOOR,
            "peft_over_fused": row["peft_over_fused"] >= TARGET_PEFT_OVER_FUSED,
        }
        if device.type == "cuda" and row["fastft_path"] == "triton"
        else None
    )
    del workload, steps, probe
    release_buffers()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:.1f}"


def format_table(rows: list[dict[str, Any]]) -> str:
    """A fixed-width table of the medians, ratios, memory and the fused-vs-peft error of every run."""
    header = (
        f"{'shape':13s} {'weights':7s} {'fused ms':>9s} {'peft ms':>9s} {'floor ms':>9s} {'fused/floor':>11s} "
        f"{'peft/fused':>10s} {'peak MiB fused/peft/floor':>26s} {'err vs peft':>11s}"
    )
    lines = [header, "-" * len(header)]
    for row in rows:
        ms, memory = row["ms"], row["memory"]
        peaks = "/".join(
            _mib(memory[system]["peak_above_start_bytes"] if memory[system] else None) for system in SYSTEMS
        )
        lines.append(
            f"{row['shape']:13s} {row['weights']:7s} {ms['fused']:9.3f} {ms['peft']:9.3f} {ms['floor']:9.3f} "
            f"{row['fused_over_floor']:11.3f} {row['peft_over_fused']:10.2f} {peaks:>26s} "
            f"{row['correctness']['fused_vs_peft']['max']:11.1e}"
        )
        decode = row.get("nf4_decode")
        if decode:
            lines.append(
                f"{'':13s} {'':7s} NF4 decoded in the GEMM: {decode['in_kernel_ms']:.3f} ms against "
                f"{decode['buffer_ms']:.3f} ms through the buffer ({decode['faster']} faster; outputs differ by "
                f"{decode['in_kernel_vs_buffer_relative_error']:.1e})"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Parse the command line, run every shape × weight format, print the table and write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--shapes",
        nargs="+",
        choices=sorted(SHAPES),
        default=None,
        help="default: the Llama shapes on CUDA, tiny on CPU",
    )
    parser.add_argument(
        "--dtypes",
        nargs="+",
        choices=[*DTYPES, "nf4"],
        default=None,
        help="base weight formats; default bf16 nf4 on CUDA, fp32 nf4 on CPU",
    )
    parser.add_argument(
        "--nf4-compute",
        choices=list(DTYPES),
        default=None,
        help="compute dtype for nf4; default bf16 (CUDA), fp32 (CPU)",
    )
    parser.add_argument("--tokens", type=int, default=None, help="override every shape's token count")
    parser.add_argument("--repeats", type=int, default=None, help="alternated rounds (default 30 on CUDA, 5 on CPU)")
    parser.add_argument(
        "--warmup", type=int, default=None, help="untimed steps per system (default 5 on CUDA, 3 on CPU)"
    )
    parser.add_argument("--inner", type=int, default=None, help="steps per timed sample (default 5 on CUDA, 1 on CPU)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default bench/results/lora-<device>.json)")
    args = parser.parse_args(argv)

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible")
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda and dispatch.INTERPRETED:
        parser.error("TRITON_INTERPRET=1 runs the Triton kernels in the interpreter; unset it for a GPU run")
    shapes = args.shapes or list(GPU_SHAPES if cuda else CPU_SHAPES)
    formats = args.dtypes or (["bf16", "nf4"] if cuda else ["fp32", "nf4"])
    nf4_compute = DTYPES[args.nf4_compute or ("bf16" if cuda else "fp32")]
    settings = {
        "repeats": args.repeats if args.repeats is not None else (30 if cuda else 5),
        "warmup": args.warmup if args.warmup is not None else (5 if cuda else 3),
        "inner": args.inner if args.inner is not None else (5 if cuda else 1),
        "seed": args.seed,
        "tokens_override": args.tokens,
        "order": list(SYSTEMS),
        "lora": {"lora_alpha": 16, "lora_dropout": 0.0, "adapter_dtype": "compute dtype", "autocast": False},
        "timer": "torch.cuda.Event" if cuda else "time.perf_counter",
        "triton_interpret": dispatch.INTERPRETED,
        "targets": {"fused_over_floor_max": TARGET_FUSED_OVER_FLOOR, "peft_over_fused_min": TARGET_PEFT_OVER_FUSED},
    }
    if min(settings["repeats"], settings["inner"]) < 1 or settings["warmup"] < 0:
        parser.error("--repeats and --inner must be at least 1, --warmup at least 0")
    if cuda:
        settings["allow_tf32"] = torch.backends.cuda.matmul.allow_tf32

    rows = []
    for name in shapes:
        shape = SHAPES[name]
        if args.tokens is not None:
            shape = Shape(shape.hidden, shape.q_out, shape.kv_out, shape.rank, args.tokens)
        for weights in formats:
            dtype = nf4_compute if weights == "nf4" else DTYPES[weights]
            row = run_one(name, shape, weights, dtype, device, settings)
            rows.append(row)
            print(
                f"{name} {weights}: fused {row['ms']['fused']:.3f} ms, peft {row['ms']['peft']:.3f} ms, "
                f"floor {row['ms']['floor']:.3f} ms",
                flush=True,
            )

    record = {
        "benchmark": "lora_qkv",
        "device": describe_device(device),
        "device_type": device.type,
        "versions": package_versions(("torch", "triton", "peft", "bitsandbytes", "transformers", "fastft")),
        "cuda": torch.version.cuda if cuda else None,
        "python": platform.python_version(),
        "settings": settings,
        "runs": rows,
    }
    table = format_table(rows)
    print(table)
    output = args.out or RESULTS / f"lora-{device_slug(record['device'])}.json"
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
