"""``fastft bench``: every system on the same model, data and seed, one process per measurement, alternated.

For each workload the systems run in turn (A B C ... A B C ...) for ``rounds`` rounds; each run is a fresh process
(:mod:`fastft.bench.worker`) in the system's environment that loads the model, sets the same seeded LoRA weights,
runs the first step (its loss, the bytes it saves for backward), then times ``steps`` more. The harness takes the
medians, compares every system with transformers + peft, writes the JSON (and a plot) and prints the table.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from fastft.bench import report, venvs
from fastft.bench.systems import BASELINE, System, select_systems
from fastft.bench.worker import RESULT_PREFIX
from fastft.bench.workloads import ALPHA, MODEL_SHAPES, RANK, Workload, select_workloads

logger = logging.getLogger(__name__)
WORKER = Path(__file__).resolve().parent / "worker.py"
# Sequence lengths tried, in order, for the longest sequence each system fits at batch 1 (GPU).
LONGEST_LADDER = (8192, 12288, 16384, 24576, 32768, 49152, 65536, 98304, 131072, 196608, 262144)


class BenchError(RuntimeError):
    """The benchmark cannot run as asked; the message says why and what to change."""


@dataclass
class Options:
    """What ``fastft bench`` runs; the fields mirror its command-line flags."""

    device: str = "cpu"
    workloads: list[str] | None = None
    systems: list[str] | None = None
    rounds: int = 2
    steps: int = 3
    quick: bool = False
    longest: bool = False
    output_dir: Path | None = None
    venv_root: Path | None = None
    rebuild_venvs: bool = False
    timeout_s: int = 1800
    plot: bool = True
    readme: Path | None = None


def repository_root() -> Path | None:
    """The source checkout fastft runs from, if it runs from one (it has ``bench/`` beside ``fastft/``)."""
    root = Path(__file__).resolve().parents[2]
    return root if (root / "pyproject.toml").exists() and (root / "bench").is_dir() else None


def _cache_dir(options: Options) -> Path:
    return (options.venv_root or venvs.default_root()).parent


def _worker_env(options: Options) -> dict[str, str]:
    env = dict(os.environ)
    # A benchmark never measures Triton's interpreter (the test suite turns it on for itself).
    env.pop("TRITON_INTERPRET", None)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return env


def _run_worker(python: Path, arguments: list[str], options: Options, scratch: Path) -> dict[str, Any]:
    """Run the worker; its result, or ``{"error": ...}`` with the end of its output when it failed."""
    command = [str(python), str(WORKER), *arguments]
    try:
        # Its own working folder: Unsloth writes a compiled-code cache into the current directory.
        result = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=options.timeout_s,
            env=_worker_env(options),
            cwd=scratch,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {options.timeout_s} s"}
    lines = [line for line in result.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if result.returncode == 0 and lines:
        return json.loads(lines[-1][len(RESULT_PREFIX) :])
    tail = (result.stdout + result.stderr).strip().splitlines()[-15:]
    killed = " (killed: out of host memory?)" if result.returncode in (-9, 137) else ""
    return {"error": f"worker exited with {result.returncode}{killed}", "output_tail": tail}


def prepare_model(workload: Workload, options: Options) -> str:
    """The folder ``workload`` loads: the embedded model converted to safetensors, or a random-weight model."""
    if workload.model not in MODEL_SHAPES:
        from fastft.embedded import materialise_gguf, resolve_alias

        folder, gguf_file = resolve_alias(workload.model, None)
        return str(materialise_gguf(folder, gguf_file)) if gguf_file is not None else folder
    dtype = "float32" if workload.dtype == "float32" else "bfloat16"
    folder = _cache_dir(options) / "models" / f"{workload.model}-{dtype}"
    code = (
        "import sys; from pathlib import Path; from fastft.bench.workloads import write_random_model; "
        f"write_random_model({workload.model!r}, Path(sys.argv[1]), {dtype!r}, {options.device!r})"
    )
    # In a process of its own, so the harness never holds GPU memory the measured processes could use.
    logger.info("fastft bench: writing the random-weight %s model to %s", workload.model, folder)
    subprocess.run([sys.executable, "-c", code, str(folder)], check=True, env=_worker_env(options))
    return str(folder)


def _spec(system: System, workload: Workload, folder: str, options: Options, **overrides: Any) -> dict[str, Any]:
    spec = {
        "system": system.name,
        "folder": folder,
        "dtype": workload.dtype,
        "quant": workload.quant,
        "batch": workload.batch,
        "seq": workload.seq,
        "device": options.device,
        "max_seq_length": workload.seq,
        "rank": RANK,
        "alpha": ALPHA,
        "steps": options.steps,
        "count_flops": False,
    }
    spec.update(overrides)
    return spec


def _pythons(systems: list[System], options: Options) -> dict[str, Path]:
    pythons = {}
    for system in systems:
        if system.venv is None:
            pythons[system.name] = Path(sys.executable)
        else:
            pythons[system.name] = venvs.ensure(system.venv, options.venv_root, options.rebuild_venvs)
    return pythons


def longest_sequence(fits: Any, ladder: tuple[int, ...] = LONGEST_LADDER) -> tuple[int | None, list[dict[str, Any]]]:
    """Walk ``ladder`` upwards while ``fits(seq)`` holds; the last length that fitted (None: not even the first),
    and every probe made. ``fits`` returns a worker record; an ``"oom"`` record ends the walk."""
    best, probes = None, []
    for seq in ladder:
        record = fits(seq)
        probes.append({"seq": seq, **record})
        if record.get("oom") or "error" in record:
            break
        best = seq
    return best, probes


def run(options: Options) -> dict[str, Any]:
    """Run the benchmark ``options`` describe; returns the record written to JSON.

    Raises:
        BenchError: No CUDA device for ``--device cuda``.
    """
    import torch

    from fastft.environment import describe_device, device_slug, package_versions

    if options.device == "cuda" and not torch.cuda.is_available():
        raise BenchError("fastft bench --device cuda: torch sees no CUDA device here; run with --device cpu")
    workloads = select_workloads(options.device, options.quick, options.workloads)
    systems = select_systems(options.device, options.systems)
    started, clock = datetime.now(timezone.utc), time.perf_counter()
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    if options.device == "cpu" and load_before is not None and load_before > 1.0:
        logger.warning(
            "fastft bench: load average %.2f before the run; other work on this machine stretches CPU step times",
            load_before,
        )
    pythons = _pythons(systems, options)
    scratch = Path(tempfile.mkdtemp(prefix="fastft-bench-"))
    folders = {workload.name: prepare_model(workload, options) for workload in workloads}
    rates = {}
    for dtype in sorted({workload.dtype for workload in workloads}):
        result = _run_worker(Path(sys.executable), ["--matmul-rate", options.device, dtype], options, scratch)
        rates[dtype] = result.get("matmul_flops_per_s")
    runs: list[dict[str, Any]] = []
    total = len(workloads) * options.rounds * len(systems)
    for workload in workloads:
        for round_index in range(options.rounds):
            for system in systems:
                flops = round_index == 0 and system.name == (BASELINE if BASELINE in pythons else systems[0].name)
                spec = _spec(system, workload, folders[workload.name], options, count_flops=flops)
                begin = time.perf_counter()
                record = _run_worker(pythons[system.name], ["--spec", json.dumps(spec)], options, scratch)
                record.update(
                    workload=workload.name, system=system.name, round=round_index, wall_s=time.perf_counter() - begin
                )
                runs.append(record)
                logger.info("fastft bench [%d/%d] %s", len(runs), total, report.describe_run(record))
    longest = []
    if options.longest:
        for workload in {(w.model, w.dtype, w.quant): w for w in workloads}.values():
            for system in systems:

                def fits(seq: int, system: System = system, workload: Workload = workload) -> dict[str, Any]:
                    spec = _spec(system, workload, folders[workload.name], options, batch=1, seq=seq, steps=1)
                    return _run_worker(pythons[system.name], ["--spec", json.dumps(spec)], options, scratch)

                best, probes = longest_sequence(fits)
                longest.append(
                    {
                        "model": workload.model,
                        "quant": workload.quant,
                        "dtype": workload.dtype,
                        "system": system.name,
                        "longest_seq": best,
                        "probes": probes,
                    }
                )
                logger.info(
                    "fastft bench: %s %s %s fits %s tokens at batch 1",
                    workload.model,
                    workload.quant,
                    system.name,
                    best,
                )
    device = describe_device(torch.device(options.device)) if options.device == "cpu" else _cuda_name(options)
    record = {
        "benchmark": "fastft bench",
        "device": device,
        "device_slug": device_slug(device),
        "started": started.isoformat(timespec="seconds"),
        "duration_s": round(time.perf_counter() - clock, 1),
        "load_average": {"before": load_before, "after": os.getloadavg()[0] if hasattr(os, "getloadavg") else None},
        "settings": {
            "rounds": options.rounds,
            "timed_steps_per_run": options.steps,
            "lora": {"r": RANK, "alpha": ALPHA, "dropout": 0.0, "targets": "q k v o gate up down"},
            "step": "forward with labels = input_ids (random seeded tokens), backward, zero_grad; no optimizer",
            "order": "per workload, systems alternated round by round; one process per run",
            "workloads": [workload.to_dict() for workload in workloads],
            "systems": [vars(system) | {"devices": list(system.devices)} for system in systems],
            "quick": options.quick,
        },
        "harness_versions": package_versions(("torch", "transformers", "peft", "trl", "bitsandbytes", "fastft")),
        "matmul_flops_per_s": rates,
        "runs": runs,
        "longest": longest,
    }
    record["summary"] = report.summarise(record)
    record["targets"] = report.evaluate_targets(record)
    return record


def _cuda_name(options: Options) -> str:
    code = "import torch; print(torch.cuda.get_device_name(0))"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=_worker_env(options)
    )
    return result.stdout.strip()


def write(record: dict[str, Any], options: Options) -> dict[str, Path]:
    """Write the JSON (and plot), print the table, and refresh ``options.readme``; returns the paths written."""
    root = repository_root()
    output_dir = options.output_dir or ((root / "bench" / "results") if root else Path("bench-results"))
    output_dir.mkdir(parents=True, exist_ok=True)
    stem = f"bench-{record['device_slug']}" + ("-quick" if record["settings"]["quick"] else "")
    paths = {"json": output_dir / f"{stem}.json"}
    paths["json"].write_text(json.dumps(record, indent=1) + "\n")
    if options.plot:
        paths["plot"] = report.plot(record, output_dir / f"{stem}.png")
    print(report.markdown(record, plot_name=paths.get("plot").name if "plot" in paths else None))
    if options.readme is not None:
        report.update_readme(options.readme, record, paths)
        paths["readme"] = options.readme
    return paths
