"""``fastft bench``: every system on the same model, data and seed, one process per measurement, alternated.

For each workload the systems run in turn (A B C ... A B C ...) for ``rounds`` rounds; each run is a fresh process
(:mod:`fastft.bench.worker`) in the system's environment that loads the model, sets the same seeded LoRA weights,
runs the first step (its loss, the bytes it saves for backward), then times ``steps`` more. The harness takes the
medians, compares every system with transformers + peft and with the competitor in the same checkpointing mode,
writes the JSON (and a plot) and prints the table. ``modes`` runs every system in each checkpointing mode it has;
``longest`` adds, per system, one process that searches the longest batch-1 sequence within a time budget
(:mod:`fastft.bench.longest`).
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

from fastft.bench import longest as longest_search
from fastft.bench import report, venvs
from fastft.bench.systems import BASELINE, System, select_systems
from fastft.bench.worker import PROBE_PREFIX, RESULT_PREFIX
from fastft.bench.workloads import ALPHA, MODEL_SHAPES, RANK, Workload, is_moe, is_vlm, lora_targets, select_workloads

logger = logging.getLogger(__name__)
WORKER = Path(__file__).resolve().parent / "worker.py"
# Without --longest-budget, the longest-sequence searches of one run share this many seconds (each at least
# LONGEST_MIN_BUDGET_S): the default systems fit in about six minutes.
LONGEST_TOTAL_BUDGET_S, LONGEST_MIN_BUDGET_S = 360.0, 30.0
# Past its budget a search finishes the probe it is in (the budget check predicts each one's time); the harness
# stops it when this much more has gone by and keeps the probes it printed.
LONGEST_GRACE_S = 120.0
# The search's first length: the model's longest position over this (at most LONGEST_START), doubling from there.
LONGEST_START, LONGEST_START_DIVISOR = 8192, 16


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
    longest_budget_s: float | None = None
    modes: bool = False
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


def _text(output: str | bytes | None) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else (output or "")


def _probes(stdout: str) -> list[dict[str, Any]]:
    return [json.loads(line[len(PROBE_PREFIX) :]) for line in stdout.splitlines() if line.startswith(PROBE_PREFIX)]


def _run_worker(
    python: Path, arguments: list[str], options: Options, scratch: Path, timeout_s: float | None = None
) -> dict[str, Any]:
    """Run the worker; its result, or ``{"error": ...}`` with the end of its output (and any longest-sequence probes
    it printed, under ``probes``) when it failed or ran past ``timeout_s`` (default ``options.timeout_s``)."""
    command = [str(python), str(WORKER), *arguments]
    timeout_s = options.timeout_s if timeout_s is None else timeout_s
    try:
        # Its own working folder: Unsloth writes a compiled-code cache into the current directory.
        result = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=_worker_env(options),
            cwd=scratch,
            check=False,
        )
    except subprocess.TimeoutExpired as expired:
        # POSIX keeps what the worker printed before it was killed; a search's probes are in it.
        stdout = _text(expired.stdout)
        return {"error": f"timed out after {timeout_s:.0f} s", "timed_out": True, "probes": _probes(stdout)}
    lines = [line for line in result.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if result.returncode == 0 and lines:
        return json.loads(lines[-1][len(RESULT_PREFIX) :])
    tail = (result.stdout + result.stderr).strip().splitlines()[-15:]
    killed = " (killed: out of host memory?)" if result.returncode in (-9, 137) else ""
    failed = {"error": f"worker exited with {result.returncode}{killed}", "output_tail": tail}
    probes = _probes(result.stdout)
    return failed | ({"probes": probes} if probes else {})


def prepare_model(workload: Workload, options: Options) -> str:
    """The folder ``workload`` loads: the embedded model converted to safetensors, or a random-weight model."""
    if workload.model not in MODEL_SHAPES:
        from fastft.loading.embedded import materialise_gguf, resolve_alias

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
        "family": system.family,
        "mode": system.mode,
        "compile": system.compile,
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
        **lora_targets(workload.model),
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


def longest_ladder(folder: str) -> dict[str, int]:
    """The longest-sequence search's first length, ladder end and step for the model in ``folder``: the end is its
    ``max_position_embeddings`` (its rotary table's reach), the start that over ``LONGEST_START_DIVISOR`` (at most
    ``LONGEST_START``), lengths multiples of an eighth of the start.

    Raises:
        BenchError: The folder has no ``config.json`` with ``max_position_embeddings``.
    """
    path = Path(folder) / "config.json"
    config = json.loads(path.read_text()) if path.exists() else {}
    if not isinstance(config.get("max_position_embeddings"), int):
        raise BenchError(
            f"fastft bench --longest: {path} gives no max_position_embeddings, the end of the search's ladder; "
            "benchmark a model folder whose config has one"
        )
    limit = config["max_position_embeddings"]
    start = max(8, min(LONGEST_START, limit // LONGEST_START_DIVISOR))
    return {"start": start, "limit": limit, "granularity": max(1, start // 8)}


def longest_budget(options: Options, searches: int) -> float:
    """Seconds each search may take: ``--longest-budget``, else ``LONGEST_TOTAL_BUDGET_S`` shared among them."""
    if options.longest_budget_s is not None:
        return float(options.longest_budget_s)
    return max(LONGEST_MIN_BUDGET_S, LONGEST_TOTAL_BUDGET_S / max(searches, 1))


def longest_one(
    system: System, workload: Workload, folder: str, python: Path, options: Options, scratch: Path, budget_s: float
) -> dict[str, Any]:
    """One system's longest-sequence search, in one process of its environment; the worker's result, or one
    rebuilt from the probes it printed when it was stopped (``"time"``) or failed (``"error"``)."""
    ladder = longest_ladder(folder)
    spec = _spec(system, workload, folder, options, batch=1, seq=ladder["start"], steps=1)
    spec.update(max_seq_length=ladder["limit"], longest={**ladder, "budget_s": budget_s})
    begin = time.perf_counter()
    result = _run_worker(python, ["--spec", json.dumps(spec)], options, scratch, budget_s + LONGEST_GRACE_S)
    if "stopped_by" not in result:
        stop = "time" if result.get("timed_out") else "error"
        note = f"{result.get('error', 'no result')}; rebuilt from the {len(result.get('probes', []))} probes printed"
        rebuilt = longest_search.from_probes(result.get("probes", []), stop, note)
        if stop == "error":
            rebuilt["error"] = result.get("error", "no result")
            rebuilt["output_tail"] = result.get("output_tail", [])
        result = rebuilt
    fitted = [probe for probe in result["probes"] if probe.get("fits") and probe["seq"] == result["longest_seq"]]
    entry = {
        "model": workload.model,
        "quant": workload.quant,
        "dtype": workload.dtype,
        "system": system.name,
        "family": system.family,
        "mode": system.mode,
        "checkpointing": system.checkpointing,
        **ladder,
        "budget_s": budget_s,
        "wall_s": time.perf_counter() - begin,
        **result,
    }
    if fitted:
        entry.update({f"{key}_at_longest": fitted[0][key] for key in ("step_s", "peak_vram_bytes") if key in fitted[0]})
    return entry


def _longest_all(
    workloads: list[Workload],
    systems: list[System],
    folders: dict[str, str],
    pythons: dict[str, Path],
    options: Options,
    scratch: Path,
) -> list[dict[str, Any]]:
    # Text models only: the search grows a batch-1 text sequence, which a vision-language step does not reduce to.
    models = list({(w.model, w.dtype, w.quant): w for w in workloads if not is_vlm(w.model)}.values())
    budget_s = longest_budget(options, len(models) * len(systems))
    found = []
    for workload in models:
        for system in systems:
            entry = longest_one(
                system, workload, folders[workload.name], pythons[system.name], options, scratch, budget_s
            )
            found.append(entry)
            logger.info(
                "fastft bench: %s %s %s, longest batch-1 sequence: %s",
                workload.model,
                workload.quant,
                system.name,
                longest_search.describe(entry),
            )
    return found


def run(options: Options) -> dict[str, Any]:
    """Run the benchmark ``options`` describe; returns the record written to JSON.

    Raises:
        BenchError: No CUDA device for ``--device cuda``.
    """
    import torch

    from fastft.bench.environment import describe_device, device_slug, package_versions

    if options.device == "cuda" and not torch.cuda.is_available():
        raise BenchError("fastft bench --device cuda: torch sees no CUDA device here; run with --device cpu")
    workloads = select_workloads(options.device, options.quick, options.workloads)
    systems = select_systems(options.device, options.systems, options.modes)
    started, clock = datetime.now(timezone.utc), time.perf_counter()
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    if options.device == "cpu" and load_before is not None and load_before > 1.0:
        logger.warning(
            "fastft bench: load average %.2f before the run; other work on this machine stretches CPU step times",
            load_before,
        )
    pythons = _pythons(systems, options)
    # The workers' working folder (what they write there, and the folder itself, go when the run ends).
    with tempfile.TemporaryDirectory(prefix="fastft-bench-") as folder:
        scratch = Path(folder)
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
                    # Not for MoE: the counter would count stock peft's fold of B·A into every expert (work the routed
                    # model does not ask for), so those workloads' floor is the routed analytic count.
                    counted = round_index == 0 and not is_moe(workload.model)
                    flops = counted and system.name == (BASELINE if BASELINE in pythons else systems[0].name)
                    spec = _spec(system, workload, folders[workload.name], options, count_flops=flops)
                    begin = time.perf_counter()
                    record = _run_worker(pythons[system.name], ["--spec", json.dumps(spec)], options, scratch)
                    record.update(
                        workload=workload.name,
                        system=system.name,
                        round=round_index,
                        wall_s=time.perf_counter() - begin,
                    )
                    runs.append(record)
                    logger.info("fastft bench [%d/%d] %s", len(runs), total, report.describe_run(record))
        longest = _longest_all(workloads, systems, folders, pythons, options, scratch) if options.longest else []
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
            "lora": {
                "r": RANK,
                "alpha": ALPHA,
                "dropout": 0.0,
                "targets": "q k v o gate up down",
                "moe_targets": "q k v o + every expert's gate_up_proj and down_proj (peft target_parameters)",
            },
            "step": "forward with labels = input_ids (random seeded tokens), backward, zero_grad; no optimizer",
            "order": "per workload, systems alternated round by round; one process per run",
            "workloads": [workload.to_dict() for workload in workloads],
            "systems": [system.to_dict() for system in systems],
            "modes": options.modes,
            "longest": options.longest,
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
    """Write the JSON (and plot), print the table, and refresh ``options.readme``; returns the paths written.

    The files are ``bench-<device>[-modes][-longest][-quick].json`` (and ``.png``), so a ``--modes`` or ``--longest``
    run never overwrites the plain run of the same device."""
    root = repository_root()
    output_dir = options.output_dir or ((root / "bench" / "results") if root else Path("bench-results"))
    output_dir.mkdir(parents=True, exist_ok=True)
    stem = f"bench-{report.record_key(record)}" + ("-quick" if record["settings"]["quick"] else "")
    paths = {"json": output_dir / f"{stem}.json"}
    paths["json"].write_text(json.dumps(record, indent=1) + "\n")
    if options.plot and record["runs"]:
        paths["plot"] = report.plot(record, output_dir / f"{stem}.png")
    print(report.markdown(record, plot_name=paths.get("plot").name if "plot" in paths else None))
    if options.readme is not None:
        report.update_readme(options.readme, record, paths)
        paths["readme"] = options.readme
    return paths
