"""The static GPU check: every Triton kernel of fastft compiled for the GPUs users have, without a GPU.

``python -m fastft.kernels.compile_check [--output FILE] [--jobs N]`` (also ``fastft doctor --compile``):

1. Runs the kernels' own launch code, on ``meta`` tensors, for the shapes of SmolLM2-135M, Llama-3.2-1B and
   Llama-3-8B at 8,192 tokens (LoRA ranks 8 to 128 for the projection groups, 16-bit and NF4 bases, forward and
   backward), once per target (sm_75, sm_80, sm_86, sm_89, sm_90) and dtype, inside
   :func:`fastft.kernels.targets.simulate`, with every ``@triton.jit`` kernel swapped for a recorder. For the GEMMs,
   every configuration the tuner may choose on that target (:mod:`fastft.kernels.gemm_configs`) is walked with
   :func:`fastft.kernels.gemm_tuner.force`. So the launch arguments, grids and settings are the launchers' own.
2. Compiles each distinct specialisation through triton's compiler for that target (a stand-in driver answers
   ``get_current_target``), with the runtime's own specialisation of the recorded arguments (pointer alignment,
   integers divisible by 16), down to PTX and cubin.
3. Judges each binary with :func:`fastft.kernels.compiled.usage`: registers and spill stack (``cuobjdump``), shared
   memory against the target's per-block limit, tensor-core instructions for ``tl.dot`` and asynchronous copies for
   16-bit GEMMs.

It prints a table per kernel and target and writes JSON (default ``bench/results/compile.json`` when run from a
checkout). The exit status is 1 when any selectable configuration fails to compile, spills, overruns shared memory,
or (sm_80+) multiplies without tensor cores or without a software pipeline.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import functools
import importlib
import json
import multiprocessing
import os
import pkgutil
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fastft.kernels import dispatch, gemm_tuner, targets
from fastft.kernels.compile_cases import MODELS, TOKENS, Model, groups, others
from fastft.kernels.gemm_configs import candidates

DTYPES = {75: (torch.float16, torch.float32)} | {
    cc: (torch.bfloat16, torch.float16, torch.float32) for cc in (80, 86, 89, 90)
}
RANKS = (8, 16, 32, 64, 128)
# Pointers the recorder hands to the compiler: what torch's caching allocator gives (512-byte aligned blocks), plus
# each view's own offset, so alignment is specialised as at run time.
_BASE_ADDRESS = 1 << 21
GEMM_KERNELS = ("_lora_gemm_kernel", "_lora_gemm_nf4_kernel")


@dataclass(frozen=True)
class Pointer:
    """What the compiler needs of a tensor argument: its dtype and an address with the tensor's alignment."""

    dtype: torch.dtype
    address: int

    def data_ptr(self) -> int:
        return self.address


@dataclass
class Launch:
    """One recorded kernel launch."""

    module: str
    kernel: str
    args: tuple
    kwargs: dict
    context: dict = field(default_factory=dict)


