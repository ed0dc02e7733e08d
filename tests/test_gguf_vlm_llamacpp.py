"""llama.cpp itself runs fastft's Qwen2.5-VL pair: the language model (qwen2vl) and the mmproj (qwen2.5vl_merger).

Through llama-cpp-python's bindings (0.3.36, built from its sdist): the language model's next-token logits for a text
prompt match the merged transformers model's, and mtmd loads the mmproj beside it, tokenizes a prompt with an image
and encodes the image into embeddings that match the merged vision tower's output for the same pixels. The tiny model
uses llama.cpp's 112-pixel attention window (its qwen2.5vl_merger graph reads no other), so both sides attend alike.
Skipped where llama_cpp is not importable (the ``llamacpp`` lane installs it).
"""

from __future__ import annotations

import ctypes
import importlib

import numpy as np
import pytest
import torch
from conftest import randomize_lora_b
from vlm_tiny import MERGE, PATCH, TEMPORAL, save_tiny_vlm, tiny_image_processor

from fastft import FastModel

pytestmark = [
    pytest.mark.llamacpp,
    pytest.mark.filterwarnings("ignore:.*must be `None` or an integer within the vocabulary"),
    pytest.mark.filterwarnings("ignore:fastft.from_pretrained.*processor could not be built"),
]
llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (the llamacpp lane has it)")
# Where llama_cpp imports (the llamacpp lane), its mtmd bindings must too: the lane builds them, so a missing one is a
# failure here, not a skip.
mtmd = importlib.import_module("llama_cpp.mtmd_cpp")
pytest.importorskip("transformers.models.qwen2_5_vl.modeling_qwen2_5_vl", reason="this transformers has no Qwen2.5-VL")

WINDOW = 112
# Height x width: multiples of patch x merge, above llama.cpp's eight-token minimum, inside one 112-pixel window.
IMAGE = (32, 48)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    folder = save_tiny_vlm(tmp_path_factory.mktemp("qwen2_5_vl_llamacpp"))
    model, processing = FastModel.from_pretrained(str(folder), max_seq_length=64, dtype=torch.float32)
    model = FastModel.get_peft_model(model, r=4, lora_alpha=8, finetune_vision_layers=True)
    randomize_lora_b(model, std=0.1)
    visual = model.get_base_model().model.visual
    model.get_base_model().config.vision_config.window_size = WINDOW
    visual.window_size = WINDOW
    model.eval()
    tokenizer = getattr(processing, "tokenizer", processing)
    files = FastModel.save_gguf(model, tokenizer, tmp_path_factory.mktemp("gguf"), quantization="f32")
    return model, tokenizer, files


def test_llama_cpp_language_model_logits_match_transformers(exported):
    model, tokenizer, files = exported
    ids = tokenizer("the cat in a hat", add_special_tokens=False)["input_ids"]
    # float32 KV cache (llama.cpp defaults to f16 there) and no flash attention, to keep llama.cpp's own rounding small.
    llm = llama_cpp.Llama(
        model_path=str(files.model),
        n_ctx=64,
        logits_all=True,
        verbose=False,
        n_threads=2,
        type_k=0,
        type_v=0,
        flash_attn=False,
    )
    assert llm.tokenize(b"the cat in a hat", add_bos=False, special=False) == ids
    llm.eval(ids)
    theirs = torch.from_numpy(np.array(llm.scores[: len(ids)], dtype=np.float32))
    errors = {}
    norms = [module for module in model.modules() if hasattr(module, "variance_epsilon")]
    text_norms = [module for module in norms if ".visual." not in _name_of(model, module)]
    saved = [module.variance_epsilon for module in text_norms]
    try:
        # llama.cpp 0.3.36's qwen2vl does not read attention.layer_norm_rms_epsilon (the file has it, 1e-6) and
        # normalises with epsilon 0; on this tiny model that alone is a 1e-3 difference, so the reference is computed
        # both ways and the file must match one of them to float32 rounding.
        for epsilon in ("config", 0.0):
            if epsilon == 0.0:
                for module in text_norms:
                    module.variance_epsilon = 0.0
            with torch.no_grad():
                ours = model(input_ids=torch.tensor([ids])).logits[0].float()
            errors[epsilon] = float((theirs - ours).abs().max() / ours.abs().max())
    finally:
        for module, epsilon in zip(text_norms, saved, strict=True):
            module.variance_epsilon = epsilon
    # Measured here: 1.0e-3 against the config's epsilon, 3e-7 against epsilon 0.
    assert min(errors.values()) < 1e-5, f"llama.cpp's logits differ from transformers' by {errors}"


