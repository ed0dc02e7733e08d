"""GPUs below compute capability 8.0 (T4, V100, RTX 20xx) train in fp16 with a gradient scaler, adapters in fp32.

No GPU is needed: the CUDA queries fastft makes are monkeypatched to describe a T4 (7.5) or an A100 (8.0). Both
report ``torch.cuda.is_bf16_supported() == True``, as a real T4 does, so a choice made on it would fail here.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from conftest import tiny_llama_config
from safetensors import safe_open

from fastft import FastModel
from fastft.loading import dtypes, pretrained
from fastft.model import keep_trainable_fp32, resolve_dtype
from fastft.training.trl import sft_config

CARDS = {(7, 5): "Tesla T4", (8, 0): "NVIDIA A100-SXM4-40GB"}


@pytest.fixture
def gpu(monkeypatch):
    """Call with a (major, minor) capability to make torch report one CUDA GPU of that capability."""

    def simulate(capability: tuple[int, int]) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: CARDS[capability])
        # True on a T4 too: torch counts bf16 emulation as support.
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)

    yield simulate
    # TrainingArguments set up accelerate's process-wide state on the pretend GPU; later tests must not inherit it.
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)


def _resolve(dtype):
    """resolve_dtype's result and every warning it gave (none hidden by the once-per-location filter)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resolved = resolve_dtype(dtype)
    return resolved, caught


def test_automatic_dtype_is_fp16_below_capability_8(gpu):
    gpu((7, 5))
    resolved, caught = _resolve(None)
    assert resolved == torch.float16
    assert not caught, "the automatic choice is not a downgrade and must not warn"


@pytest.mark.parametrize("requested", [torch.bfloat16, "bf16", "bfloat16", "BF16"])
def test_explicit_bf16_becomes_fp16_with_one_warning_saying_why(gpu, requested):
    gpu((7, 5))
    resolved, caught = _resolve(requested)
    assert resolved == torch.float16
    assert len(caught) == 1, [str(w.message) for w in caught]
    assert caught[0].category is UserWarning
    message = str(caught[0].message)
    for part in ("no bf16 tensor cores", "compute capability 8.0", "Tesla T4", "compute capability 7.5"):
        assert part in message, f"{part!r} missing from: {message}"
    assert "fp16" in message and "gradient scaler" in message


def test_other_explicit_dtypes_stay_below_capability_8(gpu):
    gpu((7, 5))
    for requested, expected in (("fp16", torch.float16), (torch.float32, torch.float32)):
        resolved, caught = _resolve(requested)
        assert resolved == expected and not caught


def test_capability_8_keeps_bf16(gpu):
    gpu((8, 0))
    for requested in (None, "bf16", torch.bfloat16):
        resolved, caught = _resolve(requested)
        assert resolved == torch.bfloat16 and not caught, requested


