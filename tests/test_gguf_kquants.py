"""fastft's K-quant writer (Q4_K, Q5_K, Q6_K): decoded by the ``gguf`` package's own dequantiser (an independent
reading of ggml's layout), the bytes give back the values within each type's error, at each type's exact size.

The error bounds are measured on Gaussian rows (std 0.02, as trained weights are), seed 0, with some margin: RMS
relative error 0.0715 (Q4_K), 0.0363 (Q5_K), 0.0178 (Q6_K); the same rows give 0.0862 (Q4_0), 0.0428 (Q5_0),
0.0054 (Q8_0) through the gguf package's legacy quantisers.
"""

from __future__ import annotations

import ctypes
import importlib.util
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf.quants import dequantize

from fastft.contracts import ShapeContractError
from fastft.export import kquants

pytestmark = pytest.mark.lane

TYPES = gguf.GGMLQuantizationType
# Type -> (bytes per 256 values, RMS relative error bounds on the Gaussian rows).
EXPECTED = {"Q4_K": (144, 0.064, 0.078), "Q5_K": (176, 0.032, 0.040), "Q6_K": (210, 0.016, 0.0195)}


def _gaussian(rows: int = 64, length: int = 1024, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((rows, length)) * 0.02).astype(np.float32)


def _decode(data: np.ndarray, type_name: str) -> np.ndarray:
    return np.asarray(dequantize(data, TYPES[type_name]), dtype=np.float32)


def _relative_rms(actual: np.ndarray, expected: np.ndarray) -> float:
    return float(np.sqrt(((actual - expected) ** 2).mean() / (expected**2).mean()))


@pytest.mark.parametrize("type_name", kquants.K_TYPES)
def test_layout_size_and_round_trip_error(type_name):
    block_bytes, low, high = EXPECTED[type_name]
    rows = _gaussian()
    data = kquants.quantize(rows, type_name)
    # ggml's size, as the gguf package knows it, and ours: 4 super-blocks per row of 1024.
    assert gguf.GGML_QUANT_SIZES[TYPES[type_name]] == (256, block_bytes)
    assert data.dtype == np.uint8 and data.shape == (64, 4 * block_bytes)
    assert kquants.row_bytes(type_name, 1024) == 4 * block_bytes
    decoded = _decode(data, type_name)
    assert decoded.shape == rows.shape
    error = _relative_rms(decoded, rows)
    # Above the lower bound as well: a writer that kept more bits than the type has would not be that type.
    assert low < error < high, error
    # A one-dimensional input is one row.
    assert np.array_equal(kquants.quantize(rows[3], type_name), data[3:4])


def test_coarser_type_has_larger_error_and_k_quants_beat_legacy_types_of_their_size():
    rows = _gaussian()
    error = {name: _relative_rms(_decode(kquants.quantize(rows, name), name), rows) for name in kquants.K_TYPES}
    legacy = {
        name: _relative_rms(_decode(gguf.quants.quantize(rows, TYPES[name]), name), rows)
        for name in ("Q4_0", "Q5_0", "Q8_0")
    }
    assert legacy["Q4_0"] > error["Q4_K"] > legacy["Q5_0"] > error["Q5_K"] > error["Q6_K"] > legacy["Q8_0"], (
        error,
        legacy,
    )


