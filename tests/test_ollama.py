"""``FastModel.save_ollama`` / ``fastft export --ollama``: the Modelfile's TEMPLATE renders what the model's own chat
template renders.

The chat templates are the real ones: SmolLM2-135M-Instruct's from the offline GGUF, and Llama 3.1, Qwen2.5, Gemma 3
and Mistral-7B-Instruct-v0.2 from ``tests/data/chat_templates`` (data files; where each was copied from is in
``tests/data/chat_templates/SOURCES.md``), carried by tiny tokenizers built here with each family's special tokens
and BOS behaviour. The Modelfile is read back as Ollama's parser reads it, its TEMPLATE rendered by fastft's Go
template evaluator the way Ollama's server does (``SYSTEM`` first when the request has no system message, turns of
one role joined), and compared with ``apply_chat_template(..., add_generation_prompt=True, tokenize=False)``.

BOS: when the tokenizer adds BOS by itself, the GGUF says ``add_bos_token`` and llama.cpp puts it in front of the
rendered prompt, so the Jinja text is compared without its leading BOS (and the test asserts it had one); otherwise
the two texts are compared whole.
"""

from __future__ import annotations

import copy
import re
import stat
from pathlib import Path

import gguf
import pytest
from conftest import save_tiny_llama
from jinja2 import TemplateError
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from fastft import FastModel
from fastft.cli import main
from fastft.export.gguf_export import _adds
from fastft.export.ollama import DEFAULT_PARAMETERS, default_parameters, modelfile_text, save_ollama
from fastft.export.ollama_template import OllamaTemplateError, ollama_prompt, translate_chat_template

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
_SYSTEM = {"role": "system", "content": "You answer in one short sentence."}
_TURNS = [
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "It is 4."},
    {"role": "user", "content": "And times three?\nShow the steps."},
    {"role": "assistant", "content": "4 × 3 = 12."},
    {"role": "user", "content": "Thanks — ünïcödé 🙂"},
]
CHATS = {
    "system and two exchanges": [_SYSTEM, *_TURNS],
    "no system, two exchanges": _TURNS,
    "system and one user turn": [_SYSTEM, _TURNS[0]],
    "one user turn": [_TURNS[0]],
}
# family -> (template file, bos, eos, other special tokens, whether the tokenizer adds BOS), as the real ones are.
FAMILIES = {
    "llama-3.1": (
        "llama-3.1.jinja",
        "<|begin_of_text|>",
        "<|eot_id|>",
        ["<|start_header_id|>", "<|end_header_id|>"],
        True,
    ),
    "llama-3.2": (
        "llama-3.2.jinja",
        "<|begin_of_text|>",
        "<|eot_id|>",
        ["<|start_header_id|>", "<|end_header_id|>"],
        True,
    ),
    "llama-3": ("llama-3.jinja", "<|begin_of_text|>", "<|eot_id|>", ["<|start_header_id|>", "<|end_header_id|>"], True),
    "qwen2.5": ("qwen2.5.jinja", None, "<|im_end|>", ["<|im_start|>", "<|endoftext|>"], False),
    "gemma-3": ("gemma-3.jinja", "<bos>", "<eos>", ["<start_of_turn>", "<end_of_turn>"], True),
    "mistral-v0.2": ("mistral-7b-instruct-v0.2.jinja", "<s>", "</s>", ["[INST]", "[/INST]"], True),
}
EXPECTED_FAMILY = {
    "llama-3": "llama3",
    "llama-3.2": "llama3",
    "llama-3.1": "llama3",
    "qwen2.5": "chatml",
    "gemma-3": "gemma",
    "mistral-v0.2": "mistral",
}


def family_tokenizer(name: str) -> PreTrainedTokenizerFast:
    """A word-level tokenizer with the family's special tokens, BOS behaviour and real chat template."""
    file, bos, eos, others, adds_bos = FAMILIES[name]
    specials = [token for token in (bos, eos, *others) if token]
    vocab = {token: index for index, token in enumerate([*specials, "[UNK]", "hello", "world"])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    if adds_bos:
        core.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, vocab[bos])])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token=bos, eos_token=eos, unk_token="[UNK]", additional_special_tokens=others
    )
    tokenizer.chat_template = (TEMPLATES / file).read_text()
    return tokenizer


