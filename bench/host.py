"""Host overhead of one LoRA training step on a tiny Llama: fastft against transformers + peft and Unsloth; JSON.

    python bench/host.py                # CPU, 1 thread, 16 layers: writes results/host-cpu.json (about a minute)
    python bench/host.py --quick --out /tmp/host.json --systems transformers+peft fastft   # 2 layers (the tests)
    python bench/host.py --device cuda  # on a GPU: UNTESTED, no session has run it on one yet

The model (hidden 64, 4 / 2 heads, vocabulary 256, fp32, 1 x 16 tokens) is so small that a step's wall time on one
CPU thread is the framework's Python and dispatch cost: on a GPU, the time the GPU waits for the host. LoRA r = 8,
alpha 16 on all seven projections; a step is a forward with ``labels = input_ids``, ``backward`` and every trainable
``grad`` set to ``None`` (no optimizer). Every system is built once from the same random weights and LoRA values:
``transformers+peft`` (the baseline), ``transformers+peft+gc``; ``unsloth`` / ``unsloth-nogc`` (``"unsloth"`` / no
checkpointing), each in a ``--serve`` subprocess of ``--unsloth-python`` (Unsloth patches transformers process-wide),
``not run`` with the reason it gave where it cannot be imported; ``fastft`` / ``fastft+<mode>`` for every mode
``fastft.checkpointing.modes.resolve_mode`` accepts (found at run time), and ``fastft+compile`` (``get_peft_model(...,
compile=True)``; ``not run`` with the error where fastft rejects it).

After ``--warmup`` steps (the first one's loss is the row's), the systems alternate for ``--rounds`` rounds of
``--steps`` timed steps (the first system rotates). A row has the median host time, tokens/s and the aten operators
one step dispatches (a ``TorchDispatchMode`` over forward and backward; for compiled code, what the compiled
artifact still dispatches), and the floor those operators set (``op_floor_s``: the step's operators replayed with no
Python around them, see ``Runner.count``; ``python_share``: the rest of the host time, the framework's Python).
With ``--device cuda`` (UNTESTED) each step is synchronised on both sides (``host_issue_s``: until ``backward``
returned), and one ``torch.profiler`` step gives the kernels launched, their GPU time and the GPU busy fraction
(kernel time / median step). The JSON holds the rows, ratios to both baselines and
the issue's targets; exit status 1 after writing it when a system failed or the losses disagree.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

if __name__ == "__main__":
    _here = Path(__file__).resolve().parent
    sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != _here]
    # fastft's CPU path as a user gets it: its torch reference, not the Triton interpreter the tests turn on.
    os.environ.pop("TRITON_INTERPRET", None)

import argparse
import contextlib
import gc
import importlib.util
import json
import platform
import statistics
import subprocess
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch


def _by_path(path: Path, name: str) -> Any:
    # Loaded by path, as fastft bench's worker loads its own neighbours: the Unsloth subprocess's environment may have
    # no fastft to import from, and this script keeps its own folder off sys.path.
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# fastft bench's worker: the same seeded adapters (set_lora) in both benchmarks.
_WORKER = _by_path(Path(__file__).resolve().parent.parent / "fastft" / "bench" / "worker.py", "_fastft_bench_worker")
_OP_FLOOR = _by_path(Path(__file__).resolve().parent / "op_floor.py", "_fastft_bench_op_floor")
_REPORT = _by_path(Path(__file__).resolve().parent / "host_report.py", "_fastft_bench_host_report")
BASELINE, BASELINE_GC, BASELINE_COMPILED = _REPORT.BASELINE, _REPORT.BASELINE_GC, _REPORT.BASELINE_COMPILED
COMPILED, COMPILED_SYSTEMS, LOSS_TOLERANCE = _REPORT.COMPILED, _REPORT.COMPILED_SYSTEMS, _REPORT.LOSS_TOLERANCE
paired_ratio, summarise, table, targets = _REPORT.paired_ratio, _REPORT.summarise, _REPORT.table, _REPORT.targets
OpCounter, operator_floor = _OP_FLOOR.OpCounter, _OP_FLOOR.operator_floor
set_lora = _WORKER.set_lora
RESULTS = Path(__file__).resolve().parent / "results"
PROJECTIONS = _WORKER.TARGETS
RANK, ALPHA, BATCH, SEQ = 8, 16, _REPORT.BATCH, _REPORT.SEQ
SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
SHAPE.update(max_position_embeddings=512, tie_word_embeddings=False)
WEIGHT_SEED, LORA_SEED, INPUT_SEED = 0, _WORKER.LORA_SEED, 0
UNSLOTH = {"unsloth": "unsloth", "unsloth-nogc": False}
PREFIX = "HOST-BENCH "
QUICK = {"layers": 2, "rounds": 2, "steps": 2, "warmup": 1}
DEFAULTS = {"layers": 16, "rounds": 30, "steps": 3, "warmup": 3}
FLOOR_REPEATS = 15


class NotRun(Exception):
    """A system that cannot run in this environment (its message is the reason it gave); the row says so."""


def write_model(folder: Path, layers: int) -> None:
    """The tiny random Llama (seed ``WEIGHT_SEED``) and SmolLM2's tokenizer (loaders want one; inputs are ids)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from fastft.embedded import resolve_alias

    gguf_folder, gguf_file = resolve_alias("smollm2-135m", None)
    AutoTokenizer.from_pretrained(gguf_folder, gguf_file=gguf_file).save_pretrained(folder)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(WEIGHT_SEED)
        LlamaForCausalLM(LlamaConfig(**SHAPE, num_hidden_layers=layers)).save_pretrained(folder)


