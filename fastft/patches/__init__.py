"""fastft's patches, one module per architecture; importing this package registers them all."""

from fastft.patches import llama  # noqa: F401
