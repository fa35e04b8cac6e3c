"""twinkle_specs.flash_attention's own logic on CPU: the layout around FlashAttention-4's calls, plain and
packed, which calls it serves, the configs it refuses and the spec wiring.

FlashAttention-4 and Transformer Engine cannot run here. Stand-ins for ``flash_attn_func`` and
``flash_attn_varlen_func`` compute causal GQA attention with torch's SDPA on FlashAttention's layouts
([b, s, heads, d]; [tokens, heads, d] with int32 bounds, one sequence at a time), and one for megatron's
``TEDotProductAttention`` records the calls handed back to it; the expected output is megatron's own
layout from the portable :class:`~twinkle_specs.spec.SDPACoreAttention`. The kernels' numerics against
TE's attention are covered by tests/test_lora_gpu.py (``-m gpu``).
"""

from __future__ import annotations

import dataclasses
import sys
import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType

from twinkle_specs import flash_attention, spec
from twinkle_specs.config_mapping import transformer_config_from_hf
from twinkle_specs.spec import SDPACoreAttention

TOL = 1e-6  # fp32, the same SDPA arithmetic on both sides
SCALE = 0.3  # not 1/sqrt(d): the scale must reach the kernel


def _fake_flash_attn_func(q, k, v, softmax_scale=None, causal=False, deterministic=False):
    """FlashAttention-4's call on [b, s, heads, d], by SDPA; returns ``(out, lse)`` as some releases do."""
    assert causal and q.stride(-1) == 1
    out = F.scaled_dot_product_attention(
        *(t.transpose(1, 2) for t in (q, k, v)), is_causal=True, scale=softmax_scale, enable_gqa=True
    )
    return out.transpose(1, 2), None


def _fake_flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                 softmax_scale=None, causal=False, deterministic=False):  # fmt: skip
    """FlashAttention-4's varlen call on [tokens, heads, d]: each sequence of the bounds alone, by SDPA."""
    assert causal and cu_seqlens_q is cu_seqlens_k and cu_seqlens_q.dtype == torch.int32
    bounds = cu_seqlens_q.tolist()
    assert bounds[-1] == q.shape[0] and max_seqlen_q == max_seqlen_k == max(np.diff(bounds))
    outs = [
        _fake_flash_attn_func(*(t[None, a:b] for t in (q, k, v)), softmax_scale=softmax_scale, causal=True)[
            0
        ][0]
        for a, b in zip(bounds[:-1], bounds[1:], strict=True)
    ]
    return torch.cat(outs), None


