"""Response-only loss on SmolLM2's real chat template: markers, exact masks, refusals, and the loss in SFTTrainer."""

from __future__ import annotations

import copy

import pytest
import torch
from datasets import Dataset
from trl import SFTTrainer

from fastft import FastModel
from fastft.training.responses import (
    IGNORE_INDEX,
    detect_chat_markers,
    detect_markers,
    response_texts,
    train_on_responses_only,
)
from fastft.training.trl import loss_history, sft_config

SYSTEM = "You answer questions about the corner bakery."
CONVERSATION = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "What time do you open on Sundays?"},
    {"role": "assistant", "content": "We open at 8 am on Sundays."},
    {"role": "user", "content": "And do you sell rye bread?"},
    {"role": "assistant", "content": "Yes, dark rye every day."},
]
CHATS = [
    CONVERSATION,
    [
        {"role": "user", "content": "Name a primary colour."},
        {"role": "assistant", "content": "Blue."},
    ],
    [
        {"role": "system", "content": "Reply in one word."},
        {"role": "user", "content": "Opposite of hot?"},
        {"role": "assistant", "content": "Cold."},
        {"role": "user", "content": "Opposite of up?"},
        {"role": "assistant", "content": "Down."},
        {"role": "user", "content": "Opposite of left?"},
        {"role": "assistant", "content": "Right."},
    ],
    [
        {"role": "user", "content": "How many legs has a spider?"},
        {"role": "assistant", "content": "Eight legs, in four pairs."},
    ],
]
END = "<|im_end|>"


def _ids(tokenizer, messages) -> list[int]:
    """Token ids the way trl tokenizes a conversation."""
    return list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"])


def _expected_mask(tokenizer, messages) -> list[bool]:
    """Assistant tokens found from character positions (not from markers): each reply and the <|im_end|> after it."""
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    spans, cursor = [], 0
    for message in messages:
        start = text.index(message["content"], cursor)
        cursor = start + len(message["content"])
        if message["role"] == "assistant":
            assert text[cursor : cursor + len(END)] == END
            spans.append((start, cursor + len(END)))
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    assert encoded["input_ids"] == _ids(tokenizer, messages)  # the offsets describe the ids trl trains on
    return [any(a <= lo and hi <= b for a, b in spans) for lo, hi in encoded["offset_mapping"]]


def _replies(messages) -> list[str]:
    return [m["content"] + END for m in messages if m["role"] == "assistant"]


def test_markers_read_from_smollm2_template(smol_tokenizer):
    assert detect_markers(smol_tokenizer) == ("<|im_start|>user\n", "<|im_start|>assistant\n")
    markers = detect_chat_markers(smol_tokenizer)
    # ChatML renders system and tool turns the same way, so they end a reply too.
    assert markers.other_parts == ("<|im_start|>system\n", "<|im_start|>tool\n")


def test_tool_turn_after_a_reply_is_masked(smol_tokenizer):
    chat = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "Let me look that up."},
        {"role": "tool", "content": "Oslo: 4 C, rain."},
        {"role": "assistant", "content": "It is 4 C and raining in Oslo."},
    ]
    ids = _ids(smol_tokenizer, chat)
    (row,) = train_on_responses_only([{"input_ids": ids}], tokenizer=smol_tokenizer)
    assert response_texts(smol_tokenizer, ids, row["labels"]) == _replies(chat)


def test_marker_that_tokenizes_differently_in_context(smol_tokenizer):
    # Llama 3's markers as plain text in SmolLM2's vocabulary: after "<|eot_id|>" the marker's first "<" merges with
    # the ">" before it into one token "><", so the marker's ids in a conversation differ from its ids alone.
    llama3 = copy.deepcopy(smol_tokenizer)
    llama3.chat_template = (
        "{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' + m['content'] + "
        "'<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>"
        "\n\n' }}{% endif %}"
    )
    assert detect_markers(llama3) == (
        "<|start_header_id|>user<|end_header_id|>\n\n",
        "<|start_header_id|>assistant<|end_header_id|>\n\n",
    )
    alone = llama3("<|start_header_id|>user", add_special_tokens=False)["input_ids"]
    text = llama3.apply_chat_template(CONVERSATION, tokenize=False)
    ids = llama3(text, add_special_tokens=False)["input_ids"]
    assert not any(ids[i : i + len(alone)] == alone for i in range(1, len(ids)))  # never tokenized as alone
    (row,) = train_on_responses_only([{"input_ids": ids}], tokenizer=llama3)
    # The shared "><" token goes with the reply it starts in; every other token is exactly the replies.
    assert response_texts(llama3, ids, row["labels"]) == [
        "We open at 8 am on Sundays.<|eot_id|><",
        "Yes, dark rye every day.<|eot_id|>",
    ]


