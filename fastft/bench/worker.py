"""One measurement of ``fastft bench``, in a process of its own: build one system, run its steps, print one JSON line.

The harness starts this file with the Python of the system's environment (a competitor's venv has no fastft), so it
imports nothing of fastft at module level: this folder's ``measure.py``, ``environment.py``, ``longest.py`` and
``gpu_time.py`` are loaded by path, and ``fastft`` itself only for the fastft systems.

    python worker.py --spec '{"system": "fastft", "family": "fastft", "mode": "offload", "folder": ..., ...}'
    python worker.py --spec '{..., "longest": {"start": 8192, "limit": 262144, "granularity": 1024, "budget_s": 60}}'
    python worker.py --matmul-rate cpu float32

The last stdout line starting with ``RESULT_PREFIX`` is the measurement; a longest-sequence search also prints each
probe as it is made (``PROBE_PREFIX``), so that a search stopped from outside still leaves what it found.
"""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
# As a script this folder is sys.path[0]; nothing here may shadow an installed module.
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != _HERE]

import argparse  # noqa: E402
import gc  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from typing import Any  # noqa: E402

# Taken at import: a longest-sequence search's budget covers the whole process, model load included.
_STARTED = time.monotonic()
RESULT_PREFIX = "FASTFT-BENCH-RESULT "
PROBE_PREFIX = "FASTFT-BENCH-PROBE "
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# The 3-D expert parameters peft's target_parameters wraps on transformers 5.x's MoE blocks.
EXPERT_PARAMETERS = ("gate_up_proj", "down_proj")
LORA_SEED, INPUT_SEED = 1000, 0
PACKAGES = (
    "torch",
    "transformers",
    "peft",
    "trl",
    "accelerate",
    "bitsandbytes",
    "triton",
    "fastft",
    "unsloth",
    "unsloth_zoo",
    "liger-kernel",
)


def _load(name: str) -> Any:
    """A module of this folder loaded from its file: ``"measure"`` is ``measure.py``."""
    module_name = "_fastft_bench_" + name
    spec = importlib.util.spec_from_file_location(module_name, _HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _quantization(dtype: Any) -> Any:
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=dtype
    )


def _experts_implementation(spec: dict[str, Any]) -> dict[str, Any]:
    """``from_pretrained``'s ``experts_implementation="grouped_mm"`` for a mixture-of-experts run where the installed
    transformers has torch's grouped GEMM path for the experts (5.x), else nothing (its own default)."""
    if not spec.get("target_parameters"):
        return {}
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError:
        return {}
    return {"experts_implementation": "grouped_mm"} if "grouped_mm" in ALL_EXPERTS_FUNCTIONS else {}


def _liger_patch(folder: str) -> Any:
    """Liger-Kernel's patch function for the model in ``folder`` (``apply_liger_kernel_to_<model_type>``).

    Raises:
        ValueError: Liger-Kernel has no patch for that model type.
    """
    import liger_kernel.transformers as liger

    model_type = json.loads((Path(folder) / "config.json").read_text()).get("model_type", "llama")
    patch = getattr(liger, f"apply_liger_kernel_to_{model_type}", None)
    if patch is None:
        raise ValueError(
            f"fastft bench worker: liger-kernel has no apply_liger_kernel_to_{model_type} for the {model_type} "
            f"model in {folder}; leave the liger systems out for this workload"
        )
    return patch


