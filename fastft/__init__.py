"""fastft: faster, leaner LoRA and QLoRA fine-tuning of Hugging Face causal LMs.

The public API::

    from fastft import FastModel, ShapeContractError, patch_report

    model, tokenizer = FastModel.from_pretrained("smollm2-135m")
    model = FastModel.get_peft_model(model, r=16)
"""

__version__ = "0.1.0.dev0"

from fastft.contracts import ShapeContractError
from fastft.model import FastModel
from fastft.registry import patch_report

__all__ = ["FastModel", "ShapeContractError", "__version__", "patch_report"]
