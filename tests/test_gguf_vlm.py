"""FastModel.save_gguf on a vision-language model: Qwen2.5-VL as the two files llama.cpp runs.

The tiny random Qwen2.5-VL (tests/vlm_tiny.py) with LoRA on the language model and the vision tower, B non-zero, is
exported and read back with ``gguf.GGUFReader``. The names the test expects are written out here as llama.cpp's
loaders spell them (src/models/qwen2vl.cpp, tools/mtmd/clip.cpp and clip-impl.h of llama.cpp as vendored by
llama-cpp-python 0.3.36), not taken from fastft's code, and every value is compared with peft's own
``merge_and_unload`` of the same model after the converter's transforms (qkv split in three, the Conv3d patch kernel
split into its two temporal slices).
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch
from conftest import randomize_lora_b
from vlm_tiny import MERGE, PATCH, save_tiny_vlm, tiny_image_processor

from fastft import FastModel
from fastft.export.gguf_vlm import VisionGGUF

pytestmark = [
    pytest.mark.lane,
    pytest.mark.filterwarnings("ignore:.*must be `None` or an integer within the vocabulary"),
    pytest.mark.filterwarnings("ignore:fastft.from_pretrained.*processor could not be built"),
]
pytest.importorskip("transformers.models.qwen2_5_vl.modeling_qwen2_5_vl", reason="this transformers has no Qwen2.5-VL")

TEXT_LAYERS, VISION_BLOCKS, HIDDEN, VISION_HIDDEN = 2, 2, 64, 32
# llama.cpp's qwen2vl language model: what llama_model_qwen2vl::load_arch_tensors creates (output.weight is optional,
# present here since the tiny model's embeddings are untied).
LANGUAGE = {
    "token_embd.weight": "model.language_model.embed_tokens.weight",
    "output_norm.weight": "model.language_model.norm.weight",
    "output.weight": "lm_head.weight",
}
for _layer in range(TEXT_LAYERS):
    _prefix = f"model.language_model.layers.{_layer}."
    LANGUAGE |= {
        f"blk.{_layer}.attn_norm.weight": _prefix + "input_layernorm.weight",
        f"blk.{_layer}.ffn_norm.weight": _prefix + "post_attention_layernorm.weight",
        f"blk.{_layer}.attn_output.weight": _prefix + "self_attn.o_proj.weight",
        f"blk.{_layer}.ffn_gate.weight": _prefix + "mlp.gate_proj.weight",
        f"blk.{_layer}.ffn_up.weight": _prefix + "mlp.up_proj.weight",
        f"blk.{_layer}.ffn_down.weight": _prefix + "mlp.down_proj.weight",
    }
    for _part in "qkv":
        LANGUAGE[f"blk.{_layer}.attn_{_part}.weight"] = _prefix + f"self_attn.{_part}_proj.weight"
        LANGUAGE[f"blk.{_layer}.attn_{_part}.bias"] = _prefix + f"self_attn.{_part}_proj.bias"
# llama.cpp's clip loader for qwen2.5vl_merger: TN_PATCH_EMBD / TN_PATCH_EMBD_1, per block TN_LN_1 / TN_LN_2 (RMS:
# weight only), TN_ATTN_Q/K/V/OUTPUT, TN_FFN_GATE/UP/DOWN (with biases), TN_LN_POST, and TN_LLAVA_PROJ 0 and 2.
MMPROJ_PLAIN = {
    "v.post_ln.weight": "model.visual.merger.ln_q.weight",
    "mm.0.weight": "model.visual.merger.mlp.0.weight",
    "mm.0.bias": "model.visual.merger.mlp.0.bias",
    "mm.2.weight": "model.visual.merger.mlp.2.weight",
    "mm.2.bias": "model.visual.merger.mlp.2.bias",
}
for _block in range(VISION_BLOCKS):
    _prefix = f"model.visual.blocks.{_block}."
    MMPROJ_PLAIN |= {
        f"v.blk.{_block}.ln1.weight": _prefix + "norm1.weight",
        f"v.blk.{_block}.ln2.weight": _prefix + "norm2.weight",
    }
    for _gguf, _hf in (("attn_out", "attn.proj"), ("ffn_gate", "mlp.gate_proj"), ("ffn_up", "mlp.up_proj")):
        for _suffix in ("weight", "bias"):
            MMPROJ_PLAIN[f"v.blk.{_block}.{_gguf}.{_suffix}"] = f"{_prefix}{_hf}.{_suffix}"
    for _suffix in ("weight", "bias"):
        MMPROJ_PLAIN[f"v.blk.{_block}.ffn_down.{_suffix}"] = f"{_prefix}mlp.down_proj.{_suffix}"


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    return save_tiny_vlm(tmp_path_factory.mktemp("qwen2_5_vl_gguf"))


@pytest.fixture(scope="module")
def trained(vlm_dir):
    model, processing = FastModel.from_pretrained(str(vlm_dir), max_seq_length=64, dtype=torch.float32)
    model = FastModel.get_peft_model(model, r=4, lora_alpha=8, finetune_vision_layers=True)
    randomize_lora_b(model, std=0.1)
    tokenizer = getattr(processing, "tokenizer", processing)
    merged = copy.deepcopy(model).merge_and_unload()
    expected = {name: tensor.detach().float() for name, tensor in merged.state_dict().items()}
    return SimpleNamespace(model=model, tokenizer=tokenizer, expected=expected)


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory):
    # The tokenizer alone: the image mean / std come from the model folder's preprocessor_config.json.
    folder = tmp_path_factory.mktemp("gguf")
    files = FastModel.save_gguf(trained.model, trained.tokenizer, folder, quantization="f16")
    return SimpleNamespace(
        files=files,
        folder=folder,
        model=gguf.GGUFReader(files.model),
        mmproj=gguf.GGUFReader(files.mmproj),
    )


def _field(reader, key):
    return reader.fields[key].contents()


def _tensors(reader):
    return {tensor.name: tensor for tensor in reader.tensors}


def _values(tensor) -> torch.Tensor:
    data = np.asarray(tensor.data)
    if tensor.tensor_type not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        data = gguf.quants.dequantize(data, tensor.tensor_type)
    return torch.from_numpy(data.astype(np.float32))


def _close(actual: torch.Tensor, expected: torch.Tensor, f16: bool) -> None:
    assert actual.shape == expected.shape
    bound = 1e-3 * float(expected.abs().max()) + 1e-6 if f16 else 1e-7
    assert float((actual - expected).abs().max()) <= bound


def test_two_files_named_as_llama_cpp_users_expect(exported, vlm_dir):
    stem = vlm_dir.name
    assert isinstance(exported.files, VisionGGUF)
    assert exported.files.model == exported.folder / f"{stem}-F16.gguf"
    assert exported.files.mmproj == exported.folder / f"mmproj-{stem}-f16.gguf"
    assert sorted(path.name for path in exported.folder.iterdir()) == sorted(
        [f"{stem}-F16.gguf", f"mmproj-{stem}-f16.gguf"]
    )  # no scratch or partial file left
    assert str(exported.files) == f"{exported.files.model} and {exported.files.mmproj}"


def test_language_model_is_qwen2vl_with_mrope_sections(exported, trained):
    reader = exported.model
    assert _field(reader, "general.architecture") == "qwen2vl"
    assert _field(reader, "general.file_type") == int(gguf.LlamaFileType.MOSTLY_F16)
    assert _field(reader, "qwen2vl.rope.dimension_sections") == [2, 3, 3, 0]
    assert _field(reader, "qwen2vl.embedding_length") == HIDDEN
    assert _field(reader, "qwen2vl.block_count") == TEXT_LAYERS
    assert _field(reader, "qwen2vl.attention.head_count") == 4
    assert _field(reader, "qwen2vl.attention.head_count_kv") == 2
    assert _field(reader, "qwen2vl.feed_forward_length") == 96
    assert _field(reader, "qwen2vl.context_length") == 256
    assert _field(reader, "qwen2vl.rope.freq_base") == pytest.approx(10000.0)
    assert _field(reader, "qwen2vl.attention.layer_norm_rms_epsilon") == pytest.approx(1e-6)
    assert _field(reader, "tokenizer.ggml.model") == "gpt2"
    vocab = trained.tokenizer.get_vocab()
    tokens = _field(reader, "tokenizer.ggml.tokens")
    assert all(tokens[index] == token for token, index in vocab.items())
    assert _field(reader, "tokenizer.ggml.eos_token_id") == trained.tokenizer.eos_token_id


def test_language_model_tensors_are_the_merged_weights(exported, trained):
    tensors = _tensors(exported.model)
    assert set(tensors) == set(LANGUAGE)
    for name, source in LANGUAGE.items():
        tensor = tensors[name]
        expected = trained.expected[source]
        one_d = expected.dim() == 1
        assert tensor.tensor_type == (gguf.GGMLQuantizationType.F32 if one_d else gguf.GGMLQuantizationType.F16)
        # q / k rows as transformers keeps them: llama.cpp's M-RoPE rotates halves, as transformers does.
        _close(_values(tensor), expected, f16=not one_d)


def test_mmproj_metadata_is_what_llama_cpp_clip_reads(exported):
    reader = exported.mmproj
    processor = tiny_image_processor()
    assert _field(reader, "general.architecture") == "clip"
    assert _field(reader, "general.type") == "mmproj"
    assert _field(reader, "general.file_type") == int(gguf.LlamaFileType.MOSTLY_F16)
    assert _field(reader, "clip.has_vision_encoder") is True
    assert _field(reader, "clip.projector_type") == "qwen2.5vl_merger"
    assert _field(reader, "clip.use_silu") is True
    assert _field(reader, "clip.vision.projection_dim") == HIDDEN
    assert _field(reader, "clip.vision.image_size") == 560  # the converter's default: Qwen2.5-VL's config has none
    assert _field(reader, "clip.vision.patch_size") == PATCH
    assert _field(reader, "clip.vision.embedding_length") == VISION_HIDDEN
    assert _field(reader, "clip.vision.feed_forward_length") == 48
    assert _field(reader, "clip.vision.block_count") == VISION_BLOCKS
    assert _field(reader, "clip.vision.attention.head_count") == 2
    assert _field(reader, "clip.vision.attention.layer_norm_epsilon") == pytest.approx(1e-6)
    # fullatt_block_indexes [1]: every second block attends to the whole image.
    assert _field(reader, "clip.vision.n_wa_pattern") == 2
    assert _field(reader, "clip.vision.spatial_merge_size") == MERGE
    assert _field(reader, "clip.vision.image_mean") == pytest.approx(list(processor.image_mean))
    assert _field(reader, "clip.vision.image_std") == pytest.approx(list(processor.image_std))


def test_mmproj_tensors_are_the_merged_tower_split_as_the_converter_splits_it(exported, trained):
    tensors = _tensors(exported.mmproj)
    split = {"v.patch_embd.weight", "v.patch_embd.weight.1"}
    split |= {f"v.blk.{b}.attn_{p}.{s}" for b in range(VISION_BLOCKS) for p in "qkv" for s in ("weight", "bias")}
    assert set(tensors) == set(MMPROJ_PLAIN) | split
    for name, source in MMPROJ_PLAIN.items():
        expected = trained.expected[source]
        _close(_values(tensors[name]), expected, f16=expected.dim() > 1)
    patch = trained.expected["model.visual.patch_embed.proj.weight"]  # [C, 3, T, p, p]
    for temporal, name in enumerate(("v.patch_embd.weight", "v.patch_embd.weight.1")):
        assert tensors[name].tensor_type == gguf.GGMLQuantizationType.F16
        assert list(tensors[name].shape) == [PATCH, PATCH, 3, VISION_HIDDEN]  # ggml order: kw, kh, c_in, c_out
        _close(_values(tensors[name]), patch[:, :, temporal], f16=True)
    for block in range(VISION_BLOCKS):
        for suffix in ("weight", "bias"):
            fused = trained.expected[f"model.visual.blocks.{block}.attn.qkv.{suffix}"]
            for index, part in enumerate("qkv"):
                tensor = tensors[f"v.blk.{block}.attn_{part}.{suffix}"]
                rows = fused[index * VISION_HIDDEN : (index + 1) * VISION_HIDDEN]
                _close(_values(tensor), rows, f16=suffix == "weight")
    # The vision adapters reached the file: the merged qkv differs from the base model's.
    base = trained.model.get_base_model().model.visual.blocks[0].attn.qkv.base_layer.weight.detach().float()
    assert not torch.allclose(base[:VISION_HIDDEN], _values(tensors["v.blk.0.attn_q.weight"]), atol=1e-3)


def test_q8_0_language_model_and_a_gguf_path(trained, tmp_path, vlm_dir):
    # With the processor's parts passed as a processor (no torchvision needed for the stand-in).
    image_processor = tiny_image_processor()
    image_processor.image_mean = [0.25, 0.5, 0.75]
    processor = SimpleNamespace(tokenizer=trained.tokenizer, image_processor=image_processor)
    files = FastModel.save_gguf(trained.model, processor, tmp_path / "tiny.gguf", quantization="q8_0")
    assert files == VisionGGUF(tmp_path / "tiny.gguf", tmp_path / "mmproj-tiny-f16.gguf")
    mmproj = gguf.GGUFReader(files.mmproj)
    assert _field(mmproj, "clip.vision.image_mean") == pytest.approx([0.25, 0.5, 0.75])
    tensors = _tensors(gguf.GGUFReader(files.model))
    q = tensors["blk.0.attn_q.weight"]
    assert q.tensor_type == gguf.GGMLQuantizationType.Q8_0
    expected = trained.expected["model.language_model.layers.0.self_attn.q_proj.weight"]
    assert float((_values(q) - expected).abs().max()) <= float(expected.abs().max()) / 100
    assert tensors["blk.0.attn_q.bias"].tensor_type == gguf.GGMLQuantizationType.F32


def _stand_in(model_type: str):
    return SimpleNamespace(config=SimpleNamespace(model_type=model_type, vision_config=SimpleNamespace()))


@pytest.mark.parametrize(
    ("model_type", "reason"),
    [
        ("mllama", "llama.cpp no longer runs Llama 3.2 Vision"),
        ("qwen3_vl", "deepstack tensors"),
        ("gemma3", "does not write Gemma 3's files yet"),
        ("llava", r"vision-language models of \['qwen2_5_vl'\] only"),
    ],
)
def test_other_families_are_refused_with_the_reason_before_anything_is_written(model_type, reason, tmp_path):
    with pytest.raises(ValueError, match=f"\\({model_type}\\) is a vision-language model.*{reason}.*--mmproj"):
        FastModel.save_gguf(_stand_in(model_type), None, tmp_path / "out")
    assert not any(tmp_path.iterdir())


def test_the_single_file_writer_refuses_a_vlm_and_names_the_two_file_route(trained, tmp_path):
    from fastft.export.gguf_export import save_gguf

    with pytest.raises(ValueError, match="qwen2_5_vl is a vision-language model.*would drop the images"):
        save_gguf(trained.model, trained.tokenizer, tmp_path)
    assert not any(tmp_path.iterdir())


def test_a_config_llama_cpp_computes_differently_is_refused_by_name(trained, tmp_path):
    vision = trained.model.get_base_model().config.vision_config
    vision.spatial_merge_size = 3
    try:
        with pytest.raises(ValueError, match=r"vision_config.spatial_merge_size = 2.*has 3"):
            FastModel.save_gguf(trained.model, trained.tokenizer, tmp_path)
    finally:
        vision.spatial_merge_size = MERGE
    vision.fullatt_block_indexes = [0]
    try:
        with pytest.raises(ValueError, match=r"fullatt_block_indexes \[0\] over 2 blocks is not such a pattern"):
            FastModel.save_gguf(trained.model, trained.tokenizer, tmp_path)
    finally:
        vision.fullatt_block_indexes = [1]
    assert not any(tmp_path.iterdir())


def test_without_image_mean_and_std_nothing_is_written(trained, tmp_path, monkeypatch):
    config = trained.model.get_base_model().config
    monkeypatch.setattr(config, "_name_or_path", str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="needs its processor.*image mean / std"):
        FastModel.save_gguf(trained.model, trained.tokenizer, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_unknown_quantization_is_refused_with_the_list(trained, tmp_path):
    with pytest.raises(ValueError, match=r"quantization='q3_x' is not one of \["):
        FastModel.save_gguf(trained.model, trained.tokenizer, tmp_path, quantization="q3_x")
    assert not any(tmp_path.iterdir())


def test_cli_export_of_a_vlm_adapter_writes_both_files(trained, exported, tmp_path, capsys):
    from fastft.cli import main

    adapter = tmp_path / "adapter"
    trained.model.save_pretrained(adapter)
    out = tmp_path / "gguf"
    assert main(["export", "--adapter", str(adapter), "--gguf", str(out)]) == 0
    files = sorted(path.name for path in out.iterdir())
    assert len(files) == 2 and files[0].startswith("mmproj-") and files[0].endswith("-f16.gguf")
    assert f"{out / files[1]} and {out / files[0]}" in capsys.readouterr().out
    ours = _tensors(gguf.GGUFReader(out / files[0]))["v.blk.1.attn_v.weight"]
    expected = _tensors(exported.mmproj)["v.blk.1.attn_v.weight"]
    _close(_values(ours), _values(expected), f16=True)


def test_a_failure_in_the_second_file_leaves_neither(trained, tmp_path, monkeypatch):
    import fastft.export.gguf_vlm as gguf_vlm

    store = gguf_vlm._store

    def failing(gguf_module, name, *args, **kwargs):
        if name.startswith("v."):
            raise OSError("disk full (simulated)")
        return store(gguf_module, name, *args, **kwargs)

    monkeypatch.setattr(gguf_vlm, "_store", failing)
    with pytest.raises(OSError, match="simulated"):
        FastModel.save_gguf(trained.model, trained.tokenizer, tmp_path)
    # The language model's file was complete, but without its projector it is not renamed into place.
    assert not any(tmp_path.iterdir())


def test_tied_embeddings_write_no_output_tensor(tmp_path):
    # Qwen2.5-VL 3B ties its head to the embeddings: llama.cpp's qwen2vl then reads token_embd for both.
    from transformers import Qwen2_5_VLForConditionalGeneration
    from vlm_tiny import tiny_config, tiny_tokenizer

    tokenizer = tiny_tokenizer()
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(tiny_config(tokenizer)).float()
    model.lm_head.weight = model.get_input_embeddings().weight
    processor = SimpleNamespace(tokenizer=tokenizer, image_processor=tiny_image_processor())
    files = FastModel.save_gguf(model, processor, tmp_path / "tied.gguf")
    tensors = _tensors(gguf.GGUFReader(files.model))
    assert "output.weight" not in tensors
    _close(_values(tensors["token_embd.weight"]), model.get_input_embeddings().weight.detach(), f16=True)


@pytest.mark.parametrize("quantization", ["q4_k_m", "q6_k"])
def test_k_quant_language_model_takes_llama_cpps_mixture_and_the_mmproj_stays_f16(trained, tmp_path, quantization):
    from fastft.export.gguf_mixtures import MixtureModel, tensor_type

    processor = SimpleNamespace(tokenizer=trained.tokenizer, image_processor=tiny_image_processor())
    files = FastModel.save_gguf(trained.model, processor, tmp_path, quantization=quantization)
    reader = gguf.GGUFReader(files.model)
    tensors = _tensors(reader)
    text = trained.model.get_base_model().config.get_text_config()
    mixture = MixtureModel(int(text.num_hidden_layers), tied="output.weight" not in tensors)
    for name, tensor in tensors.items():
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        expected = tensor_type(name, shape, quantization, mixture).type_name
        assert tensor.tensor_type == getattr(gguf.GGMLQuantizationType, expected), name
    q = tensors["blk.0.attn_q.weight"]
    reference = trained.expected["model.language_model.layers.0.self_attn.q_proj.weight"]
    assert float((_values(q) - reference).abs().max()) <= float(reference.abs().max()) / 5
    file_type = _field(reader, "general.file_type")
    assert file_type == int(getattr(gguf.LlamaFileType, f"MOSTLY_{quantization.upper()}"))
    mmproj_types = {t.tensor_type for t in _tensors(gguf.GGUFReader(files.mmproj)).values()}
    assert mmproj_types <= {gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.F32}
