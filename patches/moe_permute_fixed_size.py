"""The MoE dispatcher's token permutation at a size the host knows, as megatron-core 0.19 takes it.

Upstream cause: megatron-core 0.16.x ``moe_utils.permute`` (unfused, dropless) takes the routed tokens'
indices with ``masked_select``, whose output size the host reads back from the GPU: a sync in every MoE
layer's forward, and under TE's CUDA graphs of whole MoE layers a failed capture ("operation not permitted
when stream is capturing"). megatron-core 0.19 takes the same indices with a stable argsort of the routing
map cut at ``num_out_tokens``, which a dropless dispatch knows on the host (tokens x top-k).

Fix: on 0.16.x the dispatcher's permute takes 0.19's argsort where the call is unfused, dropless and
``num_out_tokens`` is a host integer: the same indices in the same order (every True of the routing map,
row-major), so the same permuted tokens and probabilities. Other calls (``--moe-permute-fusion``, capacity
or padding, whose sizes are GPU tensors) run upstream's.
"""

from __future__ import annotations

import functools

import torch

from .gates import megatron_core_in

NEEDED_FOR = ">=0.16, <0.17 (megatron-core) on CUDA"


def is_needed() -> bool:
    return torch.cuda.is_available() and megatron_core_in("0.16", "0.17")


def fixed_size(permute):
    """megatron's ``permute``, taking a dropless unfused call's indices by argsort (megatron-core 0.19's
    way) instead of ``masked_select``."""

    @functools.wraps(permute)
    def wrapper(tokens, routing_map, probs=None, num_out_tokens=None, fused=False, drop_and_pad=False):
        if fused or drop_and_pad or not isinstance(num_out_tokens, int):
            return permute(tokens, routing_map, probs, num_out_tokens, fused, drop_and_pad)
        mask = routing_map.bool().T.contiguous()  # [experts, tokens]
        flat = mask.reshape(-1).argsort(descending=True, stable=True)[:num_out_tokens]
        sorted_indices = flat % tokens.shape[0]
        permuted_probs = None if probs is None else probs.T.contiguous().reshape(-1)[flat]
        return tokens.index_select(0, sorted_indices), permuted_probs, sorted_indices

    wrapper.fixed_size = True
    return wrapper


def apply() -> None:
    """The dispatchers call the name their module imported."""
    from megatron.core.transformer.moe import token_dispatcher

    if not getattr(token_dispatcher.permute, "fixed_size", False):
        token_dispatcher.permute = fixed_size(token_dispatcher.permute)
