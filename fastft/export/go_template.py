"""A small evaluator of Go's ``text/template``: the subset Ollama's chat templates use.

fastft renders the Modelfile ``TEMPLATE`` it writes with this evaluator and compares the text with the model's own
Jinja chat template before writing the Modelfile, so a template that would not render what the model was trained on
is refused at export instead of being found in Ollama. No Go toolchain is needed.

Covered, with Go's semantics: text and ``{{ }}`` actions with the trim markers ``{{-`` / ``-}}``, comments, pipelines
with ``|``, ``.`` / ``$`` / ``.Field.Chain`` / ``$var.Field``, string (interpreted and raw), number, boolean and
``nil`` literals, parenthesised pipelines, ``$x := ...`` declarations and ``$x = ...`` assignments with block scope,
``if`` / ``else if`` / ``else``, ``range`` (with ``$i, $v :=``, ``else``, ``break``, ``continue``), ``with``, and the
functions ``and`` / ``or`` (short-circuit, returning an operand), ``not``, ``eq`` (several operands), ``ne``, ``lt``,
``le``, ``gt``, ``ge``, ``len``, ``index``, ``slice``, ``print``, ``printf`` (``%s``, ``%d``, ``%v``, ``%q``) and
Ollama's ``json``. Data is Python ``dict`` / ``list`` / ``str`` / ``int`` / ``bool`` / ``None``; a missing map key
reads as ``None`` (Ollama parses with ``missingkey=zero``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

_WHITESPACE = " \t\r\n"
_TOKEN = re.compile(
    r"""\s*(?:
    (?P<string>"(?:[^"\\\n]|\\.)*")
    |(?P<raw>`[^`]*`)
    |(?P<declare>:=)
    |(?P<assign>=)
    |(?P<pipe>\|)
    |(?P<open>\()
    |(?P<close>\)(?:\.[A-Za-z_]\w*)*)
    |(?P<comma>,)
    |(?P<variable>\$\w*(?:\.[A-Za-z_]\w*)*)
    |(?P<field>(?:\.[A-Za-z_]\w*)+|\.)
    |(?P<number>-?\d+(?:\.\d+)?)
    |(?P<word>[A-Za-z_]\w*)
    )""",
    re.VERBOSE,
)
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", '"': '"', "\\": "\\", "'": "'", "0": "\0"}


class GoTemplateError(ValueError):
    """A template that does not parse, or an execution error Go's ``text/template`` would also raise."""


@dataclass
class _Pipe:
    names: list[str]
    assign: bool
    commands: list[list[tuple[str, Any]]]


@dataclass
class _Block:
    kind: str  # "if", "range", "with"
    pipe: _Pipe
    body: list[Any] = field(default_factory=list)
    other: list[Any] = field(default_factory=list)


class _Loop(Exception):
    def __init__(self, kind: str) -> None:
        self.kind = kind


def _unquote(token: str) -> str:
    if token.startswith("`"):
        return token[1:-1]
    return re.sub(r"\\(.)", lambda match: _ESCAPES.get(match.group(1), match.group(0)), token[1:-1])


def _lex_action(source: str, start: int) -> tuple[list[tuple[str, str]], int, bool]:
    """Tokens of the action starting after ``{{`` at ``start``, the index after its ``}}``, and its right trim."""
    tokens: list[tuple[str, str]] = []
    position = start
    while True:
        rest = source[position:]
        stripped = rest.lstrip()
        if stripped.startswith("-}}") and rest[: len(rest) - len(stripped)]:
            return tokens, position + (len(rest) - len(stripped)) + 3, True
        if stripped.startswith("}}"):
            return tokens, position + (len(rest) - len(stripped)) + 2, False
        if not stripped:
            raise GoTemplateError(f"go template: unclosed action starting at offset {start - 2}.")
        match = _TOKEN.match(source, position)
        if match is None or match.end() == position:
            raise GoTemplateError(f"go template: unexpected {stripped[:20]!r} at offset {position}.")
        tokens.append((match.lastgroup or "", match.group(match.lastgroup or 0)))
        position = match.end()