def test_multi_turn_with_system_prompt_exact_mask(smol_tokenizer):
    ids = _ids(smol_tokenizer, CONVERSATION)
    (row,) = train_on_responses_only([{"input_ids": ids}], tokenizer=smol_tokenizer)
    labels = row["labels"]
    assert len(labels) == len(ids)
    assert [label != IGNORE_INDEX for label in labels] == _expected_mask(smol_tokenizer, CONVERSATION)
    assert all(label == token for label, token in zip(labels, ids, strict=True) if label != IGNORE_INDEX)
    # Each reply with its end-of-turn token, and nothing else: not the system prompt, the questions or the markers.
    assert response_texts(smol_tokenizer, ids, labels) == [
        "We open at 8 am on Sundays.<|im_end|>",
        "Yes, dark rye every day.<|im_end|>",
    ]
    assert sum(label != IGNORE_INDEX for label in labels) < len(ids) / 2


def test_dataset_and_default_system_prompt(smol_tokenizer):
    # Without a system message SmolLM2's template inserts its own system turn; that one is masked too.
    dataset = Dataset.from_dict({"input_ids": [_ids(smol_tokenizer, chat) for chat in CHATS]})
    masked = train_on_responses_only(dataset, tokenizer=smol_tokenizer)
    assert isinstance(masked, Dataset) and masked.column_names == ["input_ids", "labels"]
    for chat, row in zip(CHATS, masked, strict=True):
        assert [label != IGNORE_INDEX for label in row["labels"]] == _expected_mask(smol_tokenizer, chat)
        assert response_texts(smol_tokenizer, row["input_ids"], row["labels"]) == _replies(chat)


def test_explicit_markers_match_detected(smol_tokenizer):
    rows = [{"input_ids": _ids(smol_tokenizer, chat)} for chat in CHATS]
    detected = train_on_responses_only(rows, tokenizer=smol_tokenizer)
    explicit = train_on_responses_only(
        rows,
        instruction_part="<|im_start|>user\n",
        response_part="<|im_start|>assistant\n",
        tokenizer=smol_tokenizer,
    )
    assert [row["labels"] for row in explicit] == [row["labels"] for row in detected]
    assert "labels" not in rows[0]  # the input rows are left as they were


def test_explicit_markers_on_plain_text_format(smol_tokenizer):
    # A non-chat format: "### Response:" is tokenized after "\n\n" here, at the very start in the standalone probe.
    text = (
        "### Instruction:\nName a colour.\n\n### Response:\nBlue.\n\n"
        "### Instruction:\nAnd another one?\n\n### Response:\nGreen, like grass." + END
    )
    ids = smol_tokenizer(text, add_special_tokens=False)["input_ids"]
    (row,) = train_on_responses_only(
        [{"input_ids": ids}],
        instruction_part="### Instruction:\n",
        response_part="### Response:\n",
        tokenizer=smol_tokenizer,
    )
    assert response_texts(smol_tokenizer, ids, row["labels"]) == ["Blue.", "Green, like grass." + END]


def test_existing_labels_and_padding_stay_masked(smol_tokenizer):
    ids = _ids(smol_tokenizer, CHATS[1])
    first_reply = len(ids) - 4  # "Blue", ".", "<|im_end|>", "\n"
    labels = list(ids)
    labels[first_reply] = IGNORE_INDEX  # e.g. a label masked upstream: never trained again
    padded = ids + [smol_tokenizer.pad_token_id] * 3
    row = {"input_ids": padded, "labels": labels + [IGNORE_INDEX] * 3, "attention_mask": [1] * len(ids) + [0] * 3}
    (out,) = train_on_responses_only([row], tokenizer=smol_tokenizer)
    trained = [i for i, label in enumerate(out["labels"]) if label != IGNORE_INDEX]
    assert trained == [first_reply + 1, first_reply + 2]
    assert smol_tokenizer.decode([padded[i] for i in trained]) == "." + END