class _TEAttention(torch.nn.Module):
    """megatron's TEDotProductAttention as FlashAttention4 uses it: its constructor, TE's softmax scale on
    ``fused_attention``, ``deterministic``; its forward records what was handed to it."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, softmax_scale=None, **_):
        super().__init__()
        self.config = config
        self.fused_attention = types.SimpleNamespace(softmax_scale=SCALE)
        self.deterministic = False
        self.handed_back: list[dict] = []

    def forward(self, query, key, value, attention_mask, attn_mask_type, attention_bias=None,
                packed_seq_params=None, **kwargs):  # fmt: skip
        self.handed_back.append({"mask": attn_mask_type, "packed": packed_seq_params, **kwargs})
        return torch.zeros(*query.shape[:-2], query.shape[-2] * query.shape[-1])  # [s, b, h] or THD [t, h]


@pytest.fixture
def stand_ins(monkeypatch):
    monkeypatch.setattr(flash_attention, "flash_attn_func", lambda: _fake_flash_attn_func)
    monkeypatch.setattr(flash_attention, "flash_attn_varlen_func", lambda: _fake_flash_attn_varlen_func)
    monkeypatch.setattr(flash_attention, "_te_dot_product_attention", lambda: _TEAttention)
    flash_attention.flash_attention_4_class.cache_clear()
    yield flash_attention.flash_attention_4_class()
    flash_attention.flash_attention_4_class.cache_clear()


def _config(**overrides):
    return transformer_config_from_hf(_default_dir(), transformer_impl="local", **overrides)


def _default_dir():
    from pathlib import Path

    import twinkle_specs

    return Path(twinkle_specs.__file__).parent / "defaults" / "qwen3-tiny"


def _qkv(s: int, b: int, heads: int, groups: int, d: int):
    g = torch.Generator().manual_seed(0)
    make = lambda h: torch.randn(s, b, h, d, generator=g, requires_grad=True)  # noqa: E731
    return make(heads), make(groups), make(groups)


@pytest.mark.parametrize("batch", [1, 3])
def test_attention_matches_megatrons_layout_and_gradients(stand_ins, batch):
    """[s, b, heads, d] in, [s, b, heads * d] out, GQA and the scale as the portable core attention computes
    them; gradients too (batch 3: the output's reshape is a copy, not a view)."""
    config = _config()
    attn = stand_ins(config, 1, AttnMaskType.causal, "self")
    reference = SDPACoreAttention(config, 1, AttnMaskType.causal, "self", softmax_scale=SCALE)
    q, k, v = _qkv(7, batch, heads=4, groups=2, d=8)
    got = attn(q, k, v, None, attn_mask_type=AttnMaskType.causal)
    want = reference(q, k, v, None, attn_mask_type=AttnMaskType.causal)
    assert got.shape == (7, batch, 32)
    torch.testing.assert_close(got, want, rtol=TOL, atol=TOL)
    dout = torch.randn_like(want)
    grads = torch.autograd.grad(got, (q, k, v), dout)
    want_grads = torch.autograd.grad(want, (q, k, v), dout)
    for g, w in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=TOL, atol=TOL)
    assert attn.handed_back == []


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"attention_bias": torch.zeros(1)}, {"mask": AttnMaskType.causal, "packed": None}),
        (
            {"attn_mask_type": AttnMaskType.padding_causal},
            {"mask": AttnMaskType.padding_causal, "packed": None},
        ),
        ({"num_splits": 2}, {"mask": AttnMaskType.causal, "packed": None, "num_splits": 2}),
    ],
)
def test_calls_it_cannot_serve_go_to_transformer_engine(stand_ins, kwargs, expected):
    attn = stand_ins(_config(), 1, AttnMaskType.causal, "self")
    q, k, v = _qkv(5, 1, heads=4, groups=2, d=8)
    call = {"attn_mask_type": AttnMaskType.causal, **kwargs}
    out = attn(q, k, v, None, **call)
    assert attn.handed_back == [expected]
    assert not out.any()  # the stand-in's zeros: TE's result is what came back


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"attention_dropout": 0.1}, "attention dropout"),
        ({"window_size": (128, 0)}, "sliding-window"),
        ({"softmax_type": "off-by-one"}, "softmax"),
    ],
)
def test_configs_no_call_could_serve_are_refused_at_build(stand_ins, overrides, named):
    config = _config(**overrides)
    assert named in flash_attention.config_refusal(config)
    with pytest.raises(ValueError, match=f"{named}.*drop --flash-attn-4"):
        stand_ins(config, 1, AttnMaskType.causal, "self")


def test_a_plain_config_is_not_refused():
    assert flash_attention.config_refusal(_config()) is None


def _packed(bounds: list[int], padded: list[int] | None = None, **fields):
    from test_sft import _packed_params

    def cu(values):
        return None if values is None else torch.tensor(values, dtype=torch.int32)

    return _packed_params(cu(bounds), cu(padded), **fields)


@pytest.mark.parametrize("mask", [AttnMaskType.causal, AttnMaskType.padding_causal])
@pytest.mark.parametrize(
    ("bounds", "padded"),
    [([0, 5, 6, 13], None), ([0, 3, 7, 12], [0, 5, 9, 13])],  # 13 tokens; 2 + 2 + 1 of padding
    ids=["bounds", "padded-bounds"],
)
def test_packed_rows_attend_inside_each_sequence(stand_ins, mask, bounds, padded):
    """THD ([tokens, heads, d] in, [tokens, heads * d] out): causal inside each sequence, the padded bounds
    where given, outputs and gradients as the portable core attention's packed path computes them."""
    config = _config()
    attn = stand_ins(config, 1, AttnMaskType.causal, "self")
    reference = SDPACoreAttention(config, 1, AttnMaskType.causal, "self", softmax_scale=SCALE)
    q, k, v = (t[:, 0] for t in _qkv(13, 1, heads=4, groups=2, d=8))
    params = _packed(bounds, padded)
    got = attn(q, k, v, None, attn_mask_type=mask, packed_seq_params=params)
    want = reference(q, k, v, None, attn_mask_type=AttnMaskType.causal, packed_seq_params=params)
    assert got.shape == (13, 32) and attn.handed_back == []
    torch.testing.assert_close(got, want, rtol=TOL, atol=TOL)
    dout = torch.randn_like(want)
    for g, w in zip(
        torch.autograd.grad(got, (q, k, v), dout), torch.autograd.grad(want, (q, k, v), dout), strict=True
    ):
        torch.testing.assert_close(g, w, rtol=TOL, atol=TOL)


