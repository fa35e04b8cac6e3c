"""Where this rank's parameters sit in the tensor/pipeline/expert-parallel layout."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from megatron.core import parallel_state as ps

from .hf_config import QwenArch
from .weight_map import Binding, bind


def model_chunks(model) -> list[torch.nn.Module]:
    """The GPTModel chunks of this rank: accepts a model, a DDP/Float16Module wrapper or a VPP list."""
    chunks = model if isinstance(model, list | tuple) else [model]
    out = []
    for chunk in chunks:
        while hasattr(chunk, "module") and not hasattr(chunk, "decoder"):
            chunk = chunk.module
        out.append(chunk)
    return out


@dataclass(frozen=True)
class GroupInfo:
    rank: int
    size: int
    group: object | None


def tp_info(expert: bool) -> GroupInfo:
    """The (expert-)tensor-parallel rank, size and group that shard a parameter."""
    if not ps.model_parallel_is_initialized():
        return GroupInfo(0, 1, None)
    if expert:
        return GroupInfo(
            ps.get_expert_tensor_parallel_rank(),
            ps.get_expert_tensor_parallel_world_size(),
            ps.get_expert_tensor_parallel_group(),
        )
    return GroupInfo(
        ps.get_tensor_model_parallel_rank(),
        ps.get_tensor_model_parallel_world_size(),
        ps.get_tensor_model_parallel_group(),
    )


def is_adapter_param(name: str) -> bool:
    """LoRA factors are not base weights: they come from an adapter, not from the HF checkpoint."""
    return ".lora_" in name


def bindings(model, arch: QwenArch) -> Iterator[tuple[Binding, torch.nn.Parameter]]:
    """Every base parameter of this rank with its HF tensors, in module order."""
    ep_rank = ps.get_expert_model_parallel_rank() if ps.model_parallel_is_initialized() else 0
    ep_size = ps.get_expert_model_parallel_world_size() if ps.model_parallel_is_initialized() else 1
    local_experts = (arch.num_experts or 0) // ep_size
    for chunk in model_chunks(model):
        layers = chunk.decoder.layers if hasattr(chunk, "decoder") else []
        global_layer = {i: layer.layer_number - 1 for i, layer in enumerate(layers)}
        for name, param in chunk.named_parameters():
            if is_adapter_param(name):
                continue
            yield (
                bind(
                    name,
                    arch,
                    chunk.vocab_size,
                    global_layer.__getitem__,
                    lambda e: ep_rank * local_experts + e,
                ),
                param,
            )
