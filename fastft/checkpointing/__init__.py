"""Gradient checkpointing: what ``use_gradient_checkpointing`` installs and what a checkpointed layer keeps.

The modes and their installation on a model (:mod:`~fastft.checkpointing.modes`, the ``checkpoint.offload`` patch);
one autograd node per checkpointed decoder-layer call and its recompute (:mod:`~fastft.checkpointing.layer`); layer
inputs parked in pinned host memory on a side stream (:mod:`~fastft.checkpointing.offload`); the ``"sqrt"`` modes'
segments, whose inner inputs are replayed instead of kept (:mod:`~fastft.checkpointing.replay`); the shortcut a fused
layer offers its recompute and replay, so they run its node without its forward (:mod:`~fastft.checkpointing.rerun`).

May import: ``fastft.kernels`` and ``fastft.registry``; never the patches, loading, training or export.
"""
