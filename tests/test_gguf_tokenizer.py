"""fastft's own tokenizer for byte-level BPE GGUF files (fastft/loading/gguf_tokenizer.py), on every release.

The reference ids in tests/data/gguf_tokenizer/smollm2_ids.json come from transformers 5.24's conversion of SmolLM2's
GGUF, split as llama.cpp's "smollm" pre-tokenizer splits (how and why: the docstring of make_smollm2_ids.py there,
which writes the file). Older releases convert the same file differently (5.5.4: a Metaspace tokenizer that adds BOS),
so the file, not the installed transformers, is the reference.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from fastft.loading import embedded
from fastft.loading.embedded import conversion_folder, resolve_alias
from fastft.loading.gguf_tokenizer import (
    GGUFTokenizerSpec,
    build_tokenizer,
    can_build,
    is_byte_level,
    read_gguf_tokenizer,
)

pytestmark = pytest.mark.lane

EXPECTED = json.loads((Path(__file__).parent / "data" / "gguf_tokenizer" / "smollm2_ids.json").read_text("utf-8"))
TEXTS = [entry["text"] for entry in EXPECTED["texts"]]


@pytest.fixture(scope="module")
def smol_spec() -> GGUFTokenizerSpec:
    folder, gguf_file = resolve_alias("smollm2-135m", None)
    return read_gguf_tokenizer(Path(folder) / gguf_file)


@pytest.fixture(scope="module")
def smol(smol_spec):
    return build_tokenizer(smol_spec)


def test_the_gguf_metadata_is_read(smol_spec):
    assert (smol_spec.model, smol_spec.pre) == ("gpt2", "smollm") and can_build(smol_spec)
    assert len(smol_spec.tokens) == len(smol_spec.token_types) == 49152 and len(smol_spec.merges) == 48900
    assert smol_spec.special_ids == {"bos": 1, "eos": 2, "unk": 0, "pad": 2}
    assert not smol_spec.add_bos and not smol_spec.add_eos
    assert smol_spec.chat_template.startswith("{% for message in messages %}")


@pytest.mark.parametrize("entry", EXPECTED["texts"], ids=[str(index) for index in range(len(TEXTS))])
def test_ids_match_the_reference_and_decode_back(smol, entry):
    ids = smol(entry["text"]).input_ids
    assert ids == entry["ids"], (smol.convert_ids_to_tokens(ids), entry["text"])
    assert smol.decode(ids) == entry["text"]


def test_numbers_after_whitespace_runs_split_as_llama_cpp_does(smol):
    """llama.cpp's "smollm" splits off digits first: the two spaces stay one merged token (transformers 5.24 gives
    two, as its plain GPT-2 split cuts " 1" from the run)."""
    assert smol.convert_ids_to_tokens(smol("a  1").input_ids) == ["a", "ĠĠ", "1"]
    assert smol.convert_ids_to_tokens(smol(" 2024").input_ids) == ["Ġ", "2", "0", "2", "4"]


def test_special_tokens_no_bos_and_the_chat_template(smol):
    assert (smol.bos_token, smol.eos_token, smol.pad_token, smol.unk_token) == (
        "<|im_start|>",
        "<|im_end|>",
        "<|im_end|>",
        "<|endoftext|>",
    )
    assert (smol.bos_token_id, smol.eos_token_id, smol.pad_token_id, smol.unk_token_id) == (1, 2, 2, 0)
    assert smol("Hi").input_ids == smol("Hi", add_special_tokens=False).input_ids == [26843]
    # Control tokens are matched whole and are special: skip_special_tokens drops them.
    assert smol("<|im_start|><file_sep>x").input_ids[:2] == [1, 5]
    assert smol.decode([1, 26843, 2], skip_special_tokens=True) == "Hi"
    assert len(smol) == 49152 and is_byte_level(smol)
    assert sorted(smol("Hi")) == ["attention_mask", "input_ids"]  # no token_type_ids, which generate() refuses

    chat = smol.apply_chat_template(EXPECTED["conversation"], add_generation_prompt=True, tokenize=False)
    assert chat == EXPECTED["chat"]["text"]
    assert smol(chat).input_ids == EXPECTED["chat"]["ids"]


def test_saved_and_reloaded_it_tokenizes_the_same(smol, tmp_path):
    from transformers import AutoTokenizer

    smol.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    for entry in EXPECTED["texts"]:
        assert reloaded(entry["text"]).input_ids == entry["ids"], entry["text"]
    assert reloaded.chat_template == smol.chat_template and reloaded.eos_token_id == 2
    assert is_byte_level(reloaded)


def _bytes_vocab() -> list[str]:
    from tokenizers.pre_tokenizers import ByteLevel

    return sorted(ByteLevel.alphabet())


def _spec(**changes) -> GGUFTokenizerSpec:
    """A tiny byte-level vocabulary: the 256 byte tokens, two merges and a control token."""
    tokens = ["<s>", "</s>", *_bytes_vocab(), "Ġa", "12"]
    fields = {
        "model": "gpt2",
        "pre": "gpt-2",
        "tokens": tokens,
        "token_types": [3, 3] + [1] * (len(tokens) - 2),
        "merges": ["Ġ a", "1 2"],
        "special_ids": {"bos": 0, "eos": 1},
    }
    return GGUFTokenizerSpec(**{**fields, **changes})


def test_the_files_bos_and_eos_flags_are_honoured():
    tokenizer = build_tokenizer(_spec(add_bos=True, add_eos=True))
    ids = tokenizer(" a").input_ids
    assert tokenizer.convert_ids_to_tokens(ids) == ["<s>", "Ġa", "</s>"]
    assert tokenizer(" a", add_special_tokens=False).input_ids == ids[1:-1]


def test_the_pre_tokenizer_follows_the_files_name():
    # gpt-2 keeps a run of digits together (so "12" merges); smollm splits each digit; llama-bpe groups three.
    assert build_tokenizer(_spec()).tokenize("123") == ["12", "3"]
    assert build_tokenizer(_spec(pre="smollm")).tokenize("123") == ["1", "2", "3"]
    assert build_tokenizer(_spec(pre="llama-bpe")).tokenize("1234") == ["12", "3", "4"]


def test_unknown_files_are_left_to_transformers():
    assert not can_build(_spec(pre="some-new-pre"))
    assert not can_build(_spec(model="llama"))
    with pytest.raises(ValueError, match="fastft.loading.gguf_tokenizer: expected a byte-level BPE"):
        build_tokenizer(_spec(model="llama"))
    with pytest.raises(ValueError, match="two tokens joined by one space"):
        build_tokenizer(_spec(merges=["Ġa"]))


def test_a_non_byte_level_conversion_by_transformers_is_refused(monkeypatch, tmp_path):
    """A byte-level file whose pre-tokenizer fastft does not know goes to transformers; a Metaspace result (what
    5.5.4 made of SmolLM2's) is an error, not a tokenizer that silently gives wrong ids."""
    from tokenizers import decoders
    from transformers import AutoTokenizer

    metaspace = build_tokenizer(_spec())
    metaspace.backend_tokenizer.decoder = decoders.Metaspace()
    monkeypatch.setattr(embedded.gguf_tokenizer, "read_gguf_tokenizer", lambda path: _spec(pre="some-new-pre"))
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda *args, **kwargs: metaspace)
    with pytest.raises(ValueError, match="fastft.loading.embedded: model.gguf holds a byte-level BPE tokenizer"):
        embedded._gguf_tokenizer(str(tmp_path), "model.gguf", tmp_path / "model.gguf")


def test_the_conversion_cache_key_names_the_format(tmp_path, monkeypatch):
    """A folder converted under an older format (on 5.5.4, with its wrong tokenizer) is not reused."""
    monkeypatch.setenv("FASTFT_CACHE", str(tmp_path))
    (tmp_path / "m.gguf").write_bytes(b"")
    current = conversion_folder(str(tmp_path), "m.gguf")
    embedded_format = embedded.CONVERSION_FORMAT
    monkeypatch.setattr(embedded, "CONVERSION_FORMAT", 1)
    assert conversion_folder(str(tmp_path), "m.gguf") != current
    assert current.parent == tmp_path / "gguf" and current.name.startswith("m-")
    # A folder transformers 5 wrote does not load on 4 (and the other way round): each major release has its own.
    monkeypatch.setattr(embedded, "CONVERSION_FORMAT", embedded_format)
    monkeypatch.setattr(embedded, "transformers", SimpleNamespace(__version__="9.0.0"))
    assert conversion_folder(str(tmp_path), "m.gguf") != current
