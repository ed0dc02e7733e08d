"""save_gguf's llama.cpp mixtures (q4_k_m, q5_k_m, q6_k): transformers reloads the file (its GGUF loader dequantises
K-quants), every tensor has the type the mixture gives it, its bytes are the K-quant of the merged weights, and the
reloaded model predicts like the merged one.

Two models: a tiny Llama whose rows are multiples of 256 (8 layers, untied), so every matrix takes its K-quant and
the "more bits" layers differ from the others; and the real SmolLM2-135M (hidden 576), whose attention and gate / up
rows fall back to llama.cpp's 32-block types while ffn_down (rows of 1536) is K-quantised. SmolLM2 ships here as a
Q4_1 GGUF, so its "full-precision" weights already lie on a 4-bit grid: its logit errors below are measured, and not
what a 16-bit checkpoint would show.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from conftest import randomize_lora_b, relative_error, tiny_llama_config
from safetensors.torch import load_file
from test_gguf_export import PROMPT, _small_tokenizer
from transformers import AutoModelForCausalLM, LlamaForCausalLM

import fastft.export.gguf_export as gguf_export
from fastft import FastModel
from fastft.export import kquants
from fastft.export.gguf_mixtures import MixtureModel, tensor_type

TYPES = gguf.GGMLQuantizationType


def _types(file) -> dict[str, str]:
    return {tensor.name: tensor.tensor_type.name for tensor in gguf.GGUFReader(file).tensors}


def _assert_mixture(file, quantization: str, model: MixtureModel) -> dict[str, str]:
    """Every tensor of the file has the type gguf_mixtures gives it (shapes read back in transformers' order)."""
    reader = gguf.GGUFReader(file)
    types = {}
    for tensor in reader.tensors:
        shape = tuple(int(d) for d in reversed(tensor.shape))
        assert tensor.tensor_type.name == tensor_type(tensor.name, shape, quantization, model).type_name, tensor.name
        types[tensor.name] = tensor.tensor_type.name
    file_type = reader.fields["general.file_type"].contents()
    assert file_type == int(getattr(gguf.LlamaFileType, gguf_export.FILE_TYPES[quantization][1]))
    return types


def _merged_weight(folder, key: str) -> np.ndarray:
    state = {}
    for shard in sorted(folder.glob("*.safetensors")):
        state.update(load_file(shard))
    return state[key].float().numpy()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """An 8-layer Llama with rows of 256 / 512 and LoRA on every projection (B non-zero), merged in float32."""
    tokenizer = _small_tokenizer()
    folder = tmp_path_factory.mktemp("tiny-k")
    config = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=8, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(tiny_llama_config(tokenizer, **config, initializer_range=0.02)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    model, tokenizer = FastModel.from_pretrained(str(folder), max_seq_length=64)
    model = FastModel.get_peft_model(model, r=4, lora_alpha=8, use_gradient_checkpointing=False)
    randomize_lora_b(model, seed=3, std=0.05)
    FastModel.for_inference(model)
    merged = FastModel.save_merged(model, tokenizer, tmp_path_factory.mktemp("tiny-k-out") / "merged", torch.float32)
    return model, tokenizer, merged, folder


# Relative logit error of the reloaded file against the merged float32 model on 23 random tokens (measured: q4_k_m
# 0.205, q5_k_m 0.102, q6_k 0.057: eight random layers compound each matrix's 7 / 3.6 / 1.8 % error), and the size of
# the file against the f32 file's (0.151 / 0.178 / 0.206 measured).
TINY_BOUNDS = {"q4_k_m": (0.3, 0.16), "q5_k_m": (0.15, 0.19), "q6_k": (0.08, 0.22)}


@pytest.mark.parametrize("quantization", list(TINY_BOUNDS))
def test_tiny_llama_k_quant_files(tiny, tmp_path, quantization):
    model, tokenizer, merged_dir, _ = tiny
    file = FastModel.save_gguf(model, tokenizer, tmp_path / f"tiny-{quantization}.gguf", quantization=quantization)
    types = _assert_mixture(file, quantization, MixtureModel(n_layers=8))
    base = {"q4_k_m": "Q4_K", "q5_k_m": "Q5_K", "q6_k": "Q6_K"}[quantization]
    assert types["blk.4.attn_q.weight"] == types["blk.4.ffn_down.weight"] == types["token_embd.weight"] == base
    assert types["blk.3.ffn_down.weight"] == types["blk.3.attn_v.weight"] == types["output.weight"] == "Q6_K"
    assert types["blk.3.ffn_norm.weight"] == "F32"
    # The bytes are fastft's K-quant of the merged weight rounded to float16 (ffn_down's rows keep their order) ...
    merged_down = _merged_weight(merged_dir, "model.layers.4.mlp.down_proj.weight").astype(np.float16)
    tensor = next(t for t in gguf.GGUFReader(file).tensors if t.name == "blk.4.ffn_down.weight")
    expected_bytes = kquants.quantize(merged_down.astype(np.float32), base)
    assert np.array_equal(np.asarray(tensor.data).reshape(-1), expected_bytes.reshape(-1))
    # ... and every quantised tensor is what quantising the f16 file's tensor gives: llama.cpp's pipeline (f16 GGUF,
    # then llama-quantize, whose quantisers write these same bytes: test_gguf_kquants) yields this very file's data.
    f16 = {t.name: t for t in gguf.GGUFReader(FastModel.save_gguf(model, tokenizer, tmp_path / "f16.gguf")).tensors}
    for tensor in gguf.GGUFReader(file).tensors:
        if tensor.tensor_type.name == "F32":
            continue
        values = np.asarray(f16[tensor.name].data, dtype=np.float32)
        encoded = (
            kquants.quantize(values, tensor.tensor_type.name)
            if tensor.tensor_type.name in kquants.K_TYPES
            else gguf.quants.quantize(values, tensor.tensor_type)
        )
        assert np.array_equal(np.asarray(tensor.data).reshape(-1), encoded.reshape(-1)), tensor.name
    ids = torch.randint(3, model.config.vocab_size, (1, 23), generator=torch.Generator().manual_seed(5))
    reloaded = AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name, dtype=torch.float32)
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32)
    with torch.no_grad():
        error = relative_error(reloaded(ids).logits, merged(ids).logits)
    bound, size_ratio = TINY_BOUNDS[quantization]
    assert 0 < error < bound, error
    f32 = FastModel.save_gguf(model, tokenizer, tmp_path / "tiny-f32.gguf", quantization="f32")
    assert file.stat().st_size < size_ratio * f32.stat().st_size, file.stat().st_size / f32.stat().st_size


