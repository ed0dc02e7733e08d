"""fastft's built-in patches: one module per architecture family, trl's fused log-prob head, and the offload
checkpointer.

This is the one place that lists them. Each module registers its records with :mod:`fastft.registry` on import;
the registry itself imports none of them. Importing this package registers them all (``fastft.model`` does, before
it patches a model).
"""

import importlib

BUILTIN = (
    "fastft.patches.llama",
    "fastft.patches.qwen",
    "fastft.patches.gemma",
    "fastft.patches.gemma3_vision",
    "fastft.patches.phi3",
    "fastft.patches.moe",
    "fastft.patches.gpt_oss",
    "fastft.patches.qwen2_5_vl",
    "fastft.patches.qwen3_vl",
    "fastft.patches.mllama",
    "fastft.patches.generic",
    "fastft.patches.trl_logprobs",
    "fastft.checkpointing.modes",
)

for _module in BUILTIN:
    importlib.import_module(_module)
