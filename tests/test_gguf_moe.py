"""FastModel.save_gguf of mixture-of-experts models (Qwen3-MoE as llama.cpp's ``qwen3moe``, Mixtral as its ``llama``
with experts), in whichever expert layout the installed transformers has: the file's tensors read back into a stock
model predict what the merged model does."""

from __future__ import annotations

import re

import gguf
import numpy as np
import pytest
import torch
from conftest import randomize_lora_b, relative_error
from test_gguf_export import _small_tokenizer
from test_moe_lora import HIDDEN, TOP_K, E
from test_moe_lora import _config as moe_config
from transformers import AutoConfig, AutoModelForCausalLM

from fastft import FastModel
from fastft.contracts import ShapeContractError
from fastft.loading.dtypes import _DTYPE_KWARG

pytestmark = pytest.mark.lane

WIDTH = 64


def _transformers_reads(family: str) -> bool:
    # transformers' own GGUF loader reads qwen3moe files from 4.5x on (not 4.53); it has no Mixtral (llama with
    # experts) reader in any release.
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    return family == "qwen3_moe" and "qwen3_moe" in GGUF_CONFIG_MAPPING


def _config(family: str, tokenizer, **overrides):
    # test_moe_lora's tiny configs with the small tokenizer's vocabulary, an untied head, experts WIDTH wide; Qwen3-MoE
    # renormalises its top-k weights, as llama.cpp's qwen3moe (and Qwen3-30B-A3B's config) does.
    if family == "qwen3_moe":
        sizes = dict(intermediate_size=96, moe_intermediate_size=WIDTH, norm_topk_prob=True)
    else:
        sizes = dict(intermediate_size=WIDTH)
    return moe_config(family, vocab_size=len(tokenizer), tie_word_embeddings=False, **{**sizes, **overrides})


