"""The vision-language collator (fastft.training.vision_data) over the processor fastft loads for a tiny Qwen2.5-VL:
labels -100 exactly outside the assistant's replies (image tokens included), pixel values and image grid as the
processor makes them, images from paths, PIL images and arrays, and each refusal naming the example; the processor
built without torchvision; the shapes demo set."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from vlm_chat import chat_processor, save_chat_vlm

from fastft import ShapeContractError
from fastft.training.responses import response_texts
from fastft.training.vision_data import INDEX_COLUMN, VisionDataCollator, prepare_vision_rows

pytestmark = [
    pytest.mark.lane,
    pytest.mark.filterwarnings("ignore:.*must be `None` or an integer within the vocabulary"),
    pytest.mark.filterwarnings("ignore:fastft.from_pretrained.*processor could not be built"),
]
pytest.importorskip("transformers.models.qwen2_5_vl", reason="this transformers has no Qwen2.5-VL")


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    return save_chat_vlm(tmp_path_factory.mktemp("chat-vlm"))


@pytest.fixture(scope="module")
def processor(vlm_dir):
    return chat_processor(vlm_dir)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    from fastft.demo.vision import write_demo

    return write_demo(tmp_path_factory.mktemp("shapes"))


def _picture(seed: int, size=(40, 56)):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8))


def _chat(*turns, images=()):
    """A chat from (role, content) pairs; ``"<image>"`` in a user turn's text becomes an image part."""
    images = list(images)
    messages = []
    for role, content in turns:
        if role == "user" and "<image>" in content:
            parts = []
            for number, piece in enumerate(content.split("<image>")):
                if number:
                    parts.append({"type": "image", "image": images.pop(0)})
                if piece:
                    parts.append({"type": "text", "text": piece})
            content = parts
        messages.append({"role": role, "content": content})
    return {"messages": messages}


def _image_ids(processor):
    return [processor.tokenizer.convert_tokens_to_ids(token) for token in ("<|image_pad|>", "<|video_pad|>")]


def test_labels_are_ignored_exactly_outside_the_replies(processor):
    examples = [
        _chat(
            ("system", "Answer briefly."),
            ("user", "<image>What shape is this?"),
            ("assistant", "A red circle."),
            ("user", "And this one?<image>"),
            ("assistant", "The same in blue."),
            images=[_picture(1), _picture(2)],
        ),
        _chat(("user", "Hi there"), ("assistant", "Hello.")),
    ]
    batch = VisionDataCollator(processor, max_length=256)(examples)
    ids, labels, mask = batch["input_ids"], batch["labels"], batch["attention_mask"]
    tokenizer = processor.tokenizer
    assert response_texts(tokenizer, ids[0], labels[0]) == ["A red circle.<|im_end|>", "The same in blue.<|im_end|>"]
    assert response_texts(tokenizer, ids[1], labels[1]) == ["Hello.<|im_end|>"]
    trained = labels != -100
    assert torch.equal(labels[trained], ids[trained])
    image = torch.isin(ids, torch.tensor(_image_ids(processor)))
    assert image[0].sum() > 0 and not (trained & image).any()
    assert not (trained & (mask == 0)).any()
    # Every token outside the replies is -100: the system and user turns, the markers, the images, the padding.
    untrained = tokenizer.decode(ids[0][~trained[0] & (mask[0] == 1)])
    assert "Answer briefly." in untrained and "What shape is this?" in untrained and "And this one?" in untrained
    assert "circle" not in untrained and "blue" not in untrained
    # Right padding, the text row padded after its real tokens.
    assert mask[1].tolist() == sorted(mask[1].tolist(), reverse=True) and mask[1].sum() < mask[0].sum()


def test_pixel_values_grid_and_ids_match_the_processor_called_directly(processor):
    pictures = [_picture(3), _picture(4, (64, 32)), _picture(5)]
    examples = [
        _chat(("user", "<image>Which?<image>"), ("assistant", "Both."), images=pictures[:2]),
        _chat(("user", "<image>Colour?"), ("assistant", "Grey."), images=pictures[2:]),
    ]
    collator = VisionDataCollator(processor)
    batch = collator(examples)
    direct = processor.image_processor(images=pictures, return_tensors="pt")
    assert torch.equal(batch["pixel_values"], direct["pixel_values"])
    assert torch.equal(batch["image_grid_thw"], direct["image_grid_thw"])
    for row, example in enumerate(examples):
        text, images = collator.render(example)
        alone = processor(text=[text], images=images, return_tensors="pt")
        length = int(batch["attention_mask"][row].sum())
        assert torch.equal(batch["input_ids"][row, :length], alone["input_ids"][0])
        for key in ("mm_token_type_ids", "token_type_ids"):
            if key in alone:  # transformers 5.x marks the image tokens for M-RoPE
                assert torch.equal(batch[key][row, :length], alone[key][0])
    merge = processor.image_processor.merge_size
    placeholders = torch.isin(batch["input_ids"], torch.tensor(_image_ids(processor))).sum()
    assert placeholders == int(direct["image_grid_thw"].prod(-1).sum()) // merge**2


