"""Time fastft's fused LoRA projection groups (forward + backward) against peft and the bare base GEMMs; write JSON.

Usage::

    python bench/lora.py                                   # CUDA when present: Llama-3-8B and Llama-3.2-1B groups,
                                                           # 8192 tokens, bf16 and NF4 (bf16 compute)
    python bench/lora.py --device cpu --shapes tiny --tokens 256 --repeats 3   # the harness on CPU (fp32, NF4)
    python bench/lora.py --tune-only --shapes llama-3.2-1b --out tuner.json     # only fill the GEMM tuning cache

Each group is what one fused autograd node of fastft covers in a Llama layer, run on one ``[tokens, in]`` input
``x`` that requires grad (as a model's hidden states do), one forward and one backward with fixed upstream
gradients:

- ``qkv``: q / k / v of ``[tokens, hidden]`` (:func:`fastft.kernels.lora_qkv.lora_qkv`);
- ``o``: o_proj of ``[tokens, heads·head_dim]`` (:func:`fastft.kernels.lora_o.lora_o`);
- ``mlp``: gate / up, SwiGLU, down (:func:`fastft.kernels.lora_mlp.lora_mlp`);
- ``moe``: a Qwen3-MoE layer's experts with LoRA on every expert, called with a fixed top-k routing of x
  (:class:`fastft.kernels.lora_moe_experts.LoRAMoEExperts` against transformers' ``Qwen3MoeExperts`` under peft's
  ``target_parameters``; ``fastft``'s systems: ``auto`` alone, its grouped GEMMs have no cuBLAS-or-Triton choice;
  ``grouped_mm``: the stock experts on transformers' ``grouped_mm``, ``peft`` on its eager loop; ``floor``: the two
  base grouped GEMMs over the rows sorted by expert). Dense weights only (no NF4 experts), on shapes with experts.

Systems, alternated in one process (cublas, triton, auto, peft, floor, cublas, ...):

- ``cublas``, ``triton``, ``auto``: fastft's group over :class:`~fastft.kernels.lora_projection.LoRAWeights` built
  from the very parameters peft made (so every system shares base weights, A and B), with its base GEMM forced to
  torch's matmul (``FASTFT_GEMM=cublas``), forced to the fused Triton kernel (``triton``; NF4 decoded into the
  reused buffer) or left to the tuner (``auto``, the default a user gets: on a GPU it times cuBLAS against every
  Triton configuration on first use and keeps the fastest). ``auto`` is tuned before any timing starts, so its
  samples time the chosen path, never the tuning; the JSON keeps what the tuner chose and why
  (:func:`fastft.kernels.gemm_tuner.choices`, with its timings) and how long the tuning call took;
- ``peft``: real peft (``get_peft_model`` with ``LoraConfig(r, lora_alpha=16, lora_dropout=0)``) over ``nn.Linear``
  (or bitsandbytes ``Linear4bit`` for NF4) projections, each ``base(x) + lora_B(lora_A(x)) * scaling``;
- ``floor``: the bare base GEMMs of the group, ``X Wᵀ`` forward and ``dY W`` backward, no LoRA (for NF4 over the
  already dequantised dense weight; for ``mlp`` gate|up and down as two GEMMs, no SwiGLU).

On a CPU there is no cuBLAS-or-Triton choice (both run torch's matmul), so only ``auto``, ``peft`` and ``floor``
run unless ``--systems`` says otherwise; under ``TRITON_INTERPRET=1`` ``triton`` and ``auto`` run the interpreted
kernel. With NF4 bases the run also times the Triton kernel decoding the 4-bit tiles inside the GEMM
(``nf4_in_kernel``: ``FASTFT_NF4_DEQUANT=kernel``) against the reused buffer (``nf4_decode`` in the JSON).

The ratios per row are the ones the GEMM-selection issue targets: ``auto / cublas`` (the tuner's choice must be no
slower than cuBLAS, within the noise of the paired per-round ratios) and, for ``qkv``, ``auto / floor`` (at most
1.15) and ``peft / auto`` (at least 1.5). They are judged only on a GPU with the Triton dispatch (``met`` is null
elsewhere).

The LoRA weights are kept in the compute dtype (``autocast_adapter_dtype=False``, no autocast), so every system
multiplies in the same dtype. Timing: on CUDA a pair of ``torch.cuda.Event`` around ``--inner`` back-to-back steps,
synchronised before and after; on CPU ``time.perf_counter``. The JSON keeps every sample and the medians. The same
run checks correctness: the relative error of each fastft system against peft (outputs, dX, every dA and dB) and of
each against a float64 computation of the same function. Peak memory per system is
``torch.cuda.max_memory_allocated`` over one step (CUDA); on every device the bytes autograd keeps for backward beyond
the inputs and weights.

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
import importlib.util
import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from typing import Any

import torch
import torch.nn.functional as F

from fastft.bench.environment import describe_device, device_slug, package_versions
from fastft.bench.measure import SavedTensorBytes
from fastft.kernels import dispatch, gemm_tuner
from fastft.kernels.gemm_tuner import NF4_DEQUANT_ENV
from fastft.kernels.lora_projection import LoRAWeights, release_buffers


def _load_sibling(name: str) -> Any:
    """A module of this folder, loaded from its file: the folder itself stays off ``sys.path``."""
    spec = importlib.util.spec_from_file_location(
        f"_fastft_bench_{name}", Path(__file__).resolve().parent / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    # In sys.modules before it runs: its dataclasses look their module up there.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


_workload = _load_sibling("lora_workload")
_report = _load_sibling("lora_report")
FASTFT_SYSTEMS, NOISE_MIN, SYSTEMS = _report.FASTFT_SYSTEMS, _report.NOISE_MIN, _report.SYSTEMS
TARGET_PEFT_OVER_QKV, TARGET_QKV_OVER_FLOOR = _report.TARGET_PEFT_OVER_QKV, _report.TARGET_QKV_OVER_FLOOR
auto_path, evaluate_targets, format_table = _report.auto_path, _report.evaluate_targets, _report.format_table
format_targets, ratio_noise, row_ratios = _report.format_targets, _report.ratio_noise, _report.row_ratios
summarise = _report.summarise
GROUPS, NF4_IN_KERNEL, SHAPES, SYSTEM_MODES = (_workload.GROUPS, _workload.NF4_IN_KERNEL, _workload.SHAPES,
                                              _workload.SYSTEM_MODES)  # fmt: skip
Shape, Workload, base_flops = _workload.Shape, _workload.Workload, _workload.base_flops
build_workload, clear_grads, fastft_forward = _workload.build_workload, _workload.clear_grads, _workload.fastft_forward
gemm_mode, in_mode, linear, make_step = _workload.gemm_mode, _workload.in_mode, _workload.linear, _workload.make_step
projections_of, system_forward = _workload.projections_of, _workload.system_forward

RESULTS = Path(__file__).resolve().parent / "results"
CPU_GROUPS = ("qkv",)
CPU_SYSTEMS = ("auto", "peft", "floor")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


GPU_SHAPES = ("llama-3-8b", "llama-3.2-1b", "qwen3-30b-a3b")
CPU_SHAPES = ("tiny",)


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.double()
    return ((actual.double() - expected).norm() / expected.norm()).item()


def _results(workload: Workload, system: str) -> dict[str, torch.Tensor]:
    """Outputs (concatenated), dX and every LoRA gradient of one step of ``system``."""
    forward = workload.forward["fastft" if system in SYSTEM_MODES else system]

    def step() -> dict[str, torch.Tensor]:
        clear_grads(workload)
        outputs = forward()
        torch.autograd.backward(list(outputs), list(workload.upstream))
        found = {"output": torch.cat([out.detach() for out in outputs], dim=-1), "grad_x": workload.x.grad.clone()}
        for name, param in workload.lora_params.items():
            found[f"grad_{name}"] = param.grad.clone()
        return found

    return in_mode(system, step)()


def _float64_results(workload: Workload) -> dict[str, torch.Tensor]:
    """The same function as the fastft and peft systems, every operand upcast to float64, by autograd."""
    if workload.group == "moe":
        return _workload.moe_float64_results(workload)
    x = workload.x.detach().double().requires_grad_()
    params = {name: p.detach().double().requires_grad_() for name, p in workload.lora_params.items()}

    def project(inputs: torch.Tensor, index: int) -> torch.Tensor:
        name = workload.names[index]
        weight, scale = workload.dense[index].double(), workload.scales[index]
        a, b = params[f"{name}.lora_A"], params[f"{name}.lora_B"]
        return inputs @ weight.t() + scale * (inputs @ a.t()) @ b.t()

    if workload.group == "mlp":
        outputs = [project(F.silu(project(x, 0)) * project(x, 1), 2)]
    else:
        outputs = [project(x, index) for index in range(len(workload.names))]
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
    if system in SYSTEM_MODES:
        # The fused NF4 path keeps one dequantisation buffer across calls; free it so this step pays for it, as a
        # model's first layer does (peft / bitsandbytes allocate theirs on every call).
        release_buffers()


def probe_system(workload: Workload, system: str, device: torch.device) -> tuple[dict[str, torch.Tensor], dict]:
    """One step of a fastft system from a clean slate of tuner choices: its results, the GEMM choices it made and
    how long that first call took (for ``auto`` on a GPU, the tuning; for ``triton``, the compilation)."""
    gemm_tuner.reset()
    _sync(device)
    begin = time.perf_counter()
    found = _results(workload, system)
    _sync(device)
    first_call_s = time.perf_counter() - begin
    return found, {"first_call_s": first_call_s, "choices": gemm_tuner.choices()}


def run_one(
    name: str,
    shape: Shape,
    group: str,
    weights: str,
    dtype: torch.dtype,
    device: torch.device,
    systems: list[str],
    settings: dict,
) -> dict[str, Any]:
    """Build one workload, check it, time the systems and measure their memory; the JSON-ready row."""
    workload = build_workload(shape, group, weights, dtype, device, settings["seed"])
    probe = workload.x
    # The MoE experts' grouped GEMMs have no forced mode (auto alone); its stock systems are the workload's own.
    systems = [s for s in systems if s in workload.forward or (s in SYSTEM_MODES and (group != "moe" or s == "auto"))]
    fastft_systems = [system for system in systems if system in SYSTEM_MODES]
    # The NF4 decode question: the Triton kernel decoding 4-bit tiles in its K loop against the reused buffer.
    decode_base = next((s for s in ("triton", "auto") if s in fastft_systems), None) if weights == "nf4" else None
    # auto last: the probe that tunes leaves its choice in the tuner's memory for the timed steps (the others reset
    # it), so the samples time exactly the choice recorded here.
    probed = [s for s in fastft_systems if s != "auto"] + ([NF4_IN_KERNEL] if decode_base else [])
    probed += ["auto"] if "auto" in fastft_systems else []

    results, gemm = {}, {}
    for system in probed:
        results[system], gemm[system] = probe_system(workload, system, device)
    correctness: dict[str, Any] = {}
    for stock in ("peft", "grouped_mm"):
        if stock in systems:
            results[stock] = _results(workload, stock)
    exact = _float64_results(workload)
    for system in fastft_systems:
        if "peft" in results:
            correctness[f"{system}_vs_peft"] = _compare(results[system], results["peft"])
        correctness[f"{system}_vs_float64"] = _compare(results[system], exact)
    for stock in ("peft", "grouped_mm"):
        if stock in results:
            correctness[f"{stock}_vs_float64"] = _compare(results[stock], exact)
    decode_check = (
        _relative_error(results[NF4_IN_KERNEL]["output"], results[decode_base]["output"]) if decode_base else None
    )
    del results, exact

    steps = {system: make_step(workload, system) for system in systems}
    if decode_base:
        steps[NF4_IN_KERNEL] = make_step(workload, NF4_IN_KERNEL)
    samples = time_systems(steps, device, settings["repeats"], settings["warmup"], settings["inner"])
    medians = {system: statistics.median(values) for system, values in samples.items()}

    memory = {
        system: peak_memory(steps[system], device, functools.partial(_before_memory_step, workload, system))
        for system in steps
    }
    saved = {system: saved_bytes(system_forward(workload, system), workload.resident) for system in steps}

    flops = base_flops(shape, group)
    judged = device.type == "cuda" and dispatch.use_triton(probe)
    row = {
        "shape": name,
        "group": group,
        "projections": workload.names,
        "dims": asdict(shape),
        "weights": weights,
        "compute_dtype": str(dtype).removeprefix("torch."),
        "lora_scale": workload.scales[0],
        "peft_layer": workload.peft_layer,
        # The kernels' device dispatch; which GEMM each fastft system then ran is in gemm_choices.
        "fastft_path": "triton" if dispatch.use_triton(probe) else "reference",
        "gemm_paths": {system: sorted({c["path"] for c in gemm[system]["choices"]}) for system in gemm},
        "gemm_choices": gemm,
        "ms": medians,
        "samples_ms": samples,
        "ratios": row_ratios(medians),
        "auto_over_cublas_noise": ratio_noise(samples),
        "base_flops": flops,
        "base_tflop_per_s": {system: flops / (ms * 1e-3) / 1e12 for system, ms in medians.items()},
        "memory": memory,
        "saved_for_backward_bytes": saved,
        "correctness": correctness,
        **({"notes": workload.notes} if workload.notes else {}),
    }
    if decode_base:
        row["nf4_decode"] = {
            "buffer_system": decode_base,
            "buffer_ms": medians[decode_base],
            "in_kernel_ms": medians[NF4_IN_KERNEL],
            "faster": "buffer" if medians[decode_base] <= medians[NF4_IN_KERNEL] else "in_kernel",
            "in_kernel_vs_buffer_relative_error": decode_check,
        }
    row["targets"] = evaluate_targets(row, judged)
    del workload, steps, probe
    release_buffers()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def _shape_with_tokens(shape: Shape, tokens: int | None) -> Shape:
    return shape if tokens is None else Shape(**{**asdict(shape), "tokens": tokens})


def _tuning_weights(
    shape: Shape, group: str, weights: str, dtype: torch.dtype, device: torch.device, seed: int
) -> tuple[torch.Tensor, list[LoRAWeights]]:
    """fastft's projections of one group (no peft) and an input, for the tuning run."""
    gen = torch.Generator().manual_seed(seed)
    fused = []
    specs = projections_of(shape, group)
    for _, out_features, in_features in specs:
        layer, _ = linear(weights, torch.randn(out_features, in_features, generator=gen) * 0.02, dtype, device)
        a = (torch.randn(shape.rank, in_features, generator=gen) / math.sqrt(in_features)).to(device, dtype)
        b = (torch.randn(out_features, shape.rank, generator=gen) * 0.02).to(device, dtype)
        fused.append(LoRAWeights(layer.weight, a.requires_grad_(), b.requires_grad_(), 1.0))
    x = torch.randn(shape.tokens, specs[0][2], generator=gen).to(device, dtype).requires_grad_()
    return x, fused


