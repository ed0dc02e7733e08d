"""Time each fastft kernel (forward + backward) against its torch eager counterpart, and write JSON.

Usage::

    python bench/kernels.py                        # CUDA when present, else CPU; JSON under bench/results/
    python bench/kernels.py --device cpu --quick   # small shapes, a few repeats (what the test suite runs)

On CUDA the fastft column is the Triton kernels; on CPU it is fastft's torch reference path (the interpreter is far
too slow to time), which the JSON records as ``"fastft_path": "reference"`` so a CPU figure is never read as a
kernel speed-up. Each row reports the median time of both systems measured in the same run, the speed-up, the
bytes (or FLOPs) the operation must move, the rate achieved against the device ceiling measured here (a large copy
for bandwidth, a large matmul for FLOP/s), bytes saved for backward, and the relative error of fastft's output
against the eager one.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":
    # Run as a script, this folder is sys.path[0] and this file would be importable as a top-level `kernels`,
    # shadowing the PyPI package bitsandbytes imports; drop the folder before anything imports bitsandbytes.
    _here = Path(__file__).resolve().parent
    sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != _here]

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from fastft.bench.environment import describe_device, device_slug, package_versions
from fastft.bench.measure import SavedTensorBytes
from fastft.kernels import dispatch
from fastft.kernels.cross_entropy import default_chunk_size, fused_linear_cross_entropy
from fastft.kernels.nf4 import dequantize_nf4, nf4_linear
from fastft.kernels.rms_norm import rms_norm
from fastft.kernels.rope import apply_rope
from fastft.kernels.swiglu import swiglu

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class Shapes:
    """A Llama-shaped workload: one micro-batch of ``tokens`` through one layer's hot spots and the LM head."""

    tokens: int
    batch: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int


# Llama-3.2-1B's dimensions at batch 4 × 2048 tokens; on CPU, SmolLM2-135M's at 2 × 256.
GPU_SHAPES = Shapes(8192, 4, 2048, 8192, 32, 8, 64, 128256)
CPU_SHAPES = Shapes(512, 2, 576, 1536, 9, 3, 64, 49152)
QUICK_SHAPES = Shapes(64, 2, 128, 256, 4, 2, 32, 1000)


@dataclass
class Case:
    """One kernel's benchmark: both systems' step functions and what the operation must move or compute."""

    name: str
    fastft: Callable[[], torch.Tensor]
    eager: Callable[[], torch.Tensor]
    bytes_moved: int = 0
    flops: int = 0
    notes: str = ""
    extra: dict = field(default_factory=dict)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_ms(step: Callable[[], object], device: torch.device, repeats: int, warmup: int) -> float:
    for _ in range(warmup):
        step()
    _sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _peak_extra_bytes(step: Callable[[], object], device: torch.device) -> int:
    """The most CUDA memory one step holds above what was allocated before it (its transients and outputs)."""
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


def _saved_bytes(step: Callable[[], torch.Tensor]) -> int:
    """Bytes autograd keeps for backward over one forward (each storage counted once)."""
    with SavedTensorBytes() as saved:
        step()
    return saved.bytes


def device_ceilings(device: torch.device, dtype: torch.dtype, quick: bool) -> dict:
    """Measured copy bandwidth (GB/s) and matmul rate (TFLOP/s) of this device, the rates rows are read against."""
    numel = (1 << 22) if quick else (1 << 28 if device.type == "cuda" else 1 << 25)
    src = torch.randn(numel, device=device, dtype=torch.float32)
    dst = torch.empty_like(src)
    copy_ms = _median_ms(lambda: dst.copy_(src), device, repeats=5 if quick else 20, warmup=2)
    n = 256 if quick else (8192 if device.type == "cuda" else 1024)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    matmul_ms = _median_ms(lambda: a @ b, device, repeats=5 if quick else 20, warmup=2)
    return {
        "copy_gb_per_s": 2 * src.nbytes / (copy_ms * 1e-3) / 1e9,
        "matmul_tflop_per_s": 2 * n**3 / (matmul_ms * 1e-3) / 1e12,
        "matmul_dtype": str(dtype).removeprefix("torch."),
    }