def test_paths_pil_images_and_arrays_give_the_same_batch(processor, tmp_path):
    picture = _picture(6)
    path = tmp_path / "picture.png"
    picture.save(path)
    array = np.array(picture)
    forms = {
        "path": str(path),
        "pathlib": path,
        "pil": picture,
        "pil_rgba": picture.convert("RGBA"),
        "numpy_hwc": array,
        "numpy_chw": array.transpose(2, 0, 1).copy(),
        "numpy_float": array.astype(np.float32) / 255,
        "torch_chw": torch.from_numpy(array).permute(2, 0, 1),
        "datasets_dict": {"bytes": path.read_bytes(), "path": None},
    }
    collator = VisionDataCollator(processor)
    batches = {
        name: collator([_chat(("user", "<image>What?"), ("assistant", "Noise."), images=[form])])
        for name, form in forms.items()
    }
    reference = batches.pop("pil")
    for name, batch in batches.items():
        assert batch.keys() == reference.keys(), name
        for key in reference:
            assert torch.equal(batch[key], reference[key]), (name, key)


def test_images_listed_apart_from_the_messages_as_trl_lays_them_out(processor):
    pictures = [_picture(7), _picture(8)]
    inline = _chat(("user", "<image>One<image>two"), ("assistant", "Yes."), images=pictures)
    listed = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image"},
                    {"type": "text", "text": "One"},
                    {"type": "image"},
                    {"type": "text", "text": "two"},
                ],
            },
            {"role": "assistant", "content": [{"type": "text", "text": "Yes."}]},
        ],
        "images": pictures,
    }
    collator = VisionDataCollator(processor)
    a, b = collator([inline]), collator([listed])
    assert all(torch.equal(a[key], b[key]) for key in a)
    with pytest.raises(ValueError, match=r"example 0 of the batch lists 3 images in 'images' but its messages have 2"):
        collator([dict(listed, images=[*pictures, _picture(9)])])


def test_text_after_the_images_is_cut_to_max_length(processor):
    example = _chat(("user", "<image>Say a lot."), ("assistant", "word " * 40), images=[_picture(10)])
    full = VisionDataCollator(processor)([example])
    length = int(full["attention_mask"].sum())
    image_end = int(torch.isin(full["input_ids"][0], torch.tensor(_image_ids(processor))).nonzero().max())
    limit = length - 10  # inside the reply
    assert image_end < limit
    cut = VisionDataCollator(processor, max_length=limit)([example])
    assert cut["input_ids"].shape == (1, limit)
    assert torch.equal(cut["input_ids"][0], full["input_ids"][0, :limit])
    assert torch.equal(cut["pixel_values"], full["pixel_values"])
    assert (cut["labels"][0] != -100).sum() > 0


def _indexed(rows):
    return [{**row, INDEX_COLUMN: index} for index, row in enumerate(rows)]


def test_an_example_whose_image_would_be_cut_is_refused_by_index(processor):
    rows = _indexed(
        [
            _chat(("user", "Hi"), ("assistant", "Hello.")),
            _chat(("user", "word " * 30 + "<image>What?"), ("assistant", "A cat."), images=[_picture(11)]),
        ]
    )
    with pytest.raises(ShapeContractError, match=r"example 1 is \d+ tokens and its image tokens run to position .*cut"):
        VisionDataCollator(processor, max_length=32)(rows)


def test_packing_an_image_batch_is_refused_by_index(processor):
    rows = _indexed(
        [
            _chat(("user", "Hi"), ("assistant", "Hello.")),
            _chat(("user", "<image>?"), ("assistant", "A."), images=[_picture(12)]),
        ]
    )
    with pytest.raises(ShapeContractError, match="example 1 holds 1 image.*packed"):
        VisionDataCollator(processor, packing=True)(rows)
    packed_row = {**rows[1], "seq_lengths": [5, 7]}
    with pytest.raises(ShapeContractError, match="example 1 holds 1 image.*packed"):
        VisionDataCollator(processor)([rows[0], packed_row])
    # Text-only rows are not what packing refuses.
    assert VisionDataCollator(processor, packing=True)(rows[:1])["input_ids"].shape[0] == 1


@pytest.mark.parametrize(
    ("image", "error", "message"),
    [
        (np.zeros((16, 16), dtype=np.uint8), ShapeContractError, r"shape \[16, 16\]; expected \[height, width, 3\]"),
        (np.zeros((16, 16, 4), dtype=np.uint8), ShapeContractError, r"shape \[16, 16, 4\]; expected"),
        (torch.zeros(2, 3, 16, 16), ShapeContractError, r"shape \[2, 3, 16, 16\]; expected"),
        (
            np.full((16, 16, 3), 2.0, dtype=np.float32),
            ValueError,
            r"values in \[2.0, 2.0\]; expected floats in \[0, 1\]",
        ),
        ("missing.png", ValueError, "the image file 'missing.png' does not exist"),
        (42, ValueError, "an image of type int; expected a file path, a PIL image, or an RGB array"),
    ],
)
def test_a_bad_image_is_refused_naming_the_example(processor, image, error, message):
    rows = _indexed([_chat(("user", "Hi"), ("assistant", "Hello."))] * 3)
    rows[2] = {**_chat(("user", "<image>?"), ("assistant", "A."), images=[image]), INDEX_COLUMN: 2}
    with pytest.raises(error, match=r"example 2, image 0: .*" + message):
        VisionDataCollator(processor)(rows)