def cases(
    shapes: list[str], formats: list[str], groups: list[str], device: torch.device, args: argparse.Namespace
) -> Iterator[tuple[str, Any, str, str, torch.dtype]]:
    """Every (shape name, shape at --tokens, group, weight format, compute dtype) the run measures, in order."""
    for name in shapes:
        shape = _shape_with_tokens(SHAPES[name], args.tokens)
        for weights in formats:
            dtype = _compute_dtype(weights, args, device)
            for group in groups:
                # moe needs experts and dense expert weights; mlp a dense MLP (Qwen3-30B-A3B's layers have none).
                if (group == "moe" and (not shape.experts or weights == "nf4")) or (
                    group == "mlp" and not shape.intermediate
                ):
                    continue
                yield name, shape, group, weights, dtype


def tune_only(
    shapes: list[str], formats: list[str], groups: list[str], device: torch.device, args: argparse.Namespace
) -> dict[str, Any]:
    """One forward + backward of every group under ``FASTFT_GEMM=auto``: on a GPU this tunes each (dtype, shape
    bucket) and fills the cache; the record holds every choice and how long each group's first call took."""
    runs = []
    for name, shape, group, weights, dtype in cases(shapes, formats, groups, device, args):
        x, fused = _tuning_weights(shape, group, weights, dtype, device, args.seed)
        with gemm_mode("auto"):
            _sync(device)
            begin = time.perf_counter()
            outputs = fastft_forward(group, x, fused)
            torch.autograd.backward(list(outputs), [torch.ones_like(out) for out in outputs])
            _sync(device)
        seconds = time.perf_counter() - begin
        runs.append({"shape": name, "group": group, "weights": weights, "tokens": shape.tokens, "s": seconds})
        print(f"{name} {group} {weights}: first forward + backward {seconds:.2f} s", flush=True)
        del x, fused, outputs
        release_buffers()
    return {"benchmark": "gemm_tuning", "runs": runs, "choices": gemm_tuner.choices()}


