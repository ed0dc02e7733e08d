"""The per-tensor GGML types of each file type, against what llama.cpp's own quantiser chose.

The expected tables were read from files ``llama_model_quantize`` (llama-cpp-python 0.3.36's llama.cpp) wrote from
fastft's f16 GGUFs: SmolLM2-135M (30 layers, rows of 576: the K-quant fallbacks) and 8-layer models with rows of 256
(tied and untied Llama, Mixtral with 8 experts, Qwen3-MoE with 4). fastft's choice matched llama.cpp's on every tensor
of all of them.
"""

from __future__ import annotations

import pytest

from fastft.export.gguf_mixtures import (
    FILE_TYPES,
    MixtureModel,
    TypeChoice,
    fallback_warning,
    tensor_type,
    use_more_bits,
)

pytestmark = pytest.mark.lane

# SmolLM2-135M: hidden 576, 9 / 3 heads of 64, FFN 1536, 49152 tokens, tied embeddings.
SMOL_SHAPES = {
    "attn_q": (576, 576),
    "attn_k": (192, 576),
    "attn_v": (192, 576),
    "attn_output": (576, 576),
    "ffn_gate": (1536, 576),
    "ffn_up": (1536, 576),
    "ffn_down": (576, 1536),
}
SMOL_MORE_BITS = [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29]
# File type -> (attn_q / k / output / gate / up, attn_v, attn_v in a more-bits layer, ffn_down, ffn_down more bits).
SMOL_EXPECTED = {
    "q4_k_m": ("Q5_0", "Q5_0", "Q8_0", "Q4_K", "Q6_K"),
    "q5_k_m": ("Q5_1", "Q5_1", "Q8_0", "Q5_K", "Q6_K"),
    "q6_k": ("Q8_0", "Q8_0", "Q8_0", "Q6_K", "Q6_K"),
    "q8_0": ("Q8_0", "Q8_0", "Q8_0", "Q8_0", "Q8_0"),
}


def test_more_bits_layers():
    # The first and last eighth, and every third layer between (llama.cpp's use_more_bits).
    assert [layer for layer in range(30) if use_more_bits(layer, 30)] == SMOL_MORE_BITS
    assert [layer for layer in range(8) if use_more_bits(layer, 8)] == [0, 3, 6, 7]
    assert [layer for layer in range(32) if use_more_bits(layer, 32)] == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27,
                                                                          28, 29, 30, 31]  # fmt: skip


@pytest.mark.parametrize("quantization", list(SMOL_EXPECTED))
def test_smollm2_types_and_fallbacks(quantization, caplog):
    model = MixtureModel(n_layers=30, tied=True)
    plain, v_plain, v_more, down_plain, down_more = SMOL_EXPECTED[quantization]
    fallbacks = []
    for layer in range(30):
        more = layer in SMOL_MORE_BITS
        for kind, shape in SMOL_SHAPES.items():
            name = f"blk.{layer}.{kind}.weight"
            expected = {"attn_v": v_more if more else v_plain, "ffn_down": down_more if more else down_plain}
            choice = tensor_type(name, shape, quantization, model)
            assert choice.type_name == expected.get(kind, plain), name
            if choice.replaced is not None:
                fallbacks.append((name, shape, choice))
        for norm in ("attn_norm", "ffn_norm"):
            assert tensor_type(f"blk.{layer}.{norm}.weight", (576,), quantization, model).type_name == "F32"
    # Tied: the embedding is the head, Q8_0 as its rows (576) do not fit Q6_K's blocks.
    assert tensor_type("token_embd.weight", (49152, 576), quantization, model) == TypeChoice("Q8_0")
    assert tensor_type("output_norm.weight", (576,), quantization, model).type_name == "F32"
    choice = tensor_type("blk.3.attn_q.weight", (576, 576), quantization, model)
    assert choice.replaced == {"q4_k_m": "Q4_K", "q5_k_m": "Q5_K", "q6_k": "Q6_K", "q8_0": None}[quantization]
    # llama.cpp's quantiser warns for 180 of SmolLM2's 272 tensors; here one warning names them all, by group.
    with caplog.at_level("WARNING", logger="fastft.gguf_export"):
        fallback_warning(fallbacks)
    if quantization == "q8_0":
        assert fallbacks == [] and caplog.records == []
        return
    assert len(fallbacks) == 30 * 6 and len(caplog.records) == 1
    message = caplog.records[0].getMessage()
    assert message.startswith("fastft.save_gguf: 180 tensors take llama.cpp's fallback type")
    assert all(name in message for name, _, _ in fallbacks)
    stored = plain if quantization != "q6_k" else "Q8_0"
    assert f"rows of 576 (not a multiple of {choice.replaced}'s block of 256): stored as {stored}" in message


def _types(model: MixtureModel, quantization: str, names: dict[str, tuple[int, ...]]) -> dict[str, set[str]]:
    """Tensor kind -> the set of types its tensors across the layers got."""
    found: dict[str, set[str]] = {}
    for layer in range(model.n_layers):
        for kind, shape in names.items():
            choice = tensor_type(f"blk.{layer}.{kind}.weight", shape, quantization, model)
            found.setdefault(kind, set()).add(choice.type_name)
    return found