def build(spec: dict[str, Any]) -> Any:
    """Load ``spec["folder"]`` and add LoRA r=16 the way ``spec["family"]`` does, with its checkpointing set to
    ``spec["mode"]`` (see :class:`fastft.bench.systems.System`).

    LoRA goes on ``spec["target_modules"]`` (default the seven projections of a Llama block) and, for a
    mixture-of-experts model, on every expert through peft's ``target_parameters`` (``spec["target_parameters"]``):
    stock transformers + peft runs the experts with transformers' ``grouped_mm`` where it has it, fastft takes its own
    MoE defaults (``target_modules=None``: the attention and every expert).

    Raises:
        ValueError: An unknown family, or Liger-Kernel without a patch for the model's type.
    """
    family, mode, folder, nf4 = spec["family"], spec["mode"], spec["folder"], spec["quant"] == "nf4"
    if family not in ("transformers+peft", "liger", "unsloth", "fastft"):
        raise ValueError(f"fastft bench worker: unknown family {family!r} in the spec of {spec.get('system')!r}")
    modules = spec.get("target_modules") or TARGETS
    # A vision-language model's targets are one peft pattern (the language model's projections), not a name list.
    modules = modules if isinstance(modules, str) else list(modules)
    parameters, vision = list(spec.get("target_parameters") or []), spec.get("image_size") is not None
    # Only where there is something to pass: a peft or Unsloth without target_parameters still builds dense models.
    extra = {"target_parameters": parameters} if parameters else {}
    if family == "unsloth":
        import unsloth  # noqa: F401  (Unsloth must be imported before transformers)
    import torch

    dtype = getattr(torch, spec["dtype"])
    device_map = {"": 0} if spec["device"] == "cuda" else None
    if family == "unsloth":
        import unsloth as unsloth_module

        # Vision-language models: FastVisionModel with the language model's projections only (the others' pattern).
        fast = unsloth_module.FastVisionModel if vision else unsloth_module.FastLanguageModel
        switches = dict(
            finetune_vision_layers=False,
            finetune_language_layers=True,
            finetune_attention_modules=True,
            finetune_mlp_modules=True,
        )
        model, _ = fast.from_pretrained(
            model_name=folder, max_seq_length=spec["max_seq_length"], dtype=dtype, load_in_4bit=nf4
        )
        model = fast.get_peft_model(
            model,
            r=spec["rank"],
            lora_alpha=spec["alpha"],
            lora_dropout=0,
            bias="none",
            use_gradient_checkpointing=mode,
            random_state=0,
            **(switches if vision else {"target_modules": modules, **extra}),
        )
    elif family == "fastft":
        from fastft import FastModel

        model, _ = FastModel.from_pretrained(
            folder,
            max_seq_length=spec["max_seq_length"],
            dtype=dtype,
            load_in_4bit=nf4,
            attn_implementation="sdpa",
        )
        model = FastModel.get_peft_model(
            model,
            r=spec["rank"],
            lora_alpha=spec["alpha"],
            lora_dropout=0.0,
            # MoE and vision-language models: fastft's own defaults, the same adapters as the others' lists.
            target_modules=None if parameters or vision else modules,
            use_gradient_checkpointing=mode,
            compile=bool(spec.get("compile", False)),
        )
    else:
        if family == "liger":
            _liger_patch(folder)()
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        if vision:
            from transformers import AutoModelForImageTextToText as AutoModelForCausalLM  # noqa: N814
        model = AutoModelForCausalLM.from_pretrained(
            folder,
            dtype=dtype,
            attn_implementation="sdpa",
            device_map=device_map,
            quantization_config=_quantization(dtype) if nf4 else None,
            **_experts_implementation(spec),
        )
        if mode:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        config = LoraConfig(
            r=spec["rank"],
            lora_alpha=spec["alpha"],
            lora_dropout=0.0,
            target_modules=modules,
            task_type="CAUSAL_LM",
            **extra,
        )
        model = get_peft_model(model, config)
    model.train()
    return model


def set_lora(model: Any) -> dict[str, Any]:
    """Give every LoRA A and B seeded values from (layer, projection), the same in every system and process.

    peft starts B at zero, which would make the adapters a no-op and the loss blind to them. An MoE block's experts
    carry one peft wrapper per 3-D parameter (``...mlp.experts`` and ``...mlp.experts.base_layer``, in an order that
    follows the config), each holding the E experts' A's and B's stacked; they are told apart by the parameter they
    wrap, so every system seeds the same values into the same expert's adapter. Returns how many adapters were set
    and a checksum of the values, which the harness compares across systems.
    """
    import torch

    pattern = re.compile(r"layers\.(\d+)\..*\b(" + "|".join(TARGETS) + r")$")
    layer_of = re.compile(r"layers\.(\d+)\.")
    count, checksum = 0, 0.0
    for name, module in model.named_modules():
        if not hasattr(module, "lora_A") or "default" not in getattr(module, "lora_A", {}):
            continue
        match, wrapped = pattern.search(name), getattr(module, "parameter_name", None)
        if match is not None:
            layer, projection = int(match.group(1)), TARGETS.index(match.group(2))
        elif wrapped in EXPERT_PARAMETERS and layer_of.search(name):
            layer, projection = int(layer_of.search(name).group(1)), len(TARGETS) + EXPERT_PARAMETERS.index(wrapped)
        else:
            continue
        generator = torch.Generator().manual_seed(LORA_SEED + 16 * layer + projection)
        a_weight, b_weight = module.lora_A["default"].weight, module.lora_B["default"].weight
        a = torch.randn(a_weight.shape, generator=generator) / a_weight.shape[1] ** 0.5
        b = torch.randn(b_weight.shape, generator=generator) * 0.02
        with torch.no_grad():
            a_weight.copy_(a)
            b_weight.copy_(b)
        count += 1
        checksum += float(a.double().abs().sum() + b.double().abs().sum())
    return {"adapters": count, "lora_checksum": checksum}


