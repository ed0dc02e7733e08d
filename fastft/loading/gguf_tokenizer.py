"""Byte-level BPE tokenizers built straight from a GGUF file's metadata, the same on every transformers release.

transformers' own GGUF tokenizer conversion changes from release to release: 5.5.4 turns SmolLM2's byte-level BPE
vocabulary (``tokenizer.ggml.model = "gpt2"``) into a ``CodeLlamaTokenizer`` with a Metaspace decoder and a BOS
token, so the model it loads answers gibberish; 5.24 builds a byte-level tokenizer but splits text with the plain
GPT-2 rule, where llama.cpp (and SmolLM's own ``tokenizer.json``) first splits every digit apart. Building the
tokenizer here, with ``tokenizers`` and the file's own tokens, merges, token types, special ids, flags and chat
template, gives one result on every supported release, and one that tokenizes as llama.cpp does for the same file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# llama.cpp's names for the ways a byte-level vocabulary splits text before BPE (``tokenizer.ggml.pre``), grouped by
# the split each one means (llama.cpp's llama-vocab.cpp). A name not listed here is left to transformers.
_GPT2_PRES = frozenset({"gpt-2", "gpt2", "mpt", "olmo", "jais", "trillion"})
_DIGITS_PRES = frozenset({"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"})
# Split patterns as tokenizer.json spells them; fastft.export.gguf_export maps the same two back to these names.
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLIT_PRES = {
    **dict.fromkeys(("llama-bpe", "llama3", "llama-v3", "falcon3", "dbrx", "smaug-bpe"), LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), QWEN2_SPLIT),
}
# Llama 3's tokenizer.json takes a whole word from the vocabulary before trying merges (ignore_merges), and llama.cpp
# does the same for these pre-tokenizers.
_IGNORE_MERGES_PRES = frozenset({"llama-bpe", "llama3", "llama-v3", "falcon3", "dbrx", "smaug-bpe"})
SUPPORTED_PRES = _GPT2_PRES | _DIGITS_PRES | frozenset(_SPLIT_PRES)

# gguf's TokenType values (gguf.constants.TokenType), spelled out so this module reads the file without importing
# more of gguf than its reader.
_CONTROL = 3
_USER_DEFINED = 4


@dataclass
class GGUFTokenizerSpec:
    """What a GGUF file says about its tokenizer (the ``tokenizer.*`` metadata keys).

    Attributes:
        model: ``tokenizer.ggml.model``: ``"gpt2"`` for byte-level BPE, ``"llama"`` for SentencePiece, ...
        pre: ``tokenizer.ggml.pre``, llama.cpp's name for the pre-tokenizer (``"smollm"``, ``"llama-bpe"``, ...).
        tokens: The vocabulary, by id.
        token_types: gguf's TokenType of each token (1 normal, 3 control, 4 user-defined, ...).
        merges: The BPE merges as ``"left right"`` strings, highest priority first.
        special_ids: ``bos``, ``eos``, ``unk`` and ``pad`` token ids, for the ones the file names.
        add_bos: Whether an encoded text starts with the BOS token.
        add_eos: Whether an encoded text ends with the EOS token.
        chat_template: The default chat template, or a dict of named ones (``"default"`` among them), or None.
    """

    model: str | None
    pre: str | None
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    special_ids: dict[str, int] = field(default_factory=dict)
    add_bos: bool = False
    add_eos: bool = False
    chat_template: str | dict[str, str] | None = None


def read_gguf_tokenizer(path: str | Path) -> GGUFTokenizerSpec:
    """Read the tokenizer metadata of a GGUF file (no tensors are read).

    Args:
        path: The GGUF file.

    Returns:
        The file's tokenizer description.
    """
    from gguf import GGUFReader

    reader = GGUFReader(str(path))

    def value(key: str) -> Any:
        entry = reader.fields.get(key)
        return None if entry is None else entry.contents()

    special_ids = {}
    keys = (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("unk", "unknown_token_id"), ("pad", "padding_token_id"))
    for name, key in keys:
        found = value(f"tokenizer.ggml.{key}")
        if found is not None:
            special_ids[name] = int(found)
    template: str | dict[str, str] | None = value("tokenizer.chat_template")
    # Named templates (tool use, RAG) live in their own keys, listed in tokenizer.chat_templates.
    names = value("tokenizer.chat_templates") or []
    named = {name: value(f"tokenizer.chat_template.{name}") for name in names}
    named = {name: text for name, text in named.items() if text}
    if named:
        template = {**({"default": template} if template else {}), **named}
    tokens = value("tokenizer.ggml.tokens") or []
    return GGUFTokenizerSpec(
        model=value("tokenizer.ggml.model"),
        pre=value("tokenizer.ggml.pre"),
        tokens=list(tokens),
        token_types=list(value("tokenizer.ggml.token_type") or [1] * len(tokens)),
        merges=list(value("tokenizer.ggml.merges") or []),
        special_ids=special_ids,
        add_bos=bool(value("tokenizer.ggml.add_bos_token")),
        add_eos=bool(value("tokenizer.ggml.add_eos_token")),
        chat_template=template,
    )


def can_build(spec: GGUFTokenizerSpec) -> bool:
    """Whether ``build_tokenizer`` knows this file's tokenizer: byte-level BPE with a pre-tokenizer listed here."""
    return spec.model == "gpt2" and (spec.pre or "gpt-2") in SUPPORTED_PRES and bool(spec.merges)


