"""Memory of one DPO step and one GRPO step on CPU: fastft against transformers + peft under trl; write JSON.

Usage::

    python bench/preference.py                         # SmolLM2-135M, DPO 2 pairs x 512 tokens, GRPO 4 generations
    python bench/preference.py --seq 64 --completion 16 --out /tmp/pref.json   # a quick run
    python bench/preference.py --device cuda          # on a GPU (bench/gpu_check.sh OUTDIR pref)
    python bench/preference.py --allocator returning  # peak RSS as live memory (glibc returns freed blocks at once)

Each (method, system) runs in its own subprocess (so peak RSS is that system's alone), on the same float32 folder
(the embedded SmolLM2-135M-Instruct converted from its GGUF), LoRA r=16 on all seven projections, LoRA B made
non-zero with the same seed on every system, and the same batch:

- ``stock``: ``FastModel.from_pretrained(..., patch=False)`` (stock transformers modules) and peft, with the
  trainer's default gradient checkpointing (trl's configs turn it on: transformers' recompute checkpointing);
- ``stock-no-ckpt``: the same without gradient checkpointing (every activation kept);
- ``fastft``: ``FastModel`` with its patches and ``use_gradient_checkpointing="offload"`` (on a CPU: recompute, the
  input of every layer kept);
- ``fastft-sqrt``: the same with ``use_gradient_checkpointing="sqrt"`` (one layer input in every ceil(sqrt(L)) kept,
  the others replayed in backward: one more forward of the decoder).

On a CPU every system computes in fp32; with ``--device cuda`` in the dtype ``FastModel`` picks for the GPU (bf16 from
compute capability 8.0, fp16 below) with trl's mixed precision to match, and the device memory is recorded too: the
growth of ``torch.cuda.max_memory_allocated`` over the step, which is where ``"offload"`` moves the layer inputs
out of (the saved-bytes counter sees them either way).

DPO: 2 pairs, prompt + completion = ``--seq`` tokens per sequence (4 sequences in the batch), beta 0.1, the
reference being the policy with its adapters disabled. GRPO: one prompt of ``--seq`` minus ``--completion`` tokens,
4 generations of exactly ``--completion`` new tokens (sampling, seeded; min = max new tokens), beta 0.04 (so a
reference forward runs), a reward of each completion's length in distinct tokens. For each, one training step is
the trainer's ``compute_loss`` on the first batch then ``backward``; recorded: the loss, bytes saved for backward
over the loss computation (``fastft.bench.measure.SavedTensorBytes``, each storage once, parameters left out), peak RSS
growth over the step with the memory-mapped weights paged in beforehand (``fastft.bench.measure``; whether the kernel
let the peak be reset is recorded too), step time, the checkpointing mode, and which log-prob head ran
(``fastft_fused_logprob_calls``). The losses of all systems must agree (1e-4 relative)
or the script exits 1 after writing its record.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

if __name__ == "__main__":
    _here = Path(__file__).resolve().parent
    sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != _here]

import argparse
import json
import platform
import subprocess
import time
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parent / "results"
SYSTEMS = ("stock", "stock-no-ckpt", "fastft", "fastft-sqrt")
METHODS = ("dpo", "grpo")
LOSS_TOLERANCE = 1e-4
# glibc keeps freed blocks in its heap (and raises its mmap threshold as large blocks come and go), so by default the
# peak RSS of a step is its live peak plus what the heap held on to. "returning" maps every block over 64 KiB on its
# own and trims at once: slower, but the peak RSS is then the step's live memory.
ALLOCATORS = {
    "default": {},
    "returning": {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"},
}
SEED = 0


def _text(tokens: int, tokenizer: Any, salt: int) -> str:
    """Text of about ``tokens`` tokens (decoded from seeded ids, so the lengths hold after re-tokenizing)."""
    generator = torch.Generator().manual_seed(SEED + salt)
    ids = torch.randint(1000, 20000, (tokens,), generator=generator).tolist()
    return tokenizer.decode(ids)


def build(system: str, folder: str, seq: int, device: str):
    """The LoRA model of ``system`` and its tokenizer (on the GPU FastModel picks with ``device="cuda"``)."""
    from fastft import FastModel

    model, tokenizer = FastModel.from_pretrained(
        folder,
        max_seq_length=2 * seq,
        dtype=torch.float32 if device == "cpu" else None,
        patch=system.startswith("fastft"),
        attn_implementation="sdpa",
    )
    checkpointing = {"stock": True, "stock-no-ckpt": False, "fastft": "offload", "fastft-sqrt": "sqrt"}[system]
    model = FastModel.get_peft_model(
        model, r=16, lora_alpha=16, lora_dropout=0.0, use_gradient_checkpointing=checkpointing, random_state=SEED
    )
    generator = torch.Generator().manual_seed(SEED + 1)
    for name, parameter in model.named_parameters():
        if "lora_B" in name:
            with torch.no_grad():
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.02)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def _common_args(system: str, out: str, model: Any) -> dict[str, Any]:
    on_gpu = model.device.type == "cuda"
    return {
        "output_dir": out,
        "report_to": "none",
        "use_cpu": not on_gpu,
        "bf16": on_gpu and model.dtype == torch.bfloat16,
        "fp16": on_gpu and model.dtype == torch.float16,
        "seed": SEED,
        "max_steps": 1,
        "logging_steps": 1,
        "dataloader_num_workers": 0,
        # trl's default (on) for both stock systems' trainers; stock-no-ckpt turns it off, fastft keeps its own mode.
        "gradient_checkpointing": system == "stock",
    }


def dpo_trainer(system: str, model: Any, tokenizer: Any, seq: int, out: str):
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    prompt_tokens = seq // 4
    rows = {
        "prompt": [_text(prompt_tokens, tokenizer, i) for i in range(2)],
        "chosen": [_text(seq - prompt_tokens, tokenizer, 10 + i) for i in range(2)],
        "rejected": [_text(seq - prompt_tokens, tokenizer, 20 + i) for i in range(2)],
    }
    args = DPOConfig(**_common_args(system, out, model), per_device_train_batch_size=2, max_length=seq, beta=0.1)
    return DPOTrainer(model=model, args=args, train_dataset=Dataset.from_dict(rows), processing_class=tokenizer)


def grpo_trainer(system: str, model: Any, tokenizer: Any, seq: int, completion: int, out: str):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    def distinct_tokens(completions: list[Any], **_: Any) -> list[float]:
        return [float(len(set(str(text).split()))) for text in completions]

    prompt = _text(seq - completion, tokenizer, 3)
    args = GRPOConfig(
        **_common_args(system, out, model),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=completion,
        beta=0.04,
        generation_kwargs={"min_new_tokens": completion},
    )
    return GRPOTrainer(
        model=model,
        reward_funcs=distinct_tokens,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": [prompt] * 4}),
        processing_class=tokenizer,
    )


def probe(method: str, system: str, folder: str, seq: int, completion: int, out: str, device: str) -> dict[str, Any]:
    """One step of ``method`` on ``system`` in this process; what it measured."""
    from fastft.bench.measure import SavedTensorBytes, peak_rss_bytes, reset_peak_rss, resident_bytes
    from fastft.checkpointing.modes import get_mode

    torch.manual_seed(SEED)
    model, tokenizer = build(system, folder, seq, device)
    if method == "dpo":
        trainer = dpo_trainer(system, model, tokenizer, seq, out)
    else:
        trainer = grpo_trainer(system, model, tokenizer, seq, completion, out)
    model.train()
    batch = next(iter(trainer.get_train_dataloader()))
    if method == "grpo":
        torch.manual_seed(SEED)
        batch = trainer._prepare_inputs(batch)
        trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train for each step
    base = model.get_base_model()
    calls = getattr(base, "fastft_fused_logprob_calls", 0)
    on_gpu = model.device.type == "cuda"
    if on_gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        device_before = torch.cuda.memory_allocated()
    with torch.no_grad():
        # The weights are memory-mapped from safetensors and paged in by their first read: do that before the step,
        # or every system's "growth" would include the whole model (about 500 MB here), not its working memory.
        for tensor in [*model.parameters(), *model.buffers()]:
            tensor.sum()
    before = resident_bytes()
    reset = reset_peak_rss()
    start = time.perf_counter()
    with SavedTensorBytes(exclude=[*model.parameters(), *model.buffers()]) as saved:
        loss = trainer.compute_loss(model, batch)
    loss.backward()
    if on_gpu:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    record = {
        "method": method,
        "system": system,
        "loss": float(loss.detach()),
        "saved_bytes": saved.bytes,
        "saved_tensors": saved.tensors,
        "rss_before_bytes": before,
        "peak_rss_growth_bytes": None if before is None else peak_rss_bytes() - before,
        "peak_reset_took": reset,
        "step_s": round(seconds, 3),
        "fused_logprob_calls": getattr(base, "fastft_fused_logprob_calls", 0) - calls,
        "checkpointing": str(get_mode(base)),
        "tokens": int(batch["input_ids"].numel()) if "input_ids" in batch else None,
        "dtype": str(model.dtype).removeprefix("torch."),
        "peak_device_growth_bytes": torch.cuda.max_memory_allocated() - device_before if on_gpu else None,
    }
    if method == "grpo":
        record["tokens"] = int(batch["prompt_ids"].numel() + batch["completion_ids"].numel())
        record["completion_ids_checksum"] = int(batch["completion_ids"].sum())
    return record


def _ratio(numerator: int | None, denominator: int | None) -> float | None:
    return None if numerator is None or not denominator else numerator / denominator


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--seq", type=int, default=512, help="tokens per sequence (prompt + completion)")
    parser.add_argument("--completion", type=int, default=128, help="GRPO: new tokens per generation")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument(
        "--allocator",
        default="default",
        choices=ALLOCATORS,
        help="'returning': glibc hands freed blocks back at once, so peak RSS follows live memory, not its heap",
    )
    parser.add_argument("--out", help="the JSON record (default: results/preference-<device>[-returning].json)")
    parser.add_argument("--probe", nargs=2, metavar=("METHOD", "SYSTEM"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    from fastft.loading.embedded import materialise_gguf, resolve_alias

    folder, gguf_file = resolve_alias(args.model, None)
    folder = str(materialise_gguf(folder, gguf_file)) if gguf_file is not None else folder
    if args.probe:
        import tempfile

        with tempfile.TemporaryDirectory() as out:
            record = probe(*args.probe, folder, args.seq, args.completion, out, args.device)
        print("RECORD " + json.dumps(record))
        return 0

    from fastft.bench.environment import describe_device, device_slug, package_versions

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench/preference.py: --device cuda, but torch sees no CUDA device")
    device = describe_device(torch.device(args.device))
    suffix = "" if args.allocator == "default" else f"-{args.allocator}"
    out_path = Path(args.out or RESULTS / f"preference-{device_slug(device)}{suffix}.json")

    runs = []
    for method in args.methods:
        for system in SYSTEMS:
            command = [sys.executable, str(Path(__file__).resolve()), "--model", args.model, "--seq", str(args.seq)]
            command += ["--completion", str(args.completion), "--device", args.device, "--probe", method, system]
            # fastft's CPU path is its torch reference, as a user gets it, not the Triton interpreter tests turn on.
            env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
            env.update(ALLOCATORS[args.allocator])
            done = subprocess.run(command, capture_output=True, text=True, cwd=str(Path.home()), env=env)
            lines = [line for line in done.stdout.splitlines() if line.startswith("RECORD ")]
            if done.returncode != 0 or not lines:
                print(done.stdout[-3000:], done.stderr[-6000:], file=sys.stderr)
                raise SystemExit(f"bench/preference.py: the {method} / {system} probe failed ({done.returncode})")
            runs.append(json.loads(lines[-1][len("RECORD ") :]))
            print(json.dumps(runs[-1]))
    summary = {}
    agree = True
    for method in args.methods:
        rows = {run["system"]: run for run in runs if run["method"] == method}
        stock = rows["stock"]
        losses = [run["loss"] for run in rows.values()]
        method_agrees = max(losses) - min(losses) <= LOSS_TOLERANCE * abs(stock["loss"])
        agree = agree and method_agrees
        summary[method] = {"losses_agree": method_agrees}
        for system in ("fastft", "fastft-sqrt"):
            fastft = rows[system]
            summary[method][system] = {
                "saved_ratio_vs_stock": fastft["saved_bytes"] / stock["saved_bytes"],
                "saved_ratio_vs_stock_no_ckpt": fastft["saved_bytes"] / rows["stock-no-ckpt"]["saved_bytes"],
                "peak_rss_growth_ratio_vs_stock": _ratio(
                    fastft["peak_rss_growth_bytes"], stock["peak_rss_growth_bytes"]
                ),
                "peak_device_growth_ratio_vs_stock": _ratio(
                    fastft["peak_device_growth_bytes"], stock["peak_device_growth_bytes"]
                ),
                "step_time_ratio_vs_stock": fastft["step_s"] / stock["step_s"],
                "fused_logprob_calls": fastft["fused_logprob_calls"],
            }
    record = {
        "benchmark": "bench/preference.py",
        "device": device,
        "platform": platform.platform(),
        "versions": package_versions(("torch", "transformers", "peft", "trl", "fastft")),
        "model": args.model,
        "seq": args.seq,
        "completion": args.completion,
        "allocator": {"name": args.allocator, "environment": ALLOCATORS[args.allocator]},
        "load_average": os.getloadavg(),
        "runs": runs,
        "summary": summary,
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
