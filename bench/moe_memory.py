"""Bytes one sparse MoE block saves for backward: fastft's fused grouped-expert path against transformers + peft.

    python bench/moe_memory.py                   # writes results/moe-memory-cpu.json (about half a minute)
    python bench/moe_memory.py --quick --out /tmp/moe.json   # a smaller shape (the tests)

A Qwen3-MoE decoder layer's sparse block (router + experts) scaled down from Qwen3-30B-A3B's (hidden 2048,
moe_intermediate 768, 128 experts, top-8) to fit a CPU: hidden 512, moe_intermediate 256, 32 experts, top-4, fp32,
one sequence of 512 tokens. LoRA r = 16, alpha 32 on every expert's gate_up_proj and down_proj, through peft's
``target_parameters`` on both sides (the same adapter values). Each side runs the block once on the same hidden
states with autograd on, inside ``fastft.bench.measure.SavedTensorBytes`` (each storage once, the model's own
parameters left out): stock transformers + peft (peft's parametrisation adds ``B·A`` to the whole expert stack each
forward, transformers' eager experts loop over the experts that got tokens) against the block as
``FastModel.get_peft_model`` patches it. The outputs and the LoRA gradients of one backward are compared too
(fp32: 1e-5 / 1e-4 relative). The JSON records both byte counts, their ratio and issue 32's target (at most 0.5);
the exit status is 1 when the outputs disagree. Needs transformers >= 5 (the fused expert layout).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

if __name__ == "__main__":
    _here = Path(__file__).resolve().parent
    sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != _here]
    os.environ.pop("TRITON_INTERPRET", None)

import argparse
import json
import platform
import tempfile
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parent / "results"
SHAPE = dict(hidden_size=512, moe_intermediate_size=256, num_experts=32, num_experts_per_tok=4)
QUICK = dict(hidden_size=64, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2)
RANK, ALPHA, TARGET = 16, 32, 0.5


def _config(shape: dict[str, int]) -> Any:
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=256,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=shape["hidden_size"] // 4,
        intermediate_size=2 * shape["hidden_size"],
        max_position_embeddings=1024,
        **shape,
    )


def _models(folder: Path, shape: dict[str, int]) -> tuple[torch.nn.Module, torch.nn.Module]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, Qwen3MoeForCausalLM

    from fastft import FastModel

    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(_config(shape))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "experts" in name or name.endswith("gate.weight"):
                parameter.normal_(0, 0.05)
    model.save_pretrained(folder)
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel(vocab={f"w{i}": i for i in range(256)}, unk_token="w0"))
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token="w0", pad_token="w1").save_pretrained(folder)
    ours, _ = FastModel.from_pretrained(str(folder), max_seq_length=1024, dtype=torch.float32)
    ours = FastModel.get_peft_model(
        ours, r=RANK, lora_alpha=ALPHA, target_modules=["q_proj"], use_gradient_checkpointing=False,
        target_parameters=["experts.gate_up_proj", "experts.down_proj"],
    )  # fmt: skip
    stock = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    config = LoraConfig(
        r=RANK,
        lora_alpha=ALPHA,
        target_modules=["q_proj"],
        target_parameters=["experts.gate_up_proj", "experts.down_proj"],
    )
    stock = get_peft_model(stock, config)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        lora = {
            n: torch.randn(p.shape, generator=generator) * 0.05 for n, p in stock.named_parameters() if "lora_" in n
        }
        for model_ in (stock, ours):
            for name, parameter in model_.named_parameters():
                if name in lora:
                    parameter.copy_(lora[name])
    return stock, ours


def _block(model: torch.nn.Module) -> torch.nn.Module:
    return model.get_base_model().model.layers[0].mlp


def _measure(model: torch.nn.Module, hidden: torch.Tensor) -> dict[str, Any]:
    from fastft.bench.measure import SavedTensorBytes

    block = _block(model)
    x = hidden.clone().requires_grad_(True)
    with SavedTensorBytes([*model.parameters(), *model.buffers()]) as saved:
        out = block(x)
    out.backward(torch.ones_like(out) / out.numel())
    grads = {n: p.grad.detach().clone() for n, p in block.named_parameters() if p.grad is not None}
    return {
        "saved_bytes": saved.bytes,
        "saved_tensors": saved.tensors,
        "out": out.detach(),
        "grads": grads,
    }


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def run(quick: bool, tokens: int) -> dict[str, Any]:
    import transformers
    from packaging.version import Version

    if Version(transformers.__version__) < Version("5"):
        raise SystemExit(
            f"bench/moe_memory.py needs transformers >= 5 (fused experts), found {transformers.__version__}"
        )
    shape = QUICK if quick else SHAPE
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        stock, ours = _models(Path(folder), shape)
        hidden = torch.randn(1, tokens, shape["hidden_size"], generator=torch.Generator().manual_seed(2))
        rows = {"transformers+peft": _measure(stock, hidden), "fastft": _measure(ours, hidden)}
    expected, actual = rows["transformers+peft"], rows["fastft"]
    output_error = _relative(actual["out"], expected["out"])
    grad_errors = {name: _relative(actual["grads"][name], grad) for name, grad in expected["grads"].items()}
    ratio = actual["saved_bytes"] / expected["saved_bytes"]
    from fastft.bench.environment import package_versions

    return {
        "benchmark": "bench/moe_memory.py",
        "device": f"cpu: {platform.processor() or platform.machine()} (1 thread)",
        "versions": package_versions(["torch", "transformers", "peft", "fastft"]),
        "settings": {"shape": shape, "tokens": tokens, "rank": RANK, "lora_alpha": ALPHA, "dtype": "float32"},
        "systems": {
            name: {key: value for key, value in row.items() if key not in ("out", "grads")}
            for name, row in rows.items()
        },
        "saved_bytes_ratio": ratio,
        "target": {
            "metric": "fastft saved_bytes / transformers+peft saved_bytes",
            "limit": TARGET,
            "met": ratio <= TARGET,
        },
        "output_relative_error": output_error,
        "max_lora_grad_relative_error": max(grad_errors.values()) if grad_errors else None,
        "lora_grads_compared": len(grad_errors),
        "agree": output_error <= 1e-5 and all(error <= 1e-4 for error in grad_errors.values()) and bool(grad_errors),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small shape (the tests)")
    parser.add_argument("--tokens", type=int, default=None, help="tokens in the batch (512; --quick: 64)")
    parser.add_argument("--out", type=Path, default=RESULTS / "moe-memory-cpu.json")
    args = parser.parse_args(argv)
    tokens = args.tokens or (64 if args.quick else 512)
    record = run(args.quick, tokens)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    stock, ours = (record["systems"][name]["saved_bytes"] for name in ("transformers+peft", "fastft"))
    print(f"saved for backward: transformers+peft {stock / 2**20:.2f} MiB, fastft {ours / 2**20:.2f} MiB")
    print(f"ratio {record['saved_bytes_ratio']:.3f} (target <= {TARGET}); outputs agree: {record['agree']}")
    return 0 if record["agree"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
