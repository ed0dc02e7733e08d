"""Loading: how a model gets from a hub id, a folder or a GGUF file into memory as a fastft model.

Where it comes from (:mod:`~fastft.loading.sources`, :mod:`~fastft.loading.embedded` with a GGUF's tokenizer from
:mod:`~fastft.loading.gguf_tokenizer`, :mod:`~fastft.loading.base_names`), its dtype and 4-bit choice
(:mod:`~fastft.loading.dtypes`), the load itself and a saved adapter put back on it (:mod:`~fastft.loading.pretrained`,
:mod:`~fastft.loading.adapters`), LoRA wiring (:mod:`~fastft.loading.lora`), vision-language models' class, processor
and LoRA layers (:mod:`~fastft.loading.vision`, :mod:`~fastft.loading.image_processor`,
:mod:`~fastft.loading.vision_targets`), regional compilation (:mod:`~fastft.loading.compile`) and one GPU per process
(:mod:`~fastft.loading.distributed`).
:class:`fastft.model.FastModel` is the façade over it.

May import: ``fastft.kernels``, ``fastft.contracts``, ``fastft.registry``, ``fastft.patches`` and the checkpointing
modules; never ``fastft.model``, ``fastft.export``, ``fastft.training`` or ``fastft.bench`` (they build on this).
"""
