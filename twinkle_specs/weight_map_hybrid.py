"""Weight-map rows of the hybrid Qwen models (Qwen3-Next, Qwen3.5, Qwen3.5-MoE), in the style of
:mod:`.weight_map`: the rules here are tried before the shared ones (the gated attention's ``linear_qkv``
replaces the plain QKV layout), and multimodal Qwen3.5 checkpoints keep their language model under
``model.language_model.`` (see :func:`hf_name`).

Gated DeltaNet (megatron-core's parameter layout, :class:`~twinkle_specs.gdn.PortableGatedDeltaNet`):
``in_proj`` holds, on each TP rank, that rank's [q; k; v; z; beta; alpha] rows (its key heads and their
value heads); ``conv1d`` its [q; k; v] channels; ``A_log``/``dt_bias`` its value heads. Qwen3.5 stores
in_proj_qkv / in_proj_z / in_proj_b / in_proj_a; Qwen3-Next in_proj_qkvz / in_proj_ba grouped per key head.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from .config_reading import QwenArch
from .weight_rules import RULES, L, Layout, P, Replicated, RowSplit, Rule, _chunk


@dataclass
class GatedQKV(Layout):
    """linear_qkv of gated attention: per query group [q heads; their gates; k; v]. transformers' q_proj
    holds [q; gate] per head."""

    groups: int
    heads_per_group: int
    head_dim: int

    def load(self, read, names, rank, size):
        g0, g1 = _chunk(self.groups, rank, size, names[0])
        hpg, d = self.heads_per_group, self.head_dim
        qg = read(names[0], (g0 * hpg * 2 * d, g1 * hpg * 2 * d), None)
        k = read(names[1], (g0 * d, g1 * d), None)
        v = read(names[2], (g0 * d, g1 * d), None)
        n, rest = g1 - g0, qg.shape[1:]
        qg = qg.reshape(n, hpg, 2, d, *rest)
        parts = [
            qg[:, :, 0].reshape(n, hpg * d, *rest),
            qg[:, :, 1].reshape(n, hpg * d, *rest),
            k.reshape(n, d, *rest),
            v.reshape(n, d, *rest),
        ]
        return torch.cat(parts, dim=1).reshape(-1, *rest)

    def export(self, shards, names):
        full = torch.cat(list(shards))
        hpg, d, rest = self.heads_per_group, self.head_dim, full.shape[1:]
        q, gate, k, v = full.reshape(self.groups, 2 * hpg * d + 2 * d, *rest).split(
            [hpg * d, hpg * d, d, d], dim=1
        )
        qg = torch.stack([q.reshape(self.groups, hpg, d, *rest), gate.reshape(self.groups, hpg, d, *rest)], 2)
        return {
            names[0]: qg.reshape(-1, *rest).contiguous(),
            names[1]: k.reshape(-1, *rest).contiguous(),
            names[2]: v.reshape(-1, *rest).contiguous(),
        }


@dataclass
class GDNInProj(Layout):
    """in_proj rows of one TP rank: [q; k; v; z; beta; alpha] of its key heads and their value heads."""

    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    fused: bool  # Qwen3-Next: (in_proj_qkvz, in_proj_ba) grouped per key head

    def _sections(self, size: int) -> list[int]:
        qk, v, nv = self.key_heads * self.key_dim, self.value_heads * self.value_dim, self.value_heads
        return [qk // size, qk // size, v // size, v // size, nv // size, nv // size]

    def load(self, read, names, rank, size):
        k0, k1 = _chunk(self.key_heads, rank, size, names[0])
        v0, v1 = _chunk(self.value_heads, rank, size, names[0])
        dk, dv, r = self.key_dim, self.value_dim, self.value_heads // self.key_heads
        if self.fused:
            group = 2 * dk + 2 * r * dv
            qkvz = read(names[0], (k0 * group, k1 * group), None)
            ba = read(names[1], (k0 * 2 * r, k1 * 2 * r), None)
            n, rest = k1 - k0, qkvz.shape[1:]
            q, k, v, z = qkvz.reshape(n, group, *rest).split([dk, dk, r * dv, r * dv], dim=1)
            b, a = ba.reshape(n, 2 * r, *rest).split([r, r], dim=1)
            return torch.cat([t.reshape(-1, *rest) for t in (q, k, v, z, b, a)])
        qk = self.key_heads * dk
        return torch.cat(
            [
                read(names[0], (k0 * dk, k1 * dk), None),
                read(names[0], (qk + k0 * dk, qk + k1 * dk), None),
                read(names[0], (2 * qk + v0 * dv, 2 * qk + v1 * dv), None),
                read(names[1], (v0 * dv, v1 * dv), None),
                read(names[2], (v0, v1), None),
                read(names[3], (v0, v1), None),
            ]
        )

    def export(self, shards, names):
        split = [s.split(self._sections(len(shards))) for s in shards]
        q, k, v, z, b, a = (torch.cat([parts[i] for parts in split]) for i in range(6))
        rest = q.shape[1:]
        if not self.fused:
            return {
                names[0]: torch.cat([q, k, v]),
                names[1]: z.contiguous(),
                names[2]: b.contiguous(),
                names[3]: a.contiguous(),
            }
        nk, dk, r, dv = self.key_heads, self.key_dim, self.value_heads // self.key_heads, self.value_dim
        qkvz = torch.cat(
            [
                q.reshape(nk, dk, *rest),
                k.reshape(nk, dk, *rest),
                v.reshape(nk, r * dv, *rest),
                z.reshape(nk, r * dv, *rest),
            ],
            dim=1,
        )
        ba = torch.cat([b.reshape(nk, r, *rest), a.reshape(nk, r, *rest)], dim=1)
        return {names[0]: qkvz.reshape(-1, *rest), names[1]: ba.reshape(-1, *rest)}


@dataclass
class SectionSplit(Layout):
    """Dim 0 made of sections (conv1d channels [q; k; v]; or one section: A_log, dt_bias), each split
    over TP; a rank holds its part of every section, in order."""

    sections: tuple[int, ...]

    def load(self, read, names, rank, size):
        parts, start = [], 0
        for n in self.sections:
            r0, r1 = _chunk(n, rank, size, names[0])
            parts.append(read(names[0], (start + r0, start + r1), None))
            start += n
        return torch.cat(parts)

    def export(self, shards, names):
        local = [n // len(shards) for n in self.sections]
        split = [s.split(local) for s in shards]
        return {names[0]: torch.cat([parts[i] for i in range(len(local)) for parts in split])}


GDN = r"self_attention\."
A = P + "linear_attn."


def _gdn_in_proj_names(a: QwenArch) -> tuple[str, ...]:
    return (A + "in_proj_qkvz.weight", A + "in_proj_ba.weight")


def _in_proj(a: QwenArch, _: int) -> Layout:
    h = a.hybrid
    return GDNInProj(
        h.num_key_heads, h.num_value_heads, h.key_head_dim, h.value_head_dim, h.fused_projections
    )


def _conv(a: QwenArch, _: int) -> Layout:
    h = a.hybrid
    qk = h.num_key_heads * h.key_head_dim
    return SectionSplit((qk, qk, h.num_value_heads * h.value_head_dim))


def _value_heads(a: QwenArch, _: int) -> Layout:
    return SectionSplit((a.hybrid.num_value_heads,))


HYBRID_RULES: tuple[Rule, ...] = (
    Rule(
        L + GDN + r"linear_qkv\.weight",
        tuple(P + f"self_attn.{p}_proj.weight" for p in "qkv"),
        lambda a, _: GatedQKV(a.num_query_groups, a.num_attention_heads // a.num_query_groups, a.kv_channels),
    ),
    # in_proj: the names are the Qwen3.5 ones; hf_names() swaps in Qwen3-Next's fused pair.
    Rule(
        L + GDN + r"in_proj\.weight",
        (A + "in_proj_qkv.weight", A + "in_proj_z.weight", A + "in_proj_b.weight", A + "in_proj_a.weight"),
        _in_proj,
    ),
    Rule(L + GDN + r"conv1d\.weight", (A + "conv1d.weight",), _conv),
    Rule(L + GDN + r"A_log", (A + "A_log",), _value_heads),
    Rule(L + GDN + r"dt_bias", (A + "dt_bias",), _value_heads),
    Rule(L + GDN + r"out_norm\.weight", (A + "norm.weight",), lambda a, _: Replicated()),
    Rule(
        L + GDN + r"out_proj\.weight",
        (A + "out_proj.weight",),
        lambda a, _: RowSplit(a.hybrid.num_value_heads * a.hybrid.value_head_dim),
    ),
)
COMPILED_HYBRID = tuple((re.compile(r.megatron + "$"), r) for r in HYBRID_RULES + RULES)
# TE fuses the GDN layer's input norm into in_proj (as megatron-core's own GDN spec does).
HYBRID_ALIASES = ((re.compile(r"self_attention\.in_proj\.layer_norm_weight$"), "input_layernorm.weight"),)


def hf_names(arch: QwenArch, rule: Rule, names: tuple[str, ...]) -> tuple[str, ...]:
    """The rule's HF names for this checkpoint: Qwen3-Next's fused GDN projections, and the language
    model's prefix of multimodal checkpoints."""
    h = arch.hybrid
    if rule.megatron.endswith(r"in_proj\.weight") and h.fused_projections:
        layer = names[0].split(".")[2]
        names = tuple(n.replace("{layer}", layer) for n in _gdn_in_proj_names(arch))
    if h.text_prefix != "model.":
        names = tuple(h.text_prefix + n[len("model.") :] if n.startswith("model.") else n for n in names)
    return names


