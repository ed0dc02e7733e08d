"""FastModel.save_gguf: the file reloads through transformers' ``gguf_file=`` and predicts what the merged model does.

The main round trip uses the real SmolLM2-135M-Instruct (9 heads / 3 kv heads, tied embeddings, ChatML template) with
LoRA r=8 on all seven projections and LoRA B made non-zero, so that a merge that skipped the adapters, or a q/k row
order that did not invert, shows in the predictions. Tiny models (with a small byte-level vocabulary, which
transformers' GGUF loader reads much faster) cover what SmolLM2 does not: an explicit head_dim with
hidden != heads * head_dim, untied embeddings, a 4-bit NF4 base, bf16 and q8_0 tensor types, and a Llama 3 style
pre-tokenizer.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch
from conftest import randomize_lora_b, relative_error, tiny_llama_config
from transformers import AutoModelForCausalLM, AutoTokenizer

from fastft import FastModel
from fastft.kernels import dispatch

# A system turn of its own keeps the template from adding SmolLM2's long default one (shorter forwards).
PROMPT = [
    {"role": "system", "content": "You are a concise assistant."},
    {"role": "user", "content": "Why is the sky blue?"},
]
STEPS = 20
TOKENIZER_PROBES = [
    "Hello world! 123 4567 3.14159",
    "  multiple   spaces\n\ttabs and\r\nnewlines ",
    "Café déjà vu — ünïcödé, 日本語, emoji 🙂",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "def f(x):\n    return x ** 2  # comment",
]


def _greedy(model, prompt_ids: torch.Tensor, steps: int = STEPS) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy decoding with a KV cache: the new token ids and each step's next-token logits."""
    tokens, logits_per_step, past, feed = [], [], None, prompt_ids
    with torch.no_grad():
        for _ in range(steps):
            out = model(input_ids=feed, past_key_values=past, use_cache=True)
            logits = out.logits[0, -1].float()
            past, feed = out.past_key_values, logits.argmax().view(1, 1)
            tokens.append(feed.item())
            logits_per_step.append(logits)
    return torch.tensor(tokens), torch.stack(logits_per_step)


def _teacher_forced(model, sequence: torch.Tensor, prompt_length: int) -> torch.Tensor:
    """Next-token logits at the last prompt position and at each generated one but the last ([STEPS, vocab])."""
    with torch.no_grad():
        logits = model(input_ids=sequence[None], use_cache=False).logits[0].float()
    return logits[prompt_length - 1 : -1]


def _field(reader: gguf.GGUFReader, key: str):
    return reader.fields[key].contents()


@pytest.fixture(scope="module")
def smol():
    """SmolLM2 with LoRA r=8 (B seeded, non-zero), in inference mode, and the chat prompt's ids."""
    model, tokenizer = FastModel.from_pretrained("smollm2-135m", max_seq_length=256)
    model = FastModel.get_peft_model(model, r=8, lora_alpha=16, use_gradient_checkpointing=False)
    randomize_lora_b(model, seed=1, std=0.05)
    FastModel.for_inference(model)
    text = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
    return SimpleNamespace(model=model, tokenizer=tokenizer, text=text, prompt_ids=prompt_ids)


@pytest.fixture(scope="module")
def exported(smol, tmp_path_factory):
    folder = tmp_path_factory.mktemp("export")
    merged = FastModel.save_merged(smol.model, smol.tokenizer, folder / "merged", dtype=torch.float16)
    f16 = FastModel.save_gguf(smol.model, smol.tokenizer, folder / "gguf")  # a folder: the name is derived
    q8 = FastModel.save_gguf(smol.model, smol.tokenizer, folder / "gguf" / "smol-q8.gguf", quantization="q8_0")
    return SimpleNamespace(folder=folder, merged=merged, f16=f16, q8=q8)