def _convert(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return Pointer(value.dtype, _BASE_ADDRESS + value.storage_offset() * value.element_size())
    return value


class _Recorder:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](*args, **kwargs)`` records instead of launching."""

    def __init__(self, module: str, name: str, sink: list[Launch], context: dict) -> None:
        self.module, self.name, self.sink, self.context = module, name, sink, context

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        def record(*args: Any, **kwargs: Any) -> None:
            converted = tuple(_convert(a) for a in args)
            self.sink.append(
                Launch(
                    self.module, self.name, converted, {k: _convert(v) for k, v in kwargs.items()}, dict(self.context)
                )
            )

        return record


@functools.cache
def jit_functions() -> dict[str, tuple[str, Any]]:
    """Every ``@triton.jit`` function defined in fastft.kernels: name -> (module, JITFunction).

    Under ``TRITON_INTERPRET=1`` they are interpreted functions: they can be recorded (the tests do), not compiled.
    """
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    import fastft.kernels as package

    found = {}
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"fastft.kernels.{info.name}")
        for name, value in vars(module).items():
            if isinstance(value, JITFunction | InterpretedFunction) and _defined_in(value, module.__name__):
                found[name] = (module.__name__, value)
    return found


def _defined_in(function: Any, module: str) -> bool:
    inner = getattr(function, "fn", function)
    return getattr(inner, "__module__", None) == module


def launched_kernels() -> dict[str, tuple[str, Any]]:
    """The kernels a launcher starts (``_…_kernel``); the other jit functions are helpers inlined into them."""
    return {name: entry for name, entry in jit_functions().items() if name.endswith("_kernel")}


@contextlib.contextmanager
def recording(sink: list[Launch], context: dict) -> Iterator[None]:
    """Swap every launched kernel for a :class:`_Recorder` in its module for the duration of the block."""
    swapped = []
    for name, (module_name, function) in launched_kernels().items():
        module = sys.modules[module_name]
        setattr(module, name, _Recorder(module_name, name, sink, context))
        swapped.append((module, name, function))
    try:
        yield
    finally:
        for module, name, function in swapped:
            setattr(module, name, function)


def record_launches(models: dict[str, Model] = MODELS, ranks: tuple[int, ...] = RANKS) -> tuple[list[Launch], list]:
    """Run every launcher for every target, dtype, model and rank under the recorder.

    Returns:
        ``(launches, not_selectable)``: each launch with its context (target, dtype, model, call, rank, candidate),
        and one row per (target, dtype, group kind) where no Triton GEMM may run, with the reason.
    """
    launches: list[Launch] = []
    not_selectable = []
    for capability, dtypes in DTYPES.items():
        for dtype in dtypes:
            for kind in ("dense", "nf4"):
                if not candidates(capability, dtype, kind):
                    not_selectable.append(
                        {
                            "target": f"sm_{capability}",
                            "dtype": str(dtype).removeprefix("torch."),
                            "kind": kind,
                            "reason": gemm_tuner.no_triton_reason(capability, dtype),
                        }
                    )
            for name, model in models.items():
                launches += record(capability, dtype, name, model, ranks)
    return launches, not_selectable


def record(
    capability: int, dtype: torch.dtype, model_name: str, model: Model, ranks: tuple[int, ...] = RANKS
) -> list[Launch]:
    """The launches of every kernel call for one target, dtype and model: the non-GEMM kernels once, and each LoRA
    group (16-bit and NF4 base, every rank) once per GEMM candidate the target allows (cuBLAS where none)."""
    launches: list[Launch] = []
    context = {"target": f"sm_{capability}", "dtype": str(dtype).removeprefix("torch."), "model": model_name}
    with targets.simulate(capability):
        for call, run in others(model, dtype):
            with recording(launches, {**context, "call": call}), gemm_tuner.force("cublas"):
                run()
        for nf4 in (False, True):
            options = gemm_tuner.triton_candidates(capability, dtype, nf4, every=True) or [None]
            for option in options:
                for rank in ranks:
                    for call, run in groups(model, rank, dtype, nf4):
                        case = {
                            **context,
                            "call": f"{call} ({'nf4' if nf4 else 'dense'} base)",
                            "rank": rank,
                            "candidate": "cublas" if option is None else option.label,
                        }
                        with (
                            recording(launches, case),
                            gemm_tuner.force("cublas" if option is None else "triton", option),
                        ):
                            run()
    return launches


def specialization_key(launch: Launch, capability: int) -> tuple:
    """What makes two launches one binary: triton specialises pointers on 16-byte alignment, integers on being 1 or
    a multiple of 16 (unless marked do_not_specialize) and on fitting 32 bits; constexprs and options by value."""
    _, function = jit_functions()[launch.kernel]
    parts = [launch.kernel, capability]
    for param, value in zip(function.params, launch.args, strict=False):
        if isinstance(value, Pointer):
            parts.append((str(value.dtype), value.address % 16 == 0))
        elif isinstance(value, bool) or param.is_constexpr:
            parts.append(repr(value))
        elif isinstance(value, int):
            wide = not -(2**31) <= value < 2**31
            parts.append(("i", wide) if param.do_not_specialize else ("i", wide, value == 1, value % 16 == 0))
        else:
            parts.append(type(value).__name__)
    parts.append(tuple(sorted((k, repr(v)) for k, v in launch.kwargs.items())))
    return tuple(parts)


class _StandInDriver:
    """The parts of triton's driver that compiling for a target reads, answering for a GPU that is not there."""

    def __init__(self, capability: int) -> None:
        self.capability = capability

    def get_current_device(self) -> tuple[str, int]:
        return ("fastft-compile-check", self.capability)

    def get_current_stream(self, device: Any = None) -> int:
        return 0

    def get_current_target(self) -> Any:
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", self.capability, 32)

    def get_active_torch_device(self) -> torch.device:
        return torch.device("meta")