def hybrid_tensor_shapes(arch: QwenArch, shared: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """``shared`` (the shapes every Qwen layer has, from weight_map.hf_tensor_shapes) made hybrid: gated
    q_proj, linear_attn tensors instead of self_attn ones on linear layers, the checkpoint's prefix."""
    h = arch.hybrid
    out = dict(shared)
    d, hid = arch.kv_channels, arch.hidden_size
    qk, v, nv = h.num_key_heads * h.key_head_dim, h.num_value_heads * h.value_head_dim, h.num_value_heads
    for i, kind in enumerate(h.layer_types):
        p = f"model.layers.{i}."
        if kind == "full_attention":
            out[p + "self_attn.q_proj.weight"] = (2 * arch.num_attention_heads * d, hid)
            continue
        for name in [n for n in out if n.startswith(p + "self_attn.")]:
            del out[name]
        a = p + "linear_attn."
        if h.fused_projections:
            out[a + "in_proj_qkvz.weight"] = (2 * qk + 2 * v, hid)
            out[a + "in_proj_ba.weight"] = (2 * nv, hid)
        else:
            out |= {
                a + "in_proj_qkv.weight": (2 * qk + v, hid),
                a + "in_proj_z.weight": (v, hid),
                a + "in_proj_b.weight": (nv, hid),
                a + "in_proj_a.weight": (nv, hid),
            }
        out |= {
            a + "conv1d.weight": (2 * qk + v, 1, h.conv_kernel),
            a + "A_log": (nv,),
            a + "dt_bias": (nv,),
            a + "norm.weight": (h.value_head_dim,),
            a + "out_proj.weight": (hid, v),
        }
    if h.text_prefix == "model.":
        return out
    return {h.text_prefix + k[len("model.") :] if k.startswith("model.") else k: s for k, s in out.items()}