@pytest.fixture(scope="module")
def runs(smol, exported):
    """Greedy runs of the merged safetensors model and the f16 file; teacher-forced logits of every model."""

    def load(file):
        return AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name, dtype=torch.float32).eval()

    merged_model = AutoModelForCausalLM.from_pretrained(exported.merged, dtype=torch.float32).eval()
    gguf_f16, gguf_q8 = load(exported.f16), load(exported.q8)
    merged_tokens, merged_logits = _greedy(merged_model, smol.prompt_ids)
    f16_tokens, f16_logits = _greedy(gguf_f16, smol.prompt_ids)
    sequence = torch.cat([smol.prompt_ids[0], merged_tokens])
    prompt_length = smol.prompt_ids.shape[1]
    # Module fixtures run outside conftest's per-test switch, so the patched model is put on the torch reference
    # here (through the Triton interpreter this forward would take minutes).
    with dispatch.force_reference():
        lora_forced = _teacher_forced(smol.model, sequence, prompt_length)
        with smol.model.disable_adapter():
            base_forced = _teacher_forced(smol.model, sequence, prompt_length)
    return SimpleNamespace(
        merged_tokens=merged_tokens,
        merged_logits=merged_logits,
        f16_tokens=f16_tokens,
        f16_logits=f16_logits,
        merged_forced=_teacher_forced(merged_model, sequence, prompt_length),
        q8_forced=_teacher_forced(gguf_q8, sequence, prompt_length),
        lora_forced=lora_forced,
        base_forced=base_forced,
    )


def test_file_metadata_tensors_and_types(exported):
    assert exported.f16.name.endswith("-F16.gguf") and exported.f16.parent == exported.folder / "gguf"
    # Written under a temporary name and renamed: nothing but the two finished files is left in the folder.
    assert sorted(p.name for p in exported.f16.parent.iterdir()) == sorted([exported.f16.name, "smol-q8.gguf"])
    reader = gguf.GGUFReader(exported.f16)
    expected = {
        "general.architecture": "llama",
        "llama.block_count": 30,
        "llama.context_length": 8192,
        "llama.embedding_length": 576,
        "llama.feed_forward_length": 1536,
        "llama.attention.head_count": 9,
        "llama.attention.head_count_kv": 3,
        "llama.rope.dimension_count": 64,
        "llama.vocab_size": 49152,
        "general.file_type": int(gguf.LlamaFileType.MOSTLY_F16),
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.padding_token_id": 2,
        "tokenizer.ggml.add_bos_token": False,
    }
    assert {key: _field(reader, key) for key in expected} == expected
    assert _field(reader, "llama.rope.freq_base") == pytest.approx(100000.0)
    assert _field(reader, "llama.attention.layer_norm_rms_epsilon") == pytest.approx(1e-5)
    assert len(_field(reader, "tokenizer.ggml.tokens")) == 49152
    assert "<|im_start|>" in _field(reader, "tokenizer.chat_template")
    types = {tensor.name: tensor.tensor_type for tensor in reader.tensors}
    # Tied embeddings: no output.weight, which is how llama.cpp and transformers both recognise them.
    assert len(types) == 2 + 30 * 9 and "output.weight" not in types
    assert types["blk.0.attn_q.weight"] == gguf.GGMLQuantizationType.F16
    assert types["token_embd.weight"] == gguf.GGMLQuantizationType.F16
    assert types["blk.29.ffn_norm.weight"] == gguf.GGMLQuantizationType.F32
    # 8.5 bits per weight against 16 (the q8_0 tensor types are checked on a tiny model, which reads faster).
    assert exported.q8.stat().st_size < 0.6 * exported.f16.stat().st_size


def test_tokenizer_round_trip(smol, exported):
    reloaded = AutoTokenizer.from_pretrained(exported.f16.parent, gguf_file=exported.f16.name)
    source = smol.tokenizer
    assert reloaded.chat_template == source.chat_template
    text = reloaded.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=False)
    assert text == smol.text
    assert reloaded(text)["input_ids"] == source(text)["input_ids"] == smol.prompt_ids[0].tolist()
    for probe in TOKENIZER_PROBES:
        assert reloaded(probe)["input_ids"] == source(probe)["input_ids"], probe
    for attribute in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        assert getattr(reloaded, attribute) == getattr(source, attribute), attribute
    assert len(reloaded) == len(source)
    assert reloaded.decode(smol.prompt_ids[0]) == smol.text