def compile_launch(launch: Launch, capability: int) -> dict[str, Any]:
    """Compile one recorded launch for a target and judge the binary; a compile error is a result, not a raise."""
    from triton.runtime import driver

    from fastft.kernels.compiled import usage

    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # triton 3.9's default, said aloud to silence its warning
    _, function = jit_functions()[launch.kernel]
    previous = driver._active
    driver.set_active(_StandInDriver(capability))
    started = time.perf_counter()
    try:
        kernel = function.warmup(*launch.args, grid=(1,), **launch.kwargs)
    except Exception as error:  # noqa: BLE001 - the report names every failure
        return {"error": f"{type(error).__name__}: {str(error).strip()[:2000]}"}
    finally:
        driver._active = previous
    seconds = time.perf_counter() - started
    dot = launch.kernel in GEMM_KERNELS
    x_dtype = next(a.dtype for a in launch.args if isinstance(a, Pointer))
    found = usage(kernel, capability, has_dot=dot, sixteen_bit=x_dtype in (torch.float16, torch.bfloat16))
    constexprs = {k: v for k, v in launch.kwargs.items() if not isinstance(v, Pointer)}
    return {"compile_s": round(seconds, 2), "settings": {k: repr(v) for k, v in constexprs.items()}, **found.as_dict()}


def _compile_job(job: tuple[Launch, int]) -> dict[str, Any]:
    return compile_launch(*job)


def run_check(jobs: int | None = None, progress: bool = True) -> dict[str, Any]:
    """Record, compile and judge everything; the report as a JSON-ready dict."""
    if dispatch.INTERPRETED:
        raise RuntimeError(
            "fastft.kernels.compile_check: TRITON_INTERPRET=1 turns the kernels into interpreted functions that "
            "cannot be compiled; run it without TRITON_INTERPRET."
        )
    if not dispatch.HAS_TRITON:
        raise RuntimeError("fastft.kernels.compile_check needs triton: pip install 'fastft[cuda]' or triton.")
    import triton

    started = time.perf_counter()
    launches, not_selectable = record_launches()
    binaries: dict[tuple, dict] = {}
    cases = []
    for launch in launches:
        capability = int(launch.context["target"].removeprefix("sm_"))
        key = specialization_key(launch, capability)
        entry = binaries.setdefault(key, {"id": len(binaries), "launch": launch, "capability": capability})
        cases.append({**launch.context, "kernel": launch.kernel, "binary": entry["id"]})
    ordered = sorted(binaries.values(), key=lambda e: e["id"])
    work = [(entry["launch"], entry["capability"]) for entry in ordered]
    results = _compile_all(work, jobs, progress)
    records = []
    for entry, result in zip(ordered, results, strict=True):
        launch = entry["launch"]
        records.append({"id": entry["id"], "kernel": launch.kernel, "target": f"sm_{entry['capability']}", **result})
    expected = set(launched_kernels())
    seen_by_target: dict[str, set[str]] = {}
    for record in records:
        seen_by_target.setdefault(record["target"], set()).add(record["kernel"])
    uncovered = {
        target: sorted(expected - seen - (set(GEMM_KERNELS) if target == "sm_75" else set()))
        for target, seen in seen_by_target.items()
    }
    return {
        "about": "fastft static GPU check: python -m fastft.kernels.compile_check (no GPU needed)",
        "versions": {"triton": triton.__version__, "torch": torch.__version__, **_fastft_version()},
        "tokens": TOKENS,
        "ranks": list(RANKS),
        "models": {name: vars(model) for name, model in MODELS.items()},
        "targets": {
            f"sm_{cc}": {"cards": t.cards, "shared_bytes": t.shared_bytes, "tensor_core_dot": t.tensor_core_dot}
            for cc, t in targets.TARGETS.items()
        },
        "helpers": sorted(set(jit_functions()) - expected),
        "not_selectable": not_selectable,
        "uncovered": {k: v for k, v in uncovered.items() if v},
        "binaries": records,
        "cases": cases,
        "seconds": round(time.perf_counter() - started, 1),
    }


def _fastft_version() -> dict[str, str]:
    from fastft._version import __version__

    return {"fastft": __version__}