def build(system: str, folder: Path, device: str, dtype: torch.dtype, checkpointing: bool | str) -> torch.nn.Module:
    """The LoRA model of ``system`` in training mode (``checkpointing``: the fastft / Unsloth mode)."""
    keywords = dict(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=list(PROJECTIONS), bias="none")
    keywords.update(use_gradient_checkpointing=checkpointing, random_state=LORA_SEED)
    if system.startswith("unsloth"):
        from unsloth import FastLanguageModel

        # load_in_4bit defaults to True in Unsloth: the base must be the same dense weights as everyone else's.
        model, _ = FastLanguageModel.from_pretrained(str(folder), max_seq_length=SEQ, dtype=dtype, load_in_4bit=False)
        return FastLanguageModel.get_peft_model(model, **keywords)
    if system.startswith("fastft"):
        from fastft import FastModel

        model, _ = FastModel.from_pretrained(str(folder), max_seq_length=SEQ, dtype=dtype, attn_implementation="sdpa")
        if system != COMPILED:
            return FastModel.get_peft_model(model, **keywords)
        try:
            return FastModel.get_peft_model(model, **keywords, compile=True)
        except Exception as error:
            refusal = f"{type(error).__name__}: {error}"
            raise NotRun(f"FastModel.get_peft_model(..., compile=True) refused: {refusal}") from error
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype, attn_implementation="sdpa").to(device)
    model.config.use_cache = False
    if system == BASELINE_COMPILED:
        from transformers.modeling_layers import GradientCheckpointingLayer

        for layer in [module for module in model.modules() if isinstance(module, GradientCheckpointingLayer)]:
            layer.compile()
    if system == BASELINE_GC:
        # transformers 5.23 renamed gradient_checkpointing_enable (kept as a deprecated alias).
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    config = LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=list(PROJECTIONS))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(LORA_SEED)
        return get_peft_model(model, config)