DENSE = {"attn_q": (256, 256), "attn_v": (128, 256), "attn_output": (256, 256), "ffn_down": (256, 512)}
EXPERTS = {
    "attn_k": (128, 256),
    "attn_v": (128, 256),
    "attn_output": (256, 256),
    "ffn_gate_exps": (8, 512, 256),
    "ffn_down_exps": (8, 256, 512),
    "ffn_gate_inp": (8, 256),
}


@pytest.mark.parametrize(
    ("quantization", "base", "head"), [("q4_k_m", "Q4_K", "Q6_K"), ("q5_k_m", "Q5_K", "Q6_K"), ("q6_k", "Q6_K", "Q6_K")]
)
def test_rows_of_256(quantization, base, head):
    dense = MixtureModel(n_layers=8)
    more = {"Q4_K": {"Q4_K", "Q6_K"}, "Q5_K": {"Q5_K", "Q6_K"}, "Q6_K": {"Q6_K"}}[base]
    assert _types(dense, quantization, DENSE) == {"attn_q": {base}, "attn_v": more, "attn_output": {base},
                                                  "ffn_down": more}  # fmt: skip
    assert tensor_type("blk.3.attn_v.weight", (128, 256), quantization, dense).type_name == head
    assert tensor_type("blk.4.attn_v.weight", (128, 256), quantization, dense).type_name == base
    # Untied: the head gets Q6_K, the embedding the base type; tied, the embedding is the head.
    assert tensor_type("output.weight", (300, 256), quantization, dense).type_name == head
    assert tensor_type("token_embd.weight", (300, 256), quantization, dense).type_name == base
    tied = MixtureModel(n_layers=8, tied=True)
    assert tensor_type("token_embd.weight", (300, 256), quantization, tied).type_name == head
    # Mixtral's 8 experts: attn_k and attn_v at Q8_0, Q4_K_M's attn_output at Q5_K, the router float32, and the
    # stacked down experts by the layer in their name.
    mixtral = MixtureModel(n_layers=8, n_experts=8)
    expected = {
        "attn_k": {"Q8_0"},
        "attn_v": {"Q8_0"},
        "attn_output": {"Q5_K" if quantization == "q4_k_m" else base},
        "ffn_gate_exps": {base},
        "ffn_down_exps": more,
        "ffn_gate_inp": {"F32"},
    }
    assert _types(mixtral, quantization, EXPERTS) == expected
    assert tensor_type("blk.7.ffn_down_exps.weight", (8, 256, 512), quantization, mixtral).type_name == head
    # Qwen3-MoE's 4 (or 128) experts: none of the 8-expert rules.
    qwen = MixtureModel(n_layers=8, n_experts=4)
    assert _types(qwen, quantization, EXPERTS) == expected | {"attn_k": {base}, "attn_v": more, "attn_output": {base}}
    assert tensor_type("blk.0.attn_q_norm.weight", (64,), quantization, qwen).type_name == "F32"


def test_70b_attn_v_and_float_types():
    # Llama 2 / 3 70B (80 layers, GQA): an attn_v left at Q4_K gets Q5_K; more-bits layers still get Q6_K.
    big = MixtureModel(n_layers=80, is_70b=True)
    assert tensor_type("blk.40.attn_v.weight", (1024, 8192), "q4_k_m", big).type_name == "Q5_K"
    assert tensor_type("blk.0.attn_v.weight", (1024, 8192), "q4_k_m", big).type_name == "Q6_K"
    assert tensor_type("blk.40.attn_v.weight", (1024, 8192), "q5_k_m", big).type_name == "Q5_K"
    # The float types store every matrix in that type, whatever its rows; vectors and the router stay float32.
    model = MixtureModel(n_layers=2, n_experts=8)
    for quantization in ("f32", "f16", "bf16"):
        expected = FILE_TYPES[quantization][0]
        assert tensor_type("blk.0.attn_v.weight", (24, 40), quantization, model).type_name == expected
        assert tensor_type("token_embd.weight", (100, 40), quantization, model).type_name == expected
        assert tensor_type("blk.0.ffn_gate_inp.weight", (8, 40), quantization, model).type_name == "F32"
        assert tensor_type("blk.0.attn_norm.weight", (40,), quantization, model).type_name == "F32"


def test_rows_fitting_no_block_are_f16():
    # Rows of 80 fit neither Q4_K's 256 nor Q5_0's 32: llama.cpp stores them as F16, as does q8_0 here.
    model = MixtureModel(n_layers=2)
    for quantization, replaced in (("q4_k_m", "Q4_K"), ("q5_k_m", "Q5_K"), ("q6_k", "Q6_K"), ("q8_0", "Q8_0")):
        assert tensor_type("blk.1.attn_q.weight", (64, 80), quantization, model) == TypeChoice("F16", replaced)
    with pytest.raises(ValueError, match=r"cannot read a layer index below 2 from the tensor name 'blk.7.attn_v"):
        tensor_type("blk.7.attn_v.weight", (64, 256), "q4_k_m", model)
