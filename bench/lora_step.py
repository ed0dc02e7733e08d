"""One LoRA training step of a whole model, fastft against transformers + peft, on CPU; write JSON.

Usage::

    python bench/lora_step.py                  # SmolLM2-135M (the embedded model), 2 x 512 tokens, fp32, 5 repeats
    python bench/lora_step.py --model <folder> --seq 32 --batch 2 --repeats 1 --out /tmp/step.json   # the harness

Two systems load the same safetensors folder (for the default ``smollm2-135m``, the float32 folder fastft converts
the embedded GGUF into) in float32 with ``attn_implementation="sdpa"`` and put LoRA (r=16, alpha 16, no dropout) on
all seven projections:

- ``transformers+peft``: ``AutoModelForCausalLM.from_pretrained`` and ``peft.get_peft_model``, nothing else;
- ``fastft``: ``FastModel.from_pretrained`` and ``FastModel.get_peft_model`` without gradient checkpointing.

fastft's LoRA weights are copied into the peft model, with LoRA B set non-zero (seeded) first, so both compute the
same function; the first step's losses must agree within 1e-4 relative (and the LoRA gradients are compared), or
the script writes its record and exits with status 1. One step is the forward with ``labels = input_ids`` (random
tokens, seeded), ``loss.backward()`` and ``zero_grad``; no optimizer. The systems alternate (peft, fastft, peft, ...)
after one warm-up step each, and the medians of ``--repeats`` steps are compared. Bytes saved for backward are
counted with ``torch.autograd.graph.saved_tensors_hooks`` over one forward: each storage once, the model's
parameters (frozen base weights included) left out; the raw sum of every packed tensor's bytes is kept too. Peak RSS
is measured in a fresh subprocess per system (the process's high-water mark is reset after loading, then one step
runs), since two models in one process share one RSS.

On CPU fastft runs its torch reference path, never the Triton kernels: the record says ``"fastft_path":
"reference"``. The machine's load average before and after is recorded: with as many threads as cores, other work
on the machine stretches steps several-fold and unevenly (on 2 cores, SmolLM2 steps of 8 to 51 s under load against
5.5 s quiet), so a run under load measures the load, not the systems.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

if __name__ == "__main__":
    # Run as a script, this folder is sys.path[0]; keep it off the path so nothing here can shadow an installed
    # package (bitsandbytes imports the PyPI `kernels`).
    _here = Path(__file__).resolve().parent
    sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != _here]

import argparse
import gc
import json
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parent / "results"
PEFT, FASTFT = "transformers+peft", "fastft"
SYSTEMS = (PEFT, FASTFT)
TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANK, ALPHA = 16, 16
LOSS_TOLERANCE = 1e-4
# Name prefixes of fastft's fused autograd functions, counted in each loss graph (attention's q / k / v node is
# LoRAQKVRoPEFunction where RoPE runs in it, LoRAQKVFunction where the family's per-head norms keep it apart).
FUSED_NODES = ("LoRAQKV", "LoRAO", "LoRAMLP", "LoRADecoderLayer")
SEED = 0


def model_folder(model: str) -> str:
    """The folder both systems load: an alias's converted safetensors folder, else ``model`` itself."""
    from fastft.loading.embedded import materialise_gguf, resolve_alias

    folder, gguf_file = resolve_alias(model, None)
    return str(materialise_gguf(folder, gguf_file)) if gguf_file is not None else folder


def build_system(name: str, folder: str, max_seq_length: int | None) -> torch.nn.Module:
    """Load ``folder`` in float32 with sdpa attention and add LoRA the way ``name`` does it; training mode."""
    if name == PEFT:
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")
        config = LoraConfig(
            r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=TARGET_MODULES, task_type="CAUSAL_LM"
        )
        model = get_peft_model(base, config)
    else:
        from fastft import FastModel

        base, _ = FastModel.from_pretrained(
            folder, max_seq_length=max_seq_length, dtype=torch.float32, attn_implementation="sdpa"
        )
        model = FastModel.get_peft_model(
            base, r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, use_gradient_checkpointing=False
        )
    model.train()
    return model


