"""trl's preference and RL trainers (DPO, KTO, GRPO, reward modelling) on a fastft model against the same trainer on
stock transformers + peft: the first step's loss, every LoRA gradient and every metric trl logs, in every lane.

Each case builds one tiny random Llama twice (``patch=True`` and ``patch=False``), adds identical LoRA adapters through
``FastModel.get_peft_model`` (B made non-zero), builds the trainer with identical settings on each and runs one real
``trainer.train()`` step: the loss is captured where the trainer computes it, the gradients just before the optimizer
step (clipping off), the metrics from the step's log. Bases: fp32 without checkpointing, fp32 with the offloaded
checkpointer, NF4 4-bit with it. The reference of DPO / KTO / GRPO is the policy itself, no second model: with its
adapters disabled (peft), or, as trl >= 1.0 sets it up for a PeftModel, on trl's frozen "ref" copy of the adapter;
each side computes its own reference log-probs. GRPO samples its completions inside the step (model.generate, no
vLLM): both sides are seeded identically at the step's start and their completion ids must be equal. Each case's two
steps run once and serve three tests: parity with stock; every forward on fastft's fused layers and checkpointer; and,
where fastft's ``trl.fused_logprobs`` patch applies, its fused log-prob head serving the policy and the reference.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import trl
from conftest import lora_weights, randomize_lora_b, relative_error
from datasets import Dataset
from transformers import TrainerCallback

from fastft import FastModel, patch_report
from fastft.model import keep_trainable_fp32

pytestmark = [
    pytest.mark.lane,
    # trl 1.0 moved KTO to trl.experimental and warns on the stable import path this file uses in every lane.
    pytest.mark.filterwarnings("ignore:The `KTO:FutureWarning"),
]

SEED = 11


@dataclasses.dataclass(frozen=True)
class Bounds:
    """Relative bounds of the loss (and compute_loss's float inputs), each LoRA gradient, and the logged metrics
    (relative, absolute)."""

    loss: float
    grad: float
    metric_rtol: float
    metric_atol: float


# The reward metrics (rewards/*, KTO's kl) are beta x differences of two sums of tens of log-probs: each sum's fp32
# rounding, in another order in the fused kernel than in stock's, leaves a few 1e-6 in the difference (3e-6 seen on
# AVX-512 CPUs for a reward of -0.18), so the absolute bound is 1e-5.
FP32 = Bounds(loss=1e-5, grad=1e-4, metric_rtol=1e-5, metric_atol=1e-5)
# Gradients this far below the largest one are rounding noise on both sides (see parity.assert_parity).
ZERO_GRAD_SCALE = 1e-5
FUSED_LOGPROBS = "trl.fused_logprobs"

# (use_gradient_checkpointing, load_in_4bit) per base.
BASES = {
    "lora": (False, False),
    "lora-offload": ("offload", False),
    "qlora-offload": ("offload", True),
    "lora-sqrt": ("sqrt", False),
}
# The trainers whose step the "sqrt" checkpointer (layer inputs replayed in backward) is checked on.
SQRT_KINDS = ("dpo", "grpo")

PROMPTS = ["The capital of France is", "Two plus two equals"]
CHOSEN = [" Paris, a city on the Seine.", " four, as everyone knows."]
REJECTED = [" a large green bicycle.", " seven hundred and twelve."]
# Logged per step but not a function of the model (the loss is compared unrounded, as compute_loss returned it; the
# gradients one by one instead of their norm), and wall-clock times (GRPO's step_time).
UNCOMPARED_LOG_KEYS = {"loss", "grad_norm", "learning_rate", "epoch", "step"}
TIMING_LOG_KEYS = ("time", "runtime", "per_second")


def length_reward(completions, **kwargs) -> list[float]:
    """A deterministic reward on the completion text (GRPO): differs between most pairs of completions, so the
    group-relative advantages are not all zero."""
    texts = [c if isinstance(c, str) else " ".join(m["content"] for m in c) for c in completions]
    return [float(sum(map(ord, text)) % 11) / 10.0 for text in texts]


@dataclasses.dataclass(frozen=True)
class Kind:
    """One trl trainer: its class and config names, the config fields it needs and may use, and its dataset."""

    trainer: str
    config: str
    required: dict[str, Any]
    optional: dict[str, Any]
    rows: Callable[[], dict[str, list]]
    # Metrics every supported trl version logs for it, so the comparison of the logs never compares nothing.
    metrics: tuple[str, ...] = ()
    # The logged metric that measures the policy's distance from its reference (None: the trainer has no reference).
    signal: str | None = None
    extra: Callable[[], dict[str, Any]] = dict


KINDS = {
    "dpo": Kind(
        "DPOTrainer",
        "DPOConfig",
        required=dict(beta=0.1, max_length=32),
        optional=dict(max_prompt_length=12, max_completion_length=16, precompute_ref_log_probs=False),
        rows=lambda: dict(prompt=PROMPTS, chosen=CHOSEN, rejected=REJECTED),
        metrics=(
            "rewards/chosen",
            "rewards/rejected",
            "rewards/margins",
            "rewards/accuracies",
            "logps/chosen",
            "logps/rejected",
            "logits/chosen",
            "logits/rejected",
        ),
        signal="rewards/chosen",
    ),
    "kto": Kind(
        "KTOTrainer",
        "KTOConfig",
        required=dict(beta=0.1, max_length=32),
        optional=dict(max_prompt_length=12, max_completion_length=16, precompute_ref_log_probs=False),
        # One desirable and one undesirable example per batch; KTO's KL term pairs each prompt with the other row's
        # completion.
        rows=lambda: dict(prompt=PROMPTS, completion=[CHOSEN[0], REJECTED[1]], label=[True, False]),
        metrics=("kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected"),
        # Not the KL: trl < 1.16 logs it clamped at 0, which it is here.
        signal="rewards/chosen",
    ),
    "grpo": Kind(
        "GRPOTrainer",
        "GRPOConfig",
        required=dict(beta=0.1, num_generations=2, max_completion_length=6),
        optional=dict(max_prompt_length=12, use_vllm=False, temperature=1.0, log_completions=False),
        rows=lambda: dict(prompt=PROMPTS),
        metrics=("kl", "reward", "reward_std", "rewards/length_reward/mean", "completions/mean_length"),
        signal="kl",
        extra=lambda: dict(reward_funcs=[length_reward]),
    ),
    "reward": Kind(
        "RewardTrainer",
        "RewardConfig",
        required=dict(max_length=32),
        optional=dict(center_rewards_coefficient=0.01),
        rows=lambda: dict(
            chosen=[p + c for p, c in zip(PROMPTS, CHOSEN, strict=True)],
            rejected=[p + r for p, r in zip(PROMPTS, REJECTED, strict=True)],
        ),
        # trl 0.19 logs no metric of its own for reward modelling; later versions log accuracy, margin and more.
    ),
}


@dataclasses.dataclass(frozen=True)
class Case:
    """A trainer on a base, with the reference either the adapters-disabled policy or trl's "ref" adapter copy."""

    name: str
    base: str
    reference: str | None

    @property
    def id(self) -> str:
        return "-".join(part for part in (self.name, self.base, self.reference) if part)

    def __str__(self) -> str:
        return self.id


CASES = [
    Case(name, base, "disabled" if KINDS[name].signal else None)
    for name in sorted(KINDS)
    for base in BASES
    if base != "lora-sqrt" or name in SQRT_KINDS
] + [Case(name, "lora-offload", "ref-adapter") for name in sorted(KINDS) if KINDS[name].signal]


def _config_fields(config_class: type) -> set[str]:
    return {field.name for field in dataclasses.fields(config_class)}


def _trainer_classes(kind: Kind) -> tuple[type, type]:
    """The trainer and config classes of the installed trl, or a skip naming what it lacks."""
    trainer_class, config_class = getattr(trl, kind.trainer, None), getattr(trl, kind.config, None)
    if trainer_class is None or config_class is None:
        pytest.skip(f"trl {trl.__version__} has no {kind.trainer} / {kind.config}")
    missing = sorted(set(kind.required) - _config_fields(config_class))
    if missing:
        pytest.skip(f"trl {trl.__version__}'s {kind.config} has no {missing}")
    return trainer_class, config_class


def _config(kind: Kind, config_class: type, output_dir: str):
    fields = _config_fields(config_class)
    settings: dict[str, Any] = dict(
        output_dir=output_dir,
        report_to="none",
        use_cpu=True,
        bf16=False,
        fp16=False,
        seed=SEED,
        data_seed=SEED,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=1,
        max_steps=1,
        learning_rate=1e-3,
        lr_scheduler_type="constant",
        # The gradients are read before the optimizer step: no clipping in between.
        max_grad_norm=0.0,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        dataloader_pin_memory=False,
    )
    # Checkpointing is the mode FastModel.get_peft_model chose, on both sides; trl's own switch stays off
    # (transformers 5.23 renamed it, and trl >= 0.20 defaults it to on).
    settings["activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"] = False
    settings.update(kind.required)
    settings.update({key: value for key, value in kind.optional.items() if key in fields})
    return config_class(**settings)


class _StepProbe(TrainerCallback):
    """Seeds the step (GRPO samples inside it) and copies the gradients just before the optimizer step."""

    def __init__(self, model) -> None:
        self.model = model
        self.grads: dict[str, torch.Tensor] | None = None

    def on_step_begin(self, args, state, control, **kwargs):
        torch.manual_seed(SEED)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.grads = {
            name: parameter.grad.detach().clone()
            for name, parameter in self.model.named_parameters()
            if parameter.requires_grad and parameter.grad is not None
        }


@dataclasses.dataclass
class Step:
    """What one side's first training step produced."""

    losses: list[torch.Tensor]
    grads: dict[str, torch.Tensor]
    lora: dict[str, torch.Tensor]
    dtypes: set[torch.dtype]
    metrics: dict[str, float]
    # The tensors compute_loss received: token ids (GRPO's sampled completions among them) and, for GRPO, each
    # side's own old / reference log-probs and advantages.
    inputs: dict[str, torch.Tensor]
    forwards: list[Forward]
    # fastft's patch report after the step, by name (every row "disabled" on the stock side).
    report: dict[str, dict]
    # How many bitsandbytes Linear4bit projections the model has.
    quantized: int
    # The decoder layers' checkpoint functions after the step (see Forward.checkpointers).
    checkpointers: set[str]


# The adapter state of a reference forward, per case.reference.
REFERENCE_STATE = {"disabled": "disabled", "ref-adapter": "ref"}


@dataclasses.dataclass
class Forward:
    """One forward of the trained PeftModel during the step."""

    # "default" for the policy; "disabled" or "ref" (trl's frozen copy of the adapter) for the reference.
    adapters: str
    # How many log-probs fastft's fused head computed during it (fastft_fused_logprob_calls on the base model).
    fused_logprob_calls: int
    # The layers patch_report said run the stock path at that moment (fastft side only).
    fallbacks: dict[str, str]
    # The checkpoint function of each decoder layer at that moment, by type name ("off" where checkpointing is off):
    # fastft's offloaded one is LayerCheckpoint.
    checkpointers: set[str]


def _bnb_linear4bit() -> type:
    from bitsandbytes.nn import Linear4bit

    return Linear4bit


def _causal_lm(folder: str, patch: bool, load_in_4bit: bool):
    return FastModel.from_pretrained(folder, max_seq_length=64, patch=patch, load_in_4bit=load_in_4bit)


def _classifier(folder: str, patch: bool, load_in_4bit: bool):
    """A one-label sequence classifier (a reward model) on the tiny Llama's weights, through FastModel."""
    model, tokenizer = FastModel.from_pretrained(
        folder, max_seq_length=64, patch=patch, load_in_4bit=load_in_4bit, task="sequence-classification"
    )
    with torch.no_grad():
        # Not in the checkpoint, so transformers initialises it from the global RNG: make it the same on both sides.
        score = model.score.weight
        score.copy_(torch.randn(score.shape, generator=torch.Generator().manual_seed(SEED)) * 0.1)
    return model, tokenizer


def _run_step(case: Case, patch: bool, folder: str, output_dir: str) -> Step:
    kind = KINDS[case.name]
    trainer_class, config_class = _trainer_classes(kind)
    checkpointing, load_in_4bit = BASES[case.base]
    model, tokenizer = (_classifier if case.name == "reward" else _causal_lm)(folder, patch, load_in_4bit)
    model = FastModel.get_peft_model(
        model,
        r=8,
        lora_alpha=16,
        lora_dropout=0.0,
        random_state=SEED,
        use_gradient_checkpointing=checkpointing,
        **({"task_type": "SEQ_CLS"} if case.name == "reward" else {}),
    )
    # Wider than conftest's default, so the policy is far enough from its reference that the rewards and the KL are
    # well above fp32 rounding.
    randomize_lora_b(model, seed=SEED, std=0.2)
    lora = lora_weights(model)

    trainer = trainer_class(
        model=model,
        args=_config(kind, config_class, output_dir),
        train_dataset=Dataset.from_dict(kind.rows()),
        processing_class=tokenizer,
        **kind.extra(),
    )
    _choose_reference(trainer.model, case)
    # trl >= 1.0 casts the trained weights of a 4-bit model to bf16 when it builds these trainers (whatever bf16=
    # says); fastft's recipe (`fastft train`, README) casts them back to fp32 over an fp32 or fp16 base, on both sides
    # here. Left in bf16, stock peft would compute each LoRA branch in bf16 and fastft in fp32, and the two would
    # differ by bf16 rounding (loss ~1e-3); over an fp32 base a bf16 classifier head fails outright.
    keep_trainable_fp32(trainer.model)
    probe = _StepProbe(model)
    trainer.add_callback(probe)
    losses, inputs = [], {}
    trainer.compute_loss = _recording(trainer.compute_loss, losses, inputs)
    forwards: list[Forward] = []
    hooks = _watch_forwards(model, patch, forwards)
    dtypes = {parameter.dtype for name, parameter in model.named_parameters() if "lora_" in name}
    try:
        trainer.train()
    finally:
        for hook in hooks:
            hook.remove()
    assert probe.grads is not None, "the optimizer step was never reached"
    logged = next(row for row in trainer.state.log_history if row.get("step") == 1 and "train_runtime" not in row)
    metrics = {
        key: float(value)
        for key, value in logged.items()
        if isinstance(value, (int, float))
        and key not in UNCOMPARED_LOG_KEYS
        and not any(part in key for part in TIMING_LOG_KEYS)
    }
    report = {row["name"]: row for row in patch_report(model)}
    # bitsandbytes' own class (peft's LoRA wrapper around it is also named Linear4bit).
    quantized = sum(isinstance(module, _bnb_linear4bit()) for module in model.modules())
    checkpointers = _checkpointers(model.get_base_model())
    return Step(losses, probe.grads, lora, dtypes, metrics, inputs, forwards, report, quantized, checkpointers)


def _choose_reference(model, case: Case) -> None:
    """trl >= 1.0 gives a PeftModel it is handed a frozen copy of its adapter, named "ref", as the reference (DPO
    and GRPO from 1.0, KTO from 1.16); older trl, and any trl that wraps the model itself from a ``peft_config``,
    disables the adapters instead. ``reference="disabled"`` removes the copy, so trl takes its adapters-disabled path;
    ``"ref-adapter"`` keeps it."""
    has_copy = "ref" in getattr(model, "peft_config", {})
    if case.reference == "ref-adapter" and not has_copy:
        pytest.skip(f"trl {trl.__version__}'s {KINDS[case.name].trainer} adds no 'ref' adapter to a PeftModel")
    if case.reference == "disabled" and has_copy:
        model.delete_adapter("ref")


def _recording(compute_loss: Callable, losses: list, inputs: dict) -> Callable:
    """``trainer.compute_loss`` that also keeps each loss and the first batch's tensors."""

    def recording_compute_loss(*args, **kwargs):
        batch = args[1] if len(args) > 1 else kwargs["inputs"]
        for key, value in batch.items():
            if isinstance(value, torch.Tensor):
                inputs.setdefault(key, value.detach().clone())
        result = compute_loss(*args, **kwargs)
        losses.append((result[0] if isinstance(result, tuple) else result).detach().clone())
        return result

    return recording_compute_loss


def _checkpointers(model) -> set[str]:
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [module for module in model.modules() if isinstance(module, GradientCheckpointingLayer)]
    assert layers, "no checkpointable decoder layer found"
    return {
        type(getattr(layer, "_gradient_checkpointing_func", None)).__name__
        if getattr(layer, "gradient_checkpointing", False)
        else "off"
        for layer in layers
    }


def _watch_forwards(model, patch: bool, forwards: list[Forward]) -> list:
    """Hooks on the PeftModel that note each forward's adapter state, fused log-prob calls, stock-path layers and
    checkpoint functions."""
    base = model.get_base_model()
    layer = next(module for module in model.modules() if hasattr(module, "lora_A") and hasattr(module, "base_layer"))
    started: list[tuple[str, int, dict[str, str], set[str]]] = []

    def before(module, args, kwargs):
        adapters = "disabled" if layer.disable_adapters else ",".join(layer.active_adapters)
        fallbacks = {}
        if patch:
            for row in patch_report(model):
                fallbacks.update(row.get("fallbacks") or {})
        calls = getattr(base, "fastft_fused_logprob_calls", 0)
        started.append((adapters, calls, fallbacks, _checkpointers(base)))

    def after(module, args, kwargs, output):
        adapters, calls, fallbacks, checkpointers = started.pop()
        calls = getattr(base, "fastft_fused_logprob_calls", 0) - calls
        forwards.append(Forward(adapters, calls, fallbacks, checkpointers))

    return [
        model.register_forward_pre_hook(before, with_kwargs=True),
        model.register_forward_hook(after, with_kwargs=True),
    ]


@pytest.fixture(scope="module")
def steps(tiny_llama_dir, tmp_path_factory) -> Callable[[Case], tuple[Step, Step]]:
    """(fastft, stock) first steps of a case, run once per module and shared by the tests below."""
    cache: dict[Case, tuple[Step, Step]] = {}

    def get(case: Case) -> tuple[Step, Step]:
        if case not in cache:
            out = tmp_path_factory.mktemp(case.id)
            cache[case] = (
                _run_step(case, True, str(tiny_llama_dir), str(out / "fastft")),
                _run_step(case, False, str(tiny_llama_dir), str(out / "stock")),
            )
        return cache[case]

    return get


def _assert_grads_match(grads: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], tolerance: float) -> None:
    assert grads.keys() == expected.keys() and any("lora_A" in name for name in grads), sorted(grads)
    floor = ZERO_GRAD_SCALE * max(grad.norm().item() for grad in expected.values())
    assert floor > 0, "every gradient is zero: the step compared nothing"
    for name, grad in grads.items():
        if expected[name].norm().item() < floor:
            assert grad.norm().item() < floor, f"{name}: {grad.norm().item():.2e} where stock is ~0"
            continue
        error = relative_error(grad, expected[name])
        assert error <= tolerance, f"{name}: relative error {error:.2e} > {tolerance:.0e}"


