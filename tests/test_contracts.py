"""Shape contracts: each refusal names the module (or adapter tensor), the expected and the actual shape."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import randomize_lora_b, relative_error, tiny_llama_config

from fastft import FastModel, ShapeContractError
from fastft.contracts import (
    attention_shape,
    check_adapter_tensors,
    check_config,
    check_lora,
    check_projections,
    guard_max_seq_length,
)
from fastft.loading.distributed import DataParallelRefused

pytestmark = pytest.mark.lane


def _save_tiny(folder, tokenizer, **overrides):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(tiny_llama_config(tokenizer, **overrides)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _ids(length: int, rows: int = 2, seed: int = 5) -> torch.Tensor:
    return torch.randint(3, 1000, (rows, length), generator=torch.Generator().manual_seed(seed))


def test_heads_not_a_multiple_of_kv_heads_refused_before_weights_load(tmp_path, smol_tokenizer):
    # Only config.json is saved: the refusal must come before transformers looks for weights.
    tiny_llama_config(smol_tokenizer, hidden_size=96, num_attention_heads=6, num_key_value_heads=4).save_pretrained(
        tmp_path
    )
    with pytest.raises(ShapeContractError, match=r"self_attn.*\[6 x 16\].*\[4 x 16\].*num_attention_heads=6") as error:
        FastModel.from_pretrained(str(tmp_path))
    assert "num_key_value_heads=4" in str(error.value) and "[1, 2, 3, 6]" in str(error.value)
    # transformers 5.x builds 4 / 3 and fails only in the first forward; the contract refuses it directly.
    config = tiny_llama_config(smol_tokenizer, num_attention_heads=4, num_key_value_heads=3)
    with pytest.raises(ShapeContractError, match=r"num_attention_heads=4, num_key_value_heads=3"):
        check_config(config)


def test_gqa_hidden_320_40_heads_8_kv_heads_loads_and_trains(tmp_path, smol_tokenizer):
    # A 1024-token vocabulary (the ids stay below it) keeps the LM head's backward from dominating the test.
    sizes = dict(hidden_size=320, intermediate_size=256, num_attention_heads=40, num_key_value_heads=8)
    folder = _save_tiny(tmp_path, smol_tokenizer, vocab_size=1024, **sizes)
    model, _ = FastModel.from_pretrained(str(folder), max_seq_length=64)
    attention = model.model.layers[0].self_attn
    widths = (attention.q_proj.out_features, attention.k_proj.out_features, attention.o_proj.in_features)
    assert widths == (320, 64, 320)
    model = FastModel.get_peft_model(model, r=8, lora_alpha=16, use_gradient_checkpointing=False)
    randomize_lora_b(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    ids = _ids(24)
    losses = []
    for _ in range(5):
        optimizer.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in trainable)
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1, losses


def test_explicit_head_dim_with_hidden_not_heads_times_head_dim(tmp_path, smol_tokenizer):
    # transformers 5.23 rejects hidden % heads != 0 even with an explicit head_dim, so 64 / 4 heads / head_dim 32.
    folder = _save_tiny(tmp_path, smol_tokenizer, hidden_size=64, num_attention_heads=4, head_dim=32)
    model, _ = FastModel.from_pretrained(str(folder))
    shape = attention_shape(model.config)
    assert (shape.hidden, shape.heads, shape.kv_heads, shape.head_dim) == (64, 4, 2, 32)
    assert model.model.layers[0].self_attn.q_proj.out_features == 128
    assert check_projections(model) == 2
    model = FastModel.get_peft_model(model, r=4)
    assert torch.isfinite(model(input_ids=_ids(9), labels=_ids(9)).loss)


def _with_narrow_q_proj(model, layer: int = 1):
    model.model.layers[layer].self_attn.q_proj = torch.nn.Linear(64, 48, bias=False)
    return model


def test_mismatched_q_proj_refused_at_from_pretrained(tiny_llama_dir, monkeypatch):
    import fastft.loading.pretrained as fastft_pretrained

    load = fastft_pretrained.AutoModelForCausalLM.from_pretrained
    # A module built against another config than the one the model carries (a custom modelling file, a bad edit).
    monkeypatch.setattr(
        fastft_pretrained.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: _with_narrow_q_proj(load(*a, **k))
    )
    with pytest.raises(ShapeContractError, match=r"model\.layers\.1\.self_attn\.q_proj: .*\[64, 64\].*got \[48, 64\]"):
        FastModel.from_pretrained(str(tiny_llama_dir))


def _save_phi3(folder, tokenizer, **overrides):
    from transformers import Phi3Config, Phi3ForCausalLM

    base = tiny_llama_config(tokenizer).to_dict()
    settings = {key: base[key] for key in ("vocab_size", "hidden_size", "intermediate_size", "pad_token_id")}
    settings.update(num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, **overrides)
    torch.manual_seed(0)
    Phi3ForCausalLM(Phi3Config(**settings)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_phi3_qkv_proj_wider_than_its_config_refused_before_loading(tmp_path, smol_tokenizer, monkeypatch):
    folder = _save_phi3(tmp_path, smol_tokenizer)
    config = json.loads((folder / "config.json").read_text())
    config["num_key_value_heads"] = 4  # the weights were saved with 2
    (folder / "config.json").write_text(json.dumps(config))
    import fastft.loading.pretrained as fastft_pretrained

    def never(*args, **kwargs):
        raise AssertionError("the weights were loaded before the contract refused them")

    monkeypatch.setattr(fastft_pretrained.AutoModelForCausalLM, "from_pretrained", never)
    # (4 + 2 x 4) x 16 = 192 rows expected; the checkpoint holds (4 + 2 x 2) x 16 = 128.
    pattern = (
        r"model\.layers\.0\.self_attn\.qkv_proj .*\[192, 64\].*num_key_value_heads.*got \[128, 64\].*fix config\.json"
    )
    with pytest.raises(ShapeContractError, match=pattern):
        FastModel.from_pretrained(str(folder))


def test_phi3_defaults_to_its_packed_projections(tmp_path, smol_tokenizer):
    model, _ = FastModel.from_pretrained(str(_save_phi3(tmp_path, smol_tokenizer)))
    peft_model = FastModel.get_peft_model(model, r=4)
    assert set(peft_model.peft_config["default"].target_modules) == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}


def test_mismatched_q_proj_refused_at_get_peft_model(tiny_llama_dir):
    model, _ = FastModel.from_pretrained(str(tiny_llama_dir))
    _with_narrow_q_proj(model, layer=0)
    with pytest.raises(ShapeContractError, match=r"model\.layers\.0\.self_attn\.q_proj: .*\[64, 64\].*got \[48, 64\]"):
        FastModel.get_peft_model(model, r=4)


def test_lora_a_and_b_of_the_wrong_shape_refused(tiny_llama_dir, monkeypatch):
    import fastft.loading.lora as fastft_lora

    model, _ = FastModel.from_pretrained(str(tiny_llama_dir))
    peft_model = FastModel.get_peft_model(model, r=8)
    assert check_lora(peft_model) == 2 * 7
    peft_model.base_model.model.model.layers[0].self_attn.q_proj.lora_A["default"] = torch.nn.Linear(64, 3, bias=False)
    with pytest.raises(
        ShapeContractError,
        match=r"model\.layers\.0\.self_attn\.q_proj\.lora_A\['default'\]: expected \[8, 64\].*\[3, 64\]",
    ):
        check_lora(peft_model)

    wrap = fastft_lora._peft_get_peft_model

    def wrap_badly(*args, **kwargs):
        wrapped = wrap(*args, **kwargs)
        # k_proj out is kv_heads 2 x head_dim 16 = 32; a B sized for q_proj's 64 does not fit it.
        wrapped.base_model.model.model.layers[1].self_attn.k_proj.lora_B["default"] = torch.nn.Linear(8, 64)
        return wrapped

    monkeypatch.setattr(fastft_lora, "_peft_get_peft_model", wrap_badly)
    model, _ = FastModel.from_pretrained(str(tiny_llama_dir))
    with pytest.raises(
        ShapeContractError,
        match=r"model\.layers\.1\.self_attn\.k_proj\.lora_B\['default'\]: expected \[32, 8\].*\[64, 8\]",
    ):
        FastModel.get_peft_model(model, r=8)


def _strip_quant_state(module) -> None:
    # What any rebuild of a Params4bit does: the packed bytes stay, the quantisation statistics are gone.
    module.weight = torch.nn.Parameter(module.weight.data, requires_grad=False)


def test_4bit_q_proj_without_quant_state_named_on_forward(tiny_llama_dir):
    model, _ = FastModel.from_pretrained(str(tiny_llama_dir), max_seq_length=64, load_in_4bit=True)
    model = FastModel.get_peft_model(model, r=4, use_gradient_checkpointing=False)
    assert torch.isfinite(model(input_ids=_ids(9)).logits).all()
    _strip_quant_state(model.base_model.model.model.layers[0].self_attn.q_proj.base_layer)
    # bitsandbytes would re-attach module.quant_state here; the contract refuses any weight that lost its own.
    with pytest.raises(
        ShapeContractError,
        match=r"model\.layers\.0\.self_attn\.q_proj: expected .*\[64, 64\].*\[2048, 1\].*no quant_state",
    ):
        model(input_ids=_ids(9))


def test_4bit_without_quant_state_refused_at_get_peft_model(tiny_llama_dir):
    model, _ = FastModel.from_pretrained(str(tiny_llama_dir), load_in_4bit=True)
    _strip_quant_state(model.model.layers[1].mlp.down_proj)
    with pytest.raises(
        ShapeContractError, match=r"model\.layers\.1\.mlp\.down_proj: expected .*\[64, 128\].*\[4096, 1\]"
    ):
        FastModel.get_peft_model(model, r=4)


def test_data_parallel_replication_of_4bit_refused(tiny_llama_dir):
    model, _ = FastModel.from_pretrained(str(tiny_llama_dir), load_in_4bit=True)
    model = FastModel.get_peft_model(model, r=4, use_gradient_checkpointing=False)
    # torch.nn.parallel.replicate (nn.DataParallel's forward on several GPUs) needs CUDA for the parameter broadcast
    # it does first; it then calls _replicate_for_data_parallel() on every module of network.modules(), in order.
    # That second step is the one fastft overrides, so calling it the same way runs the code DataParallel would.
    # The transformers model refuses first, for any fastft model (fastft.loading.distributed,
    # tests/test_distributed.py)...
    with pytest.raises(DataParallelRefused, match=r"LlamaForCausalLM onto .*torchrun"):
        for module in model.modules():
            module._replicate_for_data_parallel()
    # ...and every 4-bit layer refuses too, naming itself, should a copy of it reach replication on its own.
    q_proj = model.get_base_model().model.layers[0].self_attn.q_proj.base_layer
    with pytest.raises(ShapeContractError, match=r"model\.layers\.0\.self_attn\.q_proj: nn\.DataParallel .*torchrun"):
        q_proj._replicate_for_data_parallel()
    assert model.get_base_model().model.embed_tokens._replicate_for_data_parallel() is not None

    # Were a replica made anyway, it would share the quant_state hook: replicate() copies the module's __dict__
    # (hooks included) and sets the broadcast parameters, plain tensors without quant_state, on the replica.
    replica = torch.nn.Module._replicate_for_data_parallel(q_proj)
    replica._parameters["weight"] = q_proj.weight.data.clone()
    with pytest.raises(ShapeContractError, match=r"model\.layers\.0\.self_attn\.q_proj: .*no quant_state"):
        replica(torch.randn(1, 3, 64))


@pytest.fixture(scope="module")
def q_adapter(tiny_llama_dir, tmp_path_factory):
    """A saved r=8 LoRA adapter on q_proj of the tiny model, with the logits it gives."""
    model, _ = FastModel.from_pretrained(str(tiny_llama_dir))
    model = FastModel.get_peft_model(model, r=8, target_modules=["q_proj"], use_gradient_checkpointing=False)
    randomize_lora_b(model)
    FastModel.for_inference(model)
    with torch.no_grad():
        logits = model(input_ids=_ids(11)).logits
    folder = tmp_path_factory.mktemp("q-adapter")
    model.save_pretrained(folder)
    return folder, logits


def test_adapter_loads_and_matches(tiny_llama_dir, q_adapter):
    folder, expected = q_adapter
    model, _ = FastModel.from_pretrained(str(tiny_llama_dir))
    model = FastModel.load_adapter(model, folder)
    with torch.no_grad():
        assert relative_error(model(input_ids=_ids(11)).logits, expected) < 1e-6
    # An adapter folder given to from_pretrained loads its base, then the adapter the same way.
    model, tokenizer = FastModel.from_pretrained(str(folder), max_seq_length=64)
    assert tokenizer.model_max_length == 64 and not model.training
    with torch.no_grad():
        assert relative_error(model(input_ids=_ids(11)).logits, expected) < 1e-6


def test_adapter_for_another_hidden_size_refused_by_tensor_key(tmp_path, smol_tokenizer, q_adapter):
    folder = _save_tiny(tmp_path / "wide", smol_tokenizer, hidden_size=96, num_attention_heads=6, num_key_value_heads=2)
    model, _ = FastModel.from_pretrained(str(folder))
    with pytest.raises(
        ShapeContractError,
        match=r"base_model\.model\.model\.layers\.0\.self_attn\.q_proj\.lora_A\.weight: expected \[8, 96\].*\[8, 64\]",
    ):
        FastModel.load_adapter(model, q_adapter[0])
    assert not any("lora_" in name for name, _ in model.named_modules()), "nothing may be loaded before the check"


def test_adapter_whose_config_rank_differs_from_its_weights_refused(tiny_llama_dir, tmp_path, q_adapter):
    import shutil

    folder = shutil.copytree(q_adapter[0], tmp_path / "relabelled")
    config = json.loads((folder / "adapter_config.json").read_text())
    config["r"] = 4
    (folder / "adapter_config.json").write_text(json.dumps(config))
    model, _ = FastModel.from_pretrained(str(tiny_llama_dir))
    with pytest.raises(
        ShapeContractError,
        match=r"layers\.0\.self_attn\.q_proj\.lora_A\.weight: expected \[4, 64\].*r=4.*got \[8, 64\]",
    ):
        FastModel.load_adapter(model, folder)


def test_adapter_tensor_checks_cover_rank_pattern_and_missing_modules(tiny_llama_dir):
    model, _ = FastModel.from_pretrained(str(tiny_llama_dir))
    prefix = "base_model.model.model.layers."
    fits = {
        prefix + "0.self_attn.v_proj.lora_A.weight": torch.empty(2, 64),
        prefix + "0.self_attn.v_proj.lora_B.weight": torch.empty(32, 2),
        prefix + "0.mlp.up_proj.lora_A.weight": torch.empty(8, 64),
        "base_model.model.lm_head.weight": torch.empty(model.config.vocab_size, 64),
    }
    assert check_adapter_tensors(model, fits, {"r": 8, "rank_pattern": {"v_proj": 2}}) == 4
    with pytest.raises(ShapeContractError, match=r"layers\.5\.self_attn\.q_proj\.lora_A\.weight: .*no such module"):
        check_adapter_tensors(model, {prefix + "5.self_attn.q_proj.lora_A.weight": torch.empty(8, 64)}, {"r": 8})
    vocab = model.config.vocab_size  # len(tokenizer): 49157 on transformers 5.5, which adds 5 infill tokens
    with pytest.raises(
        ShapeContractError, match=rf"lm_head\.weight: expected \[{vocab}, 64\].*got \[{vocab + 8}, 64\]"
    ):
        check_adapter_tensors(model, {"base_model.model.lm_head.weight": torch.empty(vocab + 8, 64)}, {"r": 8})


def test_input_longer_than_max_seq_length_refused_with_both_lengths(tiny_llama_dir):
    model, _ = FastModel.from_pretrained(str(tiny_llama_dir), max_seq_length=32)
    model = FastModel.get_peft_model(model, r=4, use_gradient_checkpointing=False)
    assert model(input_ids=_ids(32), labels=_ids(32)).loss.isfinite()
    message = r"model \(LlamaModel\): expected at most max_seq_length=32 .*got 40 in input_ids of shape \[2, 40\]"
    with pytest.raises(ShapeContractError, match=message + r".*truncation=True.*max_length=32"):
        model(input_ids=_ids(40), labels=_ids(40))
    # trl >= 1.15 calls the backbone directly; the check sits there.
    backbone = model.get_base_model().model
    with pytest.raises(ShapeContractError, match=message):
        backbone(_ids(40))
    embeds = backbone.embed_tokens(_ids(40))
    with pytest.raises(ShapeContractError, match=r"got 40 in inputs_embeds of shape \[2, 40, 64\]"):
        backbone(inputs_embeds=embeds)


def test_max_seq_length_is_per_call_and_per_packed_sequence(tiny_llama_dir):
    model, tokenizer = FastModel.from_pretrained(str(tiny_llama_dir), max_seq_length=32)
    FastModel.for_inference(model)
    # Generation past max_seq_length: after the prompt, each step feeds one token with the KV cache.
    out = model.generate(_ids(30, rows=1), max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert out.shape == (1, 36)
    # A padding-free row of two 20-token sequences: each restarts its positions, so each fits.
    packed = torch.cat([torch.arange(20), torch.arange(20)])[None]
    assert model(input_ids=_ids(40, rows=1), position_ids=packed).logits.shape == (1, 40, model.config.vocab_size)
    with pytest.raises(ShapeContractError, match=r"got 40 in input_ids \(longest packed sequence"):
        model(input_ids=_ids(40, rows=1), position_ids=torch.arange(40)[None])
    guard_max_seq_length(model, 48)  # a second call replaces the limit instead of stacking hooks
    assert model(input_ids=_ids(40, rows=1)).logits.shape[1] == 40


def test_dtype_reaches_every_transformers_version(tiny_llama_dir):
    # transformers < 4.56 only knows torch_dtype=; a dtype= it ignored would load float32.
    model, _ = FastModel.from_pretrained(str(tiny_llama_dir), dtype="bf16")
    assert model.dtype == torch.bfloat16
