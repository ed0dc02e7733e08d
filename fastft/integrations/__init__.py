"""fastft inside other trainers: :func:`apply` puts a model built elsewhere on the fused path,
:class:`FastftCallback` does it from a transformers / trl trainer, and :mod:`fastft.integrations.axolotl` holds the
Axolotl plugin (imported on its own: it needs axolotl)."""

from fastft.integrations.apply_model import apply
from fastft.integrations.callback import FastftCallback

__all__ = ["FastftCallback", "apply"]