@pytest.mark.parametrize("case", CASES, ids=str)
def test_first_step_matches_stock(case, steps):
    fast, stock = steps(case)
    # The same starting point: identical adapters, in the same dtype (after trl built the trainer).
    assert fast.lora.keys() == stock.lora.keys()
    assert all(torch.equal(fast.lora[key], stock.lora[key]) for key in fast.lora)
    assert fast.dtypes == stock.dtypes
    _, load_in_4bit = BASES[case.base]
    # 2 layers x 7 projections.
    assert fast.quantized == stock.quantized == (14 if load_in_4bit else 0)
    bounds = FP32
    assert stock.dtypes == {torch.float32}, stock.dtypes

    # The same batch; for GRPO that includes the completions each side sampled from its own model, and the old /
    # reference log-probs each side computed with its own model.
    assert fast.inputs.keys() == stock.inputs.keys()
    if case.name == "grpo":
        assert "completion_ids" in stock.inputs, sorted(stock.inputs)
    for key, expected in stock.inputs.items():
        actual = fast.inputs[key]
        if expected.is_floating_point():
            error = relative_error(actual, expected) if expected.norm() > 0 else actual.norm().item()
            assert error <= bounds.loss, f"input {key}: relative error {error:.2e}"
        else:
            assert torch.equal(actual, expected), f"input {key} differs:\n{actual}\n{expected}"

    assert len(fast.losses) == len(stock.losses) >= 1
    for loss, expected in zip(fast.losses, stock.losses, strict=True):
        assert torch.isfinite(loss)
        error = relative_error(loss, expected) if expected != 0 else abs(loss.item())
        assert error <= bounds.loss, (loss.item(), expected.item())

    _assert_grads_match(fast.grads, stock.grads, bounds.grad)

    assert fast.metrics.keys() == stock.metrics.keys()
    assert set(KINDS[case.name].metrics) <= stock.metrics.keys(), sorted(stock.metrics)
    for key, expected in stock.metrics.items():
        actual = fast.metrics[key]
        assert math.isclose(actual, expected, rel_tol=bounds.metric_rtol, abs_tol=bounds.metric_atol), (
            key,
            actual,
            expected,
        )

    # Both sides ran the same forwards: the policy's, and the reference's in the adapter state the case asks for.
    assert [f.adapters for f in fast.forwards] == [f.adapters for f in stock.forwards]
    states = {f.adapters for f in stock.forwards}
    assert "default" in states, states
    if case.reference is not None:
        assert REFERENCE_STATE[case.reference] in states, states
        # The reference really is what the case says: the adapters-disabled base, which the non-zero LoRA B moved
        # the policy away from; or trl's copy of the adapter, equal to the policy at the first step.
        signal = KINDS[case.name].signal
        for side in (fast, stock):
            if case.reference == "disabled":
                assert abs(side.metrics[signal]) > 1e-3, (signal, side.metrics[signal])
            else:
                assert abs(side.metrics[signal]) <= 1e-5, (signal, side.metrics[signal])


