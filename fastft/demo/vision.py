"""The built-in vision demo set: shapes in colours drawn with PIL, a question and its answer per image.

``fastft train --data demo`` trains a vision-language model on it. The set is drawn, not shipped: the first use writes
the PNG images and ``shapes.jsonl`` into fastft's cache (``$FASTFT_CACHE/demo/shapes-v1``), and every later use reads
them back. Drawing is deterministic (one seeded generator, PIL's integer rasteriser, PNG without timestamps), so the
files are the same on every machine; ``VERSION`` changes whenever the drawing or the rows do.

Each row is a chat in the format :class:`fastft.training.vision_data.VisionDataCollator` reads: a user turn with an
image part (a path relative to the JSONL file) and a question, and an assistant turn with the answer::

    {"messages": [{"role": "user", "content": [{"type": "image", "image": "images/000.png", "text": null},
                                               {"type": "text", "image": null, "text": "What shape is this?"}]},
                  {"role": "assistant", "content": [{"type": "text", "image": null, "text": "A red circle."}]}]}

(every part carries both keys, as a JSON reader unifies them anyway).
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

VERSION = 1
SEED = 20261126
SIZE = 112  # pixels a side: 4 x 4 merged patches of Qwen2.5-VL (28 px each), a few tokens per image
SHAPES = ("circle", "square", "triangle", "diamond")
COLOURS = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (235, 200, 30),
    "purple": (140, 60, 180),
    "orange": (245, 140, 30),
}
# (question, answer template): the answers name the shape, the colour, or both.
QUESTIONS = (
    ("What shape is this?", "A {colour} {shape}."),
    ("What colour is the shape?", "It is {colour}."),
    ("Describe the image.", "A {colour} {shape} on a white background."),
)
FILE_NAME = "shapes.jsonl"


def draw(shape: str, colour: str, rng: random.Random) -> Any:
    """One ``SIZE`` x ``SIZE`` RGB image: ``shape`` filled with ``colour`` on white, its size and place drawn from
    ``rng``.

    Args:
        shape: One of :data:`SHAPES`.
        colour: One of :data:`COLOURS`.
        rng: The generator (advanced by three draws).

    Returns:
        A PIL image.

    Raises:
        ValueError: An unknown shape or colour.
    """
    from PIL import Image, ImageDraw

    if shape not in SHAPES or colour not in COLOURS:
        raise ValueError(
            f"fastft.demo.vision.draw: unknown shape {shape!r} or colour {colour!r}; shapes {SHAPES}, "
            f"colours {tuple(COLOURS)}"
        )
    image = Image.new("RGB", (SIZE, SIZE), (255, 255, 255))
    radius = rng.randint(SIZE // 5, SIZE // 3)
    x = rng.randint(radius + 2, SIZE - radius - 2)
    y = rng.randint(radius + 2, SIZE - radius - 2)
    fill = COLOURS[colour]
    canvas = ImageDraw.Draw(image)
    if shape == "circle":
        canvas.ellipse((x - radius, y - radius, x + radius, y + radius), fill=fill)
    elif shape == "square":
        canvas.rectangle((x - radius, y - radius, x + radius, y + radius), fill=fill)
    elif shape == "diamond":
        canvas.polygon([(x, y - radius), (x + radius, y), (x, y + radius), (x - radius, y)], fill=fill)
    else:
        corners = [
            (x + radius * math.cos(a), y + radius * math.sin(a)) for a in (-math.pi / 2, math.pi / 6, 5 * math.pi / 6)
        ]
        canvas.polygon([(round(cx), round(cy)) for cx, cy in corners], fill=fill)
    return image


def build_items(seed: int = SEED) -> list[tuple[str, str, str, str]]:
    """The demo's ``(shape, colour, question, answer)`` rows, in a fixed shuffled order: every shape in every colour,
    each with every question."""
    items = [
        (shape, colour, question, answer.format(shape=shape, colour=colour))
        for shape in SHAPES
        for colour in COLOURS
        for question, answer in QUESTIONS
    ]
    random.Random(seed).shuffle(items)
    return items


def _row(image_path: str, question: str, answer: str) -> dict:
    def part(kind: str, value: str) -> dict:
        return {"type": kind, "image": value if kind == "image" else None, "text": value if kind == "text" else None}

    return {
        "messages": [
            {"role": "user", "content": [part("image", image_path), part("text", question)]},
            {"role": "assistant", "content": [part("text", answer)]},
        ]
    }


def write_demo(folder: Path, seed: int = SEED) -> Path:
    """Draw the demo into ``folder``: ``images/NNN.png`` and ``shapes.jsonl`` (image paths relative to it).

    Args:
        folder: Where to write (created if missing).
        seed: The generator's seed; the default is the set ``fastft train`` uses.

    Returns:
        The JSONL file.
    """
    folder = Path(folder)
    (folder / "images").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    rows = []
    for index, (shape, colour, question, answer) in enumerate(build_items(seed)):
        name = f"images/{index:03d}.png"
        draw(shape, colour, rng).save(folder / name, format="PNG", optimize=False)
        rows.append(_row(name, question, answer))
    path = folder / FILE_NAME
    # newline="" keeps "\n" on Windows too, so the file is byte-identical everywhere.
    with path.open("w", encoding="utf-8", newline="") as file:
        file.writelines(json.dumps(row) + "\n" for row in rows)
    return path


def vision_demo_path() -> Path:
    """The demo's JSONL file in fastft's cache, drawn there on first use.

    Drawn into a temporary folder beside its final place and renamed into it, so a process that finds the folder
    finds it whole (two processes drawing at once, e.g. DDP ranks, keep the first one's).

    Returns:
        The path of ``shapes.jsonl``; its image paths are relative to its folder.
    """
    from fastft.loading.embedded import cache_dir

    target = cache_dir() / "demo" / f"shapes-v{VERSION}"
    if (target / FILE_NAME).is_file():
        return target / FILE_NAME
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        write_demo(scratch)
        os.replace(scratch, target)
    except OSError:
        if not (target / FILE_NAME).is_file():
            raise
    finally:
        if scratch.exists():
            shutil.rmtree(scratch)
    return target / FILE_NAME


__all__ = ["COLOURS", "QUESTIONS", "SHAPES", "build_items", "draw", "vision_demo_path", "write_demo"]
