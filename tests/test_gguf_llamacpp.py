"""fastft's GGUF files checked by llama.cpp itself (llama-cpp-python), on SmolLM2-135M-Instruct.

The ``llamacpp`` lane (``python .ci/lanes.py --lane llamacpp``) builds llama.cpp from llama-cpp-python's source
distribution and runs these tests; elsewhere llama_cpp is not installed and the module is skipped.

The reference is the 16-bit model: SmolLM2's weights rounded to float16 (so the f16 and f32 files hold exactly the
model's values) and run by stock transformers in float32. Every file type fastft writes is exported once, then:

- llama.cpp loads it and its next-token logits at every position of a fixed chat prompt stay within the bound this
  file states for the type (max and mean abs error, top-1 agreement, top-5 overlap; measured values beside ``BOUNDS``);
- each quantised mixture has, tensor for tensor, the type llama.cpp's own quantiser (``llama_model_quantize``) picks
  from the f16 file, and fastft's Q4_K_M tensors are no further from the f16 values than llama.cpp's;
- the tokenizer and chat template stored in the file give llama.cpp the token ids Hugging Face's tokenizer gives.
"""

from __future__ import annotations

import ctypes
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.llamacpp

if importlib.util.find_spec("llama_cpp") is None:
    # Only a missing package skips: an installed llama_cpp whose library fails to load fails below, at import.
    pytest.skip(
        "needs llama-cpp-python (llama.cpp); run these with: python .ci/lanes.py --lane llamacpp",
        allow_module_level=True,
    )

import gguf  # noqa: E402
import llama_cpp  # noqa: E402
from llama_cpp.llama_chat_format import Jinja2ChatFormatter  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from fastft import FastModel  # noqa: E402
from fastft.export.gguf_export import QUANTIZATIONS  # noqa: E402
from fastft.loading.embedded import materialise_gguf, resolve_alias  # noqa: E402

CONVERSATION = [
    {"role": "system", "content": "You are a concise assistant."},
    {"role": "user", "content": "Why is the sky blue?"},
    {"role": "assistant", "content": "Air scatters short (blue) wavelengths of sunlight more than long ones."},
    {"role": "user", "content": "And why are sunsets red? Answer in 2 sentences, café-style: ünïcödé, 日本語 🙂"},
]
# Digits, whitespace runs and multi-byte text: where SmolLM2's pre-tokenizer (llama.cpp's "smollm") can go wrong.
PROBES = ("Hello world! 123 4567 3.14159", "  multiple   spaces\n\ttabs and\r\nnewlines ", "déjà 日本語 🙂")
N_CTX = 256
THREADS = 2


@dataclass(frozen=True)
class Bound:
    """How far a file type's next-token logits may be from the 16-bit model's, over every prompt position."""

    max_abs: float  # largest |logit difference|, over positions and vocabulary
    mean_abs: float  # mean |logit difference|
    top1: float  # least fraction of positions whose argmax agrees
    top5: float  # least mean overlap of the two top-5 sets (1.0: the same five tokens everywhere)


# Measured on this prompt (86 tokens; the reference logits span -24 .. 39, std 7.0) with llama.cpp of llama-cpp-python
# 0.3.36 on the CPU, built two ways: -march=native on an AVX-512 machine, and the lane's portable AVX2 build. The
# comments give max |d|, mean |d|, top-1 and top-5 of each build (native / portable). The two builds sum in different
# orders, which moved the argmax at up to 5 of the 86 positions; so each bound has about 1.5x margin on the errors and
# 6 or more positions below the lower top-1. llama.cpp rounds the activations too (to f16 against f16 weights, to
# 8-bit blocks against quantised ones), so only f32 is near exact, and q8_0 is further off than bf16.
BOUNDS = {
    # 0.0001 / 0.0001, 0.00001 / 0.00001, 1.000 / 1.000, 1.000 / 1.000
    "f32": Bound(max_abs=0.01, mean_abs=0.001, top1=1.0, top5=0.99),
    # 0.063 / 0.047, 0.0070 / 0.0067, 1.000 / 1.000, 0.998 / 1.000
    "f16": Bound(max_abs=0.15, mean_abs=0.015, top1=0.93, top5=0.97),
    # 0.455 / 0.470, 0.060 / 0.063, 0.988 / 0.988, 0.988 / 0.991
    "bf16": Bound(max_abs=1.0, mean_abs=0.12, top1=0.92, top5=0.95),
    # 2.19 / 2.27, 0.257 / 0.267, 0.942 / 0.942, 0.947 / 0.958
    "q8_0": Bound(max_abs=3.5, mean_abs=0.4, top1=0.87, top5=0.9),
    # 3.21 / 3.23, 0.448 / 0.442, 0.884 / 0.849, 0.933 / 0.919
    "q6_k": Bound(max_abs=5.0, mean_abs=0.7, top1=0.77, top5=0.86),
    # 8.12 / 8.21, 1.074 / 1.073, 0.837 / 0.779, 0.807 / 0.798
    "q5_k_m": Bound(max_abs=12.0, mean_abs=1.6, top1=0.70, top5=0.73),
    # 8.61 / 8.25, 1.043 / 1.013, 0.849 / 0.860, 0.844 / 0.847
    "q4_k_m": Bound(max_abs=12.0, mean_abs=1.6, top1=0.77, top5=0.78),
}
# llama.cpp's file type (enum llama_ftype) for each name fastft writes.
FTYPES = {
    "f32": llama_cpp.LLAMA_FTYPE_ALL_F32,
    "f16": llama_cpp.LLAMA_FTYPE_MOSTLY_F16,
    "bf16": llama_cpp.LLAMA_FTYPE_MOSTLY_BF16,
    "q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0,
    "q4_k_m": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M,
    "q5_k_m": llama_cpp.LLAMA_FTYPE_MOSTLY_Q5_K_M,
    "q6_k": llama_cpp.LLAMA_FTYPE_MOSTLY_Q6_K,
}
QUANTISED = [name for name in QUANTIZATIONS if name not in ("f32", "f16", "bf16")]


