"""FastModel: the façade users call. Loading, LoRA wiring and adapters live in :mod:`fastft.loading`, merged and GGUF
export in :mod:`fastft.export`; each method here is theirs, so this file only says what the API is."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import PreTrainedTokenizerBase

from fastft import patches  # noqa: F401  (registers the built-in patches)
from fastft.checkpointing import modes as checkpoint
from fastft.loading import adapters, lora, pretrained
from fastft.loading.dtypes import resolve_dtype
from fastft.loading.lora import (
    DEFAULT_TARGET_MODULES,
    PACKED_TARGET_MODULES,
    base_model,
    default_target_modules,
    is_sequence_classifier,
    keep_trainable_fp32,
)
from fastft.loading.pretrained import TASKS

if TYPE_CHECKING:
    from fastft.export.gguf_vlm import VisionGGUF


class FastModel:
    """Entry points of fastft. All methods are static; the models they return are plain transformers / peft
    objects, usable wherever those are."""

    from_pretrained = staticmethod(pretrained.from_pretrained)
    get_peft_model = staticmethod(lora.get_peft_model)
    load_adapter = staticmethod(adapters.load_adapter)

    @staticmethod
    def for_inference(model: torch.nn.Module) -> torch.nn.Module:
        """Switch to inference: eval mode, KV cache on, checkpointing off. Returns the same model."""
        model.eval()
        base = base_model(model)
        checkpoint.suspend(base)
        base.config.use_cache = True
        return model

    @staticmethod
    def for_training(model: torch.nn.Module) -> torch.nn.Module:
        """Switch back to training: train mode, KV cache off, the chosen checkpointing on. Returns the model."""
        model.train()
        base = base_model(model)
        checkpoint.resume(base)
        base.config.use_cache = False
        return model

    @staticmethod
    def save_merged(
        model: torch.nn.Module,
        tokenizer: PreTrainedTokenizerBase | None,
        save_directory: str | Path,
        dtype: torch.dtype | str = torch.float16,
        max_shard_size: int | str = "5GB",
        overwrite: bool = False,
    ) -> Path:
        """Merge the LoRA adapters into the base weights and save a plain transformers model.

        The merge is streamed: each tensor is merged (in float32, a 4-bit base dequantised one projection at a time)
        and written a block of rows at a time into size-capped safetensors shards, with
        ``model.safetensors.index.json`` as transformers writes it. Host memory beyond the loaded model stays within
        one block of merged rows (16 MB) or one dequantised 4-bit projection, so an 8B model merges on a 12 GB Colab
        runtime. The model in memory is not changed. Everything is written into a hidden folder beside
        ``save_directory`` and renamed into place when complete, so an error or an interrupt leaves
        ``save_directory`` as it was. The folder loads with plain ``AutoModelForCausalLM.from_pretrained``.

        Args:
            model: A model from :meth:`get_peft_model` (or :meth:`from_pretrained`, saved as is).
            tokenizer: Saved beside the weights when given.
            save_directory: Output folder; created if missing. An existing folder with files in it is refused
                unless ``overwrite=True``.
            dtype: dtype of the saved weights: ``torch.float16`` (default), ``torch.bfloat16`` or
                ``torch.float32``, or a name such as ``"bf16"``.
            max_shard_size: Largest shard, as bytes or a string such as ``"5GB"`` (default) or ``"500MB"``; a
                single tensor larger than this gets a shard of its own, as in transformers.
            overwrite: Replace an existing non-empty ``save_directory`` (the old one is removed only after the new
                one is complete).

        Returns:
            The output folder.

        Raises:
            FileExistsError: ``save_directory`` is a file, or a non-empty folder and ``overwrite`` is false.
            ValueError: An unsupported ``dtype``, an unparsable ``max_shard_size``, or merged weights that are not
                finite (or exceed float16's range with ``dtype=torch.float16``).
            NotImplementedError: DoRA adapters, 8-bit weights, or a model whose on-disk tensor names differ from
                its in-memory ones.
        """
        from fastft.export.merged_save import save_merged

        return save_merged(model, tokenizer, save_directory, dtype, max_shard_size=max_shard_size, overwrite=overwrite)

    @staticmethod
    def save_gguf(
        model: torch.nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        path: str | Path,
        quantization: str = "f16",
    ) -> Path | VisionGGUF:
        """Merge the LoRA adapters and write one GGUF file, the single-file format of llama.cpp and the tools on it.

        The merge is :meth:`save_merged`'s (float32, 4-bit bases dequantised), streamed one tensor at a time in
        blocks of rows, so host memory beyond the loaded model stays within one decoder layer's merged weights; the
        model in memory is not changed. Written with the ``gguf`` package (``pip install 'fastft[gguf]'``),
        no llama.cpp build needed. The file reloads with
        ``AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)`` and
        ``AutoTokenizer.from_pretrained(folder, gguf_file=name)``. It is written under a temporary name and
        renamed when complete, so an interrupted export leaves no partial file.

        Args:
            model: A Llama-architecture, Qwen3-MoE or Mixtral model from :meth:`get_peft_model` (or
                :meth:`from_pretrained`, or an already merged model), in any dtype, 4-bit included. MoE experts are
                written stacked, as llama.cpp reads them.
            tokenizer: Its byte-level BPE tokenizer (Llama 3, SmolLM, GPT-2 style); vocabulary, merges, special
                tokens and chat template go into the file.
            path: A ``.gguf`` file path, or a folder (created if missing) in which the file is named
                ``<model>-<QUANTIZATION>.gguf``.
            quantization: ``"f16"`` (default), ``"bf16"``, ``"f32"``, or one of llama.cpp's mixtures:
                ``"q8_0"`` (8-bit blocks, about half the size of f16), ``"q6_k"``, ``"q5_k_m"`` or ``"q4_k_m"``
                (K-quants written by fastft, with the per-tensor types llama.cpp's quantiser picks: more bits for
                the head and some attn_v / ffn_down layers, its 32-block fallback for rows that are not a multiple
                of 256). Norm weights stay float32 in every case, as llama.cpp expects.

            A vision-language model (Qwen2.5-VL) is written as llama.cpp runs it, in two files: the language model
            (architecture ``qwen2vl``) and the vision tower with its merger as ``mmproj-<model>-f16.gguf`` (pass the
            processor as ``tokenizer``: the mmproj holds its image mean and std). Other vision-language families are
            refused with the reason (:mod:`fastft.export.gguf_vision`).

        Returns:
            The path of the written file; for a vision-language model a ``VisionGGUF`` (``.model``, ``.mmproj``).

        Raises:
            ValueError: Another architecture, a config llama.cpp would compute differently (Qwen3-MoE's dense
                layers or unnormalised top-k weights), a tokenizer that is not byte-level BPE, an unknown
                quantization, or merged weights that are not finite (or exceed float16's range with ``"f16"``).
            ShapeContractError: Expert tensors that disagree with the config.
            NotImplementedError: A rope scaling other than default, linear or llama3.
            ImportError: The ``gguf`` package is missing.
        """
        from fastft.export.gguf_export import save_gguf
        from fastft.export.gguf_vision import vision_family
        from fastft.export.gguf_vlm import save_vlm_gguf

        if vision_family(model) is not None:
            return save_vlm_gguf(model, tokenizer, path, quantization)
        return save_gguf(model, tokenizer, path, quantization)

    @staticmethod
    def save_ollama(
        model: torch.nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        directory: str | Path,
        quantization: str = "q8_0",
        template: str | None = None,
        system: str | None = None,
        stop: list[str] | None = None,
        parameters: dict[str, Any] | None = None,
    ) -> tuple[Path, Path]:
        """Write the merged model as a GGUF plus an Ollama ``Modelfile`` in ``directory``.

        Then ``ollama create NAME -f DIRECTORY/Modelfile``. The GGUF is :meth:`save_gguf`'s. The Modelfile's
        ``TEMPLATE`` is the model's Jinja chat template translated into Ollama's Go template syntax for the
        families recognised by the markers they emit (Llama 3.x headers, ChatML as in Qwen2 / 2.5 / 3 and SmolLM2,
        Gemma turns, Mistral ``[INST]``) and checked, before anything is written, to render the same text as the
        chat template on conversations with and without a system message; ``SYSTEM`` carries a default system
        prompt the chat template has, ``PARAMETER stop`` the end-of-turn markers, and sampling defaults (see
        :func:`fastft.export.ollama.default_parameters`). Both files are written under temporary names and renamed.

        Args:
            model: As for :meth:`save_gguf`.
            tokenizer: Its tokenizer, with the chat template.
            directory: Output folder (created if missing); the GGUF is named ``<model>-<QUANTIZATION>.gguf``.
            quantization: Any of :meth:`save_gguf`'s (default ``"q8_0"``).
            template: An Ollama Go template to write instead of the translation (it is parsed, not checked).
            system: A default system prompt instead of the chat template's.
            stop: Stop strings for ``template=`` (default: the EOS token).
            parameters: ``PARAMETER`` values that replace or add to the defaults, e.g. ``{"temperature": 0.2}``.

        Returns:
            The GGUF path and the Modelfile path.

        Raises:
            OllamaTemplateError: (a ``ValueError``) The chat template cannot be translated (no template, markers of
                no supported family, or a rendering that differs); the GGUF is written, the Modelfile is not, and
                the message says where the renderings differ.
            ValueError, NotImplementedError, ImportError: As for :meth:`save_gguf`.
        """
        from fastft.export.ollama import save_ollama

        return save_ollama(model, tokenizer, directory, quantization, template, system, stop, parameters)


__all__ = [
    "DEFAULT_TARGET_MODULES",
    "PACKED_TARGET_MODULES",
    "TASKS",
    "FastModel",
    "default_target_modules",
    "is_sequence_classifier",
    "keep_trainable_fp32",
    "resolve_dtype",
]