def test_streaming_block_size_does_not_change_the_file(tiny, tmp_path, monkeypatch):
    # Rows are encoded independently, so blocks of a few rows give the same bytes as the default blocks of 4M values:
    # the export's memory bound holds for K-quants as for the other types. (The base model alone: a LoRA merge's
    # float32 rounding itself depends on the block shape, in every file type.)
    _, _, _, folder = tiny
    model, tokenizer = FastModel.from_pretrained(str(folder), max_seq_length=64)
    whole = FastModel.save_gguf(model, tokenizer, tmp_path / "default.gguf", quantization="q4_k_m")
    monkeypatch.setattr(gguf_export, "BLOCK_ELEMENTS", 4096)
    monkeypatch.setattr(gguf_export, "_CHUNK_ELEMENTS", 1024)
    small = FastModel.save_gguf(model, tokenizer, tmp_path / "small-blocks.gguf", quantization="q4_k_m")
    assert whole.read_bytes() == small.read_bytes()


def test_cli_takes_the_mixture_names(tmp_path, capsys):
    from fastft.cli import main

    with pytest.raises(SystemExit):
        main(["export", "--adapter", str(tmp_path), "--gguf", str(tmp_path / "x.gguf"), "--quantization", "q3_k_m"])
    assert "invalid choice: 'q3_k_m'" in capsys.readouterr().err
    # q4_k_m passes the parser; the export then stops at the missing adapter.
    code = main(["export", "--adapter", str(tmp_path), "--gguf", str(tmp_path / "x.gguf"), "--quantization", "q4_k_m"])
    assert code != 0 and "adapter_config.json" in capsys.readouterr().err


def test_unknown_quantization_is_refused_with_the_list(tiny, tmp_path):
    model, tokenizer, _, _ = tiny
    with pytest.raises(ValueError, match=r"quantization='q4_k_s' is not one of \[.*'q4_k_m', 'q5_k_m', 'q6_k'\]"):
        FastModel.save_gguf(model, tokenizer, tmp_path / "x.gguf", quantization="q4_k_s")
    assert list(tmp_path.iterdir()) == []


def test_smollm2_q4_k_m(tmp_path, caplog):
    """The real model: fallbacks on rows of 576, K-quants on ffn_down, tied embeddings at Q8_0; reloaded by
    transformers, it predicts like the LoRA model it was merged from along a greedy continuation of a chat prompt."""
    from fastft.kernels import dispatch

    model, tokenizer = FastModel.from_pretrained("smollm2-135m", max_seq_length=256)
    model = FastModel.get_peft_model(model, r=8, lora_alpha=16, use_gradient_checkpointing=False)
    randomize_lora_b(model, seed=1, std=0.05)
    FastModel.for_inference(model)
    with caplog.at_level("WARNING", logger="fastft.gguf_export"):
        file = FastModel.save_gguf(model, tokenizer, tmp_path / "smol.gguf", quantization="q4_k_m")
    # One warning names the 180 tensors whose rows of 576 take a 32-block type.
    warnings = [record.getMessage() for record in caplog.records if "fallback type" in record.getMessage()]
    assert len(warnings) == 1 and warnings[0].startswith("fastft.save_gguf: 180 tensors take")
    assert "blk.0.attn_q.weight" in warnings[0] and "blk.0.ffn_down.weight" not in warnings[0]
    types = _assert_mixture(file, "q4_k_m", MixtureModel(n_layers=30, tied=True))
    counts = {name: list(types.values()).count(name) for name in set(types.values())}
    # As llama.cpp's quantiser writes SmolLM2's Q4_K_M: 166 Q5_0 fallbacks, 14 + 1 Q8_0, 14 Q6_K, 16 Q4_K.
    assert counts == {"Q5_0": 166, "Q8_0": 15, "Q6_K": 14, "Q4_K": 16, "F32": 61}, counts
    # 105.5 MB, against 270.9 MB for f16 (the same bytes llama.cpp's Q4_K_M of the f16 file takes).
    assert 100e6 < file.stat().st_size < 110e6, file.stat().st_size

    text = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=False)
    prompt = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=file.name, dtype=torch.float32).eval()
    with torch.no_grad():
        sequence = reloaded.generate(prompt, max_new_tokens=20, do_sample=False)[0]
        actual = reloaded(sequence[None]).logits[0, prompt.shape[1] - 1 : -1]
        with dispatch.force_reference():
            expected = model(input_ids=sequence[None]).logits[0, prompt.shape[1] - 1 : -1].float()
    # Measured: the next token on the prompt agrees, 15 of the 20 positions agree, relative logit error 0.150
    # (largest difference 4.4).
    agreement = (actual.argmax(-1) == expected.argmax(-1)).float().mean().item()
    assert actual[0].argmax() == expected[0].argmax()
    assert agreement >= 0.7, agreement
    assert 0 < relative_error(actual, expected) < 0.2, relative_error(actual, expected)
