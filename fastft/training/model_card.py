"""The README.md model card ``fastft train`` writes beside an adapter, naming its base model."""

from __future__ import annotations

from pathlib import Path


def model_card(base: str, method: str, output: str | Path, steps: int) -> str:
    """A model card for a LoRA adapter: hub metadata naming the base, and how to load the adapter.

    trl's own card names the base only when it is a hub id (and writes ``[None](https://huggingface.co/None)`` for a
    local folder, which is what the embedded model loads from), so fastft writes its own.

    Args:
        base: The base model, as the adapter's ``base_model_name_or_path`` names it.
        method: The training method (``"sft"``, ``"dpo"``, ``"kto"`` or ``"grpo"``).
        output: The adapter folder.
        steps: The optimizer steps trained.

    Returns:
        The card's Markdown, with YAML front matter.
    """
    folder = str(output)
    return f"""---
library_name: peft
base_model: {base}
tags:
- base_model:adapter:{base}
- lora
- {method}
- fastft
- trl
pipeline_tag: text-generation
---

# LoRA adapter for {base}

A LoRA adapter for [{base}](https://huggingface.co/{base}) (the base model: where it is a local folder, that folder),
trained with `fastft train --method {method}` for {steps} steps.

## Loading it

With peft and transformers alone (the base is fetched from the hub, or read from a folder by the same name):

```python
from peft import AutoPeftModelForCausalLM
from transformers import AutoTokenizer

model = AutoPeftModelForCausalLM.from_pretrained("{folder}")
tokenizer = AutoTokenizer.from_pretrained("{folder}")
```

With fastft, which also finds an embedded base without the hub:

```python
from fastft import FastModel

model, tokenizer = FastModel.from_pretrained("{folder}")
```

Merged into its base as a plain transformers folder or a GGUF file: `fastft export --adapter {folder} --merged DIR`
or `--gguf FILE`.
"""