def _pre_tokenizer(pre: str) -> Any:
    from tokenizers import Regex, pre_tokenizers

    if pre in _GPT2_PRES:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGITS_PRES:
        # llama.cpp splits off every number character (\p{N}) before the GPT-2 split; Digits splits on the same
        # Unicode classes, and is what SmolLM's tokenizer.json uses (fastft.save_gguf names it "smollm" again).
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT_PRES[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _token(spec: GGUFTokenizerSpec, name: str) -> str | None:
    index = spec.special_ids.get(name)
    if index is None or not 0 <= index < len(spec.tokens):
        return None
    return spec.tokens[index]


def build_tokenizer(spec: GGUFTokenizerSpec) -> Any:
    """Build the fast tokenizer a byte-level BPE GGUF file describes.

    Args:
        spec: The file's tokenizer description (``read_gguf_tokenizer``); ``can_build(spec)`` must be true.

    Returns:
        A ``PreTrainedTokenizerFast`` (``TokenizersBackend`` on transformers 5) with the file's vocabulary, merges,
        special tokens, BOS/EOS behaviour and chat template.

    Raises:
        ValueError: The file is not byte-level BPE, names an unknown pre-tokenizer, or has a malformed merge.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors
    from transformers import PreTrainedTokenizerFast

    pre = spec.pre or "gpt-2"
    if not can_build(spec):
        raise ValueError(
            f"fastft.loading.gguf_tokenizer: expected a byte-level BPE GGUF tokenizer (tokenizer.ggml.model 'gpt2' "
            f"with merges, pre-tokenizer one of {sorted(SUPPORTED_PRES)}), got model {spec.model!r}, pre-tokenizer "
            f"{spec.pre!r} and {len(spec.merges)} merges; load this file's tokenizer with transformers instead."
        )
    if len(spec.token_types) != len(spec.tokens):
        raise ValueError(
            f"fastft.loading.gguf_tokenizer: expected one token type per token, got {len(spec.token_types)} types for "
            f"{len(spec.tokens)} tokens; the file's tokenizer.ggml.token_type is damaged, so convert the model again."
        )
    vocab = {token: index for index, token in enumerate(spec.tokens)}
    merges = []
    for merge in spec.merges:
        # Byte-level tokens spell a space as "Ġ", so the one space in a merge separates its two halves.
        halves = tuple(merge.split(" "))
        if len(halves) != 2:
            raise ValueError(
                f"fastft.loading.gguf_tokenizer: expected every GGUF merge to be two tokens joined by one space, got "
                f"{merge!r}; the file's tokenizer.ggml.merges is damaged, so convert the model again."
            )
        merges.append(halves)
    # The BPE model gets no unk token: every byte has a token in a byte-level vocabulary, so none is ever needed.
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=pre in _IGNORE_MERGES_PRES))
    backend.pre_tokenizer = _pre_tokenizer(pre)
    backend.decoder = decoders.ByteLevel()
    added = [
        AddedToken(token, special=kind == _CONTROL, normalized=False)
        for token, kind in zip(spec.tokens, spec.token_types, strict=True)
        if kind in (_CONTROL, _USER_DEFINED)
    ]
    # Control and user-defined tokens are matched whole in the text, as llama.cpp does; they keep their ids.
    backend.add_special_tokens([token for token in added if token.special])
    backend.add_tokens([token for token in added if not token.special])

    bos, eos = _token(spec, "bos"), _token(spec, "eos")
    add_bos, add_eos = spec.add_bos and bos is not None, spec.add_eos and eos is not None
    single = " ".join([f"{bos}:0"] * add_bos + ["$A:0"] + [f"{eos}:0"] * add_eos)
    pair = " ".join([single] + [f"{bos}:1"] * add_bos + ["$B:1"] + [f"{eos}:1"] * add_eos)
    specials = [(bos, spec.special_ids["bos"])] * add_bos + [(eos, spec.special_ids["eos"])] * add_eos
    backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)

    kwargs: dict[str, Any] = {f"{name}_token": _token(spec, name) for name in ("bos", "eos", "unk", "pad")}
    kwargs = {key: text for key, text in kwargs.items() if text is not None}
    if spec.chat_template:
        kwargs["chat_template"] = spec.chat_template
    # add_bos_token / add_eos_token restate the post-processor for transformers 5, which rebuilds it from them;
    # clean_up_tokenization_spaces off keeps decode(encode(text)) == text (" ." would become "."). A causal LM takes
    # no token_type_ids, which transformers 4's PreTrainedTokenizerFast returns by default and generate() refuses.
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        add_bos_token=add_bos,
        add_eos_token=add_eos,
        clean_up_tokenization_spaces=False,
        model_input_names=["input_ids", "attention_mask"],
        **kwargs,
    )


def has_byte_level(section: dict[str, Any] | None) -> bool:
    """Whether a ``tokenizer.json`` pre-tokenizer or decoder section is, or holds in its Sequence, a ByteLevel step."""
    if section is None:
        return False
    if section.get("type") == "ByteLevel":
        return True
    steps = (section.get("pretokenizers") or []) + (section.get("decoders") or [])
    return any(has_byte_level(step) for step in steps)


def is_byte_level(tokenizer: Any) -> bool:
    """Whether a fast tokenizer decodes bytes (a ByteLevel decoder), as a ``"gpt2"`` GGUF vocabulary needs."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    return has_byte_level(json.loads(backend.to_str()).get("decoder"))