def _name_of(model, target) -> str:
    return next(name for name, module in model.named_modules() if module is target)


def _encode_with_mtmd(files, pixels: np.ndarray) -> np.ndarray:
    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_default_params()
    llm = llama_cpp.llama_model_load_from_file(str(files.model).encode(), params)
    assert llm, "llama.cpp did not load the language model"
    context_params = mtmd.mtmd_context_params_default()
    context_params.use_gpu = False
    context_params.n_threads = 2
    context_params.warmup = False
    context = mtmd.mtmd_init_from_file(str(files.mmproj).encode(), llm, context_params)
    assert context, "mtmd did not load the mmproj"
    try:
        height, width, _ = pixels.shape
        data = np.ascontiguousarray(pixels, dtype=np.uint8)
        bitmap = mtmd.mtmd_bitmap_init(width, height, data.ctypes.data_as(ctypes.POINTER(ctypes.c_ubyte)))
        marker = mtmd.mtmd_default_marker()
        prompt = b"look: " + (marker if isinstance(marker, bytes) else marker.encode())
        text = mtmd.mtmd_input_text(prompt, len(prompt), False, True)
        chunks = mtmd.mtmd_input_chunks_init()
        bitmaps = (ctypes.c_void_p * 1)(bitmap)
        assert mtmd.mtmd_tokenize(context, chunks, ctypes.byref(text), bitmaps, 1) == 0
        images = [
            mtmd.mtmd_input_chunks_get(chunks, index)
            for index in range(mtmd.mtmd_input_chunks_size(chunks))
            if mtmd.mtmd_input_chunk_get_type(mtmd.mtmd_input_chunks_get(chunks, index))
            == mtmd.MTMD_INPUT_CHUNK_TYPE_IMAGE
        ]
        assert len(images) == 1
        assert mtmd.mtmd_encode_chunk(context, images[0]) == 0
        tokens = mtmd.mtmd_input_chunk_get_n_tokens(images[0])
        width_embd = llama_cpp.llama_model_n_embd(llm)
        out = mtmd.mtmd_get_output_embd(context)
        embeddings = np.ctypeslib.as_array(out, shape=(tokens * width_embd,)).reshape(tokens, width_embd).copy()
        mtmd.mtmd_input_chunks_free(chunks)
        mtmd.mtmd_bitmap_free(bitmap)
        return embeddings
    finally:
        mtmd.mtmd_free(context)
        llama_cpp.llama_model_free(llm)


def test_llama_cpp_mtmd_loads_the_pair_and_encodes_an_image_as_the_tower_does(exported):
    model, _, files = exported
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (*IMAGE, 3), dtype=np.uint8)
    theirs = torch.from_numpy(_encode_with_mtmd(files, pixels))
    # transformers' side: the same pixels rescaled and normalised with the mmproj's mean / std, laid out as
    # Qwen2-VL's image processor lays them out (the frame repeated for the two temporal slices).
    processor = tiny_image_processor()
    mean = torch.tensor(processor.image_mean).view(3, 1, 1)
    std = torch.tensor(processor.image_std).view(3, 1, 1)
    image = (torch.from_numpy(pixels).permute(2, 0, 1).float() / 255 - mean) / std
    frames = image.unsqueeze(0).repeat(TEMPORAL, 1, 1, 1)  # [T, C, H, W]
    grid_h, grid_w = IMAGE[0] // PATCH, IMAGE[1] // PATCH
    patches = frames.reshape(TEMPORAL, 3, grid_h // MERGE, MERGE, PATCH, grid_w // MERGE, MERGE, PATCH)
    patches = patches.permute(2, 5, 3, 6, 1, 0, 4, 7).reshape(grid_h * grid_w, 3 * TEMPORAL * PATCH * PATCH)
    grid = torch.tensor([[1, grid_h, grid_w]])
    with torch.no_grad():
        ours = model.get_base_model().model.visual(patches, grid_thw=grid)
    ours = getattr(ours, "pooler_output", ours).float()
    assert theirs.shape == ours.shape == (grid_h * grid_w // MERGE**2, 64)
    error = float((theirs - ours).abs().max() / ours.abs().max())
    # Measured here: 4.6e-4 (the mmproj's matrices are f16).
    assert error < 2e-3, f"llama.cpp's image embeddings differ from transformers' by {error:.2e}"
