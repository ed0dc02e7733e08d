"""Export: a trained model written for other tools, and the file plumbing every writer shares.

Merging LoRA into the base weights one tensor at a time (:mod:`~fastft.export.merge`), safetensors shards
(:mod:`~fastft.export.shards`), the merged transformers folder (:mod:`~fastft.export.merged_save`), GGUF for llama.cpp
(:mod:`~fastft.export.gguf_export`; K-quants in :mod:`~fastft.export.kquants`, llama.cpp's per-tensor type
mixtures in :mod:`~fastft.export.gguf_mixtures`, a vision-language model's two files in
:mod:`~fastft.export.gguf_vlm`), the Ollama Modelfile beside it (:mod:`~fastft.export.ollama`, its chat template
translated in :mod:`~fastft.export.ollama_template` and checked with :mod:`~fastft.export.go_template`) and the
permissions of written files (:mod:`~fastft.export.file_modes`).
``FastModel.save_merged`` / ``save_gguf`` / ``save_ollama`` and ``fastft export`` call into it.

May import: ``fastft.kernels``, ``fastft.contracts``, ``fastft.patches`` and ``fastft.loading``; never
``fastft.model``, ``fastft.training`` or ``fastft.bench``.
"""