REFERENCE_CASES = [case for case in CASES if case.reference is not None]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_every_forward_of_the_step_runs_fastfts_layers_and_checkpointer(case, steps):
    """Every forward of the step (the policy's; the reference's, with the adapters disabled or on trl's "ref" copy)
    takes fastft's fused attention / MLP path in every layer, as patch_report saw the model at the start of each
    forward; and the policy's run under the checkpointing get_peft_model chose: fastft's offloaded LayerCheckpoint in
    every layer, even after trl turned checkpointing off and on around a reference forward."""
    fast, _ = steps(case)
    states = [f.adapters for f in fast.forwards]
    if case.reference is not None:
        assert REFERENCE_STATE[case.reference] in states, states
    for forward in fast.forwards:
        assert forward.fallbacks == {}, f"{forward.adapters} forward: layers on peft's stock path: {forward.fallbacks}"
    checkpointing, _ = BASES[case.base]
    expected = {"LayerCheckpoint"} if checkpointing in ("offload", "sqrt") else {"off"}
    policy = [f.checkpointers for f in fast.forwards if f.adapters == "default"]
    assert policy and all(found == expected for found in policy), (expected, policy)
    assert fast.checkpointers == expected, f"after the step: {fast.checkpointers}"


@pytest.mark.parametrize("case", REFERENCE_CASES, ids=str)
def test_fused_logprob_head_serves_policy_and_reference(case, steps):
    """Where fastft's trl.fused_logprobs patch applies (trl's fused LM head, trl 1.16), it computes the per-token
    log-probs of every policy and reference forward of the step."""
    fast, _ = steps(case)
    row = fast.report[FUSED_LOGPROBS]
    if row["status"] != "applied":
        pytest.skip(f"{FUSED_LOGPROBS} is {row['status']} with trl {trl.__version__}: {row['reason']}")
    states = [f.adapters for f in fast.forwards]
    assert {"default", REFERENCE_STATE[case.reference]} <= set(states), states
    unserved = [f.adapters for f in fast.forwards if f.fused_logprob_calls < 1]
    assert not unserved, f"forwards that fastft's fused log-prob head did not serve: {unserved} (of {states})"