def test_cpu_stays_float32_and_keeps_an_explicit_bf16(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _resolve(None) == (torch.float32, [])
    assert _resolve("bf16") == (torch.bfloat16, [])


@pytest.mark.parametrize(
    ("capability", "fp16", "bf16"), [((7, 5), True, False), ((8, 0), False, True)], ids=["sm75", "sm80"]
)
def test_trl_config_mixed_precision_follows_capability(gpu, tmp_path, capability, fp16, bf16):
    gpu(capability)
    config = sft_config(str(tmp_path / "out"), resolve_dtype(None), 64)
    assert (config.fp16, config.bf16) == (fp16, bf16)
    assert not config.use_cpu


def test_trl_config_turns_bf16_into_fp16_below_capability_8(gpu, tmp_path):
    gpu((7, 5))
    with pytest.warns(UserWarning, match="no bf16 tensor cores"):
        config = sft_config(str(tmp_path / "out"), torch.bfloat16, 64)
    assert config.fp16 and not config.bf16


class _Loaded(Exception):
    """Raised by the stand-in loader, carrying the arguments from_pretrained gave it."""


def test_from_pretrained_loads_and_quantises_in_fp16_below_capability_8(gpu, tiny_llama_dir, monkeypatch):
    gpu((7, 5))

    def capture(source, **kwargs):
        raise _Loaded(kwargs)

    monkeypatch.setattr(pretrained.AutoModelForCausalLM, "from_pretrained", capture)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(_Loaded) as loaded:
            FastModel.from_pretrained(str(tiny_llama_dir), dtype="bf16", load_in_4bit=True)
    kwargs = loaded.value.args[0]
    assert kwargs[dtypes._DTYPE_KWARG] == torch.float16
    assert kwargs["quantization_config"].bnb_4bit_compute_dtype == torch.float16
    assert len([w for w in caught if "bf16 tensor cores" in str(w.message)]) == 1, "one warning per call"


def _tiny_model(smol_tokenizer, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    config = tiny_llama_config(smol_tokenizer, vocab_size=256, tie_word_embeddings=False)
    return LlamaForCausalLM(config).to(dtype)


def test_trained_weights_are_fp32_over_an_fp16_base_and_the_scaler_unscales_them(smol_tokenizer):
    model = FastModel.get_peft_model(
        _tiny_model(smol_tokenizer, torch.float16),
        r=4,
        lora_alpha=8,
        modules_to_save=["embed_tokens", "lm_head"],
        use_gradient_checkpointing=False,
    )
    trained = {name: p for name, p in model.named_parameters() if p.requires_grad}
    assert any("lora_A" in name for name in trained) and any("lora_B" in name for name in trained)
    assert sum("modules_to_save" in name for name in trained) == 2
    assert {name: p.dtype for name, p in trained.items() if p.dtype != torch.float32} == {}
    frozen = {p.dtype for p in model.parameters() if not p.requires_grad}
    assert frozen == {torch.float16}, "the base must stay fp16"

    ids = torch.randint(3, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    # Without autocast (generation, CPU) the fp32 copies take fp16 inputs and hand fp16 on.
    with torch.no_grad():
        assert model(input_ids=ids).logits.dtype == torch.float16

    # One fp16 step as Trainer takes it with fp16=True: autocast, scaled backward, unscale, step.
    optimizer = torch.optim.SGD(list(trained.values()), lr=1.0)
    scaler = torch.amp.GradScaler("cpu")
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(input_ids=ids, labels=ids).loss
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)  # raises "Attempting to unscale FP16 gradients" for any fp16 weight
    embedding = next(p for name, p in trained.items() if "embed_tokens.modules_to_save" in name)
    before = embedding.detach().clone()
    assert embedding.grad.dtype == torch.float32 and embedding.grad.abs().sum() > 0
    scaler.step(optimizer)
    assert not torch.equal(embedding, before), "the step must update the fp32 copy"


def test_a_bf16_base_is_left_as_it_is(smol_tokenizer):
    model = FastModel.get_peft_model(
        _tiny_model(smol_tokenizer, torch.bfloat16), r=4, modules_to_save=["lm_head"], use_gradient_checkpointing=False
    )
    copy = next(p for name, p in model.named_parameters() if "lm_head.modules_to_save" in name)
    assert copy.dtype == torch.bfloat16, "bf16 trains without a gradient scaler; its copies need no upcast"
    assert keep_trainable_fp32(model) == []


def test_fastft_train_keeps_adapters_fp32_on_a_4bit_fp16_base(tiny_llama_dir, tmp_path):
    # trl's SFTTrainer casts the trained weights of a 4-bit model to bf16 when it is built; `fastft train` must undo
    # that for an fp16 run, or its gradient scaler would get bf16 adapters (fp16 ones on other versions).
    from fastft.training.train import TrainOptions, run

    output = tmp_path / "run"
    metrics = run(
        TrainOptions(
            output=str(output),
            model=str(tiny_llama_dir),
            max_steps=1,
            seq_len=64,
            batch_size=2,
            load_in_4bit=True,
            dtype="float16",
            save_steps=100,
        )
    )
    assert metrics["dtype"] == "float16" and metrics["completed"]
    with safe_open(str(output / "adapter_model.safetensors"), "pt") as handle:
        dtypes = {key: handle.get_slice(key).get_dtype() for key in handle.keys()}  # noqa: SIM118 (not a dict)
    assert dtypes and set(dtypes.values()) == {"F32"}, dtypes
    assert json.loads((output / "adapter_config.json").read_text())["peft_type"] == "LORA"


def test_bf16_trained_weights_over_an_fp32_base_come_back_to_fp32(smol_tokenizer):
    model = FastModel.get_peft_model(
        _tiny_model(smol_tokenizer, torch.float32), r=4, modules_to_save=["lm_head"], use_gradient_checkpointing=False
    )
    trained = [p for p in model.parameters() if p.requires_grad]
    for parameter in trained:
        # What trl's trainers do to the trained weights of a 4-bit model when they are built.
        parameter.data = parameter.data.to(torch.bfloat16)
    assert len(keep_trainable_fp32(model)) == len(trained)
    assert all(p.dtype == torch.float32 for p in trained)
    # Over an fp32 base the copies compute in fp32 like everything else: no dtype hooks.
    assert not any(getattr(module, "_fastft_fp32_copy", False) for module in model.modules())