def _load(path: Path, **kwargs) -> llama_cpp.Llama:
    # A float32 KV cache, so that what the comparison sees is the file's rounding, not llama.cpp's f16 cache.
    return llama_cpp.Llama(
        model_path=str(path),
        n_ctx=N_CTX,
        n_batch=N_CTX,
        n_threads=THREADS,
        logits_all=True,
        type_k=llama_cpp.GGML_TYPE_F32,
        type_v=llama_cpp.GGML_TYPE_F32,
        verbose=False,
        **kwargs,
    )


def _quantize_with_llama_cpp(source: Path, target: Path, name: str) -> Path:
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[name]
    params.nthread = THREADS
    code = llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(), ctypes.byref(params))
    assert code == 0, f"llama_model_quantize {source.name} -> {name} returned {code}"
    return target


def _tensors(path: Path) -> dict[str, gguf.ReaderTensor]:
    # The reader maps the file: a tensor's bytes are read when it is dequantised, one tensor at a time.
    return {tensor.name: tensor for tensor in gguf.GGUFReader(path).tensors}


def _dequantized(tensor: gguf.ReaderTensor) -> np.ndarray:
    return gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float64)


def _relative_rms(values: np.ndarray, reference: np.ndarray) -> float:
    return float(np.linalg.norm(values - reference) / np.linalg.norm(reference))


@pytest.fixture(scope="module")
def smol():
    """The 16-bit SmolLM2 (float16 values in float32 tensors), its tokenizer and the chat prompt's ids."""
    folder = materialise_gguf(*resolve_alias("smollm2-135m", None))
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(parameter.half().float())
    tokenizer = AutoTokenizer.from_pretrained(folder)
    text = tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert 40 < len(ids) < N_CTX
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].double().numpy()
    return SimpleNamespace(model=model, tokenizer=tokenizer, text=text, ids=ids, logits=logits)


@pytest.fixture(scope="module")
def exported(smol, tmp_path_factory) -> dict[str, Path]:
    """One file per type fastft writes, exported once for the module."""
    folder = tmp_path_factory.mktemp("gguf-llamacpp")
    return {name: FastModel.save_gguf(smol.model, smol.tokenizer, folder, quantization=name) for name in QUANTIZATIONS}


@pytest.fixture(scope="module")
def llama_cpp_quantized(exported, tmp_path_factory) -> dict[str, Path]:
    """llama.cpp's own quantiser run on fastft's f16 file, for each quantised type fastft writes."""
    folder = tmp_path_factory.mktemp("gguf-llama-quantize")
    return {name: _quantize_with_llama_cpp(exported["f16"], folder / f"{name}.gguf", name) for name in QUANTISED}


def test_every_file_type_has_a_bound_and_a_llama_cpp_file_type():
    # A type added to QUANTIZATIONS must be measured here before it ships.
    assert sorted(QUANTIZATIONS) == sorted(BOUNDS) == sorted(FTYPES)


@pytest.mark.parametrize("name", QUANTIZATIONS)
def test_llama_cpp_loads_the_file_and_predicts_what_transformers_does(name, smol, exported):
    llm = _load(exported[name])
    try:
        assert llm.n_vocab() == len(smol.tokenizer) == 49152
        assert llm.metadata["general.architecture"] == "llama"
        assert int(llm.metadata["general.file_type"]) == FTYPES[name]
        llm.eval(smol.ids)
        logits = np.array(llm.scores[: len(smol.ids)], dtype=np.float64)
    finally:
        llm.close()
    reference = smol.logits
    max_abs = float(np.abs(logits - reference).max())
    mean_abs = float(np.abs(logits - reference).mean())
    top1 = float((logits.argmax(-1) == reference.argmax(-1)).mean())
    top5_ours = np.argsort(-logits, axis=-1)[:, :5]
    top5_reference = np.argsort(-reference, axis=-1)[:, :5]
    top5 = float(np.mean([len(set(a) & set(b)) / 5 for a, b in zip(top5_ours, top5_reference, strict=True)]))
    size_mb = exported[name].stat().st_size / 1e6
    errors = f"|dlogit| max {max_abs:.4f} mean {mean_abs:.4f}, top-1 {top1:.3f}, top-5 {top5:.3f}"
    print(f"\n{name}: {size_mb:.1f} MB, {errors}")
    bound = BOUNDS[name]
    assert np.isfinite(logits).all()
    assert max_abs <= bound.max_abs, f"{name}: max |logit - transformers'| is {max_abs:.4f} > {bound.max_abs}"
    assert mean_abs <= bound.mean_abs, f"{name}: mean |logit - transformers'| is {mean_abs:.4f} > {bound.mean_abs}"
    assert top1 >= bound.top1, f"{name}: the argmax agrees at {top1:.3f} of positions < {bound.top1}"
    assert top5 >= bound.top5, f"{name}: the top-5 sets overlap {top5:.3f} < {bound.top5}"


