"""The straight-line layer program (fastft.kernels.lora_layer_program): the general decoder-layer node's loss and
gradients bit for bit, on both kernel paths, in both GEMM orders, with cast adapters, under checkpointing, and the
layers it leaves to the general node."""

from __future__ import annotations

import contextlib

import pytest
import torch
from parity import lora_model, make_batch, save_family

import fastft.kernels.lora_decoder_layer as node
from fastft.kernels import gemm_tuner
from fastft.kernels.lora_layer_program import LayerProgram
from fastft.patches.fused_layer import layer_programs

STEPS = 2


@pytest.fixture
def programs(monkeypatch) -> dict[str, object]:
    """A switch for the programs (``state["on"]``) and the count of layer calls that ran one (``state["ran"]``)."""
    state: dict[str, object] = {"on": True, "ran": 0}
    found = node.program_for

    def switched(spec, x2d, dtype):
        program = found(spec, x2d, dtype) if state["on"] else None
        state["ran"] += program is not None
        return program

    monkeypatch.setattr(node, "program_for", switched)
    return state


def _steps(model, batch, steps: int = STEPS) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss and LoRA gradients of the last of ``steps`` forward + backward passes (no optimizer step)."""
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        loss = model(**batch).loss
        loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}
    return loss.detach(), grads


def _compare(folder, programs, checkpointing, batch, **load) -> int:
    """Train a model with programs and one without; assert equal bits; return how many layer calls ran a program."""
    results = []
    for on in (True, False):
        programs["on"], programs["ran"] = on, 0
        model = lora_model(folder, patch=True, checkpointing=checkpointing, **load)
        results.append((_steps(model, batch), programs["ran"]))
    ((loss, grads), ran), ((expected_loss, expected), _) = results
    assert torch.equal(loss, expected_loss), (loss, expected_loss)
    assert grads.keys() == expected.keys() and any("lora_A" in name for name in grads)
    for name, grad in grads.items():
        assert grad is not None and torch.equal(grad, expected[name]), name
    return ran


def _batch(vocab: int) -> dict[str, torch.Tensor]:
    batch = make_batch(vocab, batch=2, seq=7, pad=2)
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], "labels": batch["labels"]}


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory, smol_tokenizer) -> str:
    return save_family(tmp_path_factory.mktemp("llama"), "llama", smol_tokenizer)


@pytest.mark.parametrize("order", ["cublas", "cublas-accumulate"])
@pytest.mark.parametrize("checkpointing", [False, True, "offload"])
def test_the_general_nodes_bits(llama_folder, kernel_path, programs, monkeypatch, order, checkpointing):
    # Every group on torch's matmul in the chosen order, as the tuner picks on a GPU, whichever kernel path the
    # norms, RoPE and the gate take (the Triton path is the H100's, through the interpreter here).
    choice = gemm_tuner.Choice(gemm_tuner.CUBLAS if order == "cublas" else gemm_tuner.CUBLAS_ACCUMULATE, "test")
    monkeypatch.setattr(gemm_tuner, "choose", lambda *args, **kwargs: choice)
    config_layers = 2
    ran = _compare(llama_folder, programs, checkpointing, _batch(512))
    # The first step's calls choose the GEMMs (general node); from the second every call runs the program: forward
    # and, checkpointed, the recompute too (the first step's recompute already finds the choices made).
    calls = {False: config_layers, True: 3 * config_layers, "offload": 3 * config_layers}[checkpointing]
    assert ran == calls


@pytest.mark.parametrize("autocast", [False, True], ids=["bf16", "bf16-under-autocast"])
def test_cast_adapters_over_a_bf16_base(llama_folder, programs, monkeypatch, autocast):
    # peft keeps fp32 adapters over a 16-bit base: one cast copy forward, the gradients cast back in one copy. Under
    # autocast (a Trainer's bf16=True) the norms and the attention run under it and the groups with it off.
    monkeypatch.setattr(gemm_tuner, "choose", lambda *args, **kwargs: gemm_tuner.Choice(gemm_tuner.CUBLAS, "test"))
    context = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with context:
        ran = _compare(llama_folder, programs, False, _batch(512), dtype=torch.bfloat16)
    assert ran == 2
    model = lora_model(llama_folder, patch=True, checkpointing=False, dtype=torch.bfloat16)
    adapters = [p for name, p in model.named_parameters() if "lora_" in name]
    bases = [p for name, p in model.named_parameters() if "base_layer" in name]
    assert {p.dtype for p in adapters} == {torch.float32} and {p.dtype for p in bases} == {torch.bfloat16}


def _program_of(layer: torch.nn.Module) -> dict | None:
    _, spec = layer.__dict__["_fastft_plan"].value
    return spec.programs


def test_mistral_with_its_sliding_window(smol_tokenizer, tmp_path, programs, monkeypatch):
    # The attention function gets the layer's sliding window through the same attend closure; checkpointed, so the
    # recompute runs the program too.
    monkeypatch.setattr(gemm_tuner, "choose", lambda *args, **kwargs: gemm_tuner.Choice(gemm_tuner.CUBLAS, "test"))
    folder = save_family(tmp_path, "mistral", smol_tokenizer, sliding_window=4)
    assert _compare(folder, programs, True, _batch(256)) == 6


@pytest.mark.interpreted
def test_triton_gemm_groups(llama_folder, programs):
    # The tuner's Triton GEMM (the interpreter's here) runs through lora_math.run inside the program.
    with gemm_tuner.force("triton"):
        assert _compare(llama_folder, programs, False, _batch(512)) == 2


@pytest.mark.parametrize("case", ["qwen2-biases", "nf4"])
def test_biases_and_nf4_bases(llama_folder, smol_tokenizer, tmp_path, programs, monkeypatch, case):
    # q / k / v biases (Qwen2) and QLoRA's NF4 bases (dequantised into the shared buffer, forward and backward).
    monkeypatch.setattr(gemm_tuner, "choose", lambda *args, **kwargs: gemm_tuner.Choice(gemm_tuner.CUBLAS, "test"))
    if case == "nf4":
        ran = _compare(llama_folder, programs, False, _batch(512), load_in_4bit=True)
    else:
        folder = save_family(tmp_path, "qwen2", smol_tokenizer)
        ran = _compare(folder, programs, True, _batch(256))
    assert ran == (2 if case == "nf4" else 6)


def test_the_program_steps_aside_for_a_frozen_adapter(llama_folder, programs):
    with gemm_tuner.force("cublas"):
        # A frozen adapter: its layer's plan has no program table at all; the other layer runs its program.
        model = lora_model(llama_folder, patch=True, checkpointing=False)
        assert layer_programs(model) == {"fused_layers": 0, "programs": 0}  # no plan before the first call
        layers = model.get_base_model().model.layers
        layers[0].self_attn.q_proj.lora_A["default"].weight.requires_grad_(False)
        _steps(model, _batch(512))
        assert _program_of(layers[0]) is None and programs["ran"] == 1
        assert layer_programs(model) == {"fused_layers": 2, "programs": 1}


def test_a_parameter_cast_in_place_sends_the_call_back_to_the_general_node(llama_folder, programs):
    with gemm_tuner.force("cublas"):
        model = lora_model(llama_folder, patch=True, checkpointing=False)
        batch = _batch(512)
        _steps(model, batch)
        layer = model.get_base_model().model.layers[1]
        (program,) = _program_of(layer).values()
        assert isinstance(program, LayerProgram) and program.holds()
        # model.to() swaps parameter data in place: the plan stays, the program's dtypes no longer hold, and the
        # general node casts the float64 B as it always has.
        lora_b = layer.mlp.down_proj.lora_B["default"].weight
        lora_b.data = lora_b.data.double()
        assert not program.holds()
        programs["ran"] = 0
        _steps(model, batch, steps=1)
        assert programs["ran"] == 1  # the first layer's
        assert lora_b.grad.dtype == torch.float64 and lora_b.grad.abs().sum() > 0


def test_the_program_table_is_bounded(llama_folder, programs, monkeypatch):
    # One program per rows bucket and tuner generation: a run whose lengths keep changing clears the table.
    import fastft.kernels.lora_layer_program as module

    monkeypatch.setattr(module, "_MAX_PROGRAMS", 1)
    with gemm_tuner.force("cublas"):
        model = lora_model(llama_folder, patch=True, checkpointing=False)
        layer = model.get_base_model().model.layers[1]
        for seq in (7, 20, 7):
            batch = make_batch(512, batch=2, seq=seq)
            _steps(model, {"input_ids": batch["input_ids"], "labels": batch["labels"]})
            (program,) = _program_of(layer).values()
            assert isinstance(program, LayerProgram)


def test_transformers_own_checkpointing_a_partial_grad_and_a_second_backward(llama_folder, programs, monkeypatch):
    # transformers' non-reentrant checkpointing recomputes through the program; torch.autograd.grad over a few
    # adapters gets the general node's values; a second backward through a spent node says so, as the general one.
    inputs = _batch(512)
    results = []
    for on in (True, False):
        programs["on"], programs["ran"] = on, 0
        with gemm_tuner.force("cublas"):
            model = lora_model(llama_folder, patch=True, checkpointing=False)
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.train()
            loss, grads = _steps(model, inputs)
            some = [p for name, p in model.named_parameters() if "lora_A" in name][:3]
            partial = torch.autograd.grad(model(**inputs).loss, some)
            assert (programs["ran"] > 0) == on
            model.gradient_checkpointing_disable()
            loss = model(**inputs).loss
            loss.backward(retain_graph=True)
            with pytest.raises(RuntimeError, match="backward already ran"):
                loss.backward()
        results.append((grads, partial))
    (grads, partial), (expected, expected_partial) = results
    assert all(torch.equal(grad, expected[name]) for name, grad in grads.items())
    assert all(torch.equal(a, b) for a, b in zip(partial, expected_partial, strict=True))