class Runner:
    """One built system in this process: warm-up, timed steps, one counted step, one profiled step."""

    def __init__(self, model: torch.nn.Module, device: str) -> None:
        self.model = model.train()
        self.lora = set_lora(model)
        self.cuda = device == "cuda"
        generator = torch.Generator().manual_seed(INPUT_SEED)
        self.ids = torch.randint(0, SHAPE["vocab_size"], (BATCH, SEQ), generator=generator).to(device)
        # Collected once: walking model.parameters() each step costs milliseconds on this model.
        self.params = [parameter for parameter in model.parameters() if parameter.requires_grad]

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def step(self) -> torch.Tensor:
        """One forward + backward; the grads go back to None (what zero_grad(set_to_none=True) leaves)."""
        loss = self.model(input_ids=self.ids, labels=self.ids).loss
        loss.backward()
        for parameter in self.params:
            parameter.grad = None
        return loss  # not detached here: that would be one more op counted against every system

    def warm(self, steps: int) -> dict[str, Any]:
        """``steps`` untimed steps; the first one's loss and the LoRA values set."""
        started = time.perf_counter()
        loss = self.step().item()
        for _ in range(steps - 1):
            self.step()
        self._sync()
        return {"loss": loss, "warmup_s": time.perf_counter() - started, **self.lora}

    def time(self, steps: int) -> dict[str, list[float]]:
        """Wall times of ``steps`` steps; on CUDA also the time until ``backward`` returned (before the sync)."""
        walls, issues = [], []
        for _ in range(steps):
            self._sync()
            start = time.perf_counter()
            self.step()
            issued = time.perf_counter()
            self._sync()
            walls.append(time.perf_counter() - start)
            issues.append(issued - start)
        return {"host_s": walls, "host_issue_s": issues} if self.cuda else {"host_s": walls}

    def count(self) -> dict[str, Any]:
        """The aten operators one step dispatches, the most frequent ones, and what they alone cost (``op_floor_s``,
        ``op_replay_loop_s``: see ``bench/op_floor.py``)."""
        with OpCounter(record=True) as counter:
            self.step()
        self._sync()
        calls, counter.calls = counter.calls, []
        found = {"ops_per_step": sum(counter.counts.values()), "top_ops": counter.counts.most_common(12)}
        return found | operator_floor(calls, self._sync, FLOOR_REPEATS)

    def profile(self) -> dict[str, Any]:
        """CUDA only: kernels (and copies) one step runs on the GPU, launch calls, and their summed GPU time."""
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            self.step()
            self._sync()
        events = prof.key_averages()
        gpu = [event for event in events if event.device_type.name == "CUDA"]
        launch_names = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")
        found = dict(gpu_kernels_per_step=sum(event.count for event in gpu))
        found["kernel_launches_per_step"] = sum(event.count for event in events if event.key in launch_names)
        return found | {"gpu_kernel_s": sum(event.self_device_time_total for event in gpu) / 1e6}

    def close(self) -> None:
        """Nothing to end in this process."""


class RemoteRunner:
    """A system in a subprocess of its own (``--serve``), driven over stdin / stdout with the Runner's methods."""

    def __init__(self, command: list[str], log: Path) -> None:
        env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
        self.log = log
        with log.open("w") as stderr:  # the child keeps its own descriptor
            pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "stderr": stderr}
            self._process = subprocess.Popen(command, **pipes, text=True, env=env, cwd=log.parent)
        self.ready = self._reply()

    def _reply(self) -> dict[str, Any]:
        for line in self._process.stdout:
            if line.startswith(PREFIX):
                return json.loads(line[len(PREFIX) :])
        self._process.wait()
        tail = self.log.read_text()[-3000:]
        raise RuntimeError(f"the {self.log.stem} worker exited with {self._process.returncode}: {tail}")

    def _call(self, method: str, *args: int) -> dict[str, Any]:
        self._process.stdin.write(json.dumps([method, *args]) + "\n")
        self._process.stdin.flush()
        return self._reply()

    def __getattr__(self, method: str) -> Callable[..., dict[str, Any]]:
        # warm, time, count and profile run the worker's Runner method of that name.
        if method not in ("warm", "time", "count", "profile"):
            raise AttributeError(method)
        return lambda *args: self._call(method, *args)

    def close(self) -> None:
        if self._process.poll() is None:
            self._process.stdin.close()
            self._process.wait(timeout=60)