def _compile_all(work: list[tuple[Launch, int]], jobs: int | None, progress: bool) -> list[dict]:
    jobs = jobs or os.cpu_count() or 1
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(work), desc="compiling for sm_75/80/86/89/90", unit="binary")
    try:
        if jobs == 1:
            results = []
            for item in work:
                results.append(_compile_job(item))
                if bar is not None:
                    bar.update()
            return results
        # spawn: each worker imports triton afresh instead of inheriting the parent's driver state.
        context = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
            futures = [pool.submit(_compile_job, item) for item in work]
            for _done in concurrent.futures.as_completed(futures):
                if bar is not None:
                    bar.update()
            return [future.result() for future in futures]
    finally:
        if bar is not None:
            bar.close()


def failures(report: dict[str, Any]) -> list[str]:
    """Every reason the report fails: compile errors, problems of selectable binaries, uncovered kernels."""
    found = []
    for record in report["binaries"]:
        where = f"{record['kernel']} on {record['target']} (binary {record['id']}, {record.get('settings', {})})"
        if "error" in record:
            found.append(f"{where}: does not compile: {record['error'][:300]}")
        for problem in record.get("problems", []):
            found.append(f"{where}: {problem}")
    for target, kernels in report["uncovered"].items():
        found.append(f"{target}: no launch recorded for {', '.join(kernels)}")
    return found


def table(report: dict[str, Any]) -> str:
    """A Markdown table: per kernel and target, binaries, worst registers / spill / shared memory, instructions."""
    rows: dict[tuple[str, str], list[dict]] = {}
    for record in report["binaries"]:
        rows.setdefault((record["kernel"], record["target"]), []).append(record)
    lines = [
        "| kernel | target | binaries | max registers | max spill (B) | max shared (KB) / limit | tensor cores | "
        "async copies | problems |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for (kernel, target), records in sorted(rows.items()):
        ok = [r for r in records if "error" not in r]
        limit = report["targets"][target]["shared_bytes"] // 1024
        shared = max((r["shared_bytes"] for r in ok), default=0) / 1024
        registers = max((r["registers"] or 0 for r in ok), default=0)
        spill = max((r["spill_bytes"] or 0 for r in ok), default=0)
        if kernel in GEMM_KERNELS:
            mma = sorted({"wgmma" if r["wgmma"] else "mma" if r["mma"] else "none" for r in ok})
            cores = "/".join(mma)
            copies = "yes" if all(r["cp_async"] + r["tma"] for r in ok) else "no"
        else:
            cores = copies = "-"
        problems = sum(len(r.get("problems", [])) + ("error" in r) for r in records)
        lines.append(
            f"| `{kernel}` | {target} | {len(records)} | {registers} | {spill} | {shared:.0f} / {limit} | {cores} | "
            f"{copies} | {problems or 'none'} |"
        )
    for row in report["not_selectable"]:
        if row["dtype"] != "float32" or row["target"] == "sm_75":
            lines.append(
                f"| `lora GEMM ({row['kind']})` | {row['target']} | {row['dtype']}: not selectable, cuBLAS runs "
                f"| | | | | | {row['reason']} |"
            )
    return "\n".join(lines)


def dumps(report: dict[str, Any]) -> str:
    """The report as JSON text, one line per launch case (there are thousands) so the file stays readable in a diff."""
    head = json.dumps({key: value for key, value in report.items() if key != "cases"}, indent=1)
    cases = ",\n  ".join(json.dumps(case, separators=(",", ":")) for case in report["cases"])
    return f'{head[:-2]},\n "cases": [\n  {cases}\n ]\n}}\n'


def default_output() -> Path:
    """``bench/results/compile.json`` of the checkout this module sits in, else ``./compile.json``."""
    checkout = Path(__file__).resolve().parent.parent
    results = checkout / "bench" / "results"
    return results / "compile.json" if results.is_dir() else Path("compile.json")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fastft.kernels.compile_check", description=__doc__.split("\n")[0])
    parser.add_argument("--output", type=Path, default=None, help="JSON file to write (default: %(default)s)")
    parser.add_argument("--jobs", type=int, default=None, help="compiler processes (default: one per core)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    output = args.output or default_output()
    report = run_check(jobs=args.jobs, progress=not args.quiet)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(dumps(report))
    print(table(report))
    problems = failures(report)
    print(
        f"\n{len(report['cases'])} launch cases, {len(report['binaries'])} binaries, {report['seconds']} s; "
        f"written to {output}"
    )
    if problems:
        print(f"\n{len(problems)} problem(s):", *problems, sep="\n  ")
        return 1
    print(
        "no compile failure, spill or shared-memory overrun; every selectable GEMM uses tensor cores and is pipelined"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