def test_packed_rows_masked_per_example(smol_tokenizer):
    parts = [_ids(smol_tokenizer, chat) for chat in CHATS[:3]]
    row = {"input_ids": sum(parts, []), "seq_lengths": [len(p) for p in parts]}
    (out,) = train_on_responses_only([row], tokenizer=smol_tokenizer)
    expected = sum((_expected_mask(smol_tokenizer, chat) for chat in CHATS[:3]), [])
    assert [label != IGNORE_INDEX for label in out["labels"]] == expected


def test_no_chat_template_is_refused(smol_tokenizer):
    bare = copy.deepcopy(smol_tokenizer)
    bare.chat_template = None
    with pytest.raises(ValueError, match=r"no chat template.*instruction_part=.*response_part="):
        train_on_responses_only([{"input_ids": [1, 2, 3]}], tokenizer=bare)


def test_template_without_markers_is_refused(smol_tokenizer):
    plain = copy.deepcopy(smol_tokenizer)
    plain.chat_template = "{% for message in messages %}{{ message['content'] }}\n{% endfor %}"
    with pytest.raises(ValueError, match=r"no turn markers.*pass instruction_part="):
        train_on_responses_only([{"input_ids": [1, 2, 3]}], tokenizer=plain)


def test_example_without_reply_is_refused(smol_tokenizer):
    ids = _ids(smol_tokenizer, CONVERSATION)
    mask = _expected_mask(smol_tokenizer, CONVERSATION)
    cut = mask.index(True)  # truncated just before the first reply
    rows = [{"input_ids": ids}, {"input_ids": ids[:cut]}, {"input_ids": ids}]
    with pytest.raises(ValueError, match=r"1 of 3 dataset rows \(index 1\) have no assistant token.*max_length"):
        train_on_responses_only(rows, tokenizer=smol_tokenizer)
    with pytest.raises(ValueError, match="pass tokenizer="):
        train_on_responses_only(rows)
    with pytest.raises(ValueError, match="no 'input_ids'"):
        train_on_responses_only([{"messages": CONVERSATION}], tokenizer=smol_tokenizer)


# --- inside trl's SFTTrainer: a tiny random Llama with SmolLM2's tokenizer ---


def _trainer(folder, dataset, tmp_path, eval_dataset=None, **config):
    model, tokenizer = FastModel.from_pretrained(str(folder), max_seq_length=256)
    model = FastModel.get_peft_model(model, r=8, lora_alpha=16, random_state=5)
    settings = dict(max_steps=1, save_strategy="no", seed=5, per_device_train_batch_size=4)
    settings.update(per_device_eval_batch_size=4, learning_rate=1e-3)
    settings.update(config)
    args = sft_config(str(tmp_path / "out"), torch.float32, settings.pop("max_length", 256), **settings)
    return SFTTrainer(
        model=model, processing_class=tokenizer, train_dataset=dataset, eval_dataset=eval_dataset, args=args
    )


def _hand_loss(model, tokenizer, chats, masked: bool) -> float:
    """Mean cross-entropy over the trained tokens, from the model's logits, one conversation at a time."""
    total, count = torch.zeros((), dtype=torch.float64), 0
    model.eval()
    with torch.no_grad():
        for chat in chats:
            ids = _ids(tokenizer, chat)
            keep = torch.tensor(_expected_mask(tokenizer, chat) if masked else [True] * len(ids))
            logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].double()
            losses = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]), reduction="none")
            total += losses[keep[1:]].sum()
            count += int(keep[1:].sum())
    return (total / count).item()