def test_packed_rows_it_cannot_serve_go_to_transformer_engine(stand_ins):
    """Keys bounded other than the queries, a dynamic context-parallel group, the non-causal padding mask:
    TE's forward, with the call as it came."""
    attn = stand_ins(_config(), 1, AttnMaskType.causal, "self")
    q, k, v = (t[:, 0] for t in _qkv(8, 1, heads=4, groups=2, d=8))
    other_keys = _packed([0, 4, 8])
    other_keys.cu_seqlens_kv = other_keys.cu_seqlens_kv.clone()
    calls = [
        (other_keys, AttnMaskType.padding_causal),
        (_packed([0, 4, 8], local_cp_size=2), AttnMaskType.causal),
        (_packed([0, 4, 8]), AttnMaskType.padding),
    ]
    for params, mask in calls:
        assert not attn(q, k, v, None, attn_mask_type=mask, packed_seq_params=params).any()
    assert attn.handed_back == [{"mask": mask, "packed": params} for params, mask in calls]


def test_missing_package_names_the_flag_and_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)  # import fails as if not installed
    flash_attention._kernels.cache_clear()
    try:
        for kernel in (flash_attention.flash_attn_func, flash_attention.flash_attn_varlen_func):
            with pytest.raises(ImportError, match=r"--flash-attn-4.*twinkle-specs\[flash-attn-4\]"):
                kernel()
    finally:
        flash_attention._kernels.cache_clear()


def test_the_spec_swaps_only_the_core_attention(stand_ins, monkeypatch):
    """With ``config.flash_attn_4`` the TE layer's core attention is FlashAttention4, the rest of the
    attention spec as megatron's (its TE spec needs TE: megatron's portable one stands in for it here)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    monkeypatch.setattr(spec, "get_gpt_layer_with_transformer_engine_spec", get_gpt_layer_local_spec)
    config = _config()
    plain = spec._megatron_layer_submodules(
        dataclasses.replace(config, transformer_impl="transformer_engine")
    )
    config.transformer_impl, config.flash_attn_4 = "transformer_engine", True
    swapped = spec._megatron_layer_submodules(config)
    assert swapped.self_attention.submodules.core_attention is stand_ins
    assert (
        dataclasses.replace(
            swapped.self_attention.submodules, core_attention=plain.self_attention.submodules.core_attention
        )
        == plain.self_attention.submodules
    )


def test_the_portable_path_refuses_the_flag():
    config = _config()
    config.flash_attn_4 = True
    with pytest.raises(ValueError, match="--flash-attn-4.*--transformer-impl transformer_engine"):
        spec._megatron_layer_submodules(config)


def test_launch_refusal_names_what_blocks_the_flag(monkeypatch):
    """Megatron's parsed args (a namespace with the TransformerConfig's field names): the package, the portable
    modules, then the config's reasons."""
    import importlib.util
    from types import SimpleNamespace

    args = SimpleNamespace(
        transformer_impl="transformer_engine",
        context_parallel_size=2,
        attention_dropout=0.0,
        window_size=None,
    )
    find = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name: None if name.startswith("flash_attn") else find(name)
    )
    assert "not installed: pip install 'twinkle-specs[flash-attn-4]'" in flash_attention.launch_refusal(args)
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name: object() if name.startswith("flash_attn") else find(name)
    )
    assert "context parallelism" in flash_attention.launch_refusal(args)
    args.transformer_impl = "local"
    assert "--transformer-impl transformer_engine, not local" in flash_attention.launch_refusal(args)
    args.transformer_impl, args.context_parallel_size = "transformer_engine", 1
    assert flash_attention.launch_refusal(args) is None