def _split(source: str) -> list[tuple[str, Any]]:
    """Text pieces and action token lists, with the trim markers applied to the text."""
    pieces: list[tuple[str, Any]] = []
    position, trim_next = 0, False
    while True:
        found = source.find("{{", position)
        text = source[position:] if found < 0 else source[position:found]
        if trim_next:
            text = text.lstrip(_WHITESPACE)
        if found < 0:
            pieces.append(("text", text))
            return pieces
        inner = found + 2
        if source[inner : inner + 1] == "-" and source[inner + 1 : inner + 2] in tuple(_WHITESPACE):
            text, inner = text.rstrip(_WHITESPACE), inner + 2
        pieces.append(("text", text))
        if source.startswith("/*", inner):
            close = source.find("*/", inner)
            end = re.compile(r"\s+-}}|}}").match(source, close + 2) if close >= 0 else None
            if end is None:
                raise GoTemplateError(f"go template: unclosed comment at offset {found}.")
            trim_next, position = end.group().endswith("-}}"), end.end()
            continue
        tokens, position, trim_next = _lex_action(source, inner)
        pieces.append(("action", tokens))


def _parse_pipe(tokens: list[tuple[str, str]]) -> _Pipe:
    names, assign = [], False
    declare_at = next((i for i, (kind, _) in enumerate(tokens) if kind in ("declare", "assign")), None)
    if declare_at is not None and all(kind in ("variable", "comma") for kind, _ in tokens[:declare_at]):
        names = [value for kind, value in tokens[:declare_at] if kind == "variable"]
        assign = tokens[declare_at][0] == "assign"
        tokens = tokens[declare_at + 1 :]
    commands, position = _parse_commands(tokens, 0, closing=False)
    if position != len(tokens):
        raise GoTemplateError(f"go template: unexpected {tokens[position][1]!r} in a pipeline.")
    return _Pipe(names, assign, commands)


def _parse_commands(tokens: list[tuple[str, str]], position: int, closing: bool) -> tuple[list, int]:
    commands: list[list[tuple[str, Any]]] = [[]]
    while position < len(tokens):
        kind, value = tokens[position]
        if kind == "close":
            if not closing:
                raise GoTemplateError("go template: unmatched ')'.")
            break
        if kind == "pipe":
            commands.append([])
        elif kind == "open":
            inner, position = _parse_commands(tokens, position + 1, closing=True)
            if position >= len(tokens):
                raise GoTemplateError("go template: unclosed '('.")
            chain = tokens[position][1][1:].split(".")[1:]
            commands[-1].append(("pipeline", (inner, chain)))
        elif kind in ("string", "raw"):
            commands[-1].append(("literal", _unquote(value)))
        elif kind == "number":
            commands[-1].append(("literal", float(value) if "." in value else int(value)))
        elif kind == "word" and value in ("true", "false", "nil"):
            commands[-1].append(("literal", {"true": True, "false": False, "nil": None}[value]))
        elif kind in ("word", "field", "variable"):
            commands[-1].append((kind, value))
        else:
            raise GoTemplateError(f"go template: unexpected {value!r} in a pipeline.")
        position += 1
    if any(not command for command in commands):
        raise GoTemplateError("go template: missing command in a pipeline.")
    return commands, position


def parse(source: str) -> list[Any]:
    """Parse ``source`` into a node list; raises :class:`GoTemplateError` on a syntax error."""
    root: list[Any] = []
    stack: list[tuple[_Block | None, list[Any]]] = [(None, root)]
    for kind, value in _split(source):
        target = stack[-1][1]
        if kind == "text":
            if value:
                target.append(value)
            continue
        if not value:
            raise GoTemplateError("go template: empty action.")
        head, rest = value[0], value[1:]
        keyword = head[1] if head[0] == "word" else None
        if keyword in ("if", "range", "with"):
            block = _Block(keyword, _parse_pipe(rest))
            target.append(block)
            stack.append((block, block.body))
        elif keyword == "else":
            block = stack[-1][0]
            if block is None or stack[-1][1] is block.other:
                raise GoTemplateError("go template: unexpected {{else}}.")
            if rest and rest[0] == ("word", "if"):
                # {{else if x}} is {{else}}{{if x}} ... with one shared {{end}}.
                nested = _Block("elif", _parse_pipe(rest[1:]))
                block.other.append(nested)
                stack[-1] = (block, block.other)
                stack.append((nested, nested.body))
            else:
                stack[-1] = (block, block.other)
        elif keyword == "end":
            while True:
                if len(stack) == 1:
                    raise GoTemplateError("go template: unexpected {{end}}.")
                block, _ = stack.pop()
                if block is not None and block.kind != "elif":
                    break
        elif keyword in ("break", "continue") and not rest:
            if not any(block is not None and block.kind == "range" for block, _ in stack):
                raise GoTemplateError(f"go template: {{{{{keyword}}}}} outside {{{{range}}}}.")
            target.append(("loop", keyword))
        elif keyword in ("define", "template", "block"):
            raise GoTemplateError(f"go template: {{{{{keyword}}}}} is not supported by this evaluator.")
        else:
            target.append(_parse_pipe(value))
    if len(stack) != 1:
        raise GoTemplateError("go template: unexpected end of template (missing {{end}}).")
    return root


