"""Builds this rank's megatron-core GPTModel stage for a Hugging Face Qwen checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from megatron.core import parallel_state as ps
from megatron.core.models.gpt import GPTModel

from .config_mapping import transformer_config_from_hf
from .hf_config import qwen_arch_from_hf
from .hybrid_spec import hybrid_block_spec
from .loading import load_hf_weights
from .lora import LoraConfig, prepare_lora_model
from .lora.config import set_model_facts
from .patches import apply_all as apply_patches
from .spec import qwen_layer_spec


def padded_vocab_size(vocab_size: int, tp_size: int, divisible_by: int = 128) -> int:
    """Megatron's rule (``--make-vocab-size-divisible-by`` times TP), falling back to TP alone."""
    multiple = (divisible_by if vocab_size % divisible_by == 0 else 1) * tp_size
    return -(-vocab_size // multiple) * multiple


def build_model(
    hf_dir: str | Path,
    *,
    load_weights: bool = True,
    parallel_output: bool = True,
    vp_stage: int | None = None,
    seed: int = 1234,
    lora: LoraConfig | None = None,
    flash_attn_4: bool = False,
    **overrides: Any,
) -> GPTModel:
    """This rank's GPTModel stage built from ``qwen_layer_spec``, with the HF weights loaded.

    Needs megatron's parallel state initialized. With ``parallel_output`` (Megatron's default, what
    vocab-parallel cross-entropy wants) logits stay split over TP ranks along the vocabulary. ``overrides`` go to the TransformerConfig
    (e.g. ``params_dtype=torch.float32``, ``sequence_parallel=True``, ``moe_grouped_gemm=True``).
    With ``lora``, the spec wraps the targeted linears and every base parameter is frozen. ``flash_attn_4``: the
    attention runs on FlashAttention-4 (:mod:`twinkle_specs.flash_attention`; the ``flash-attn-4`` extra). Applies
    twinkle-specs' megatron-core patches first (``twinkle_specs.apply_patches``).
    """
    apply_patches()
    if not ps.model_parallel_is_initialized():
        raise RuntimeError(
            "build_model needs megatron's parallel state: call torch.distributed.init_process_group and "
            "megatron.core.parallel_state.initialize_model_parallel(tp, pp, ...) first"
        )
    arch = qwen_arch_from_hf(hf_dir)
    config = transformer_config_from_hf(hf_dir, **overrides)
    if torch.cuda.is_available():
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

        if "model-parallel-rng" not in get_cuda_rng_tracker().get_states():
            model_parallel_cuda_manual_seed(seed)  # TE/TP weight init draws from the model-parallel RNG
    config.flash_attn_4 = flash_attn_4  # read by qwen_layer_submodules, as config.lora is
    if lora is not None:
        config.lora = lora  # read by qwen_layer_submodules
        set_model_facts(config, arch)
    layer_spec: Any = qwen_layer_spec
    if arch.hybrid is not None:  # zero-centred final norm: a block spec (hybrid_spec.hybrid_block_spec)
        layer_spec = hybrid_block_spec(config, qwen_layer_spec, vp_stage)
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=padded_vocab_size(arch.vocab_size, ps.get_tensor_model_parallel_world_size()),
        max_sequence_length=arch.max_position_embeddings,
        pre_process=ps.is_pipeline_first_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage),
        post_process=ps.is_pipeline_last_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage),
        parallel_output=parallel_output,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type=arch.position_embedding_type,  # rope, or yarn (config.yarn_*)
        rotary_base=arch.rotary_base,
        rotary_percent=arch.hybrid.rotary_percent if arch.hybrid is not None else 1.0,
        vp_stage=vp_stage,
    )
    if torch.cuda.is_available():
        # As Megatron's get_model does: some parameters (e.g. TE norms, the shared-expert gate) start on
        # the host even without use_cpu_initialization.
        model.cuda(torch.cuda.current_device())
    if load_weights:
        load_hf_weights(model, hf_dir)
    if lora is not None:
        prepare_lora_model(model)
    return model
