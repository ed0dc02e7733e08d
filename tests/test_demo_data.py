"""Tests for the shipped demo dataset: it is fresh, well-formed and its answers are correct."""

from __future__ import annotations

import json
import re

import pytest

from fastft.demo import demo_path
from fastft.demo.build import MONTHS, UNITS, WEEKDAYS, build_rows, to_jsonl


@pytest.fixture(scope="module")
def rows() -> list[dict[str, str]]:
    with demo_path().open(encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def _numbers(text: str) -> list[int]:
    return [int(x) for x in re.findall(r"\d+", text)]


def _matching(rows: list[dict[str, str]], pattern: str) -> list[tuple[dict[str, str], re.Match[str]]]:
    found = [(row, m) for row in rows if (m := re.fullmatch(pattern, row["response"]))]
    # An empty family would make the checks below pass vacuously.
    assert found, f"no response matches {pattern!r}"
    return found


def test_shipped_file_matches_builder() -> None:
    path = demo_path()
    assert path.name == "instructions.jsonl"
    assert path.read_bytes() == to_jsonl(build_rows()).encode("utf-8")


def test_builder_is_deterministic() -> None:
    assert build_rows() == build_rows()


def test_shape(rows: list[dict[str, str]]) -> None:
    assert 300 <= len(rows) <= 500
    for row in rows:
        assert set(row) == {"instruction", "response"}
        assert isinstance(row["instruction"], str) and row["instruction"].strip()
        assert isinstance(row["response"], str) and row["response"].strip()
        # Rows must fit comfortably in a 256-token training window.
        assert len(row["instruction"]) + len(row["response"]) < 300
        assert row["response"].endswith(".")


def test_no_duplicate_instructions(rows: list[dict[str, str]]) -> None:
    instructions = [row["instruction"] for row in rows]
    assert len(instructions) == len(set(instructions))


def test_arithmetic(rows: list[dict[str, str]]) -> None:
    ops = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "×": lambda a, b: a * b}
    found = _matching(rows, r"(\d+) ([+\-×]) (\d+) = (-?\d+)\.")
    assert {m.group(2) for _, m in found} == set(ops)
    for row, m in found:
        a, op, b, result = int(m.group(1)), m.group(2), int(m.group(3)), int(m.group(4))
        assert ops[op](a, b) == result, row
        assert sorted(_numbers(row["instruction"])) == sorted([a, b]), row
        # Subtraction rows are generated with a >= b, so a negative result means swapped operands.
        assert result >= 0, row


def test_parity(rows: list[dict[str, str]]) -> None:
    for row, m in _matching(rows, r"(\d+) is (even|odd)\."):
        n = int(m.group(1))
        assert m.group(2) == ("even" if n % 2 == 0 else "odd"), row
        assert _numbers(row["instruction"]) == [n], row


def test_compare(rows: list[dict[str, str]]) -> None:
    for row, m in _matching(rows, r"(\d+) is (larger|smaller) than (\d+)\."):
        a, b = int(m.group(1)), int(m.group(3))
        assert (a > b) if m.group(2) == "larger" else (a < b), row
        assert sorted(_numbers(row["instruction"])) == sorted([a, b]), row
        wanted = "larger" if re.search(r"larger|bigger", row["instruction"]) else "smaller"
        assert m.group(2) == wanted, row


def test_sort(rows: list[dict[str, str]]) -> None:
    for row, m in _matching(rows, r"In (ascending|descending) order the numbers are ([\d, ]+)\."):
        got = [int(x) for x in m.group(2).split(", ")]
        descending = m.group(1) == "descending"
        assert got == sorted(_numbers(row["instruction"]), reverse=descending), row


def test_word_families(rows: list[dict[str, str]]) -> None:
    for row, m in _matching(rows, r"The word '(\w+)' reversed is '(\w+)'\."):
        assert m.group(2) == m.group(1)[::-1], row
    for row, m in _matching(rows, r"In uppercase, '([a-z ]+)' is '([A-Z ]+)'\."):
        assert m.group(2) == m.group(1).upper(), row
    for row, m in _matching(rows, r"The word '(\w+)' has (\d+) letters\."):
        assert len(m.group(1)) == int(m.group(2)), row
    for row, m in _matching(rows, r"The letter '(\w)' appears (\d+) times? in '(\w+)'\."):
        assert m.group(3).count(m.group(1)) == int(m.group(2)), row
    for row, m in _matching(rows, r"The (first|last) letter of '(\w+)' is '(\w)'\."):
        word = m.group(2)
        assert m.group(3) == (word[0] if m.group(1) == "first" else word[-1]), row
    for row, m in _matching(rows, r"The plural of '(\w+)' is '(\w+)'\."):
        assert m.group(2) == m.group(1) + "s", row
    # Every quoted word in an instruction must be the one the response talks about.
    for row in rows:
        quoted = re.findall(r"'([^']+)'", row["instruction"])
        for text in quoted:
            assert f"'{text}'" in row["response"], row


def test_calendar(rows: list[dict[str, str]]) -> None:
    for names, kind in ((WEEKDAYS, "day"), (MONTHS, "month")):
        for row, m in _matching(rows, rf"The {kind} (after|before) (\w+) is (\w+)\."):
            i = names.index(m.group(2))
            step = 1 if m.group(1) == "after" else -1
            assert m.group(3) == names[(i + step) % len(names)], row
            assert m.group(2) in row["instruction"], row
            wanted = "after" if re.search(r"after|follows", row["instruction"]) else "before"
            assert m.group(1) == wanted, row
    # Spot-check the wrap-arounds independently of the tables above.
    pairs = {(row["instruction"], row["response"]) for row in rows}
    for instruction, response in pairs:
        if instruction == "What day comes after Sunday?":
            assert response == "The day after Sunday is Monday."
        if instruction == "What month comes after December?":
            assert response == "The month after December is January."


def test_units(rows: list[dict[str, str]]) -> None:
    factors = {(source, target): factor for source, target, factor in UNITS}
    for row, m in _matching(rows, r"(\d+) (\w+) is (\d+) (\w+)\."):
        amount, source, result, target = int(m.group(1)), m.group(2), int(m.group(3)), m.group(4)
        assert result == amount * factors[(source, target)], row
        assert _numbers(row["instruction"]) == [amount], row
        assert source in row["instruction"] and target in row["instruction"], row


def test_every_row_is_checked(rows: list[dict[str, str]]) -> None:
    patterns = [
        r"\d+ [+\-×] \d+ = -?\d+\.",
        r"\d+ is (even|odd)\.",
        r"\d+ is (larger|smaller) than \d+\.",
        r"In (ascending|descending) order the numbers are [\d, ]+\.",
        r"The word '\w+' reversed is '\w+'\.",
        r"In uppercase, '[a-z ]+' is '[A-Z ]+'\.",
        r"The word '\w+' has \d+ letters\.",
        r"The letter '\w' appears \d+ times? in '\w+'\.",
        r"The (first|last) letter of '\w+' is '\w'\.",
        r"The plural of '\w+' is '\w+'\.",
        r"The (day|month) (after|before) \w+ is \w+\.",
        r"\d+ \w+ is \d+ \w+\.",
    ]
    unchecked = [row for row in rows if not any(re.fullmatch(p, row["response"]) for p in patterns)]
    assert unchecked == []