def _leaf(shape, dtype, device, gen, scale: float = 1.0) -> torch.Tensor:
    tensor = torch.randn(shape, generator=gen, dtype=torch.float32) * scale
    return tensor.to(device=device, dtype=dtype).requires_grad_()


def _fwd_bwd(fn: Callable[..., torch.Tensor], inputs: list[torch.Tensor], upstream: torch.Tensor | None):
    def step() -> torch.Tensor:
        for tensor in inputs:
            tensor.grad = None
        out = fn()
        if upstream is None:
            out.backward()
        else:
            out.backward(upstream)
        return out

    return step


def build_cases(shapes: Shapes, dtype: torch.dtype, device: torch.device) -> list[Case]:
    """The five kernels on ``shapes``, each against what stock transformers / torch / bitsandbytes would run."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

    gen = torch.Generator().manual_seed(0)
    s, size = shapes, dtype.itemsize
    cases = []

    x = _leaf((s.tokens, s.hidden), dtype, device, gen)
    weight = _leaf((s.hidden,), dtype, device, gen)
    norm = LlamaRMSNorm(s.hidden, eps=1e-6).to(device=device, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
    dy = torch.randn(s.tokens, s.hidden, generator=gen).to(device=device, dtype=dtype)
    cases.append(
        Case(
            "rms_norm",
            _fwd_bwd(lambda: rms_norm(x, weight, 1e-6), [x, weight], dy),
            _fwd_bwd(lambda: norm(x), [x, norm.weight], dy),
            # forward reads x, writes y; backward reads dy and x, writes dx (the weight and dW are negligible)
            bytes_moved=5 * x.numel() * size,
        )
    )

    q = _leaf((s.batch, s.heads, s.tokens // s.batch, s.head_dim), dtype, device, gen)
    k = _leaf((s.batch, s.kv_heads, s.tokens // s.batch, s.head_dim), dtype, device, gen)
    positions = torch.arange(s.tokens // s.batch, dtype=torch.float32)
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, s.head_dim, 2, dtype=torch.float32) / s.head_dim))
    angles = torch.outer(positions, inv_freq).repeat(1, 2)[None]
    cos, sin = angles.cos().to(device=device, dtype=dtype), angles.sin().to(device=device, dtype=dtype)
    dq = torch.randn(q.shape, generator=gen).to(device=device, dtype=dtype)
    dk = torch.randn(k.shape, generator=gen).to(device=device, dtype=dtype)

    def rope_step(fn):
        def step() -> torch.Tensor:
            q.grad = k.grad = None
            q_out, k_out = fn()
            torch.autograd.backward([q_out, k_out], [dq, dk])
            return q_out

        return step

    cases.append(
        Case(
            "rope",
            rope_step(lambda: apply_rope(q, k, cos, sin)),
            rope_step(lambda: apply_rotary_pos_emb(q, k, cos, sin)),
            # q and k: read and written once forward, once backward
            bytes_moved=4 * (q.numel() + k.numel()) * size,
        )
    )

    gate0 = torch.randn(s.tokens, s.intermediate, generator=gen).to(device=device, dtype=dtype)
    up0 = torch.randn(s.tokens, s.intermediate, generator=gen).to(device=device, dtype=dtype)
    gate_leaf, up_leaf = gate0.clone().requires_grad_(), up0.clone().requires_grad_()
    dh = torch.randn(s.tokens, s.intermediate, generator=gen).to(device=device, dtype=dtype)

    def swiglu_step(fn):
        # fastft's backward overwrites its saved inputs with their gradients, so both systems get fresh
        # (non-leaf) gate/up each step from a clone; the clone's traffic is counted in bytes_moved.
        def step() -> torch.Tensor:
            gate_leaf.grad = up_leaf.grad = None
            out = fn(gate_leaf * 1, up_leaf * 1)
            out.backward(dh)
            return out

        return step

    cases.append(
        Case(
            "swiglu",
            swiglu_step(swiglu),
            swiglu_step(lambda g, u: F.silu(g) * u),
            # clones 4, forward 3, backward reads dh, gate, up and writes two gradients 5
            bytes_moved=12 * gate0.numel() * size,
            notes="both systems include making non-leaf gate/up each step (gate*1, up*1)",
        )
    )

    hidden = _leaf((s.tokens, s.hidden), dtype, device, gen)
    labels = torch.randint(0, s.vocab, (s.tokens,), generator=gen).to(device)
    labels[::7] = -100
    # LoRA leaves the LM head frozen (two matmuls: logits and d_hidden); full fine-tuning trains it (a third).
    for name, trained in (("fused_linear_cross_entropy", False), ("fused_linear_cross_entropy_trained_head", True)):
        head = _leaf((s.vocab, s.hidden), dtype, device, gen, scale=0.02).requires_grad_(trained)
        inputs = [hidden, head]
        eager = _fwd_bwd(
            lambda head=head: F.cross_entropy((hidden @ head.T).float(), labels, ignore_index=-100), inputs, None
        )
        cases.append(
            Case(
                name,
                _fwd_bwd(lambda head=head: fused_linear_cross_entropy(hidden, head, labels), inputs, None),
                eager,
                flops=(3 if trained else 2) * 2 * s.tokens * s.vocab * s.hidden,
                notes="eager = F.cross_entropy on fp32 logits of hidden @ head.T, as transformers' ForCausalLMLoss",
            )
        )
        if not trained:
            frozen, frozen_eager = head, eager

    # The frozen head at other chunk heights: taller chunks give the logits GEMM more rows (the H100 run of
    # 2026-11-27 measured it at about 590 TFLOP/s with 512-row chunks at a 128k vocabulary, Unsloth's at about 800)
    # for more transient logits memory, which each row's peak (on CUDA) shows.
    default = default_chunk_size(s.tokens, s.vocab)
    for rows in (default // 2, default * 2, default * 4):
        if not 1 <= rows < s.tokens:
            continue
        cases.append(
            Case(
                f"fused_linear_cross_entropy_chunk{rows}",
                _fwd_bwd(
                    lambda rows=rows: fused_linear_cross_entropy(hidden, frozen, labels, chunk_size=rows),
                    [hidden, frozen],
                    None,
                ),
                frozen_eager,
                flops=2 * 2 * s.tokens * s.vocab * s.hidden,
                notes=f"the frozen head in {rows}-row chunks (default {default}): GEMM height against logits memory",
            )
        )

    nf4 = _nf4_case(shapes, dtype, device, gen)
    if nf4 is not None:
        cases.append(nf4)
    return cases


def _nf4_case(shapes: Shapes, dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> Case | None:
    try:
        import bitsandbytes.functional as bnbf
    except ImportError:
        return None
    dense = torch.randn(shapes.intermediate, shapes.hidden, generator=gen) * 0.02
    packed, state = bnbf.quantize_4bit(
        dense.to(device=device, dtype=dtype), quant_type="nf4", compress_statistics=True, blocksize=64
    )
    x = _leaf((shapes.tokens, shapes.hidden), dtype, device, gen)
    dy = torch.randn(shapes.tokens, shapes.intermediate, generator=gen).to(device=device, dtype=dtype)

    def bnb_linear() -> torch.Tensor:
        return x @ bnbf.dequantize_4bit(packed, state).T

    return Case(
        "nf4_linear",
        _fwd_bwd(lambda: nf4_linear(x, packed, state), [x], dy),
        _fwd_bwd(bnb_linear, [x], dy),
        # x W^T forward and dY W backward; the dequantisation twice is the kernel's own share
        flops=2 * 2 * shapes.tokens * shapes.intermediate * shapes.hidden,
        notes="eager = bitsandbytes dequantize_4bit then matmul, forward and backward (QLoRA base layer)",
        extra={
            "dequant_fastft": lambda: dequantize_nf4(packed, state),
            "dequant_eager": lambda: bnbf.dequantize_4bit(packed, state),
            "weight_numel": dense.numel(),
        },
    )


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected.double()).norm() / expected.double().norm()).item()


def run(device: torch.device, dtype: torch.dtype, shapes: Shapes, repeats: int, warmup: int, quick: bool) -> dict:
    """Measure every case on ``device`` and return the JSON-ready record."""
    probe = torch.empty(0, device=device)
    ceilings = device_ceilings(device, dtype, quick)
    rows = []
    for case in build_cases(shapes, dtype, device):
        ours, theirs = case.fastft(), case.eager()
        error = _relative_error(ours.detach(), theirs.detach())
        # alternate the systems so drift (clocks, caches) hits both alike
        ours_ms, eager_ms = [], []
        for _ in range(2):
            ours_ms.append(_median_ms(case.fastft, device, repeats, warmup))
            eager_ms.append(_median_ms(case.eager, device, repeats, warmup))
        row = {
            "kernel": case.name,
            "fastft_ms": statistics.median(ours_ms),
            "eager_ms": statistics.median(eager_ms),
            "relative_error_vs_eager": error,
            "fastft_saved_bytes": _saved_bytes(case.fastft),
            "eager_saved_bytes": _saved_bytes(case.eager),
            "notes": case.notes,
        }
        row["speedup"] = row["eager_ms"] / row["fastft_ms"]
        if device.type == "cuda":
            row["fastft_peak_extra_bytes"] = _peak_extra_bytes(case.fastft, device)
        seconds = row["fastft_ms"] * 1e-3
        if case.bytes_moved:
            row["bytes_moved"] = case.bytes_moved
            row["fastft_gb_per_s"] = case.bytes_moved / seconds / 1e9
            row["fraction_of_copy_bandwidth"] = row["fastft_gb_per_s"] / ceilings["copy_gb_per_s"]
        if case.flops:
            row["flops"] = case.flops
            row["fastft_tflop_per_s"] = case.flops / seconds / 1e12
            row["fraction_of_matmul_rate"] = row["fastft_tflop_per_s"] / ceilings["matmul_tflop_per_s"]
        if "dequant_fastft" in case.extra:
            ours_dq = _median_ms(case.extra["dequant_fastft"], device, repeats, warmup)
            theirs_dq = _median_ms(case.extra["dequant_eager"], device, repeats, warmup)
            # reads half a byte per weight plus the absmax, writes one element of dtype per weight
            dq_bytes = case.extra["weight_numel"] * (0.5 + dtype.itemsize)
            row["dequant"] = {
                "fastft_ms": ours_dq,
                "bitsandbytes_ms": theirs_dq,
                "speedup": theirs_dq / ours_dq,
                "fastft_gb_per_s": dq_bytes / (ours_dq * 1e-3) / 1e9,
                "bit_identical": bool(torch.equal(case.extra["dequant_fastft"](), case.extra["dequant_eager"]())),
            }
        rows.append(row)
        print(
            f"{case.name:40s} fastft {row['fastft_ms']:9.3f} ms   eager {row['eager_ms']:9.3f} ms   "
            f"x{row['speedup']:.2f}   rel.err {error:.1e}",
            flush=True,
        )
    return {
        "device": describe_device(device),
        "device_type": device.type,
        "fastft_path": "triton" if dispatch.use_triton(probe) else "reference",
        "dtype": str(dtype).removeprefix("torch."),
        "shapes": shapes.__dict__,
        "repeats": repeats,
        "ceilings": ceilings,
        "versions": package_versions(("torch", "triton", "transformers", "bitsandbytes", "fastft")),
        "python": platform.python_version(),
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--dtype", choices=["bf16", "fp16", "fp32"], default=None, help="default: bf16 on CUDA, fp32 on CPU"
    )
    parser.add_argument("--quick", action="store_true", help="tiny shapes and few repeats, to check the harness")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument(
        "--output", type=Path, default=None, help="JSON path (default bench/results/kernels-<device>.json)"
    )
    args = parser.parse_args(argv)

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible")
    device = torch.device(args.device)
    dtype_name = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype_name]
    shapes = QUICK_SHAPES if args.quick else (GPU_SHAPES if device.type == "cuda" else CPU_SHAPES)
    repeats = args.repeats or (3 if args.quick else 10)
    record = run(device, dtype, shapes, repeats, warmup=1 if args.quick else 3, quick=args.quick)
    output = args.output or RESULTS / f"kernels-{device_slug(record['device'])}-{dtype_name}.json"
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