def test_f16_gguf_predicts_like_the_merged_model(runs):
    # f16 both sides: save_merged(dtype=float16) and the f16 GGUF hold the same rounded weights, both reloaded and run
    # in float32, so the 20 greedy tokens are equal and the logits equal to float32 rounding.
    assert torch.equal(runs.f16_tokens, runs.merged_tokens)
    difference = (runs.f16_logits - runs.merged_logits).abs().max().item()
    assert difference < 1e-5, difference
    # The adapters are in the file: without them the logits move by several units (4.5 measured).
    adapter_effect = (runs.merged_forced - runs.base_forced).abs().max().item()
    assert adapter_effect > 1.0, adapter_effect
    # Against the float32 LoRA model in memory (whose weights the f16 ones above are a rounding of), along the same
    # 20 tokens: the same argmax at every position, logits within f16 rounding (0.03 measured).
    lora_vs_f16 = (runs.lora_forced - runs.merged_forced).abs().max().item()
    assert lora_vs_f16 < 0.1, lora_vs_f16
    assert torch.equal(runs.lora_forced.argmax(-1), runs.merged_tokens)


def test_q8_0_gguf_next_token_agrees(runs):
    merged_argmax = runs.merged_forced.argmax(-1)
    q8_argmax = runs.q8_forced.argmax(-1)
    assert torch.equal(merged_argmax, runs.merged_tokens)  # teacher forcing reproduces the greedy run
    assert q8_argmax[0] == merged_argmax[0], "next-token prediction on the prompt"
    # Measured: 19 of the 20 positions agree, logits within 0.71 of the f16 merged model's.
    agreement = (q8_argmax == merged_argmax).float().mean().item()
    difference = (runs.q8_forced - runs.merged_forced).abs().max().item()
    assert agreement >= 0.9, agreement
    assert difference < 1.5, difference