def truth(value: Any) -> bool:
    """Go's truthiness: false, 0, nil and empty strings, slices and maps are false."""
    return value is not None and value is not False and value != 0 and value != "" and value != [] and value != {}


def _text(value: Any) -> str:
    if value is None:
        return "<no value>"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + " ".join(_text(item) for item in value) + "]"
    if isinstance(value, dict):
        return "map[" + " ".join(f"{key}:{_text(item)}" for key, item in sorted(value.items())) + "]"
    return str(value)


def _field(value: Any, name: str) -> Any:
    if isinstance(value, dict):
        return value.get(name)
    raise GoTemplateError(f"go template: can't evaluate field {name} in type {type(value).__name__}.")


def _compare(left: Any, right: Any) -> bool:
    numbers = (int, float)
    if isinstance(left, numbers) and isinstance(right, numbers) and not isinstance(left, bool):
        return left == right
    if type(left) is not type(right) and left is not None and right is not None:
        raise GoTemplateError(f"go template: incompatible types for comparison: {left!r} and {right!r}.")
    return left == right


def _order(name: str) -> Callable[[Any, Any], bool]:
    def compare(left: Any, right: Any) -> bool:
        if type(left) is not type(right) or isinstance(left, (bool, list, dict)) or left is None:
            raise GoTemplateError(f"go template: {name}: incomparable {left!r} and {right!r}.")
        return {"lt": left < right, "le": left <= right, "gt": left > right, "ge": left >= right}[name]

    return compare


def _length(value: Any) -> int:
    if isinstance(value, (str, list, dict)):
        return len(value.encode() if isinstance(value, str) else value)
    raise GoTemplateError(f"go template: len of {type(value).__name__}.")


def _index(value: Any, *keys: Any) -> Any:
    for key in keys:
        if isinstance(value, dict):
            value = value.get(key)
        elif isinstance(value, (list, str)) and isinstance(key, int) and 0 <= key < len(value):
            value = value[key]
        else:
            raise GoTemplateError(f"go template: index {key!r} out of range or not indexable.")
    return value


def _slice(value: Any, *bounds: int) -> Any:
    if not isinstance(value, (list, str)) or len(bounds) > 2:
        raise GoTemplateError(f"go template: slice of {type(value).__name__} with {len(bounds)} indexes.")
    low = bounds[0] if bounds else 0
    high = bounds[1] if len(bounds) > 1 else len(value)
    if not 0 <= low <= high <= len(value):
        raise GoTemplateError(f"go template: slice bounds [{low}:{high}] out of range for length {len(value)}.")
    return value[low:high]


def _printf(form: str, *args: Any) -> str:
    values = iter(args)

    def verb(match: re.Match[str]) -> str:
        if match.group(1) == "%":
            return "%"
        value = next(values, None)
        if match.group(1) == "q":
            return json.dumps(value)
        return _text(value)

    return re.sub(r"%([svdq%])", verb, form)


def _json(value: Any) -> str:
    # Go's json.Marshal: sorted map keys, UTF-8 kept, and <, >, & escaped for HTML.
    text = json.dumps(value, separators=(",", ":"), ensure_ascii=False, sort_keys=True)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "not": lambda value: not truth(value),
    "eq": lambda left, *rights: any(_compare(left, right) for right in rights),
    "ne": lambda left, right: not _compare(left, right),
    "lt": _order("lt"),
    "le": _order("le"),
    "gt": _order("gt"),
    "ge": _order("ge"),
    "len": _length,
    "index": _index,
    "slice": _slice,
    "print": lambda *args: "".join(_text(arg) for arg in args),
    "printf": _printf,
    "json": lambda value: _json(value),
}