@pytest.mark.parametrize("name", QUANTISED)
def test_each_tensor_has_the_type_llama_cpp_quantize_gives_it(name, exported, llama_cpp_quantized):
    ours = {t.name: t.tensor_type.name for t in gguf.GGUFReader(exported[name]).tensors}
    theirs = {t.name: t.tensor_type.name for t in gguf.GGUFReader(llama_cpp_quantized[name]).tensors}
    assert ours.keys() == theirs.keys()
    differ = {tensor: (ours[tensor], theirs[tensor]) for tensor in ours if ours[tensor] != theirs[tensor]}
    assert differ == {}, f"{name}: tensors whose type differs from llama.cpp's (fastft, llama.cpp): {differ}"


def test_q4_k_m_tensors_are_no_further_from_f16_than_llama_cpp_quantize_puts_them(exported, llama_cpp_quantized):
    reference, ours, theirs = (
        _tensors(path) for path in (exported["f16"], exported["q4_k_m"], llama_cpp_quantized["q4_k_m"])
    )
    rows, worse, identical = [], {}, 0
    for name, tensor in reference.items():
        if len(tensor.shape) == 1:
            continue  # norms stay f32 in both
        values = _dequantized(tensor)
        ours_error = _relative_rms(_dequantized(ours[name]).reshape(values.shape), values)
        theirs_error = _relative_rms(_dequantized(theirs[name]).reshape(values.shape), values)
        identical += bool(np.array_equal(ours[name].data, theirs[name].data))
        rows.append((name, ours[name].tensor_type.name, ours_error, theirs_error))
        if ours_error > theirs_error:
            worse[name] = f"{ours_error:.6f} vs {theirs_error:.6f} (+{ours_error / theirs_error - 1:.3%})"
    print("\ntensor, type, fastft relative RMS, llama.cpp relative RMS")
    for row in rows:
        print(f"{row[0]}, {row[1]}, {row[2]:.6f}, {row[3]:.6f}")
    total_ours = np.sqrt(np.mean([row[2] ** 2 for row in rows]))
    total_theirs = np.sqrt(np.mean([row[3] ** 2 for row in rows]))
    print(f"RMS over tensors: fastft {total_ours:.6f}, llama.cpp {total_theirs:.6f}")
    print(f"tensors whose bytes equal llama.cpp's: {identical} of {len(rows)}")
    assert len(rows) == 1 + 30 * 7, "token_embd and seven projections in each of the 30 layers"
    assert worse == {}, f"fastft's Q4_K_M is further from the f16 values than llama.cpp's on: {worse}"


def test_the_embedded_tokenizer_and_chat_template_give_hugging_faces_ids(smol, exported):
    llm = llama_cpp.Llama(model_path=str(exported["f16"]), vocab_only=True, verbose=False)
    try:
        template = llm.metadata["tokenizer.chat_template"]
        eos = llm.detokenize([llm.token_eos()], special=True).decode()
        bos = llm.detokenize([llm.token_bos()], special=True).decode()
        rendered = Jinja2ChatFormatter(template=template, eos_token=eos, bos_token=bos)(messages=CONVERSATION).prompt
        assert rendered == smol.text
        # add_bos=True lets llama.cpp add what the file says it adds (nothing for SmolLM2, as Hugging Face).
        assert llm.tokenize(rendered.encode(), add_bos=True, special=True) == smol.tokenizer(smol.text).input_ids
        for probe in PROBES:
            assert llm.tokenize(probe.encode(), add_bos=True, special=True) == smol.tokenizer(probe).input_ids, probe
        # llama.cpp's own C++ template engine recognises the template too (ChatML), as llama-server would use it.
        chat = (llama_cpp.llama_chat_message * len(CONVERSATION))(
            *(llama_cpp.llama_chat_message(m["role"].encode(), m["content"].encode()) for m in CONVERSATION)
        )
        buffer = ctypes.create_string_buffer(8192)
        length = llama_cpp.llama_chat_apply_template(template.encode(), chat, len(chat), True, buffer, len(buffer))
        assert 0 < length <= len(buffer)
        assert buffer.raw[:length].decode() == smol.text
    finally:
        llm.close()
