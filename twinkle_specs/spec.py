"""The Qwen transformer-layer spec for megatron-core.

``qwen_layer_spec`` is a module-level ``ModuleSpec`` *instance* (Megatron-LM core_v0.16.1's ``--spec``
hands the imported object straight to GPTModel and rejects callables; core_v0.19 accepts both). Its
layer class chooses the submodules when Megatron builds each layer, from that layer's
TransformerConfig: Transformer Engine modules when ``transformer_impl == "transformer_engine"``,
otherwise megatron-core's portable modules with a torch-SDPA core attention that runs on CPU. q/k norm,
QKV bias, dense vs MoE (TE grouped GEMM when ``moe_grouped_gemm``) and the shared expert all follow the
config, composed from megatron-core's own layer specs.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from .graph_io import record_sample, write_output_into_next_input
from .hybrid_spec import hybrid_layer_submodules, is_hybrid
from .packed_attention_check import LARGEST_SAFE_HEAD_DIM, checked_te_attention_class
from .packed_sequences import packed_bounds
from .patches import local_graph_inputs_kept


class SDPACoreAttention(MegatronModule):
    """Core attention on ``torch.nn.functional.scaled_dot_product_attention``.

    Used on the portable path: megatron-core's DotProductAttention needs CUDA (its RNG tracker and
    global buffers), this runs anywhere. Causal, GQA by head repetition, Qwen's 1/sqrt(head_dim) scale;
    packed sequences (``--sft``'s THD batches) attend within their own sequence only.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: Any,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        **_: Any,
    ) -> None:
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("the portable SDPA attention has no context parallelism; use the TE path")
        self.softmax_scale = softmax_scale if softmax_scale is not None else config.kv_channels**-0.5
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: Any = None,
        attention_bias: Any = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        if attention_bias is not None:
            raise NotImplementedError("attention bias needs the TE path")
        if packed_seq_params is not None:
            return self._packed(query, key, value, packed_seq_params)
        # [s, b, heads, d] -> [b, heads, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        # Megatron masks are True where attention is *not* allowed; SDPA wants the opposite.
        mask = None if attention_mask is None else ~attention_mask
        out = self._attend(q, k, v, mask)
        sq, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)

    def _packed(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, params: Any
    ) -> torch.Tensor:
        """Packed sequences (THD: [tokens, heads, d], ``cu_seqlens`` bounds): causal inside each sequence,
        nothing across them (the padded bounds where given, as megatron's RoPE uses them)."""
        if params.qkv_format != "thd":
            raise NotImplementedError(f"packed sequences in {params.qkv_format!r} format need the TE path")
        bounds = packed_bounds(params)
        tokens = query.shape[0]
        seq = torch.bucketize(torch.arange(tokens, device=query.device), bounds.to(query.device), right=True)
        pos = torch.arange(tokens, device=query.device)
        mask = (seq[:, None] == seq[None, :]) & (pos[:, None] >= pos[None, :])
        q, k, v = (t.permute(1, 0, 2).unsqueeze(0) for t in (query, key, value))  # [1, heads, t, d]
        out = self._attend(q, k, v, mask)
        return out[0].permute(1, 0, 2).reshape(tokens, -1)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None):
        """SDPA on [b, heads, s, d]; ``mask`` True where attention is allowed, None for causal."""
        if k.shape[1] != q.shape[1]:
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=mask is None,
            scale=self.softmax_scale,
        )


def _with_core_attention(submodules: TransformerLayerSubmodules, core: type) -> TransformerLayerSubmodules:
    """``submodules`` with its self-attention's core attention replaced by ``core``, the rest as given."""
    attention = submodules.self_attention
    inner = dataclasses.replace(attention.submodules, core_attention=core)
    return dataclasses.replace(submodules, self_attention=dataclasses.replace(attention, submodules=inner))


def _te_core_attention(config: TransformerConfig) -> type | None:
    """The core attention in place of megatron's TE one: FlashAttention-4 where asked for, megatron's checked
    for the packed calls its cuDNN trains wrong at heads above 128, else None (megatron's own)."""
    if getattr(config, "flash_attn_4", False):
        from .flash_attention import flash_attention_4_class

        return flash_attention_4_class()
    if config.kv_channels > LARGEST_SAFE_HEAD_DIM:
        return checked_te_attention_class()
    return None


def _megatron_layer_submodules(config: TransformerConfig) -> TransformerLayerSubmodules:
    """megatron-core's own GPT layer submodules for this config, TE or portable."""
    common = {
        "num_experts": config.num_moe_experts,
        "moe_grouped_gemm": config.moe_grouped_gemm,
        "qk_layernorm": config.qk_layernorm,
    }
    if config.transformer_impl == "transformer_engine":
        submodules = get_gpt_layer_with_transformer_engine_spec(**common).submodules
        core = _te_core_attention(config)
        return submodules if core is None else _with_core_attention(submodules, core)
    if getattr(config, "flash_attn_4", False):
        from .flash_attention import portable_refusal

        raise ValueError(portable_refusal(config.transformer_impl))
    submodules = get_gpt_layer_local_spec(normalization=config.normalization, **common).submodules
    keys_map = dict(submodules.sharded_state_dict_keys_map)
    if config.num_moe_experts:
        # The TE spec fuses the pre-MLP norm into linear_fc1 only for dense MLPs; an MoE layer keeps a
        # TENorm named pre_mlp_layernorm. megatron's local spec renames it for MoE too, which would make
        # portable MoE checkpoints unreadable by TE models (and TE-trained ones by portable export).
        keys_map.pop("pre_mlp_layernorm.", None)
    portable = _with_core_attention(submodules, SDPACoreAttention)
    return dataclasses.replace(portable, sharded_state_dict_keys_map=keys_map)