class _Run:
    def __init__(self, data: Any) -> None:
        self.variables: list[tuple[str, Any]] = [("$", data)]
        self.out: list[str] = []

    def lookup(self, name: str) -> Any:
        for known, value in reversed(self.variables):
            if known == name:
                return value
        raise GoTemplateError(f"go template: undefined variable {name}.")

    def set(self, name: str, value: Any) -> None:
        for index in range(len(self.variables) - 1, -1, -1):
            if self.variables[index][0] == name:
                self.variables[index] = (name, value)
                return
        raise GoTemplateError(f"go template: undefined variable {name}.")

    def operand(self, kind: str, value: Any, dot: Any, final: Any = ...) -> Any:
        if kind == "literal":
            return value
        if kind == "field":
            result = dot
            for name in value.split(".")[1:] if value != "." else []:
                result = _field(result, name)
            return result
        if kind == "variable":
            name, *chain = value.split(".")
            result = self.lookup(name)
            for part in chain:
                result = _field(result, part)
            return result
        if kind == "pipeline":
            commands, chain = value
            result = self.pipeline(_Pipe([], False, commands), dot)
            for part in chain:
                result = _field(result, part)
            return result
        if kind == "word":
            return self.call(value, [], dot, final)
        raise GoTemplateError(f"go template: unexpected operand {value!r}.")

    def call(self, name: str, args: list[tuple[str, Any]], dot: Any, final: Any) -> Any:
        if name in ("and", "or"):
            # Short-circuit, and the result is the deciding operand, not a bool (Go 1.18+).
            if not args and final is ...:
                raise GoTemplateError(f"go template: {name} needs at least one argument.")
            result = None
            for kind, value in args:
                result = self.operand(kind, value, dot)
                if truth(result) == (name == "or"):
                    return result
            return result if final is ... else final
        function = _FUNCTIONS.get(name)
        if function is None:
            raise GoTemplateError(f'go template: "{name}" is not a defined function.')
        values = [self.operand(kind, value, dot) for kind, value in args]
        if final is not ...:
            values.append(final)
        try:
            return function(*values)
        except TypeError as error:
            raise GoTemplateError(f"go template: wrong number of arguments for {name}: {error}") from error

    def pipeline(self, pipe: _Pipe, dot: Any) -> Any:
        result: Any = ...
        for command in pipe.commands:
            kind, value = command[0]
            if kind == "word":
                result = self.call(value, command[1:], dot, result)
            elif len(command) > 1:
                raise GoTemplateError(f"go template: can't give argument to non-function {value!r}.")
            else:
                if result is not ...:
                    raise GoTemplateError(f"go template: can't pipe into non-function {value!r}.")
                result = self.operand(kind, value, dot)
        if pipe.names:
            if pipe.assign:
                self.set(pipe.names[-1], result)
            else:
                self.variables.append((pipe.names[-1], result))
        return result

    def run(self, nodes: list[Any], dot: Any) -> None:
        for node in nodes:
            if isinstance(node, str):
                self.out.append(node)
            elif isinstance(node, tuple):
                raise _Loop(node[1])
            elif isinstance(node, _Pipe):
                value = self.pipeline(node, dot)
                if not node.names:
                    self.out.append(_text(value))
            else:
                self.block(node, dot)

    def scoped(self, nodes: list[Any], dot: Any) -> None:
        mark = len(self.variables)
        try:
            self.run(nodes, dot)
        finally:
            del self.variables[mark:]

    def block(self, block: _Block, dot: Any) -> None:
        mark = len(self.variables)
        try:
            if block.kind == "range":
                self.range(block, dot, mark)
                return
            value = self.pipeline(_Pipe([], False, block.pipe.commands), dot)
            if block.pipe.names:
                self.variables.append((block.pipe.names[-1], value))
            if truth(value):
                self.scoped(block.body, value if block.kind == "with" else dot)
            else:
                self.scoped(block.other, dot)
        finally:
            del self.variables[mark:]

    def range(self, block: _Block, dot: Any, mark: int) -> None:
        value = self.pipeline(_Pipe([], False, block.pipe.commands), dot)
        if isinstance(value, dict):
            items = [(key, value[key]) for key in sorted(value)]
        elif isinstance(value, (list, tuple)):
            items = list(enumerate(value))
        elif isinstance(value, int) and not isinstance(value, bool):
            items = [(index, index) for index in range(value)]
        elif value is None:
            items = []
        else:
            raise GoTemplateError(f"go template: range can't iterate over {value!r}.")
        if not items:
            self.scoped(block.other, dot)
            return
        names = block.pipe.names
        for key, item in items:
            del self.variables[mark:]
            if len(names) == 2:
                self.variables += [(names[0], key), (names[1], item)]
            elif names:
                self.variables.append((names[0], item))
            try:
                self.scoped(block.body, item)
            except _Loop as loop:
                if loop.kind == "break":
                    break


def render(source: str | list[Any], data: Any) -> str:
    """Execute a template (source text or :func:`parse` output) on ``data`` and return the text."""
    nodes = parse(source) if isinstance(source, str) else source
    run = _Run(data)
    run.run(nodes, data)
    return "".join(run.out)