def _compute_dtype(weights: str, args: argparse.Namespace, device: torch.device) -> torch.dtype:
    if weights == "nf4":
        return DTYPES[args.nf4_compute or ("bf16" if device.type == "cuda" else "fp32")]
    return DTYPES[weights]


def _output_path(args: argparse.Namespace, device_name: str, shapes: list[str], default_shapes: tuple) -> Path:
    if args.out is not None:
        return args.out
    stem = "gemm-tuning" if args.tune_only else "lora"
    # A run over fewer shapes than the default gets its own name, so two halves of one GPU run don't overwrite.
    suffix = "" if tuple(shapes) == tuple(default_shapes) else "-" + "-".join(shapes)
    return (args.out_dir or RESULTS) / f"{stem}-{device_slug(device_name)}{suffix}.json"


def main(argv: list[str] | None = None) -> int:
    """Parse the command line, run every shape × group × weight format, print the tables and write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--shapes",
        nargs="+",
        choices=sorted(SHAPES),
        default=None,
        help="default: the Llama shapes on CUDA, tiny on CPU",
    )
    parser.add_argument("--groups", nargs="+", choices=GROUPS, default=None, help="default: all on CUDA, qkv on CPU")
    parser.add_argument(
        "--systems",
        nargs="+",
        choices=SYSTEMS,
        default=None,
        help="timed systems, alternated in this order; default all on CUDA, auto peft floor on CPU",
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
    parser.add_argument(
        "--tune-only",
        action="store_true",
        help="only run each group once under FASTFT_GEMM=auto (fills the tuning cache) and write the choices",
    )
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default <out-dir>/lora-<device>.json)")
    parser.add_argument("--out-dir", type=Path, default=None, help="folder for the default JSON name (bench/results)")
    args = parser.parse_args(argv)

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible")
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda and dispatch.INTERPRETED:
        parser.error("TRITON_INTERPRET=1 runs the Triton kernels in the interpreter; unset it for a GPU run")
    default_shapes = GPU_SHAPES if cuda else CPU_SHAPES
    shapes = args.shapes or list(default_shapes)
    # On CPU the default stays the one group it always timed: every extra group is another peft build and float64
    # check, and CPU times say nothing about the GPU's GEMM choice anyway.
    groups = args.groups or list(GROUPS if cuda else CPU_GROUPS)
    formats = args.dtypes or (["bf16", "nf4"] if cuda else ["fp32", "nf4"])
    wanted = set(args.systems or (SYSTEMS if cuda else CPU_SYSTEMS))
    systems = [system for system in SYSTEMS if system in wanted]
    settings = {
        "repeats": args.repeats if args.repeats is not None else (30 if cuda else 5),
        "warmup": args.warmup if args.warmup is not None else (5 if cuda else 3),
        "inner": args.inner if args.inner is not None else (5 if cuda else 1),
        "seed": args.seed,
        "tokens_override": args.tokens,
        "groups": groups,
        "order": systems,
        "lora": {"lora_alpha": 16, "lora_dropout": 0.0, "adapter_dtype": "compute dtype", "autocast": False},
        "timer": "torch.cuda.Event" if cuda else "time.perf_counter",
        "triton_interpret": dispatch.INTERPRETED,
        "targets": {
            "auto_over_cublas_max": "1 + max(NOISE_MIN, IQR of the per-round auto/cublas ratios)",
            "noise_min": NOISE_MIN,
            "qkv_auto_over_floor_max": TARGET_QKV_OVER_FLOOR,
            "qkv_peft_over_auto_min": TARGET_PEFT_OVER_QKV,
        },
    }
    if min(settings["repeats"], settings["inner"]) < 1 or settings["warmup"] < 0:
        parser.error("--repeats and --inner must be at least 1, --warmup at least 0")
    if cuda:
        settings["allow_tf32"] = torch.backends.cuda.matmul.allow_tf32
    if args.tune_only:
        # Nothing is timed against anything: only what decides the tuner's buckets.
        settings = {
            "seed": args.seed,
            "tokens_override": args.tokens,
            "groups": groups,
            "formats": formats,
            "step": "one forward + backward per group, FASTFT_GEMM=auto, FASTFT_NF4_DEQUANT unset",
        }

    cache_file = gemm_tuner.cache_file()
    gemm = {
        # What the caller's environment asked for; each system forces its own mode regardless.
        "env": {name: os.environ.get(name) for name in (gemm_tuner.GEMM_ENV, NF4_DEQUANT_ENV, gemm_tuner.CACHE_ENV)},
        "cache_file": str(cache_file),
        # A cache that existed before the run means auto may have read its choices instead of timing them now.
        "cache_existed_before": cache_file.exists(),
    }
    started = time.perf_counter()
    if args.tune_only:
        record = tune_only(shapes, formats, groups, device, args)
    else:
        rows = []
        for name, shape, group, weights, dtype in cases(shapes, formats, groups, device, args):
            row = run_one(name, shape, group, weights, dtype, device, systems, settings)
            rows.append(row)
            timed = ", ".join(f"{system} {ms:.3f}" for system, ms in row["ms"].items())
            print(f"{name} {group} {weights}: {timed} ms; auto ran {auto_path(row)}", flush=True)
        record = {"benchmark": "lora_groups", "runs": rows, "summary": summarise(rows)}
        # Every choice each fastft system made, row by row (the tuner keeps only the latest per bucket itself).
        gemm["choices"] = [
            {"shape": row["shape"], "row_group": row["group"], "weights": row["weights"], "system": system, **choice}
            for row in rows
            for system, made in row["gemm_choices"].items()
            for choice in made["choices"]
        ]
        print(format_table(rows))
        print(format_targets(record["summary"]))

    record = {
        "benchmark": record.pop("benchmark"),
        "device": describe_device(device),
        "device_type": device.type,
        "versions": package_versions(("torch", "triton", "peft", "bitsandbytes", "transformers", "fastft")),
        "cuda": torch.version.cuda if cuda else None,
        "capability": list(torch.cuda.get_device_capability(device)) if cuda else None,
        "python": platform.python_version(),
        "duration_s": round(time.perf_counter() - started, 1),
        "settings": settings,
        "gemm": gemm,
        **record,
    }
    output = _output_path(args, record["device"], shapes, default_shapes)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