def test_an_unreadable_image_file_is_refused_naming_the_example(processor, tmp_path):
    path = tmp_path / "broken.png"
    path.write_text("not a picture")
    example = _chat(("user", "<image>?"), ("assistant", "A."), images=[str(path)])
    with pytest.raises(ValueError, match=r"example 0 of the batch, image 0: .*broken.png' cannot be read as an image"):
        VisionDataCollator(processor)([example])


def test_a_reply_cut_away_and_a_tokenizer_are_refused(processor):
    example = {**_chat(("user", "word " * 30), ("assistant", "Late.")), INDEX_COLUMN: 7}
    with pytest.raises(ValueError, match="example 7 has no assistant token left to train on"):
        VisionDataCollator(processor, max_length=16)([example])
    with pytest.raises(TypeError, match="needs the model's processor"):
        VisionDataCollator(processor.tokenizer)


def test_prepared_rows_resolve_paths_and_carry_their_index(processor, demo):
    from datasets import load_dataset

    from fastft.training.data import DataError

    rows = load_dataset("json", data_files=str(demo), split="train")
    prepared = prepare_vision_rows(rows, demo.parent, "shapes.jsonl")
    assert prepared[5][INDEX_COLUMN] == 5
    batch = VisionDataCollator(processor)([prepared[i] for i in range(4)])
    assert batch["image_grid_thw"].shape[0] == 4 and (batch["labels"] != -100).any()
    broken = rows.select(range(3)).map(
        lambda row, i: (
            {
                "messages": [
                    {**m, "content": [{**p, "image": "gone.png" if p["image"] else None} for p in m["content"]]}
                    for m in row["messages"]
                ]
            }
            if i == 2
            else {}
        ),
        with_indices=True,
    )
    with pytest.raises(DataError, match=r"example 2, image 0: the file '.*gone.png' does not exist"):
        prepare_vision_rows(broken, demo.parent, "shapes.jsonl")


def test_the_processor_is_built_without_torchvision(vlm_dir, processor, tmp_path):
    from transformers import ProcessorMixin

    assert isinstance(processor, ProcessorMixin) and type(processor).__name__ == "Qwen2_5_VLProcessor"
    assert processor.tokenizer.model_max_length == 256 and processor.chat_template
    try:
        import torchvision  # noqa: F401
    except ImportError:
        assert getattr(processor, "video_processor", None) is None
    # Saved under the upstream class name, so AutoProcessor reloads it where torchvision is installed.
    processor.save_pretrained(tmp_path)
    saved = {}
    for name in ("processor_config.json", "preprocessor_config.json"):
        if (tmp_path / name).is_file():
            saved.update(json.loads((tmp_path / name).read_text()))
    assert saved["processor_class"] == "Qwen2_5_VLProcessor"


def test_demo_is_deterministic_and_each_answer_matches_its_image(demo, tmp_path):
    from PIL import Image

    from fastft.demo.vision import COLOURS, SHAPES, write_demo

    again = write_demo(tmp_path / "again")
    assert again.read_bytes() == demo.read_bytes()
    rows = [json.loads(line) for line in demo.read_text().splitlines()]
    assert len(rows) == len(SHAPES) * len(COLOURS) * 3
    for row in rows:
        user, assistant = row["messages"]
        image = user["content"][0]["image"]
        assert (demo.parent / image).read_bytes() == (again.parent / image).read_bytes()
        answer = assistant["content"][0]["text"]
        colour = next(name for name in COLOURS if name in answer)
        pixels = np.asarray(Image.open(demo.parent / image)).reshape(-1, 3)
        # The named colour is drawn, and it is the only colour besides the white background.
        assert (pixels == COLOURS[colour]).all(-1).sum() > 100
        assert ((pixels == COLOURS[colour]).all(-1) | (pixels == 255).all(-1)).all()
        question = user["content"][1]["text"]
        shape = next((name for name in SHAPES if name in answer), None)
        assert (shape is None) == (question == "What colour is the shape?")
        if shape is not None:
            assert _shape_of(pixels.reshape(112, 112, 3)) == shape, image


def _shape_of(pixels: np.ndarray) -> str:
    """Which shape is drawn: the share of its bounding box it fills, and (triangle or diamond) whether its top and
    bottom halves are alike."""
    drawn = (pixels != 255).any(-1)
    ys, xs = drawn.nonzero()
    box = drawn[ys.min() : ys.max() + 1, xs.min() : xs.max() + 1]
    fill, half = box.mean(), box.shape[0] // 2
    if fill > 0.95:
        return "square"
    if 0.7 < fill < 0.85:
        return "circle"
    balanced = abs(box[:half].sum() / box[-half:].sum() - 1) < 0.1
    return "diamond" if balanced else "triangle"