def qwen_layer_submodules(config: TransformerConfig, layer_index: int = 0) -> TransformerLayerSubmodules:
    """The submodules of layer ``layer_index`` (0-based, global) for ``config`` (LoRA wrappers added when
    configured); hybrid models (Gated DeltaNet) choose linear or full attention per layer."""
    if config.normalization != "RMSNorm" or not config.gated_linear_unit or config.add_bias_linear:
        raise ValueError(
            "qwen_layer_spec expects a Qwen config: --normalization RMSNorm --swiglu --disable-bias-linear "
            "(twinkle-specs args --hf-model DIR prints the full set of flags)"
        )
    submodules = _megatron_layer_submodules(config)
    lora = getattr(config, "lora", None)
    if is_hybrid(config):
        submodules = hybrid_layer_submodules(submodules, config, layer_index)
    if lora is not None:
        from .lora.spec import lora_layer_submodules

        submodules = lora_layer_submodules(submodules, lora, config)
    return submodules


PACKED_ROWS_UNDER_TE_GRAPHS = (
    "packed sequences (--sft) under Transformer Engine CUDA graphs (--cuda-graph-impl transformer_engine): "
    "the graphs are captured for one plain row and Megatron-LM's replay takes no packed_seq_params. Drop "
    "--cuda-graph-impl for --sft runs (the twinkle_specs launcher refuses the pair before starting)"
)


FIRST_LAYER_INPUT_GRAD = (
    "the first decoder layer's CUDA graph was captured without its input's gradient (a LoRA model's frozen "
    "embedding, no recompute: prepare_lora_model), yet its input now requires grad, whose gradient the graph "
    "would drop. Call prepare_lora_model after anything that makes the embedding's output require grad, or "
    "set layer.input_needs_grad = True on the model's first decoder layer before the capture"
)


class QwenTransformerLayer(TransformerLayer):
    """A megatron-core TransformerLayer whose submodules come from its config (see module docstring)."""

    def __init__(
        self,
        config: TransformerConfig,
        submodules: TransformerLayerSubmodules | None = None,
        layer_number: int = 1,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        if submodules is None:
            submodules = qwen_layer_submodules(config, _global_layer_index(config, layer_number, kwargs))
        super().__init__(config, submodules, layer_number, *args, **kwargs)
        if not isinstance(self.mlp_bda, torch.nn.Module):  # megatron's bias-dropout-add function
            write_output_into_next_input(self)
        local_graph_inputs_kept.warn_if_missing(config)

    def get_layer_static_inputs(self, seq_length: int, micro_batch_size: int) -> dict[str, torch.Tensor]:
        """megatron's CUDA-graph sample inputs, recorded for the layer before this one to write its output
        into (:mod:`twinkle_specs.graph_io`); for the first layer of a LoRA model whose input needs no
        gradient (``input_needs_grad``, set by :func:`~twinkle_specs.lora.model.mark_first_layer_input`) a
        sample without one, so the captured backward skips that input gradient as eager does."""
        inputs = super().get_layer_static_inputs(seq_length, micro_batch_size)
        if not getattr(self, "input_needs_grad", True):
            inputs["hidden_states"].requires_grad_(False)
        record_sample(self, inputs["hidden_states"])
        return inputs

    def _te_cuda_graph_replay(self, *args: Any, **kwargs: Any) -> Any:
        """Megatron's TE CUDA graph replay; a packed micro-batch (``--sft``), which its replay takes only
        where the attention runs outside the graphs, is refused with what to do instead of its bare assert.
        An input that requires grad under a graph captured without its gradient is refused too."""
        hidden_states = kwargs.get("hidden_states", args[0] if args else None)
        if not getattr(self, "input_needs_grad", True) and getattr(hidden_states, "requires_grad", False):
            raise RuntimeError(FIRST_LAYER_INPUT_GRAD)
        try:
            return super()._te_cuda_graph_replay(*args, **kwargs)
        except AssertionError as err:
            if kwargs.get("packed_seq_params") is None:
                raise
            raise RuntimeError(PACKED_ROWS_UNDER_TE_GRAPHS) from err

    def _get_te_cuda_graph_replay_args(self, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        """Megatron's replay arguments for this layer's TE CUDA graph, where a LoRA model's frozen base
        keeps its FP8 weight copies across iterations (``lora_fp8_copies``, set by ``prepare_lora_model``:
        :mod:`twinkle_specs.lora.fp8_copies`)."""
        graph_args, graph_kwargs = super()._get_te_cuda_graph_replay_args(*args, **kwargs)
        copies = getattr(self, "lora_fp8_copies", None)
        if copies is not None and "is_first_microbatch" in graph_kwargs:
            graph_kwargs["is_first_microbatch"] = copies.first_microbatch(
                self, graph_kwargs["is_first_microbatch"]
            )
        return graph_args, graph_kwargs


def _global_layer_index(config: TransformerConfig, layer_number: int, kwargs: dict[str, Any]) -> int:
    """0-based index in the whole model of the stage-local, 1-based ``layer_number`` (as TransformerLayer
    computes its own ``layer_number``)."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
    from megatron.core.utils import get_pg_rank

    pg = kwargs.get("pg_collection") or ProcessGroupCollection.use_mpu_process_groups()
    return layer_number - 1 + get_transformer_layer_offset(config, kwargs.get("vp_stage"), get_pg_rank(pg.pp))


qwen_layer_spec = ModuleSpec(module=QwenTransformerLayer)
