"""Give packed sequences' bounds to the model as the 1-D tensors the THD kernels take.

Upstream cause: megatron-core 0.16.x ``get_thd_batch_on_this_cp_rank`` (what Megatron-LM core_v0.16.1's
``pretrain_gpt.py --sft`` calls) puts the micro-batch's ``cu_seqlens`` into ``PackedSeqParams`` as the
data loader collated them, ``[1, n]``; Transformer Engine's fused THD RoPE and attention need ``[n]``
("expected 1D tensor"), so no packed SFT step runs. The fix flattens a ``[1, n]`` bound (micro-batch 1,
which Megatron asserts for packing) before the call; 1-D bounds pass unchanged. megatron-core 0.19
builds its packed batches differently and is left alone.
"""

from __future__ import annotations

import functools

from .gates import megatron_core_in

NEEDED_FOR = ">=0.16, <0.17 (megatron-core)"


def is_needed() -> bool:
    return megatron_core_in("0.16", "0.17")


def _flat(bounds):
    return bounds.reshape(-1) if bounds is not None and bounds.dim() == 2 and bounds.shape[0] == 1 else bounds


def with_1d_bounds(original):
    @functools.wraps(original)
    def get_thd_batch_on_this_cp_rank(batch, cu_seqlens, cu_seqlens_padded, max_seqlen, *args, **kwargs):
        return original(batch, _flat(cu_seqlens), _flat(cu_seqlens_padded), max_seqlen, *args, **kwargs)

    get_thd_batch_on_this_cp_rank.twinkle_patched = True
    return get_thd_batch_on_this_cp_rank


def apply() -> None:
    from megatron.core import utils

    if not getattr(utils.get_thd_batch_on_this_cp_rank, "twinkle_patched", False):
        utils.get_thd_batch_on_this_cp_rank = with_1d_bounds(utils.get_thd_batch_on_this_cp_rank)