def parse_modelfile(text: str) -> list[tuple[str, str]]:
    """``(command, value)`` pairs as Ollama's parser (parser/parser.go) reads them: ``#`` comments, values to the end
    of the line, ``\"\"\"`` blocks across lines up to a closing ``\"\"\"`` followed by whitespace, ``"`` strings;
    ``PARAMETER name value`` becomes ``(name, value)``."""
    commands, position = [], 0
    head, parameter = re.compile(r"([A-Za-z]+)[ \t]+"), re.compile(r"(\w+)[ \t]+")
    block, quoted = re.compile(r'"""(.*?)"""(?=\s|$)', re.DOTALL), re.compile(r'"([^"\n]*)"(?=\s|$)')
    while True:
        position += len(text[position:]) - len(text[position:].lstrip())
        if position >= len(text):
            return commands
        if text[position] == "#":
            position = text.find("\n", position) % (len(text) + 1)
            continue
        match = head.match(text, position)
        assert match, f"Modelfile: cannot parse {text[position : position + 40]!r}"
        key, position = match.group(1).lower(), match.end()
        if key == "parameter":
            match = parameter.match(text, position)
            assert match, f"Modelfile: no parameter name at {text[position : position + 40]!r}"
            key, position = match.group(1), match.end()
        found = block.match(text, position) or quoted.match(text, position)
        if found:
            value, position = found.group(1), found.end()
        else:
            end = text.find("\n", position) % (len(text) + 1)
            value, position = text[position:end].strip(), end
        commands.append((key, value))


def _one(commands: list[tuple[str, str]], name: str) -> str | None:
    values = [value for command, value in commands if command == name]
    assert len(values) <= 1, (name, values)
    return values[0] if values else None


def assert_renders_like_the_chat_template(tokenizer, modelfile: str) -> None:
    commands = parse_modelfile(modelfile)
    template, system = _one(commands, "template"), _one(commands, "system")
    assert template, modelfile
    adds_bos = _adds(tokenizer, tokenizer.bos_token_id, 0)
    for name, messages in CHATS.items():
        expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        if adds_bos and "bos_token" in tokenizer.chat_template:
            assert expected.startswith(tokenizer.bos_token), name
            expected = expected[len(tokenizer.bos_token) :]
        assert ollama_prompt(template, messages, system) == expected, name


# transformers renders the chat templates: checked in every version lane.
@pytest.mark.lane
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_family_templates_render_like_their_chat_template(name):
    tokenizer = family_tokenizer(name)
    chat = translate_chat_template(tokenizer, adds_bos=_adds(tokenizer, tokenizer.bos_token_id, 0))
    assert chat.family == EXPECTED_FAMILY[name]
    text = modelfile_text("model.gguf", chat, dict(DEFAULT_PARAMETERS))
    if name == "mistral-v0.2":
        # The chat template refuses system messages (raise_exception), so only conversations without one compare.
        for chat_name in [chat_name for chat_name in CHATS if "system" in chat_name.split(" ")[0]]:
            with pytest.raises(TemplateError, match="roles"):
                tokenizer.apply_chat_template(CHATS[chat_name], add_generation_prompt=True, tokenize=False)
        commands = parse_modelfile(text)
        for messages in (_TURNS, _TURNS[:1]):
            expected = tokenizer.apply_chat_template(messages, tokenize=False).removeprefix("<s>")
            assert ollama_prompt(_one(commands, "template"), messages) == expected
        return
    assert_renders_like_the_chat_template(tokenizer, text)
    commands = parse_modelfile(text)
    stops = [value for command, value in commands if command == "stop"]
    assert tokenizer.eos_token in stops
    assert (_one(commands, "system") is not None) == (name == "qwen2.5")  # Qwen2.5's default system prompt


@pytest.mark.lane
def test_bos_is_text_in_the_template_when_llama_cpp_would_not_add_it():
    tokenizer = family_tokenizer("llama-3.1")
    added = translate_chat_template(tokenizer, adds_bos=True)
    printed = translate_chat_template(tokenizer, adds_bos=False)
    assert "<|begin_of_text|>" not in added.template
    assert printed.template.startswith("<|begin_of_text|>")
    for messages in CHATS.values():
        expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert ollama_prompt(printed.template, messages) == expected


