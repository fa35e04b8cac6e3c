"""The dense Qwen families' rows of the HF <-> megatron-core weight table, and the layouts rows use.

Each :class:`Rule` pairs a megatron-core parameter (a regex over its *canonical* name, see
:func:`twinkle_specs.weight_map.canonical_name`) with the HF tensor(s) it is made of and a :class:`Layout`
that says how the HF tensors are fused and split over tensor-parallel ranks. A model family adds its rows
in a module of its own (:mod:`.weight_map_hybrid`); :mod:`.weight_map` binds parameters to rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .config_reading import QwenArch

# A reader returns rows [r0, r1) (dim 0) or columns [c0, c1) (dim 1) of an HF tensor, or all of it.
Reader = Callable[[str, "tuple[int, int] | None", "tuple[int, int] | None"], torch.Tensor]


def _chunk(n: int, rank: int, size: int, what: str) -> tuple[int, int]:
    if n % size:
        raise ValueError(f"{what}: dimension {n} is not divisible by the tensor-parallel size {size}")
    step = n // size
    return rank * step, (rank + 1) * step


class Layout:
    """How HF tensors become one megatron parameter's TP shard (``load``), and back (``export``)."""

    def load(self, read: Reader, names: Sequence[str], rank: int, size: int) -> torch.Tensor:
        raise NotImplementedError

    def export(self, shards: Sequence[torch.Tensor], names: Sequence[str]) -> dict[str, torch.Tensor]:
        """``shards`` are the parameter's shards from TP rank 0, 1, ...; returns the HF tensors."""
        raise NotImplementedError


class Replicated(Layout):
    def load(self, read, names, rank, size):
        return read(names[0], None, None)

    def export(self, shards, names):
        return {names[0]: shards[0]}


@dataclass
class RowSplit(Layout):
    """Row-parallel linear: the input dimension (dim 1) is split over TP."""

    cols_total: int

    def load(self, read, names, rank, size):
        return read(names[0], None, _chunk(self.cols_total, rank, size, names[0]))

    def export(self, shards, names):
        return {names[0]: torch.cat(list(shards), dim=1)}


@dataclass
class VocabSplit(Layout):
    """Embedding/output rows split over TP; rows past the HF vocabulary are zeros (never random)."""

    vocab: int
    padded: int
    hidden: int

    def load(self, read, names, rank, size):
        r0, r1 = _chunk(self.padded, rank, size, names[0])
        parts = [read(names[0], (r0, min(r1, self.vocab)), None)] if r0 < self.vocab else []
        if r1 > self.vocab:
            dtype = parts[0].dtype if parts else torch.float32
            parts.append(torch.zeros(r1 - max(r0, self.vocab), self.hidden, dtype=dtype))
        return torch.cat(parts)

    def export(self, shards, names):
        return {names[0]: torch.cat(list(shards))[: self.vocab]}


@dataclass
class GateUp(Layout):
    """linear_fc1 holds [gate shard; up shard] on every TP rank (SwiGLU)."""

    rows_total: int

    def load(self, read, names, rank, size):
        rows = _chunk(self.rows_total, rank, size, names[0])
        return torch.cat([read(names[0], rows, None), read(names[1], rows, None)])

    def export(self, shards, names):
        halves = [s.chunk(2, dim=0) for s in shards]
        return {names[0]: torch.cat([h[0] for h in halves]), names[1]: torch.cat([h[1] for h in halves])}


@dataclass
class QKV(Layout):
    """linear_qkv rows interleaved per query group: [q heads of group g; k_g; v_g] for each group."""

    groups: int
    heads_per_group: int
    head_dim: int

    def load(self, read, names, rank, size):
        g0, g1 = _chunk(self.groups, rank, size, names[0])
        qd, d = self.heads_per_group * self.head_dim, self.head_dim
        q = read(names[0], (g0 * qd, g1 * qd), None)
        k = read(names[1], (g0 * d, g1 * d), None)
        v = read(names[2], (g0 * d, g1 * d), None)
        n, rest = g1 - g0, q.shape[1:]
        parts = [q.reshape(n, qd, *rest), k.reshape(n, d, *rest), v.reshape(n, d, *rest)]
        return torch.cat(parts, dim=1).reshape(-1, *rest)

    def export(self, shards, names):
        full = torch.cat(list(shards))
        qd, d, rest = self.heads_per_group * self.head_dim, self.head_dim, full.shape[1:]
        q, k, v = full.reshape(self.groups, qd + 2 * d, *rest).split([qd, d, d], dim=1)
        return {n: t.reshape(-1, *rest).contiguous() for n, t in zip(names, (q, k, v), strict=True)}