def serve(system: str, folder: Path, device: str, dtype: torch.dtype, threads: int) -> int:
    """The ``--serve`` worker (Unsloth): import, build, then answer one JSON command per stdin line until EOF."""
    if device == "cpu":
        torch.set_num_threads(threads)
    try:
        import unsloth  # noqa: F401  (Unsloth must be imported before transformers)
    except Exception as error:  # noqa: BLE001  (the reason Unsloth gives is the row's result)
        print(PREFIX + json.dumps({"status": "not run", "reason": f"{type(error).__name__}: {error}"}), flush=True)
        return 0
    from importlib import metadata  # not fastft.environment: this Python may have no fastft

    found: dict[str, str] = {}
    for dist in metadata.distributions():  # in sys.path order: the first one found is the one imported
        found.setdefault(dist.metadata["Name"].lower().replace("_", "-"), dist.version)
    versions = {name: found.get(name) for name in ("torch", "transformers", "peft", "trl", "unsloth", "unsloth-zoo")}
    runner = Runner(build(system, folder, device, dtype, UNSLOTH.get(system, False)), device)
    if device == "cpu":
        torch.set_num_threads(threads)  # again: Unsloth's CPU path sets its own count while loading
    print(PREFIX + json.dumps({"status": "ok", "versions": versions, "threads": torch.get_num_threads()}), flush=True)
    for line in sys.stdin:
        method, *args = json.loads(line)
        print(PREFIX + json.dumps(getattr(runner, method)(*args)), flush=True)
    return 0


def fastft_modes() -> dict[str | None, bool | str]:
    """Each distinct mode the installed fastft accepts, to a ``use_gradient_checkpointing`` value that selects it."""
    import re

    from fastft import checkpoint

    candidates: list[bool | str] = [False, True, "offload", "sqrt"]
    # _ALIASES is private; read only to find modes added after this script (they are also named in the refusal).
    candidates += [key for key in getattr(checkpoint, "_ALIASES", {}) if isinstance(key, (bool, str))]
    try:
        checkpoint.resolve_mode("not a mode")
    except ValueError as refusal:  # it names every value it takes
        candidates += re.findall(r"'([A-Za-z0-9_-]+)'", str(refusal))
    chosen: dict[str | None, bool | str] = {}
    for value in candidates:
        try:
            mode = checkpoint.resolve_mode(value)
        except ValueError:
            continue  # a quoted word of the refusal that is not a mode
        chosen.setdefault(mode, value)
    return chosen


def fastft_source() -> dict[str, Any]:
    """Where the measured fastft was imported from, and its git commit when that is a checkout."""
    import fastft

    root = Path(fastft.__file__).resolve().parents[1]
    source: dict[str, Any] = {"path": str(root), "commit": None, "dirty": None}
    if (root / ".git").exists():
        git = ["git", "-C", str(root)]
        head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout
        changes = subprocess.run([*git, "status", "--porcelain", "fastft", "kernels"], capture_output=True, text=True)
        changes.check_returncode()
        source.update(commit=head.strip(), dirty=bool(changes.stdout.strip()))
    return source


def available_systems() -> dict[str, dict[str, Any]]:
    """Every system this run can try, in build order, with its kind and ``use_gradient_checkpointing`` value."""
    systems: dict[str, dict[str, Any]] = {BASELINE: {"kind": "stock", "use_gradient_checkpointing": False}}
    systems[BASELINE_GC] = {"kind": "stock", "use_gradient_checkpointing": True}
    for name, mode in UNSLOTH.items():
        systems[name] = {"kind": "unsloth", "use_gradient_checkpointing": mode}
    for mode, value in fastft_modes().items():
        systems["fastft" if mode is None else f"fastft+{mode}"] = {
            "kind": "fastft",
            "use_gradient_checkpointing": value,
        }
    systems[COMPILED] = {"kind": "fastft", "use_gradient_checkpointing": False, "compile": True}
    systems[BASELINE_COMPILED] = {"kind": "stock", "use_gradient_checkpointing": False, "compile": True}
    return systems


def make_runner(name: str, spec: dict[str, Any], folder: Path, args: argparse.Namespace) -> Runner | RemoteRunner:
    """Build ``name``: in this process, or for Unsloth in a ``--serve`` subprocess (NotRun when it cannot run)."""
    dtype = getattr(torch, args.dtype)
    if spec["kind"] != "unsloth":
        return Runner(build(name, folder, args.device, dtype, spec["use_gradient_checkpointing"]), args.device)
    command = [args.unsloth_python, str(Path(__file__).resolve()), "--serve", name, "--folder", str(folder)]
    command += ["--device", args.device, "--dtype", args.dtype, "--threads", str(args.threads)]
    runner = RemoteRunner(command, folder.parent / f"{name}.log")
    if runner.ready["status"] != "ok":
        runner.close()
        raise NotRun(f"{runner.ready['reason']} (Python: {args.unsloth_python})")
    return runner