@pytest.mark.lane
def test_smollm2_default_system_prompt_goes_into_system(smol_tokenizer):
    chat = translate_chat_template(smol_tokenizer, adds_bos=_adds(smol_tokenizer, smol_tokenizer.bos_token_id, 0))
    assert chat.family == "chatml"
    assert chat.system == "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    assert_renders_like_the_chat_template(smol_tokenizer, modelfile_text("m.gguf", chat, {}))


@pytest.mark.lane
@pytest.mark.parametrize(
    ("template", "message"),
    [
        # Phi-3 style turns: a family fastft does not translate.
        (
            "{% for m in messages %}{{ '<|' + m['role'] + '|>\n' + m['content'] + '<|end|>\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}",
            "match none of the families",
        ),
        # ChatML markers, but a blank line between turns: not the ChatML layout, so the probe check refuses it.
        (
            "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n\n' }}"
            "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}",
            "looks like chatml .* differs .* at character",
        ),
        # A system prompt that depends on the conversation: no fixed SYSTEM can express it.
        (
            "{% if messages|length > 1 %}{{ '<|im_start|>system\nlong<|im_end|>\n' }}{% endif %}"
            "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
            "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}",
            "differs",
        ),
        # A template that raises on a plain conversation (tool-use templates that iterate `tools` unconditionally).
        ("{% for tool in tools %}{{ tool }}{% endfor %}<|im_start|>", "fails on a plain user / assistant"),
    ],
    ids=["unknown-family", "chatml-variant", "conditional-system", "fails-without-tools"],
)
def test_untranslatable_templates_are_refused_with_the_reason(smol_tokenizer, template, message):
    tokenizer = _copy(smol_tokenizer)  # the session fixture stays as it is
    tokenizer.chat_template = template
    with pytest.raises(OllamaTemplateError, match=message) as raised:
        translate_chat_template(tokenizer, adds_bos=False)
    assert "template=" in str(raised.value)  # says what to do


def _copy(tokenizer):
    return copy.deepcopy(tokenizer)


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    model, tokenizer = FastModel.from_pretrained(str(tiny_llama_dir), max_seq_length=128)
    return model, tokenizer


def test_save_ollama_writes_gguf_and_modelfile(tiny, tmp_path):
    model, tokenizer = tiny
    gguf_path, modelfile = FastModel.save_ollama(model, tokenizer, tmp_path / "out", quantization="q8_0")
    assert sorted(path.name for path in (tmp_path / "out").iterdir()) == sorted([gguf_path.name, "Modelfile"])
    commands = parse_modelfile(modelfile.read_text())
    assert _one(commands, "from") == f"./{gguf_path.name}"
    assert _one(commands, "num_ctx") == str(min(model.config.max_position_embeddings, 4096))
    assert _one(commands, "temperature") == "0.7"
    assert_renders_like_the_chat_template(tokenizer, modelfile.read_text())
    # Readable as the GGUF is (mkstemp's 0600 undone), and no temporary file left beside them.
    assert stat.S_IMODE(modelfile.stat().st_mode) == stat.S_IMODE(gguf_path.stat().st_mode)
    reader = gguf.GGUFReader(gguf_path)
    assert reader.fields["tokenizer.chat_template"].contents() == tokenizer.chat_template
    assert bool(reader.fields["tokenizer.ggml.add_bos_token"].contents()) is _adds(tokenizer, tokenizer.bos_token_id, 0)


def test_an_untranslatable_template_still_writes_the_gguf_and_no_modelfile(tiny, tmp_path):
    model, tokenizer = tiny
    tokenizer = _copy(tokenizer)
    tokenizer.chat_template = (
        "{% for m in messages %}### {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}### assistant:"
    )
    with pytest.raises(OllamaTemplateError, match="match none of the families.*The GGUF is at .*no Modelfile"):
        save_ollama(model, tokenizer, tmp_path, quantization="f16")
    assert [path.suffix for path in tmp_path.iterdir()] == [".gguf"]  # no Modelfile, no partial file