def _save(folder, family: str, tokenizer, **overrides) -> str:
    import transformers

    cls = transformers.Qwen3MoeForCausalLM if family == "qwen3_moe" else transformers.MixtralForCausalLM
    torch.manual_seed(0)
    cls(_config(family, tokenizer, **overrides)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def _field(reader: gguf.GGUFReader, key: str):
    field = reader.fields[key]
    return field.parts[field.data[0]][0]


def _uninterleave(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    # The inverse of save_gguf's q / k row order for llama.cpp's llama rope.
    rows = weight.shape[0]
    return weight.reshape(n_head, rows // n_head // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def _read_back(file, stock: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The GGUF's tensors as ``stock``'s state dict, read with the gguf package alone (the test's own reader, for
    the architecture transformers cannot load): names through gguf's map, q / k rows and expert stacks undone."""
    config = stock.config
    reader = gguf.GGUFReader(file)
    arch = gguf.MODEL_ARCH.QWEN3MOE if config.model_type == "qwen3_moe" else gguf.MODEL_ARCH.LLAMA
    name_map = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    values = {
        tensor.name: torch.from_numpy(np.array(gguf.quants.dequantize(tensor.data, tensor.tensor_type), np.float32))
        for tensor in reader.tensors
    }
    state = {}
    for key, expected in stock.state_dict().items():
        fused = re.fullmatch(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(gate_up_proj|down_proj)", key)
        single = re.fullmatch(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight", key)
        if fused:
            block = f"blk.{fused.group(1)}"
            if fused.group(2) == "gate_up_proj":
                value = torch.cat([values[f"{block}.ffn_gate_exps.weight"], values[f"{block}.ffn_up_exps.weight"]], 1)
            else:
                value = values[f"{block}.ffn_down_exps.weight"]
        elif single:
            role = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up"}.get(single.group(3), "down")
            value = values[f"blk.{single.group(1)}.ffn_{role}_exps.weight"][int(single.group(2))]
        else:
            name = name_map.get_name(key, try_suffixes=(".weight", ".bias"))
            value = values[name]
            if config.model_type == "mixtral" and (".attn_q." in name or ".attn_k." in name):
                heads = config.num_attention_heads if ".attn_q." in name else config.num_key_value_heads
                value = _uninterleave(value, heads)
        assert value.shape == expected.shape, (key, value.shape, expected.shape)
        state[key] = value
    return state


@pytest.fixture(scope="module")
def tokenizer():
    return _small_tokenizer()


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def exported(request, tmp_path_factory, tokenizer):
    """A tiny MoE with LoRA on attention and every expert (trained-looking B), merged and written as f32 and q8_0."""
    family = request.param
    folder = _save(tmp_path_factory.mktemp(family), family, tokenizer)
    model, _ = FastModel.from_pretrained(folder, max_seq_length=64)
    model = FastModel.get_peft_model(model, r=4, lora_alpha=8, use_gradient_checkpointing=False)
    randomize_lora_b(model, seed=3, std=0.2)
    FastModel.for_inference(model)
    out = tmp_path_factory.mktemp(f"{family}-out")
    merged = FastModel.save_merged(model, tokenizer, out / "merged", dtype=torch.float32)
    files = {
        q: FastModel.save_gguf(model, tokenizer, out / f"{family}-{q}.gguf", quantization=q) for q in ("f32", "q8_0")
    }
    ids = torch.randint(3, len(tokenizer), (1, 19), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        lora = model(input_ids=ids).logits
    return family, model, merged, files, ids, lora


def test_file_metadata_and_expert_tensors(exported):
    family, model, _, files, _, _ = exported
    reader = gguf.GGUFReader(files["q8_0"])
    arch = "qwen3moe" if family == "qwen3_moe" else "llama"
    assert reader.fields["general.architecture"].parts[-1].tobytes().decode() == arch
    assert _field(reader, f"{arch}.expert_count") == E
    assert _field(reader, f"{arch}.expert_used_count") == TOP_K
    if family == "qwen3_moe":
        assert _field(reader, f"{arch}.expert_feed_forward_length") == WIDTH
        assert _field(reader, f"{arch}.attention.key_length") == 8
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    types = gguf.GGMLQuantizationType
    for layer in range(model.config.num_hidden_layers):
        # gguf lists dimensions innermost first: [H, I, E] is transformers' [E, I, H].
        for kind, shape in (("gate", [HIDDEN, WIDTH, E]), ("up", [HIDDEN, WIDTH, E]), ("down", [WIDTH, HIDDEN, E])):
            tensor = tensors[f"blk.{layer}.ffn_{kind}_exps.weight"]
            assert [int(d) for d in tensor.shape] == shape
            assert tensor.tensor_type == types.Q8_0
        # The router stays float32 in every file type, as llama.cpp keeps it.
        assert tensors[f"blk.{layer}.ffn_gate_inp.weight"].tensor_type == types.F32
        assert [int(d) for d in tensors[f"blk.{layer}.ffn_gate_inp.weight"].shape] == [HIDDEN, E]
        assert (f"blk.{layer}.attn_q_norm.weight" in tensors) == (family == "qwen3_moe")
        assert f"blk.{layer}.ffn_gate.weight" not in tensors


@pytest.mark.parametrize("quantization", ["f32", "q8_0"])
def test_gguf_reads_back_and_predicts_like_the_merged_model(exported, quantization):
    family, _, merged_dir, files, ids, lora = exported
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, **{_DTYPE_KWARG: torch.float32})
    config = AutoConfig.from_pretrained(merged_dir)
    # Our own reader for every family: the tensors in llama.cpp's layout, mapped back onto a stock model.
    stock = AutoModelForCausalLM.from_config(config).float()
    stock.load_state_dict(_read_back(files[quantization], stock), strict=True)
    models = [stock]
    if _transformers_reads(family):
        # transformers' own loader; it ignores expert_feed_forward_length (the experts' width), so the config is
        # passed, as a user reloading a model whose experts are not 768 wide must.
        file = files[quantization]
        models.append(
            AutoModelForCausalLM.from_pretrained(
                file.parent, gguf_file=file.name, config=config, **{_DTYPE_KWARG: torch.float32}
            )
        )
    if quantization == "q8_0":
        # Every tensor within 8-bit rounding of the merged model's (the router's exactly: it stays float32).
        reference = merged.state_dict()
        for key, value in stock.state_dict().items():
            bound = 0 if ".gate.weight" in key or "norm" in key else 0.01
            assert relative_error(value, reference[key]) <= bound, key
    with torch.no_grad():
        expected = merged(ids).logits
        for reloaded in models:
            actual = reloaded(ids).logits
            if quantization == "f32":
                assert (actual - expected).abs().max().item() < 1e-5
                # ... and equal to the LoRA model itself: the per-expert merge and the row orders are exact.
                assert (actual - lora).abs().max().item() < 1e-4
            else:
                # Close, not equal: a token whose top-k experts are nearly tied may pick another one after 8-bit
                # rounding of the layers before it (0.02-0.11 measured on these random models).
                assert 0 < relative_error(actual, expected) < 0.25, relative_error(actual, expected)


def test_refusals(tmp_path, tokenizer, caplog):
    folder = _save(tmp_path / "dense", "qwen3_moe", tokenizer, mlp_only_layers=[1])
    model, _ = FastModel.from_pretrained(folder, max_seq_length=64)
    with pytest.raises(ValueError, match=r"qwen3moe has a sparse MoE block in every layer.*mlp_only_layers=\[1\]"):
        FastModel.save_gguf(model, tokenizer, tmp_path / "out")
    folder = _save(tmp_path / "unnormalised", "qwen3_moe", tokenizer, norm_topk_prob=False)
    model, _ = FastModel.from_pretrained(folder, max_seq_length=64)
    with pytest.raises(ValueError, match="norm_topk_prob=False"):
        FastModel.save_gguf(model, tokenizer, tmp_path / "out")
    folder = _save(tmp_path / "mixtral", "mixtral", tokenizer)
    model, _ = FastModel.from_pretrained(folder, max_seq_length=64)
    # An expert tensor that no longer fits the config is named, with both shapes, before anything is written.
    model.config.num_local_experts = E + 1
    with pytest.raises(ShapeContractError, match=rf"expected \({E + 1}, "):
        FastModel.save_gguf(model, tokenizer, tmp_path / "out")
    assert not (tmp_path / "out").exists() or list((tmp_path / "out").iterdir()) == []
    # A sliding window llama.cpp's llama graph does not have is written with a warning (only long inputs differ).
    folder = _save(tmp_path / "window", "mixtral", tokenizer, sliding_window=16)
    model, _ = FastModel.from_pretrained(folder, max_seq_length=64)
    with caplog.at_level("WARNING", logger="fastft.gguf_export"):
        FastModel.save_gguf(model, tokenizer, tmp_path / "window.gguf", quantization="f32")
    assert "sliding window of 16 tokens" in caplog.text
