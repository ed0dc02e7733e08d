"""The Modelfile's prompt, tokenized by llama.cpp from the exported GGUF, is the token sequence transformers builds.

Ollama renders the Modelfile TEMPLATE and hands the text to llama.cpp, which parses special tokens in it and adds
BOS when the GGUF's ``tokenizer.ggml.add_bos_token`` says so. This checks that whole path against
``apply_chat_template(..., tokenize=True)``: the text (``tests/test_ollama.py``) and the BOS rule (left out of the
template when llama.cpp adds it) together give the same ids. It needs llama-cpp-python, which is built from source
in its own environment, the ``llamacpp`` lane (``python .ci/lanes.py --lane llamacpp``); elsewhere the module is
skipped by name.
"""

from __future__ import annotations

import copy

import pytest
from conftest import save_tiny_llama
from test_ollama import CHATS, TEMPLATES, _one, parse_modelfile
from tokenizers import processors

from fastft import FastModel
from fastft.export.gguf_export import _adds
from fastft.export.ollama_template import ollama_prompt

pytestmark = pytest.mark.llamacpp
llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is installed only in the llama.cpp lane")


def _llama_cpp_ids(gguf_path, text: str) -> list[int]:
    vocab = llama_cpp.Llama(model_path=str(gguf_path), vocab_only=True, verbose=False)
    # Ollama's runner tokenizes with add_special (BOS only where the GGUF asks for it) and parse_special.
    return vocab.tokenize(text.encode(), add_bos=True, special=True)


@pytest.mark.parametrize("case", ["smollm2", "llama3.1-template-with-bos"])
def test_llama_cpp_tokenizes_the_ollama_prompt_as_transformers_does(case, smol_tokenizer, tmp_path, tmp_path_factory):
    tokenizer = copy.deepcopy(smol_tokenizer)
    if case != "smollm2":
        # A tokenizer that adds BOS by itself (as Llama 3's does) and a template that prints it: the GGUF says
        # add_bos_token, so the Go template must leave BOS out and llama.cpp must put it back.
        tokenizer.bos_token = "<|endoftext|>"
        bos_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
        tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
            single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", bos_id)]
        )
        tokenizer.chat_template = (TEMPLATES / "llama-3.1.jinja").read_text()
        assert _adds(tokenizer, tokenizer.bos_token_id, 0)
    base = save_tiny_llama(tmp_path_factory, tokenizer, name=f"tiny-{case}")
    model, loaded = FastModel.from_pretrained(str(base), max_seq_length=64)
    assert loaded.chat_template == tokenizer.chat_template
    gguf_path, modelfile = FastModel.save_ollama(model, loaded, tmp_path, quantization="f16")
    commands = parse_modelfile(modelfile.read_text())
    template, system = _one(commands, "template"), _one(commands, "system")
    for name, messages in CHATS.items():
        expected = loaded.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        expected = expected["input_ids"] if hasattr(expected, "keys") else expected  # a BatchEncoding in 5.x
        assert _llama_cpp_ids(gguf_path, ollama_prompt(template, messages, system)) == list(expected), name
