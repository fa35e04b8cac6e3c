"""The sequences of a packed micro-batch (``--sft``: megatron's THD ``PackedSeqParams``) as the layers that
restart at each sequence take them: Gated DeltaNet's convolution and recurrence, the portable attention's
mask and FlashAttention-4's varlen bounds.

Reading the bounds makes the host wait for the GPU, and each small host-to-device copy waits again:
:class:`PackedRow` does both once per micro-batch, shared by its layers (the same bounds tensor).
"""

from __future__ import annotations

import functools
import weakref

import torch


def packed_bounds(params) -> torch.Tensor:
    """The sequence bounds of a packed batch (megatron's ``PackedSeqParams``) that every layer restarts at:
    the padded ones where given, as megatron's RoPE uses them."""
    return params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q


class PackedRow:
    """One micro-batch's packed sequences: ``spans``, the [start, end) of each sequence (the padded bounds
    where given, covering all ``length`` tokens of the row), and the tensors the kernels read, made once per
    micro-batch (:meth:`of`)."""

    # id of a live bounds tensor -> {row length: PackedRow} (tensors compare by value, so no WeakKeyDictionary)
    _rows: dict[int, dict[int, PackedRow]] = {}

    def __init__(self, spans: list[tuple[int, int]], device: torch.device) -> None:
        self.spans, self.device = spans, device
        self._places: dict[int, torch.Tensor] = {}

    @classmethod
    def of(cls, params, length: int, device: torch.device) -> PackedRow:
        """The row of megatron's ``PackedSeqParams`` (THD) for ``length`` tokens, shared by the layers of one
        micro-batch (the same bounds tensor). Tokens after the last bound belong to one more span."""
        if params.qkv_format != "thd":
            raise NotImplementedError(f"packed sequences in {params.qkv_format!r} format: THD only")
        bounds = packed_bounds(params)
        rows = cls._rows.get(id(bounds))
        if rows is None:
            rows = cls._rows[id(bounds)] = {}
            weakref.finalize(bounds, cls._rows.pop, id(bounds), None)  # before the id can be reused
        if length not in rows:
            inner = (int(b) for b in bounds.tolist() if 0 < b < length)
            cuts = sorted({0, length, *inner})
            rows[length] = cls(list(zip(cuts[:-1], cuts[1:], strict=True)), device)
        return rows[length]

    @functools.cached_property
    def longest(self) -> int:
        """The longest span's token count (varlen kernels size their grid by it)."""
        return max(b - a for a, b in self.spans)

    def places(self, gap: int) -> torch.Tensor:
        """Where each token sits in a row that puts ``gap`` zeros before each sequence, on the row's device
        (the portable convolution and causal-conv1d restart at each sequence over such a row)."""
        if gap not in self._places:
            shifted = [torch.arange(a, b) + gap * (i + 1) for i, (a, b) in enumerate(self.spans)]
            self._places[gap] = torch.cat(shifted).to(self.device)
        return self._places[gap]

    @functools.cached_property
    def cu_seqlens_cpu(self) -> torch.Tensor:
        return torch.tensor([0, *(b for _, b in self.spans)])

    @functools.cached_property
    def cu_seqlens(self) -> torch.Tensor:
        """fla's varlen bounds, on the row's device."""
        return self.cu_seqlens_cpu.to(self.device)

    @functools.cached_property
    def cu_seqlens_int32(self) -> torch.Tensor:
        """FlashAttention's varlen bounds (int32), on the row's device."""
        return self.cu_seqlens_cpu.to(device=self.device, dtype=torch.int32)

    @functools.cached_property
    def starts(self) -> torch.Tensor:
        """Each token's sequence start (int32), on the row's device (:mod:`twinkle_specs.gdn_conv`)."""
        first = torch.tensor([a for a, _ in self.spans], dtype=torch.int32)
        lengths = torch.tensor([b - a for a, b in self.spans])
        return torch.repeat_interleave(first, lengths).to(self.device)