@dataclass(frozen=True)
class Rule:
    """megatron canonical-name regex -> HF name templates ({layer}, {expert}) and their layout."""

    megatron: str
    hf: tuple[str, ...]
    layout: Callable[[QwenArch, int], Layout]  # (arch, padded_vocab) -> Layout
    expert: bool = False  # split over the expert-tensor-parallel group; {expert} is a global index


L = r"decoder\.layers\.(?P<layer>\d+)\."
E = r"mlp\.experts\.local_experts\.(?P<expert>\d+)\."
P = "model.layers.{layer}."


def _qkv(a: QwenArch, _: int) -> Layout:
    return QKV(a.num_query_groups, a.num_attention_heads // a.num_query_groups, a.kv_channels)


def _vocab(a: QwenArch, padded_vocab: int) -> Layout:
    return VocabSplit(a.vocab_size, padded_vocab, a.hidden_size)


def _replicated(_: QwenArch, __: int) -> Layout:
    return Replicated()


RULES: tuple[Rule, ...] = (
    Rule(r"embedding\.word_embeddings\.weight", ("model.embed_tokens.weight",), _vocab),
    Rule(r"decoder\.final_layernorm\.weight", ("model.norm.weight",), _replicated),
    Rule(r"output_layer\.weight", ("lm_head.weight",), _vocab),
    Rule(L + r"input_layernorm\.weight", (P + "input_layernorm.weight",), _replicated),
    Rule(
        L + r"self_attention\.linear_qkv\.weight",
        tuple(P + f"self_attn.{p}_proj.weight" for p in "qkv"),
        _qkv,
    ),
    Rule(L + r"self_attention\.linear_qkv\.bias", tuple(P + f"self_attn.{p}_proj.bias" for p in "qkv"), _qkv),
    Rule(
        L + r"self_attention\.linear_proj\.weight",
        (P + "self_attn.o_proj.weight",),
        lambda a, _: RowSplit(a.num_attention_heads * a.kv_channels),
    ),
    Rule(L + r"self_attention\.q_layernorm\.weight", (P + "self_attn.q_norm.weight",), _replicated),
    Rule(L + r"self_attention\.k_layernorm\.weight", (P + "self_attn.k_norm.weight",), _replicated),
    Rule(L + r"pre_mlp_layernorm\.weight", (P + "post_attention_layernorm.weight",), _replicated),
    Rule(
        L + r"mlp\.linear_fc1\.weight",
        (P + "mlp.gate_proj.weight", P + "mlp.up_proj.weight"),
        lambda a, _: GateUp(a.ffn_hidden_size),
    ),
    Rule(
        L + r"mlp\.linear_fc2\.weight",
        (P + "mlp.down_proj.weight",),
        lambda a, _: RowSplit(a.ffn_hidden_size),
    ),
    Rule(L + r"mlp\.router\.weight", (P + "mlp.gate.weight",), _replicated),
    Rule(
        L + E + r"linear_fc1\.weight",
        (P + "mlp.experts.{expert}.gate_proj.weight", P + "mlp.experts.{expert}.up_proj.weight"),
        lambda a, _: GateUp(a.moe_ffn_hidden_size or 0),
        expert=True,
    ),
    Rule(
        L + E + r"linear_fc2\.weight",
        (P + "mlp.experts.{expert}.down_proj.weight",),
        lambda a, _: RowSplit(a.moe_ffn_hidden_size or 0),
        expert=True,
    ),
    Rule(
        L + r"mlp\.shared_experts\.linear_fc1\.weight",
        (P + "mlp.shared_expert.gate_proj.weight", P + "mlp.shared_expert.up_proj.weight"),
        lambda a, _: GateUp(a.shared_expert_intermediate_size or 0),
    ),
    Rule(
        L + r"mlp\.shared_experts\.linear_fc2\.weight",
        (P + "mlp.shared_expert.down_proj.weight",),
        lambda a, _: RowSplit(a.shared_expert_intermediate_size or 0),
    ),
    Rule(L + r"mlp\.shared_experts\.gate_weight", (P + "mlp.shared_expert_gate.weight",), _replicated),
)