def test_an_interrupted_modelfile_write_leaves_no_partial_file(tiny, tmp_path, monkeypatch):
    import fastft.export.ollama as ollama_module

    model, tokenizer = tiny

    def interrupted(path, recursive=False):
        raise KeyboardInterrupt

    monkeypatch.setattr(ollama_module, "as_if_created", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save_ollama(model, tokenizer, tmp_path, quantization="f16")
    assert [path.suffix for path in tmp_path.iterdir()] == [".gguf"]


def test_options_replace_the_translation_and_defaults(tiny, tmp_path):
    model, tokenizer = tiny
    template = "{{ range .Messages }}{{ .Role }}: {{ .Content }}\n{{ end }}assistant:"
    _, modelfile = save_ollama(
        model,
        tokenizer,
        tmp_path,
        "f16",
        template=template,
        system="Be brief.",
        stop=["\u0004"],
        parameters={"temperature": 0.2, "seed": 3},
    )
    commands = parse_modelfile(modelfile.read_text())
    assert _one(commands, "template") == template and _one(commands, "system") == "Be brief."
    assert (
        _one(commands, "temperature") == "0.2" and _one(commands, "seed") == "3" and _one(commands, "stop") == "\u0004"
    )
    with pytest.raises(OllamaTemplateError, match="not a valid Go template"):
        save_ollama(model, tokenizer, tmp_path / "bad", "f16", template="{{ if .System }}")
    with pytest.raises(OllamaTemplateError, match='contains """'):
        save_ollama(model, tokenizer, tmp_path / "bad2", "f16", system='say """hi"""')


def test_default_parameters_follow_a_sampling_generation_config(tiny):
    model, _ = tiny
    generation = model.generation_config
    saved = (generation.do_sample, generation.temperature, generation.top_p)
    try:
        generation.do_sample, generation.temperature, generation.top_p = True, 0.6, 0.95
        parameters = default_parameters(model)
    finally:
        generation.do_sample, generation.temperature, generation.top_p = saved
    assert parameters["temperature"] == 0.6 and parameters["top_p"] == 0.95


def test_fastft_export_ollama_on_smollm2(tmp_path, smol_tokenizer, capsys):
    model, tokenizer = FastModel.from_pretrained("smollm2-135m", max_seq_length=256)
    model = FastModel.get_peft_model(model, r=8, lora_alpha=16, use_gradient_checkpointing=False)
    adapter = tmp_path / "adapter"
    model.save_pretrained(adapter)
    assert (
        main(["export", "--adapter", str(adapter), "--ollama", str(tmp_path / "ollama"), "--quantization", "q8_0"]) == 0
    )
    assert "Modelfile" in capsys.readouterr().out
    files = sorted((tmp_path / "ollama").iterdir(), key=lambda path: path.suffix)
    assert [path.suffix for path in files] == ["", ".gguf"] and files[1].name.endswith("-Q8_0.gguf"), files
    modelfile = (tmp_path / "ollama" / "Modelfile").read_text()
    commands = parse_modelfile(modelfile)
    assert _one(commands, "from") == f"./{files[1].name}"
    assert _one(commands, "system") == "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    assert [value for command, value in commands if command == "stop"] == ["<|im_start|>", "<|im_end|>"]
    assert_renders_like_the_chat_template(smol_tokenizer, modelfile)


def test_fastft_export_ollama_refuses_an_untranslatable_template_after_writing_the_gguf(
    tmp_path, tmp_path_factory, smol_tokenizer, capsys
):
    tokenizer = _copy(smol_tokenizer)
    tokenizer.chat_template = "{% for m in messages %}### {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}### a:"
    base = save_tiny_llama(tmp_path_factory, tokenizer, name="tiny-unknown-template")
    model, _ = FastModel.from_pretrained(str(base), max_seq_length=64)
    FastModel.get_peft_model(model, r=4, lora_alpha=8, use_gradient_checkpointing=False).save_pretrained(
        tmp_path / "adapter"
    )
    out = tmp_path / "ollama"
    assert main(["export", "--adapter", str(tmp_path / "adapter"), "--ollama", str(out)]) == 2
    error = capsys.readouterr().err
    assert "match none of the families" in error and "no Modelfile was written" in error, error
    assert [path.suffix for path in out.iterdir()] == [".gguf"]
