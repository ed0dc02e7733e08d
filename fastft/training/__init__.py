"""Training: the job ``fastft train`` runs, and the pieces a user's own trl script takes from fastft.

The job (:mod:`~fastft.training.train`), its settings (:mod:`~fastft.training.options`, light enough for
``fastft --help``) and its flag and file checks (:mod:`~fastft.training.checks`); trl glue
(:mod:`~fastft.training.trl`); data: reading and shaping rows (:mod:`~fastft.training.data`, with the shipped sets in
``fastft/demo/``), response-only labels (:mod:`~fastft.training.responses`, :mod:`~fastft.training.turns`), packing
(:mod:`~fastft.training.packing`) and image + text chats for vision-language models
(:mod:`~fastft.training.vision_data`); what a run leaves beside its adapter (:mod:`~fastft.training.model_card`,
:mod:`~fastft.training.plot`).

May import: everything below it (``fastft.model``, ``fastft.loading``, ``fastft.export``, the checkpointing modules);
never ``fastft.cli`` or ``fastft.bench``.
"""