def measure(args: argparse.Namespace, names: list[str], specs: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Build every system, warm up, alternate the timed rounds, then count and (on CUDA) profile one step each."""
    from fastft.checkpointing.modes import get_mode

    rows = {name: {"system": name, "status": "ok", **specs[name]} for name in names}
    runners: dict[str, Runner | RemoteRunner] = {}

    def attempt(name: str, phase: str, work: Callable[[], Any]) -> Any:
        # A failure ends that system's measurement and is recorded; main exits 1 for it after writing the JSON.
        try:
            return work()
        except NotRun as reason:
            rows[name].update(status="not run", reason=str(reason))
        except Exception as error:  # noqa: BLE001  (recorded in the row, and the run's exit status)
            rows[name].update(status="failed", phase=phase, error=f"{type(error).__name__}: {error}")
            rows[name]["traceback"] = traceback.format_exc()[-4000:]
            print(f"bench/host.py: {name} failed in {phase}:\n{rows[name]['traceback']}", file=sys.stderr)
        closing = runners.pop(name, None)
        if closing is not None:
            closing.close()
        return None

    with tempfile.TemporaryDirectory(prefix="fastft-host-") as scratch:
        folder = Path(scratch) / "model"
        write_model(folder, args.layers)
        for name in names:
            started = time.perf_counter()
            runner = attempt(name, "build", lambda name=name: make_runner(name, specs[name], folder, args))
            if runner is not None:
                runners[name] = runner
                rows[name]["build_s"] = time.perf_counter() - started
                if isinstance(runner, RemoteRunner):
                    rows[name].update(versions=runner.ready["versions"], threads=runner.ready["threads"])
                if isinstance(runner, Runner) and specs[name]["kind"] == "fastft":
                    rows[name]["checkpointing"] = get_mode(runner.model.get_base_model())
        for name in list(runners):
            rows[name].update(attempt(name, "warm-up", lambda name=name: runners[name].warm(args.warmup)) or {})
            rows[name].update(host_s=[], round_medians_s=[])
        # Once, not per system: a full collection takes 0.2 s here; the collections the steps trigger are theirs.
        gc.collect()
        for index in range(args.rounds):  # short rounds: load from other processes falls on every system alike
            active = list(runners)
            for name in active[index % len(active) :] + active[: index % len(active)] if active else []:
                result = attempt(name, f"round {index}", lambda name=name: runners[name].time(args.steps))
                if result is not None:
                    for key, values in result.items():
                        rows[name].setdefault(key, []).extend(values)
                    rows[name]["round_medians_s"].append(statistics.median(result["host_s"]))
        for name in list(runners):
            rows[name].update(attempt(name, "op count", runners[name].count) or {})
            if name in COMPILED_SYSTEMS:
                # Its generated kernels are not aten operators: a replay of what it dispatches is no floor of it.
                rows[name].pop("op_floor_s", None)
            if args.device == "cuda" and name in runners:
                rows[name].update(attempt(name, "profile", runners[name].profile) or {})
        for name in list(runners):
            runners.pop(name).close()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="the JSON record (default: results/host-<device>.json)")
    parser.add_argument("--rounds", type=int, help=f"alternated rounds (default {DEFAULTS['rounds']})")
    parser.add_argument("--steps", type=int, help=f"timed steps per system per round (default {DEFAULTS['steps']})")
    parser.add_argument("--warmup", type=int, help=f"untimed steps per system first (default {DEFAULTS['warmup']})")
    parser.add_argument("--layers", type=int, help=f"decoder layers (default {DEFAULTS['layers']})")
    parser.add_argument("--systems", nargs="+", help="names as the table prints them (default: every one)")
    parser.add_argument("--quick", action="store_true", help="2 layers, 2 rounds x 2 steps: checks the harness")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--dtype", default="float32", choices=sorted(LOSS_TOLERANCE))
    parser.add_argument("--threads", type=int, default=1, help="torch threads on CPU (default 1)")
    parser.add_argument("--unsloth-python", help="the Python that runs Unsloth (default: fastft bench's venv or this)")
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.command = " ".join(["python bench/host.py", *(sys.argv[1:] if argv is None else argv)])
    for key, value in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.serve:
        return serve(args.serve, Path(args.folder), args.device, getattr(torch, args.dtype), args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench/host.py: --device cuda, but torch sees no CUDA device")
    if args.device == "cpu" and torch.cuda.is_available():
        raise SystemExit("bench/host.py: --device cpu on a machine with a GPU: run it with CUDA_VISIBLE_DEVICES=''")
    if not args.unsloth_python:
        from fastft.bench import venvs

        # fastft bench's Unsloth venv where one was built, else this interpreter (where Unsloth may be missing).
        python = venvs.python_of(venvs.default_root() / "unsloth")
        args.unsloth_python = str(python) if python.exists() else sys.executable
    threads = torch.get_num_threads()
    try:
        if args.device == "cpu":
            torch.set_num_threads(args.threads)
        return run(args)
    finally:
        torch.set_num_threads(threads)


def run(args: argparse.Namespace) -> int:
    """Measure, write the JSON, print the table; 1 when a system failed or the losses disagree."""
    from fastft.environment import cpu_model, describe_device, device_slug, package_versions
    from fastft.kernels import dispatch

    specs = available_systems()
    names = args.systems or list(specs)
    unknown = [name for name in names if name not in specs]
    if unknown:
        raise SystemExit(f"bench/host.py: unknown system(s) {unknown}; choose from {list(specs)}")
    names = [name for name in specs if name in names]  # build order: stock before anything that patches
    device = describe_device(torch.device(args.device))
    out_path = Path(args.out or RESULTS / f"host-{device_slug(device)}.json")
    # Under the Triton interpreter (pytest sets it before fastft is imported) fastft's CPU path would be Triton's
    # interpreter, which no user runs: force its torch reference, the CPU path a user gets.
    interpreted = args.device == "cpu" and dispatch.INTERPRETED
    load_before = os.getloadavg()
    started = time.perf_counter()
    with dispatch.force_reference() if interpreted else contextlib.nullcontext():
        rows = measure(args, names, specs)
    losses = summarise(rows, args.dtype)
    settings = dict(layers=args.layers, model=SHAPE, batch=BATCH, seq=SEQ, tokens_per_step=BATCH * SEQ, rank=RANK)
    settings.update(lora_alpha=ALPHA, target_modules=list(PROJECTIONS), dtype=args.dtype, quick=args.quick)
    settings.update(threads=torch.get_num_threads() if args.device == "cpu" else None)
    settings.update(rounds=args.rounds, steps=args.steps, warmup=args.warmup)
    settings["host_s"] = "wall time of forward + backward + grads to None (CUDA: synchronised on both sides)"
    settings["ops_per_step"] = "aten operators one step dispatches (TorchDispatchMode, forward and backward)"
    record = dict(benchmark="bench/host.py", command=args.command, device=device, device_type=args.device)
    record.update(cpu_model=cpu_model(), platform=platform.platform(), python=platform.python_version())
    record.update(versions=package_versions(("torch", "transformers", "peft", "trl", "fastft")))
    record.update(fastft_source=fastft_source(), triton_interpreter_forced_off=interpreted)
    record.update(fastft_kernel_path="GPU (Triton kernels)" if args.device == "cuda" else "torch reference")
    record.update(unsloth_python=args.unsloth_python, settings=settings, duration_s=time.perf_counter() - started)
    record.update(load_average={"before": load_before, "after": os.getloadavg()}, systems=rows, losses=losses)
    record["targets"] = targets(rows)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(record, indent=1) + "\n")
    print(table(record))
    print(f"wrote {out_path}")
    failed = [name for name, row in rows.items() if row["status"] == "failed"]
    return 1 if failed or losses["agree"] is False else 0


if __name__ == "__main__":
    sys.exit(main())