def lora_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The LoRA A and B matrices by name (the same names in both systems: both are peft models of one model)."""
    return {name: p for name, p in model.named_parameters() if "lora_A" in name or "lora_B" in name}


def randomize_lora_b(model: torch.nn.Module, seed: int, std: float = 0.02) -> None:
    """peft starts B at zero, which would make the adapters a no-op; give them seeded values."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in sorted(lora_parameters(model).items()):
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * std)


def copy_lora(source: torch.nn.Module, target: torch.nn.Module) -> int:
    """Copy every LoRA matrix of ``source`` into ``target``; both must have exactly the same set."""
    theirs, ours = lora_parameters(source), lora_parameters(target)
    if set(theirs) != set(ours):
        raise RuntimeError(f"LoRA parameters differ: {sorted(set(theirs) ^ set(ours))[:6]}")
    with torch.no_grad():
        for name, parameter in ours.items():
            parameter.copy_(theirs[name])
    return len(ours)


def make_step(model: torch.nn.Module, input_ids: torch.Tensor) -> Callable[[], float]:
    """One training step without an optimizer: forward with labels, backward, zero_grad; returns the loss."""

    def step() -> float:
        loss = model(input_ids=input_ids, labels=input_ids, use_cache=False).loss
        loss.backward()
        model.zero_grad(set_to_none=True)
        return loss.item()

    return step


def saved_for_backward(model: torch.nn.Module, input_ids: torch.Tensor) -> dict[str, Any]:
    """What autograd keeps for backward over one forward, the model's parameters (frozen or not) left out.

    ``saved_bytes`` counts each storage once at its full size (a saved view keeps its whole storage alive);
    ``saved_bytes_raw`` sums ``nbytes`` of every packed tensor, repeats included. Also counts the fused fastft
    nodes in the loss graph.
    """
    from fastft.bench.measure import SavedTensorBytes

    with SavedTensorBytes(exclude=model.parameters()) as saved:
        loss = model(input_ids=input_ids, labels=input_ids, use_cache=False).loss
    nodes = graph_node_names(loss.grad_fn)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return {
        "saved_bytes": saved.bytes,
        "saved_bytes_raw": saved.raw_bytes,
        "saved_tensors": saved.tensors,
        "saved_storages": len(saved.storages),
        "packed_parameters_excluded": saved.excluded,
        "graph_nodes": len(nodes),
        "fused_nodes": {
            prefix: sum(name.startswith(prefix) and name.endswith("FunctionBackward") for name in nodes)
            for prefix in FUSED_NODES
        },
    }


def graph_node_names(root: Any) -> list[str]:
    """The names of every node reachable from ``root`` through ``next_functions``, each node once."""
    seen, names, stack = set(), [], [root]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        names.append(type(node).__name__ if not hasattr(node, "name") else node.name())
        stack.extend(child for child, _ in getattr(node, "next_functions", ()))
    return names


def lora_grads(model: torch.nn.Module, input_ids: torch.Tensor) -> tuple[float, torch.Tensor]:
    """The loss and every LoRA gradient (flattened in name order) of one forward and backward."""
    loss = model(input_ids=input_ids, labels=input_ids, use_cache=False).loss
    loss.backward()
    params = lora_parameters(model)
    grads = torch.cat([params[name].grad.detach().flatten() for name in sorted(params)])
    model.zero_grad(set_to_none=True)
    return loss.item(), grads


