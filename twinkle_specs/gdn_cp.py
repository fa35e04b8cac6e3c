"""Context parallelism for the Gated DeltaNet: sequence shards exchanged for head shards, and back.

Under context parallelism each rank holds two of the sequence's ``2 * cp`` chunks (megatron's load
balancing for causal attention: chunks ``r`` and ``2 * cp - 1 - r`` on rank ``r``). A recurrence needs
whole sequences, so the layer trades: one all-to-all gives every rank the whole sequence, in order, for
``1 / cp`` of the heads (as megatron-core 0.19's own GatedDeltaNet does); the convolution and the rule run
there; a second all-to-all gives each rank its chunks back with every head. The parameters that act per
head (the convolution's channels, ``A_log``, ``dt_bias``) are sliced to the rank's heads; their gradients
land in the slice, and megatron sums them over the data- and context-parallel ranks.
"""

from __future__ import annotations

import itertools

import torch
from megatron.core.tensor_parallel.mappings import all_to_all


def head_order(sections: tuple[int, ...], cp: int, device: torch.device | str) -> torch.Tensor:
    """Feature order that puts part ``c`` of every section (in section order) in the ``c``-th of ``cp``
    equal blocks, so that one all-to-all over blocks sends each rank its heads of every section."""
    starts = list(itertools.accumulate(sections, initial=0))[:-1]
    return torch.cat(
        [
            torch.arange(start + c * (size // cp), start + (c + 1) * (size // cp), device=device)
            for c in range(cp)
            for start, size in zip(starts, sections, strict=True)
        ]
    )


def local_rows(sections: tuple[int, ...], cp: int, rank: int, device: torch.device | str) -> torch.Tensor:
    """Rows of a per-feature parameter laid out as ``sections`` that context-parallel ``rank`` uses."""
    return head_order(sections, cp, device).view(cp, -1)[rank]


def _natural_order(cp: int, half: int, device: torch.device | str) -> torch.Tensor:
    """Positions, in the gathered [rank, its two chunks] order, of the sequence's tokens in their order."""
    chunk_at = [2 * r for r in range(cp)] + [2 * (2 * cp - 1 - j) + 1 for j in range(cp, 2 * cp)]
    return torch.cat([torch.arange(i * half, (i + 1) * half, device=device) for i in chunk_at])


def sequence_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """[s / cp, b, features in ``head_order``] on each rank (its two chunks) -> [s, b, features / cp]: the
    whole sequence in order, this rank's block of features."""
    cp = group.size()
    s_local, b, width = x.shape
    blocks = x.reshape(s_local, b, cp, width // cp).permute(2, 0, 1, 3).reshape(cp * s_local, b, width // cp)
    gathered = all_to_all(group, blocks)  # block r: rank r's two chunks, this rank's features
    return gathered.index_select(0, _natural_order(cp, s_local // 2, x.device))


def heads_to_sequence(y: torch.Tensor, group) -> torch.Tensor:
    """[s, b, features / cp] (the whole sequence, this rank's heads) -> [s / cp, b, features]: this rank's two
    chunks, every rank's heads in rank order."""
    cp = group.size()
    s, b, width = y.shape
    by_rank = torch.argsort(_natural_order(cp, s // (2 * cp), y.device))  # the inverse permutation
    blocks = y.index_select(0, by_rank)  # [rank r's two chunks for r in ranks]
    mine = all_to_all(group, blocks)  # block r: this rank's chunks, rank r's heads
    return mine.reshape(cp, s // cp, b, width).permute(1, 2, 0, 3).reshape(s // cp, b, cp * width)
