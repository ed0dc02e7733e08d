"""Tests for the shipped demo datasets (instructions and preferences): fresh, well-formed, answers correct."""

from __future__ import annotations

import json
import re

import pytest

from fastft.demo import demo_path, preferences_path
from fastft.demo.build import MONTHS, UNHELPFUL, UNITS, WEEKDAYS, build_preference_rows, build_rows, to_jsonl


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


# The preference split (fastft train --method dpo | kto | grpo).


@pytest.fixture(scope="module")
def preferences() -> list[dict]:
    with preferences_path().open(encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def _expected_answer(question: str) -> str:
    """The answer to a preference prompt, worked out here from the question alone."""
    n = _numbers(question)
    if re.fullmatch(r"What is \d+ \+ \d+\?|Add \d+ and \d+\.|Compute the sum of \d+ and \d+\.", question):
        return str(n[0] + n[1])
    if re.fullmatch(r"What is \d+ - \d+\?|Compute \d+ minus \d+\.", question):
        return str(n[0] - n[1])
    if re.fullmatch(r"Subtract \d+ from \d+\.", question):
        return str(n[1] - n[0])
    if re.fullmatch(r"What is \d+ × \d+\?|Multiply \d+ by \d+\.|What is \d+ times \d+\?", question):
        return str(n[0] * n[1])
    if m := re.fullmatch(r"How many letters are in the word '(\w+)'\?|Count the letters in '(\w+)'\.", question):
        return str(len(m.group(1) or m.group(2)))
    if m := re.fullmatch(r"(?:What|Which) (day|month) (comes after|follows|comes before|precedes) (\w+)\?", question):
        names = WEEKDAYS if m.group(1) == "day" else MONTHS
        step = 1 if m.group(2) in ("comes after", "follows") else -1
        return names[(names.index(m.group(3)) + step) % len(names)]
    factors = {(source, target): factor for source, target, factor in UNITS}
    if m := re.fullmatch(r"Convert (\d+) (\w+) to (\w+)\.|Express (\d+) (\w+) in (\w+)\.", question):
        amount, source, target = (m.group(1), m.group(2), m.group(3)) if m.group(1) else m.group(4, 5, 6)
        return str(int(amount) * factors[(source, target)])
    if m := re.fullmatch(r"How many (\w+) are in (\d+) (\w+)\?", question):
        return str(int(m.group(2)) * factors[(m.group(3), m.group(1))])
    if m := re.fullmatch(
        r"Reverse the word '(\w+)'\.|Spell '(\w+)' backwards\.|Write the word '(\w+)' in reverse\.", question
    ):
        return next(word for word in m.groups() if word)[::-1]
    if m := re.fullmatch(r"What is the plural of '(\w+)'\?|Give the plural form of '(\w+)'\.", question):
        return (m.group(1) or m.group(2)) + "s"
    raise AssertionError(f"no family matches {question!r}")


def test_shipped_preferences_match_builder() -> None:
    path = preferences_path()
    assert path.name == "preferences.jsonl"
    assert path.read_bytes() == to_jsonl(build_preference_rows()).encode("utf-8")
    assert build_preference_rows() == build_preference_rows()


def test_preferences_shape(preferences: list[dict]) -> None:
    assert 100 <= len(preferences) <= 200
    for row in preferences:
        assert set(row) == {"prompt", "chosen", "rejected", "answer"}
        for key, role in (("prompt", "user"), ("chosen", "assistant"), ("rejected", "assistant")):
            assert len(row[key]) == 1 and set(row[key][0]) == {"role", "content"}, row
            assert row[key][0]["role"] == role and row[key][0]["content"].strip(), row
        assert isinstance(row["answer"], str) and row["answer"], row
        assert row["chosen"] != row["rejected"], row
    prompts = [row["prompt"][0]["content"] for row in preferences]
    assert len(prompts) == len(set(prompts))


def test_preferences_chosen_is_right_and_rejected_is_wrong_or_unhelpful(preferences: list[dict]) -> None:
    unhelpful = 0
    for row in preferences:
        question, chosen, rejected = (row[key][0]["content"] for key in ("prompt", "chosen", "rejected"))
        assert row["answer"] == _expected_answer(question), row
        # The chosen reply ends by stating the answer: "46 - 40 = 6.", "18 liters is 18000 milliliters."
        head, answer, tail = chosen.rpartition(row["answer"])
        assert answer and re.fullmatch(r"'?( [a-z]+)?\.", tail), row
        if rejected in UNHELPFUL:
            unhelpful += 1
            continue
        # A wrong answer in the same sentence.
        assert rejected.startswith(head) and rejected.endswith(tail), row
        assert rejected[len(head) : len(rejected) - len(tail)] != row["answer"], row
    assert 0.1 < unhelpful / len(preferences) < 0.4


def test_preferences_score_as_grpo_rewards(preferences: list[dict]) -> None:
    from fastft.training.trl import answer_reward

    answers = [row["answer"] for row in preferences]
    for key, want in (("chosen", 1.0), ("rejected", 0.0), ("prompt", 0.0)):
        # Conversational completions, as GRPO passes them, and plain text.
        assert answer_reward([row[key] for row in preferences], answers) == [want] * len(preferences), key
        assert answer_reward([row[key][0]["content"] for row in preferences], answers) == [want] * len(preferences)