def _small_tokenizer(pre_tokenizer=None):
    """A byte-level BPE tokenizer with a 265-token vocabulary: transformers' GGUF loader parses the whole vocabulary
    in Python, which for SmolLM2's 49152 tokens costs seconds per load, and the tiny models need no more."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a")]
    vocab = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    for token in sorted(pre_tokenizers.ByteLevel.alphabet()) + ["".join(pair) for pair in merges]:
        vocab.setdefault(token, len(vocab))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizer or pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|im_end|>",
    )
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    )
    return tokenizer


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    """Tiny Llamas: GQA 4/2 heads with head_dim 24 (hidden 64 != 4 * 24), untied embeddings and an FFN width q8_0
    cannot block; and a tied one."""
    from transformers import LlamaForCausalLM

    tokenizer, folders = _small_tokenizer(), {}
    untied = dict(head_dim=24, tie_word_embeddings=False, intermediate_size=80)  # 80: not a multiple of q8_0's 32
    for name, overrides in {"untied_head_dim": untied, "tied": {}}.items():
        folder = tmp_path_factory.mktemp(name)
        torch.manual_seed(0)
        LlamaForCausalLM(tiny_llama_config(tokenizer, **overrides)).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        folders[name] = folder
    return folders


@pytest.mark.parametrize(
    ("case", "load_in_4bit", "quantization"),
    [("untied_head_dim", False, "f32"), ("tied", True, "bf16"), ("untied_head_dim", False, "q8_0")],
)
def test_tiny_models_reload(tiny_dirs, tmp_path, case, load_in_4bit, quantization):
    model, tokenizer = FastModel.from_pretrained(str(tiny_dirs[case]), max_seq_length=64, load_in_4bit=load_in_4bit)
    model = FastModel.get_peft_model(model, r=4, lora_alpha=8, use_gradient_checkpointing=False)
    randomize_lora_b(model, seed=3, std=0.2)
    FastModel.for_inference(model)
    dtype = torch.bfloat16 if quantization == "bf16" else torch.float32
    merged_dir = FastModel.save_merged(model, tokenizer, tmp_path / "merged", dtype=dtype)
    file = FastModel.save_gguf(model, tokenizer, tmp_path / "tiny.gguf", quantization=quantization)
    reader = gguf.GGUFReader(file)
    types = {tensor.name: tensor.tensor_type for tensor in reader.tensors}
    assert ("output.weight" in types) == (case == "untied_head_dim")
    assert types["blk.1.attn_v.weight"] == gguf.GGMLQuantizationType[quantization.upper()]
    assert types["blk.1.ffn_norm.weight"] == gguf.GGMLQuantizationType.F32
    if quantization == "q8_0":
        # Rows of 80 values do not split into q8_0's blocks of 32: stored as f16, as llama.cpp's converter does.
        assert types["blk.1.ffn_down.weight"] == gguf.GGMLQuantizationType.F16
    if case == "untied_head_dim":
        assert _field(reader, "llama.rope.dimension_count") == 24
        assert _field(reader, "llama.attention.key_length") == 24
    reloaded_tokenizer = AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
    for probe in TOKENIZER_PROBES:
        assert reloaded_tokenizer(probe)["input_ids"] == tokenizer(probe)["input_ids"], probe
    assert reloaded_tokenizer.chat_template == tokenizer.chat_template
    ids = torch.randint(3, model.config.vocab_size, (1, 23), generator=torch.Generator().manual_seed(5))
    reloaded = AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name, dtype=torch.float32)
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32)
    assert reloaded.config.tie_word_embeddings == (case == "tied")
    assert reloaded.config.head_dim == model.config.head_dim
    with torch.no_grad():
        expected = merged(ids).logits
        actual = reloaded(ids).logits
        lora = model(input_ids=ids).logits
    difference = (actual - expected).abs().max().item()
    if quantization == "q8_0":
        # 8-bit blocks: close to the float32 merged model, not equal to it (0.020 measured).
        assert 0 < relative_error(actual, expected) < 0.05, relative_error(actual, expected)
    else:
        # Same weights on both sides (float32, or the same bf16 rounding): equal to float32 rounding.
        assert difference < 1e-4, difference
    if quantization == "f32":
        # ... and, unrounded, with the LoRA model itself: the merge and the q/k row order are exact.
        assert (actual - lora).abs().max().item() < 1e-4


def test_llama3_pre_tokenizer_round_trip(tiny_dirs, tmp_path):
    # Llama 3's pre-tokenizer (a split regex, then byte-level without its own regex) is written as llama.cpp's
    # "llama-bpe", which transformers' loader turns back into the same pre-tokenizer.
    from tokenizers import Regex, pre_tokenizers

    from fastft.loading.gguf_tokenizer import LLAMA3_SPLIT

    split = pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated")
    tokenizer = _small_tokenizer(
        pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    )
    model, _ = FastModel.from_pretrained(str(tiny_dirs["tied"]), max_seq_length=64)
    file = FastModel.save_gguf(model, tokenizer, tmp_path / "llama3-style.gguf", quantization="f32")
    assert _field(gguf.GGUFReader(file), "tokenizer.ggml.pre") == "llama-bpe"
    reloaded = AutoTokenizer.from_pretrained(tmp_path, gguf_file=file.name)
    spec = json.loads(reloaded.backend_tokenizer.to_str())["pre_tokenizer"]
    assert spec == json.loads(tokenizer.backend_tokenizer.to_str())["pre_tokenizer"]
    for probe in TOKENIZER_PROBES:
        assert reloaded(probe)["input_ids"] == tokenizer(probe)["input_ids"], probe


@pytest.mark.parametrize("rope_type", ["llama3", "linear", "yarn"])
def test_rope_scaling(tmp_path, rope_type):
    from transformers import LlamaForCausalLM

    tokenizer = _small_tokenizer()
    rope = {"rope_type": rope_type, "rope_theta": 500000.0, "factor": 8.0}
    if rope_type == "llama3":
        rope |= {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    if rope_type == "yarn":
        rope |= {"original_max_position_embeddings": 64}
    model = LlamaForCausalLM(tiny_llama_config(tokenizer, rope_parameters=rope))
    if rope_type == "yarn":
        with pytest.raises(NotImplementedError, match="rope_type 'yarn' is not supported"):
            FastModel.save_gguf(model, tokenizer, tmp_path / "yarn.gguf")
        assert list(tmp_path.iterdir()) == []
        return
    reader = gguf.GGUFReader(FastModel.save_gguf(model, tokenizer, tmp_path / "rope.gguf"))
    assert _field(reader, "llama.rope.freq_base") == pytest.approx(500000.0)
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    if rope_type == "linear":
        assert _field(reader, "llama.rope.scaling.type") == "linear"
        assert _field(reader, "llama.rope.scaling.factor") == pytest.approx(8.0)
        assert "rope_freqs.weight" not in tensors
        return
    # llama.cpp divides each rotary frequency by its factor: 1 for the fast ones, `factor` for the slow ones, a smooth
    # blend between (head_dim 16: 8 frequencies).
    factors = np.asarray(tensors["rope_freqs.weight"].data, dtype=np.float64)
    assert factors.shape == (8,) and tensors["rope_freqs.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    assert factors[0] == pytest.approx(1.0) and factors[-1] == pytest.approx(8.0)
    assert np.all(np.diff(factors) >= 0) and 1.0 < factors[len(factors) // 2] <= 8.0


def test_pre_tokenizer_names(caplog):
    from fastft.export.gguf_export import _pre_tokenizer_name

    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    digits = {"type": "Digits", "individual_digits": True}
    assert _pre_tokenizer_name(byte_level) == "gpt-2"
    assert _pre_tokenizer_name({"type": "Sequence", "pretokenizers": [digits, byte_level]}) == "smollm"
    with caplog.at_level("WARNING", logger="fastft.gguf_export"):
        assert _pre_tokenizer_name({"type": "Whitespace"}) == "default"
    assert "matches none llama.cpp is known to name" in caplog.text


def test_refusals_and_atomic_write(tiny_dirs, tmp_path, monkeypatch):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    import fastft.export.gguf_export as gguf_export

    model, tokenizer = FastModel.from_pretrained(str(tiny_dirs["tied"]), max_seq_length=64)
    with pytest.raises(ValueError, match=r"quantization='q4_k' is not one of"):
        FastModel.save_gguf(model, tokenizer, tmp_path, quantization="q4_k")
    with pytest.raises(ValueError, match="a tokenizer is required"):
        FastModel.save_gguf(model, None, tmp_path)
    qwen = Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=128,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
        )
    )
    with pytest.raises(ValueError, match=r"exports Llama-architecture, Mixtral and Qwen3-MoE.*model_type 'qwen2'"):
        FastModel.save_gguf(qwen, tokenizer, tmp_path)
    word_level = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]")))
    with pytest.raises(ValueError, match="only byte-level BPE tokenizers"):
        FastModel.save_gguf(model, word_level, tmp_path / "x.gguf")
    assert list(tmp_path.iterdir()) == []

    # A failure half-way through leaves the previous file untouched and no temporary files behind.
    target = tmp_path / "model.gguf"
    target.write_bytes(b"previous export")
    calls = {"n": 0}
    encode = gguf_export._encode

    def failing_encode(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 5:
            raise RuntimeError("disk full (simulated)")
        return encode(*args, **kwargs)

    monkeypatch.setattr(gguf_export, "_encode", failing_encode)
    with pytest.raises(RuntimeError, match="simulated"):
        FastModel.save_gguf(model, tokenizer, target)
    assert calls["n"] == 5
    assert target.read_bytes() == b"previous export"
    assert [p.name for p in tmp_path.iterdir()] == ["model.gguf"]