def rss_probe(name: str, folder: str, max_seq_length: int | None, batch: int, seq: int) -> dict[str, Any]:
    """In this (fresh) process: build ``name``, reset the RSS high-water mark, run one step, read the peak."""
    from fastft.bench.measure import peak_rss_bytes, reset_peak_rss, resident_bytes

    model = build_system(name, folder, max_seq_length)
    randomize_lora_b(model, SEED + 1)
    input_ids = _input_ids(model, batch, seq)
    gc.collect()
    loaded = resident_bytes()
    # Loading's peak is forgotten where the kernel allows it; the record says whether it did.
    reset = reset_peak_rss()
    make_step(model, input_ids)()
    peak = peak_rss_bytes()
    return {
        "rss_after_load_bytes": loaded,
        "peak_rss_bytes": peak,
        "step_rss_bytes": peak - loaded if loaded is not None else None,
        "high_water_mark_reset": reset,
    }


def _run_rss_probe(name: str, args: argparse.Namespace, folder: str) -> dict[str, Any]:
    command = [sys.executable, str(Path(__file__).resolve()), "--rss-probe", name, "--model", folder]
    command += ["--batch", str(args.batch), "--seq", str(args.seq)]
    if args.max_seq_length is not None:
        command += ["--max-seq-length", str(args.max_seq_length)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        raise RuntimeError(f"RSS probe for {name} failed:\n{result.stdout}\n{result.stderr}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def _input_ids(model: torch.nn.Module, batch: int, seq: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(SEED)
    return torch.randint(0, model.config.vocab_size, (batch, seq), generator=generator)


def _relative(actual: torch.Tensor | float, expected: torch.Tensor | float) -> float:
    actual, expected = torch.as_tensor(actual).double(), torch.as_tensor(expected).double()
    return ((actual - expected).norm() / expected.norm()).item()


def _threads() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Build both systems, check they agree, time them alternately and return the JSON-ready record."""
    from fastft import patch_report
    from fastft.bench.environment import describe_device, package_versions
    from fastft.kernels import dispatch

    if dispatch.INTERPRETED:
        raise RuntimeError(
            "fastft.kernels was imported with TRITON_INTERPRET=1, so its CPU path is the Triton interpreter; "
            "run this script in a process without it"
        )
    threads = _threads()
    torch.set_num_threads(threads)
    load_before = os.getloadavg()
    folder = model_folder(args.model)
    models = {name: build_system(name, folder, args.max_seq_length) for name in SYSTEMS}
    # With --max-seq-length left out, fastft picks min(2048, the model's position range): record what it chose.
    max_seq_length = models[FASTFT].get_base_model().max_seq_length
    patches = [
        {key: row.get(key) for key in ("name", "status", "reason", "modules", "fallbacks")}
        for row in patch_report(models[FASTFT])
    ]
    randomize_lora_b(models[FASTFT], SEED + 1)
    lora_count = copy_lora(models[FASTFT], models[PEFT])
    config = models[PEFT].config
    input_ids = _input_ids(models[PEFT], args.batch, args.seq)

    # The first step of each system, which is also its warm-up: losses and LoRA gradients must agree.
    losses, grads = {}, {}
    for name in SYSTEMS:
        losses[name], grads[name] = lora_grads(models[name], input_ids)
    loss_difference = abs(losses[FASTFT] - losses[PEFT]) / abs(losses[PEFT])
    grad_error = _relative(grads[FASTFT], grads[PEFT])
    del grads

    memory = {name: saved_for_backward(models[name], input_ids) for name in SYSTEMS}
    steps = {name: make_step(models[name], input_ids) for name in SYSTEMS}
    times: dict[str, list[float]] = {name: [] for name in SYSTEMS}
    cpu_times: dict[str, list[float]] = {name: [] for name in SYSTEMS}
    for _ in range(args.repeats):
        # alternate, so that drift and other load on the machine fall on both systems alike
        for name in SYSTEMS:
            start, cpu_start = time.perf_counter(), time.process_time()
            steps[name]()
            times[name].append(time.perf_counter() - start)
            cpu_times[name].append(time.process_time() - cpu_start)
    del models, steps
    gc.collect()
    rss = {name: _run_rss_probe(name, args, folder) for name in SYSTEMS} if args.rss else {}

    tokens = args.batch * args.seq
    systems = {}
    for name in SYSTEMS:
        median = statistics.median(times[name])
        systems[name] = {
            "step_s": times[name],
            "median_step_s": median,
            # CPU time of the whole process (all threads): less sensitive than wall time to other work on the machine
            "step_cpu_s": cpu_times[name],
            "median_step_cpu_s": statistics.median(cpu_times[name]),
            "tokens_per_s": tokens / median,
            "first_loss": losses[name],
            **memory[name],
            **({"rss": rss[name]} if name in rss else {}),
        }
    systems[FASTFT]["patches"] = patches
    time_ratio = systems[FASTFT]["median_step_s"] / systems[PEFT]["median_step_s"]
    bytes_ratio = systems[FASTFT]["saved_bytes"] / systems[PEFT]["saved_bytes"]
    record = {
        "benchmark": "lora_step",
        "device": describe_device(torch.device("cpu"), threads),
        "device_type": "cpu",
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "threads": threads,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "fastft_path": "triton" if dispatch.use_triton(torch.empty(0)) else "reference",
        "triton_interpret_removed": args.triton_interpret_removed,
        "versions": package_versions(("torch", "transformers", "peft", "triton", "bitsandbytes", "fastft")),
        "python": platform.python_version(),
        "model": {
            "name": args.model,
            "folder": folder,
            "layers": config.num_hidden_layers,
            "hidden_size": config.hidden_size,
            "intermediate_size": config.intermediate_size,
            "heads": config.num_attention_heads,
            "kv_heads": config.num_key_value_heads,
            "vocab_size": config.vocab_size,
            "tie_word_embeddings": bool(getattr(config, "tie_word_embeddings", False)),
        },
        "settings": {
            "batch": args.batch,
            "seq": args.seq,
            "tokens": tokens,
            "dtype": "float32",
            "attn_implementation": "sdpa",
            "max_seq_length": max_seq_length,
            "lora": {"r": RANK, "lora_alpha": ALPHA, "lora_dropout": 0.0, "target_modules": TARGET_MODULES},
            "lora_tensors": lora_count,
            "gradient_checkpointing": False,
            "repeats": args.repeats,
            "warmup": 1,
            "order": list(SYSTEMS),
            "step": "forward(input_ids, labels=input_ids, use_cache=False) + loss.backward() + zero_grad",
            "seed": SEED,
        },
        "systems": systems,
        "losses": {
            PEFT: losses[PEFT],
            FASTFT: losses[FASTFT],
            "relative_difference": loss_difference,
            "tolerance": LOSS_TOLERANCE,
            "agree": loss_difference <= LOSS_TOLERANCE,
            "lora_grad_relative_error": grad_error,
        },
        "ratios": {
            "step_time_fastft_over_peft": time_ratio,
            "speedup_peft_over_fastft": 1 / time_ratio,
            # each round's fastft step over the peft step just before it, then the median: robust to slow drift
            "step_time_paired_median": statistics.median(
                ours / theirs for ours, theirs in zip(times[FASTFT], times[PEFT], strict=True)
            ),
            "step_cpu_time_fastft_over_peft": systems[FASTFT]["median_step_cpu_s"] / systems[PEFT]["median_step_cpu_s"],
            "saved_bytes_fastft_over_peft": bytes_ratio,
            "saved_bytes_raw_fastft_over_peft": systems[FASTFT]["saved_bytes_raw"] / systems[PEFT]["saved_bytes_raw"],
        },
        "acceptance": {"no_slower": time_ratio <= 1.0, "fewer_saved_bytes": bytes_ratio < 1.0},
    }
    if rss:
        record["ratios"]["peak_rss_fastft_over_peft"] = rss[FASTFT]["peak_rss_bytes"] / rss[PEFT]["peak_rss_bytes"]
    return record


def print_table(record: dict[str, Any]) -> None:
    """The summary: median step time and saved bytes of each system, each as a ratio to transformers + peft."""
    base = record["systems"][PEFT]
    print(f"\n{record['device']}; {record['settings']['batch']} x {record['settings']['seq']} tokens, fp32")
    header = (
        f"{'system':<20} {'median step s':>14} {'ratio':>7} {'CPU s':>8} {'saved MB':>10} {'ratio':>7} {'raw MB':>9}"
    )
    print(header + (f" {'peak RSS MB':>12}" if "rss" in base else ""))
    for name, row in record["systems"].items():
        line = (
            f"{name:<20} {row['median_step_s']:>14.3f} {row['median_step_s'] / base['median_step_s']:>7.3f} "
            f"{row['median_step_cpu_s']:>8.2f} "
            f"{row['saved_bytes'] / 1e6:>10.1f} {row['saved_bytes'] / base['saved_bytes']:>7.3f} "
            f"{row['saved_bytes_raw'] / 1e6:>9.1f}"
        )
        if "rss" in row:
            line += f" {row['rss']['peak_rss_bytes'] / 1e6:>12.1f}"
        print(line)
    losses = record["losses"]
    print(
        f"first-step loss: peft {losses[PEFT]:.6f}, fastft {losses[FASTFT]:.6f} "
        f"(relative difference {losses['relative_difference']:.1e}; "
        f"LoRA gradients {losses['lora_grad_relative_error']:.1e})"
    )
    print(
        f"step time fastft / peft: {record['ratios']['step_time_fastft_over_peft']:.3f} (medians), "
        f"{record['ratios']['step_time_paired_median']:.3f} (median of paired rounds); load average "
        f"{record['load_average_before'][0]:.1f} before, {record['load_average_after'][0]:.1f} after "
        f"on {record['threads']} threads"
    )
    fused = record["systems"][FASTFT]["fused_nodes"]
    print(f"fastft fused nodes in the loss graph: {fused} ({record['model']['layers']} layers)")
    applied = [row["name"] for row in record["systems"][FASTFT]["patches"] if row["status"] == "applied"]
    print(f"fastft patches applied: {', '.join(applied) or 'none'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="a local folder or fastft alias (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--max-seq-length", type=int, help="fastft's max_seq_length (default: fastft's, min(2048, the model's range))"
    )
    parser.add_argument("--no-rss", dest="rss", action="store_false", help="skip the peak-RSS subprocesses")
    parser.add_argument("--out", type=Path, default=RESULTS / "lora-step-cpu.json")
    parser.add_argument("--rss-probe", choices=SYSTEMS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    # fastft.kernels reads TRITON_INTERPRET once, when it is imported (below, inside run / rss_probe): with it on, CPU
    # tensors go through the Triton interpreter (numpy, orders of magnitude slower than the torch reference that is
    # fastft's CPU path) and this benchmark would time the interpreter. The test suite sets it for the kernel tests,
    # so drop it here, before anything imports fastft; run() refuses a process where that happened earlier anyway.
    args.triton_interpret_removed = os.environ.pop("TRITON_INTERPRET", None) is not None
    if args.max_seq_length is not None and args.seq > args.max_seq_length:
        parser.error(f"--seq {args.seq} is longer than --max-seq-length {args.max_seq_length}")

    if args.rss_probe:
        torch.set_num_threads(_threads())
        print(json.dumps(rss_probe(args.rss_probe, args.model, args.max_seq_length, args.batch, args.seq)))
        return 0

    record = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2, default=str) + "\n")
    print_table(record)
    print(f"wrote {args.out}")
    if not record["losses"]["agree"]:
        print(
            f"the first-step losses differ by {record['losses']['relative_difference']:.1e} relative "
            f"(tolerance {LOSS_TOLERANCE:.0e}): the two systems do not compute the same function",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
