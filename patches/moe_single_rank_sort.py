"""No chunk sort in the MoE all-to-all dispatcher where it is the identity: one EP x TP rank.

Upstream cause: megatron-core 0.16.x-0.19.x ``MoEAlltoAllTokenDispatcher`` sorts the tokens it receives
from (source rank, local expert) order into (local expert, source rank) order after the all-to-all, and
back before the combine (``sort_chunks_by_idxs``; with ``--moe-permute-fusion`` TE's
``moe_sort_chunks_by_index``), whenever a rank holds more than one expert. With one expert- and
tensor-parallel rank there is one source rank, so both orders are the same: the sort copies the routed
tokens ([tokens x top-k, hidden]) twice in each MoE layer's forward and twice in its backward, and TE's
Triton launches cost the host ~0.3 ms a call. Qwen3.5-35B-A3B (20 layers, one H100): 7 ms of GPU time
and 14 ms of host time a step.

Fix: the dispatcher's two chunk orders are marked when it is built with ``ep_size * tp_size == 1``, and
the sort returns its input (and probabilities) unchanged for a marked order. Every other dispatcher, and
every other caller of the sort, runs upstream's.
"""

from __future__ import annotations

import functools

import torch

from .gates import megatron_core_in

NEEDED_FOR = ">=0.16, <0.20 (megatron-core) on CUDA"
KEEPS_ORDER = "_twinkle_keeps_order"  # set on a chunk order that is the identity


def is_needed() -> bool:
    return torch.cuda.is_available() and megatron_core_in("0.16", "0.20")


def skipping_identity(sort_chunks_by_idxs):
    """megatron's ``sort_chunks_by_idxs``, returning its input for an order marked :data:`KEEPS_ORDER`."""

    @functools.wraps(sort_chunks_by_idxs)
    def wrapper(input, split_sizes, sorted_idxs, probs=None, fused=False):
        if getattr(sorted_idxs, KEEPS_ORDER, False):
            return input, probs
        return sort_chunks_by_idxs(input, split_sizes, sorted_idxs, probs=probs, fused=fused)

    wrapper.skips_identity = True
    return wrapper


def marking_identity(init):
    """The dispatcher's ``__init__``, then its two chunk orders marked where one rank sends everything."""

    @functools.wraps(init)
    def wrapper(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if self.ep_size * self.tp_size == 1:
            for order in (self.sort_input_by_local_experts, self.restore_output_by_local_experts):
                setattr(order, KEEPS_ORDER, True)

    wrapper.marks_identity = True
    return wrapper


def apply() -> None:
    """The dispatcher's methods call the name its module imported."""
    from megatron.core.transformer.moe import token_dispatcher

    dispatcher = token_dispatcher.MoEAlltoAllTokenDispatcher
    if not getattr(token_dispatcher.sort_chunks_by_idxs, "skips_identity", False):
        token_dispatcher.sort_chunks_by_idxs = skipping_identity(token_dispatcher.sort_chunks_by_idxs)
    if not getattr(dispatcher.__init__, "marks_identity", False):
        dispatcher.__init__ = marking_identity(dispatcher.__init__)