@pytest.mark.parametrize("type_name", kquants.K_TYPES)
def test_special_rows(type_name):
    length = 512
    zeros = np.zeros((2, length), np.float32)
    data = kquants.quantize(zeros, type_name)
    assert not data.any(), "an all-zero row is all-zero bytes"
    assert not _decode(data, type_name).any()
    for value in (0.37, -0.37):
        constant = np.full((1, length), value, np.float32)
        decoded = _decode(kquants.quantize(constant, type_name), type_name)
        # fp16 scales: within 3e-4 of the value (1.3e-4 to 2.8e-4 measured).
        assert np.abs(decoded - value).max() < 5e-4 * abs(value), (value, np.abs(decoded - value).max())
    # Only negative values: a min-offset type carries them in its min, a symmetric one in its sign (0.041, 0.021,
    # 0.018 measured: Q4_K / Q5_K spend no level on positive values and do better than on Gaussian rows).
    negative = -np.abs(_gaussian(16, length))
    decoded = _decode(kquants.quantize(negative, type_name), type_name)
    assert _relative_rms(decoded, negative) < EXPECTED[type_name][2], _relative_rms(decoded, negative)
    # One outlier, 50x the spread: it is kept (within 0.4%), and only its own super-block loses precision, every
    # other super-block is encoded byte for byte as without it.
    rows = _gaussian(4, length)
    spiked = rows.copy()
    spiked[:, 7] = 1.0
    plain, spiked_data = kquants.quantize(rows, type_name), kquants.quantize(spiked, type_name)
    block_bytes = EXPECTED[type_name][0]
    assert np.array_equal(spiked_data[:, block_bytes:], plain[:, block_bytes:])
    assert not np.array_equal(spiked_data[:, :block_bytes], plain[:, :block_bytes])
    decoded = _decode(spiked_data, type_name)
    assert np.abs(decoded[:, 7] - 1.0).max() < 4e-3
    assert _relative_rms(decoded[:, :256], spiked[:, :256]) > _relative_rms(decoded[:, 256:], spiked[:, 256:])


@pytest.mark.parametrize("type_name", kquants.K_TYPES)
def test_chunks_do_not_change_the_bytes(type_name, monkeypatch):
    # Super-blocks are independent: encoding in chunks of 3 (a chunk boundary inside a row) gives the same bytes.
    rows = _gaussian(5, 768, seed=1)
    whole = kquants.quantize(rows, type_name)
    monkeypatch.setattr(kquants, "_CHUNK_BLOCKS", 3)
    assert np.array_equal(kquants.quantize(rows, type_name), whole)


def test_refusals():
    with pytest.raises(ShapeContractError, match=r"Q4_K encodes rows whose length is a multiple of 256.*\(2, 300\)"):
        kquants.quantize(np.ones((2, 300), np.float32), "Q4_K")
    with pytest.raises(ValueError, match=r"'Q3_K' is not one of \['Q4_K', 'Q5_K', 'Q6_K'\]"):
        kquants.quantize(np.ones((1, 256), np.float32), "Q3_K")


def _ggml_library() -> Path | None:
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        return None
    library = Path(next(iter(spec.submodule_search_locations))) / "lib" / "libggml-base.so"
    return library if library.exists() else None


# Marked so that the llamacpp lane, which runs only `-m llamacpp`, runs it; elsewhere it skips.
@pytest.mark.llamacpp
@pytest.mark.skipif(_ggml_library() is None, reason="needs llama-cpp-python (llama.cpp's libggml-base) installed")
@pytest.mark.parametrize("type_name", kquants.K_TYPES)
def test_bytes_equal_llama_cpp_reference_quantiser(type_name):
    # llama.cpp's own quantiser without an importance matrix (what llama-quantize runs) writes the same bytes.
    library = ctypes.CDLL(str(_ggml_library()))
    quantize_ref = getattr(library, f"quantize_row_{type_name[:2].lower()}_K_ref")
    rng = np.random.default_rng(2)
    spiked = _gaussian(8, 512, seed=3)
    spiked[:, 7] = 1.0
    cases = [
        _gaussian(64, 1024),
        rng.standard_t(3, (32, 512)).astype(np.float32),
        -np.abs(_gaussian(16, 512)),
        spiked,
        np.zeros((2, 256), np.float32),
        np.full((2, 256), 0.37, np.float32),
    ]
    for rows in cases:
        expected = np.zeros(kquants.row_bytes(type_name, rows.shape[1]) * rows.shape[0], np.uint8)
        pointers = (rows.ctypes.data_as(ctypes.c_void_p), expected.ctypes.data_as(ctypes.c_void_p))
        quantize_ref(*pointers, ctypes.c_int64(rows.size))
        assert np.array_equal(kquants.quantize(rows, type_name).reshape(-1), expected)