def _input_ids(spec: dict[str, Any], vocab_size: int, batch: int | None = None, seq: int | None = None) -> Any:
    import torch

    generator = torch.Generator().manual_seed(INPUT_SEED)
    ids = torch.randint(0, vocab_size, (batch or spec["batch"], seq or spec["seq"]), generator=generator)
    return ids.to("cuda" if spec["device"] == "cuda" else "cpu")


def _inputs(spec: dict[str, Any], model: Any) -> dict[str, Any]:
    """One step's keyword arguments: random ids as their own labels, or a vision-language model's image + text
    batch (``vlm_inputs.py``)."""
    device = "cuda" if spec["device"] == "cuda" else "cpu"
    if spec.get("image_size") is None:
        ids = _input_ids(spec, model.config.vocab_size)
        return {"input_ids": ids, "labels": ids}
    import transformers

    five = int(transformers.__version__.split(".")[0]) >= 5
    return _load("vlm_inputs").batch(model.config, spec["batch"], spec["seq"], spec["image_size"], device, five)


def _failure(error: BaseException) -> str:
    """The error's first line for the record; its traceback goes to stderr, whose tail the harness keeps."""
    traceback.print_exc()
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0][:300] if lines else ''}"


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """Build the system, run the first step (loss, bytes saved for backward), time ``spec["steps"]`` steps, then
    the extras: on CUDA one profiled step (GPU busy fraction, kernel launches), and the step's FLOPs.

    The extras run after everything measured, and a failure in one is recorded (``profile_error``, ``flops_error``,
    ``flops_analytic_error``) rather than raised: a FLOP formula or the profiler must never cost the row.
    """
    measure_module = _load("measure")
    environment = _load("environment")
    started = time.perf_counter()
    model = build(spec)
    import torch

    cuda = spec["device"] == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    record: dict[str, Any] = {"load_s": time.perf_counter() - started, **set_lora(model)}
    inputs = _inputs(spec, model)
    record["input_checksum"] = int(inputs["input_ids"].sum())
    record["rss_after_load_bytes"] = measure_module.resident_bytes()
    record["peak_rss_reset"] = measure_module.reset_peak_rss()

    def forward() -> Any:
        return model(**inputs, use_cache=False).loss

    def step() -> float:
        loss = forward()
        loss.backward()
        model.zero_grad(set_to_none=True)
        return loss.item()

    first = time.perf_counter()
    with measure_module.SavedTensorBytes(exclude=model.parameters()) as saved:
        loss = forward()
    loss.backward()
    model.zero_grad(set_to_none=True)
    record.update(loss=loss.item(), saved_bytes=saved.bytes, saved_bytes_raw=saved.raw_bytes)
    # With regional compilation the first step holds the compile.
    record["first_step_s"] = time.perf_counter() - first
    del loss
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(spec["steps"]):
        sync()
        begin = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - begin)
    record["step_times_s"] = times
    record["peak_rss_bytes"] = measure_module.peak_rss_bytes()
    if cuda:
        record["peak_vram_bytes"] = torch.cuda.max_memory_allocated()
    record["versions"] = environment.package_versions(PACKAGES)
    if spec.get("target_parameters"):
        # Which experts forward the stock model was set to run (fastft's patched blocks bypass it when fused).
        record["experts_implementation"] = getattr(model.config, "_experts_implementation", None)
    if spec["family"] == "fastft":
        from fastft import patch_report
        from fastft.checkpointing.modes import get_mode

        record["fastft_patches"] = sorted(row["name"] for row in patch_report(model) if row["status"] == "applied")
        # The mode the model ended up in (None: off), so a row can be checked against the mode it was asked for.
        record["fastft_checkpointing"] = get_mode(model.get_base_model())
        from fastft.loading.compile import compiled_layers

        record["fastft_compiled_layers"] = compiled_layers(model)
        from fastft.kernels import gemm_tuner

        # What each fused group's GEMM ran (cuBLAS in either order, or a Triton configuration) and why: on a GPU the
        # tuner's timings, so a step can be read against the choice it made.
        record["fastft_gemm_choices"] = gemm_tuner.choices()
        from fastft.patches.fused_layer import layer_programs

        # How many layers ran as one fused node, and how many of them as a straight-line program (the timed steps
        # come after the first, so every eligible layer has one by now).
        record["fastft_layer_programs"] = layer_programs(model)
    record.update(_extras(spec, model, step, statistics.median(times), measure_module))
    return record


