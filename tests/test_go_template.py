"""fastft's Go ``text/template`` evaluator against Go's semantics.

Two kinds of evidence: Ollama's own chat templates rendered on the conversations of Ollama's template test and
compared byte for byte with the outputs Ollama's test expects (files under ``tests/data/ollama``, copied from
github.com/ollama/ollama ``template/*.gotmpl`` and ``template/testdata/`` at commit fb30760, MIT licence), and one
case per rule of the language the evaluator claims (trim markers, scope, short-circuit, comparison errors ...), with
the result Go's ``text/template`` documents.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fastft.export.go_template import GoTemplateError, parse, render
from fastft.export.ollama_template import ollama_prompt

OLLAMA = Path(__file__).parent / "data" / "ollama"
_HELLO = {"role": "user", "content": "Hello, how are you?"}
_GREAT = {"role": "assistant", "content": "I'm doing great. How can I help you today?"}
_SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
_SHOW = {"role": "user", "content": "I'd like to show off how chat templating works!"}
# The conversations of Ollama's TestTemplate, named as its testdata files are.
CONVERSATIONS = {
    "user": [_HELLO],
    "user-assistant-user": [_HELLO, _GREAT, _SHOW],
    "system-user-assistant-user": [
        {"role": "system", "content": "You are a helpful assistant."},
        _HELLO,
        _GREAT,
        _SHOW,
    ],
}
TEMPLATES = sorted(path.stem for path in OLLAMA.glob("*.gotmpl"))


def test_the_ollama_test_data_is_there():
    assert len(TEMPLATES) == 9, TEMPLATES


@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
@pytest.mark.parametrize("name", TEMPLATES)
def test_ollama_templates_render_what_ollama_expects(name, conversation):
    source = (OLLAMA / f"{name}.gotmpl").read_text()
    actual = ollama_prompt(source, CONVERSATIONS[conversation])
    if name in ("llama2-chat", "mistral-instruct") and actual.endswith(" "):
        actual = actual[:-1]  # Ollama's test removes this trailing space for these two templates too
    assert actual == (OLLAMA / "expected" / name / conversation).read_text()


@pytest.mark.parametrize(
    ("source", "data", "expected"),
    [
        # Trim markers take all whitespace, newlines included, and need a space beside the dash.
        ("a  \n{{- 1 -}}\n\t b", {}, "a1b"),
        ("{{-3}}", {}, "-3"),
        ("x {{ 2 }} y", {}, "x 2 y"),
        ("x {{- /* a comment */ -}} y", {}, "xy"),
        ("x{{/* a comment */}}y", {}, "xy"),
        # Fields, $, literals, parentheses with a field chain.
        ("{{ .A.B }}", {"A": {"B": "deep"}}, "deep"),
        ("{{ range .L }}{{ $.X }}{{ . }}{{ end }}", {"L": ["a", "b"], "X": "-"}, "-a-b"),
        ('{{ "tab\\there" }}|{{ `raw\\n` }}', {}, "tab\there|raw\\n"),
        ("{{ (index .M 1).Role }}", {"M": [{"Role": "a"}, {"Role": "b"}]}, "b"),
        ("{{ true }} {{ false }} {{ 12 }}", {}, "true false 12"),
        ("{{ .Missing }}", {}, "<no value>"),
        # Variables: block scope, assignment reaches the outer one.
        ("{{ $x := 1 }}{{ if true }}{{ $x = 2 }}{{ end }}{{ $x }}", {}, "2"),
        ("{{ $x := 1 }}{{ if true }}{{ $x := 5 }}{{ $x }}{{ end }}{{ $x }}", {}, "51"),
        ("{{ range $i, $v := .L }}{{ $i }}={{ $v }};{{ end }}", {"L": ["a", "b"]}, "0=a;1=b;"),
        ("{{ range $v := .L }}{{ $v }}{{ end }}", {"L": ["a", "b"]}, "ab"),
        # Control: else, else if, range else, with, break, continue.
        ("{{ if .A }}a{{ else if .B }}b{{ else }}c{{ end }}", {"B": 1}, "b"),
        ("{{ if .A }}a{{ else if .B }}b{{ else }}c{{ end }}", {}, "c"),
        ("{{ range .L }}x{{ else }}empty{{ end }}", {"L": []}, "empty"),
        ("{{ with .A }}{{ . }}{{ else }}none{{ end }}", {"A": "v"}, "v"),
        ("{{ with .A }}{{ . }}{{ else }}none{{ end }}", {"A": ""}, "none"),
        (
            "{{ range .L }}{{ if eq . 2 }}{{ continue }}{{ end }}{{ if eq . 4 }}{{ break }}{{ end }}{{ . }}{{ end }}",
            {"L": [1, 2, 3, 4, 5]},
            "13",
        ),
        # and / or return the deciding operand and do not evaluate the rest.
        ('{{ and 1 0 }}|{{ and 1 2 }}|{{ or 0 "" }}|{{ or 0 "x" }}', {}, "0|2||x"),
        ("{{ or .A (index .L 9) }}", {"A": "short", "L": []}, "short"),
        ("{{ and .A (index .L 9) }}", {"A": "", "L": []}, ""),
        # Functions.
        ("{{ eq 1 2 1 }} {{ ne 1 2 }} {{ not 0 }} {{ lt 1 2 }} {{ ge 2 2 }}", {}, "true true true true true"),
        ('{{ len "héllo" }} {{ len .L }}', {"L": [1, 2, 3]}, "6 3"),
        ('{{ slice "abcdef" 1 3 }} {{ len (slice .L 1) }}', {"L": [1, 2, 3]}, "bc 2"),
        ('{{ index .M "k" }}', {"M": {"k": "v"}}, "v"),
        ('{{ printf "%s-%d-%v%%" "a" 3 true }}', {}, "a-3-true%"),
        ('{{ print "a" 1 }}', {}, "a1"),
        ('{{ "abc" | len }} {{ .S | printf "<%s>" }}', {"S": "x"}, "3 <x>"),
        ("{{ json .V }}", {"V": {"b": "<&>", "a": [1, "é"]}}, '{"a":[1,"é"],"b":"\\u003c\\u0026\\u003e"}'),
    ],
)
def test_go_semantics(source, data, expected):
    assert render(source, data) == expected


@pytest.mark.parametrize(
    ("source", "data", "message"),
    [
        ("{{ if true }}{{ $x := 1 }}{{ end }}{{ $x }}", {}, "undefined variable \\$x"),
        ('{{ eq "a" 1 }}', {}, "incompatible types for comparison"),
        ("{{ .A.B }}", {"A": "text"}, "can't evaluate field B"),
        ("{{ nosuch 1 }}", {}, '"nosuch" is not a defined function'),
        ("{{ index .L 3 }}", {"L": [1]}, "out of range"),
        ("{{ slice .L 2 1 }}", {"L": [1, 2]}, "out of range"),
    ],
)
def test_execution_errors(source, data, message):
    with pytest.raises(GoTemplateError, match=message):
        render(source, data)


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("{{ if .A }}x", "missing \\{\\{end\\}\\}"),
        ("x{{ end }}", "unexpected \\{\\{end\\}\\}"),
        ("{{ .A ", "unclosed action"),
        ("{{ break }}", "outside"),
        ("{{ else }}", "unexpected \\{\\{else\\}\\}"),
        ("{{ (len .A }}", "unclosed '\\('"),
        ('{{ template "x" }}', "not supported"),
        ("{{/* open", "unclosed comment"),
    ],
)
def test_parse_errors(source, message):
    with pytest.raises(GoTemplateError, match=message):
        parse(source)