def test_sft_trainer_loss_is_the_assistant_token_loss(tiny_llama_dir, smol_tokenizer, tmp_path):
    dataset = Dataset.from_dict({"messages": CHATS})
    masked = _trainer(tiny_llama_dir, dataset, tmp_path / "masked", eval_dataset=dataset)
    assert train_on_responses_only(masked) is masked
    plain = _trainer(tiny_llama_dir, dataset, tmp_path / "plain", eval_dataset=dataset)

    # Same random weights in both (same seed), before any step.
    hand_masked = _hand_loss(masked.model, smol_tokenizer, CHATS, masked=True)
    hand_plain = _hand_loss(masked.model, smol_tokenizer, CHATS, masked=False)
    assert _hand_loss(plain.model, smol_tokenizer, CHATS, masked=False) == pytest.approx(hand_plain, rel=1e-6)
    # A random model is about equally unsure of every token, so the two means are close; still, 100x the tolerance.
    assert abs(hand_masked - hand_plain) > 1e-3 * hand_plain

    # Evaluation batches go through the wrapped collator.
    assert masked.evaluate()["eval_loss"] == pytest.approx(hand_masked, rel=1e-5)
    assert plain.evaluate()["eval_loss"] == pytest.approx(hand_plain, rel=1e-5)

    # So do training batches: the first step's loss is computed before the update (one batch holds all 4 chats).
    masked.train()
    plain.train()
    (first,) = loss_history(masked.state)
    (first_plain,) = loss_history(plain.state)
    assert first["loss"] == pytest.approx(hand_masked, rel=1e-5)
    assert first_plain["loss"] == pytest.approx(hand_plain, rel=1e-5)

    batch = masked.data_collator([masked.train_dataset[i] for i in range(len(CHATS))])
    for row, chat in enumerate(CHATS):
        keep = batch["attention_mask"][row] == 1
        ids, labels = batch["input_ids"][row][keep].tolist(), batch["labels"][row][keep].tolist()
        assert response_texts(smol_tokenizer, ids, labels) == _replies(chat)


def test_sft_trainer_refuses_replies_truncated_away(tiny_llama_dir, smol_tokenizer, tmp_path):
    long_question = [
        {"role": "user", "content": "Tell me about bread. " * 20},
        {"role": "assistant", "content": "Bread is baked dough."},
    ]
    dataset = Dataset.from_dict({"messages": [CHATS[1], long_question, CHATS[3]]})
    trainer = _trainer(tiny_llama_dir, dataset, tmp_path, max_length=64)
    with pytest.raises(ValueError, match=r"1 of 3 train rows \(index 1\).*Raise max_length"):
        train_on_responses_only(trainer)


def test_collator_refuses_a_batch_without_replies(tiny_llama_dir, smol_tokenizer, tmp_path):
    dataset = Dataset.from_dict({"messages": CHATS})
    trainer = train_on_responses_only(_trainer(tiny_llama_dir, dataset, tmp_path))
    question_only = _ids(smol_tokenizer, [{"role": "user", "content": "Is anyone there?"}])
    with pytest.raises(ValueError, match=r"batch row 1 has no assistant token"):
        trainer.data_collator([{"input_ids": _ids(smol_tokenizer, CHATS[1])}, {"input_ids": question_only}])


def test_sft_trainer_packed_batches_masked_per_example(tiny_llama_dir, smol_tokenizer, tmp_path):
    dataset = Dataset.from_dict({"messages": CHATS})
    trainer = train_on_responses_only(_trainer(tiny_llama_dir, dataset, tmp_path, packing=True, max_length=512))
    batch = next(iter(trainer.get_train_dataloader()))
    assert "attention_mask" not in batch  # padding-free: one row, examples split where position_ids restart
    starts = (batch["position_ids"][0] == 0).nonzero().flatten().tolist() + [batch["input_ids"].shape[1]]
    found = []
    for start, end in zip(starts, starts[1:], strict=False):
        ids, labels = batch["input_ids"][0, start:end].tolist(), batch["labels"][0, start:end].tolist()
        found.append(tuple(response_texts(smol_tokenizer, ids, labels)))
    assert sorted(found) == sorted(tuple(_replies(chat)) for chat in CHATS)


def test_sft_trainer_wrapped_packing_is_refused(tiny_llama_dir, tmp_path):
    dataset = Dataset.from_dict({"messages": CHATS})
    trainer = _trainer(tiny_llama_dir, dataset, tmp_path, packing=True, packing_strategy="wrapped", max_length=64)
    with pytest.raises(ValueError, match="packing_strategy='wrapped' cuts conversations"):
        train_on_responses_only(trainer)