def _extras(spec: dict[str, Any], model: Any, step: Any, step_s: float, measure_module: Any) -> dict[str, Any]:
    """The profiled step (CUDA) and the FLOP counts, each on its own: a failure is a recorded reason."""
    extras: dict[str, Any] = {}
    if spec["device"] == "cuda":
        try:
            # FASTFT_BENCH_TRACE_DIR: a folder for each system's profiled-step timeline (bench/gpu_gaps.py reads it).
            folder = os.environ.get("FASTFT_BENCH_TRACE_DIR")
            trace = os.path.join(folder, f"{spec['system']}.json.gz") if folder else None
            if folder:
                os.makedirs(folder, exist_ok=True)
            extras.update(_load("gpu_time").profile_step(step, step_s, trace))
        except Exception as error:  # noqa: BLE001  (kept in the record; the measured row stands)
            extras["profile_error"] = _failure(error)
        finally:
            model.zero_grad(set_to_none=True)
    try:
        modules = spec.get("target_modules") or TARGETS
        # A pattern (vision-language models) stands for the seven projections of each language-model layer.
        modules = TARGETS if isinstance(modules, str) else modules
        targets = (*modules, *(spec.get("target_parameters") or ()))
        # A vision-language model: its language model's count (the frozen tower's forward, about 2 % of a
        # Qwen2.5-VL-7B step at 256 image tokens per 1280, is left out).
        config = getattr(model.config, "text_config", None) or model.config
        extras["flops_analytic"] = measure_module.lora_step_flops(
            config, spec["batch"], spec["seq"], spec["rank"], targets
        )
    except Exception as error:  # noqa: BLE001  (a config the formula does not know: the floor uses the count)
        extras["flops_analytic_error"] = _failure(error)
    if spec.get("count_flops"):
        try:
            extras["flops"] = measure_module.count_flops(step)
        except Exception as error:  # noqa: BLE001  (torch 2.11's own sdpa formula asserted here on GQA)
            extras["flops_error"] = _failure(error)
        finally:
            model.zero_grad(set_to_none=True)
    return extras


def measure_longest(spec: dict[str, Any]) -> dict[str, Any]:
    """Build the system once, then search the longest batch-1 sequence it trains at (``fastft/bench/longest.py``)
    until ``spec["longest"]["budget_s"]`` seconds after this process started; each probe is printed as it is made.
    """
    longest, settings = _load("longest"), spec["longest"]
    started = time.perf_counter()
    model = build(spec)
    import torch

    cuda = spec["device"] == "cuda"
    record: dict[str, Any] = {"load_s": time.perf_counter() - started, **set_lora(model)}

    def step(seq: int) -> dict[str, Any]:
        ids = _input_ids(spec, model.config.vocab_size, batch=1, seq=seq)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            torch.cuda.synchronize()
        begin = time.perf_counter()
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        model.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        measured = {"step_s": time.perf_counter() - begin, "loss": loss.item()}
        if cuda:
            measured["peak_vram_bytes"] = torch.cuda.max_memory_allocated()
        return measured

    def free() -> None:
        # The failed step's tensors are unreachable by now; the gradients it accumulated are not.
        model.zero_grad(set_to_none=True)
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()

    def report(probe: dict[str, Any]) -> None:
        print(PROBE_PREFIX + json.dumps(probe), flush=True)

    record.update(
        longest.search(
            step,
            start=settings["start"],
            limit=settings["limit"],
            granularity=settings["granularity"],
            deadline=_STARTED + settings["budget_s"],
            clock=time.monotonic,
            free=free,
            on_probe=report,
        )
    )
    record.update(budget_s=settings["budget_s"], elapsed_s=time.monotonic() - _STARTED)
    return record


def _oom(error: BaseException) -> bool:
    return _load("longest").is_out_of_memory(error)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--spec", help="the measurement, as JSON")
    group.add_argument("--matmul-rate", nargs=2, metavar=("DEVICE", "DTYPE"), help="measure the matmul rate")
    args = parser.parse_args(argv)
    if args.matmul_rate:
        import torch

        device, dtype = args.matmul_rate
        rate = _load("measure").matmul_rate(torch.device(device), getattr(torch, dtype))
        print(RESULT_PREFIX + json.dumps({"matmul_flops_per_s": rate}), flush=True)
        return 0
    spec = json.loads(args.spec)
    try:
        record = measure_longest(spec) if "longest" in spec else measure(spec)
    except Exception as error:
        if not _oom(error):
            raise
        # Running out of memory is a result (the longest-sequence search relies on it), not a crash.
        record = {"oom": True, "error": f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"}
    print(RESULT_PREFIX + json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
