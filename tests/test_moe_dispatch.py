"""The MoE dispatch patches' logic on a CPU host (patches/moe_single_rank_sort.py,
patches/moe_counts_on_device.py, patches/moe_permute_fixed_size.py); their no-sync evidence is
tests/test_patches_gpu.py, the capture of whole MoE layers tests/test_launch_gpu.py.

With one expert- and tensor-parallel rank megatron's all-to-all dispatcher sorts the routed tokens by a
chunk order that is the identity, and copies the experts' token counts to the host for experts that
(under twinkle's LoRA) take them on the device. Patched, the MoE block computes the same values without
either: its output and every gradient equal those of megatron's all-gather dispatcher bit for bit, over
the TE stand-ins, with torch's grouped GEMM forced (CPU runs torch's own kernel).
"""

from __future__ import annotations

import types

import pytest
import torch
from test_lora_moe_memory import EXPERTS, HIDDEN, TOKENS, _moe_layer, _step, cpu_recompute  # noqa: F401
from test_lora_support import single_rank  # noqa: F401  (fixture)
from test_lora_te_standin import te  # noqa: F401  (fixture)
from twinkle_specs.patches import moe_counts_on_device, moe_permute_fixed_size, moe_single_rank_sort

from twinkle_specs.lora import experts as lora_experts
from twinkle_specs.lora.model import keep_routed_counts_on_device


@pytest.fixture
def alltoall_on_host(monkeypatch):
    """megatron's all-to-all dispatcher built on a CPU host: its constructor makes a CUDA stream for the
    counts' copy once per process (stood in: the patched dispatch never uses it)."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    monkeypatch.setattr(MoEAlltoAllTokenDispatcher, "cuda_dtoh_stream", object())
    return MoEAlltoAllTokenDispatcher


def _patch(monkeypatch, dispatcher, sort: bool = True) -> list[int]:
    """Both patches in force for this test (undone after it); returns the list counting upstream's sorts."""
    from megatron.core.transformer.moe import token_dispatcher

    upstream, sorts = token_dispatcher.sort_chunks_by_idxs, []

    def counted(*args, **kwargs):
        sorts.append(1)
        return upstream(*args, **kwargs)

    monkeypatch.setattr(token_dispatcher, "sort_chunks_by_idxs", counted)
    if sort:
        monkeypatch.setattr(
            token_dispatcher, "sort_chunks_by_idxs", moe_single_rank_sort.skipping_identity(counted)
        )
        monkeypatch.setattr(
            dispatcher, "__init__", moe_single_rank_sort.marking_identity(dispatcher.__init__)
        )
    wrapped = moe_counts_on_device.leaving_counts_on_device(dispatcher._maybe_dtoh_and_synchronize)
    monkeypatch.setattr(dispatcher, "_maybe_dtoh_and_synchronize", wrapped)
    return sorts


def test_one_rank_chunk_orders_are_the_identity_and_marked(te, single_rank, alltoall_on_host, monkeypatch):  # noqa: F811
    """With one EP x TP rank the dispatcher's two chunk orders are 0..experts-1, the sort with either is
    a copy (upstream's unfused sort, on real tokens), and the patch marks both."""
    from megatron.core.transformer.moe.moe_utils import sort_chunks_by_idxs

    _patch(monkeypatch, alltoall_on_host)
    dispatcher = _moe_layer(te, moe_token_dispatcher_type="alltoall").token_dispatcher
    counts = torch.tensor([3, 0, 5, 1, 2, 4])
    x, probs = torch.randn(int(counts.sum()), HIDDEN), torch.rand(int(counts.sum()))
    for order in (dispatcher.sort_input_by_local_experts, dispatcher.restore_output_by_local_experts):
        assert torch.equal(order, torch.arange(EXPERTS))
        assert getattr(order, moe_single_rank_sort.KEEPS_ORDER)
        out, out_probs = sort_chunks_by_idxs(x, counts, order, probs=probs)
        assert torch.equal(out, x) and torch.equal(out_probs, probs)


@pytest.mark.parametrize(
    "targets", [("gate_proj", "up_proj", "down_proj"), ("q_proj",)], ids=["adapted", "frozen"]
)
def test_alltoall_with_counts_on_device_equals_allgather(
    te,  # noqa: F811
    single_rank,  # noqa: F811
    cpu_recompute,  # noqa: F811
    alltoall_on_host,
    monkeypatch,
    targets,
):
    """The LoRA MoE block through the patched all-to-all dispatcher (no sort, the counts handed to the
    experts as :class:`DeviceCounts`, their grouped GEMMs' offsets taken from them) gives the all-gather
    dispatcher's output, input gradient and adapter gradients bit for bit, with the experts adapted and
    with them left frozen (mlp.FrozenGroupedMLP); upstream's sort (patch off) too, called twice a
    forward."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(TOKENS // 2, 2, HIDDEN, generator=g)
    grad = torch.randn(TOKENS // 2, 2, HIDDEN, generator=g)
    monkeypatch.setattr(te, "grouped_mm_fits", lambda *a: True)
    torch.manual_seed(0)
    want = _step(_moe_layer(te, targets), x, grad)

    ends = []
    real_ends = lora_experts.DeviceCounts.ends
    monkeypatch.setattr(lora_experts.DeviceCounts, "ends", lambda self: ends.append(self) or real_ends(self))
    for sort in (True, False):
        with monkeypatch.context() as m:
            sorts = _patch(m, alltoall_on_host, sort=sort)
            torch.manual_seed(0)
            moe = _moe_layer(te, targets, moe_token_dispatcher_type="alltoall")
            keep_routed_counts_on_device(moe)
            assert moe.token_dispatcher.counts_on_device
            ends.clear()
            got = _step(moe, x, grad)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), sort
        assert len(sorts) == (0 if sort else 2), (sort, len(sorts))
        assert len({id(c) for c in ends}) == 1, "fc1 and fc2 share one DeviceCounts"


def test_counts_stay_where_experts_cannot_take_them(te, single_rank, alltoall_on_host, monkeypatch):  # noqa: F811
    """A dispatcher is asked to leave the counts on the device only where its experts take them, adapted
    or frozen: not with a bias (megatron splits it per expert on the host), nor with fp8 (it pads each
    expert's block there). Where it is not asked, it keeps the experts' reason, naming the flag."""
    _patch(monkeypatch, alltoall_on_host)
    for kwargs, reason in [
        ({}, None),
        ({"targets": ("q_proj",)}, None),
        ({"add_bias_linear": True}, "--disable-bias-linear"),
    ]:
        moe = _moe_layer(te, moe_token_dispatcher_type="alltoall", **kwargs)
        keep_routed_counts_on_device(moe)
        dispatcher = moe.token_dispatcher
        assert dispatcher.counts_on_device == (reason is None), kwargs
        assert (
            (dispatcher.host_counts_reason is None)
            if reason is None
            else reason in dispatcher.host_counts_reason
        )
    moe = _moe_layer(te, moe_token_dispatcher_type="alltoall")
    moe.experts.config = types.SimpleNamespace(**{**vars(moe.experts.config), "fp8": "hybrid"})
    keep_routed_counts_on_device(moe)
    assert not moe.token_dispatcher.counts_on_device
    assert "--fp8-format" in moe.token_dispatcher.host_counts_reason


def _stand_in_dispatcher(**change) -> types.SimpleNamespace:
    """What the counts patch reads of a dispatcher: one EP and TP rank, dropless, no capacity or padding,
    asked to leave the counts on the GPU; ``change`` overrides any of it (``moe_*`` in its config)."""
    config = {"moe_expert_capacity_factor": None, "moe_router_padding_for_quantization": False}
    fields = {"ep_size": 1, "tp_size": 1, "drop_and_pad": False, "counts_on_device": True}
    config |= {k: v for k, v in change.items() if k.startswith("moe_")}
    fields |= {k: v for k, v in change.items() if not k.startswith("moe_")}
    return types.SimpleNamespace(config=types.SimpleNamespace(**config), **fields)


@pytest.mark.parametrize(
    "change, reason",
    [
        ({}, None),
        ({"ep_size": 2}, "expert-parallel size above 1: the all-to-all's split sizes"),
        ({"tp_size": 2}, "expert tensor-parallel size above 1"),
        ({"drop_and_pad": True}, "--moe-pad-expert-input-to-capacity"),
        ({"moe_expert_capacity_factor": 1.0}, "--moe-expert-capacity-factor"),
        ({"moe_router_padding_for_quantization": True}, "--moe-router-padding-for-quantization"),
        ({"counts_on_device": False}, None),
    ],
    ids=["left", "ep2", "tp2", "drop_and_pad", "capacity", "padding", "not_asked"],
)
def test_counts_are_copied_as_upstream_unless_asked_and_enough(change, reason):
    """Upstream's copy and wait run for every dispatcher not asked, and for every asked one that needs
    host values: split sizes for an all-to-all or gather over several ranks, a data-dependent output
    size (capacity, padding); what needs them is named by the setting that does."""
    dispatcher = _stand_in_dispatcher(**change)
    calls = []
    wrapped = moe_counts_on_device.leaving_counts_on_device(lambda *a: calls.append(a) or "upstream")
    counts = torch.tensor([2, 0, 1])
    got = wrapped(dispatcher, "before_finish", counts)
    assert (got is counts) == (change == {}) and (calls == []) == (change == {}), change
    assert moe_counts_on_device.dispatch_host_reason(dispatcher) == reason


@pytest.mark.parametrize(
    "change, why",
    [
        ({"counts_on_device": False}, r"need the counts on the host \(only twinkle LoRA's grouped-GEMM"),
        (
            {"counts_on_device": False, "host_counts_reason": "biases on the linears"},
            r"need the counts on the host \(biases on the linears\)",
        ),
        ({"ep_size": 2}, r"needs host values itself \(expert-parallel size above 1"),
        ({"moe_expert_capacity_factor": 1.0}, r"needs host values itself \(--moe-expert-capacity-factor\)"),
    ],
    ids=["not_twinkle", "experts_reason", "ep2", "capacity"],
)
def test_capture_that_would_wait_is_refused_with_the_scope_to_use(monkeypatch, change, why):
    """Inside a CUDA graph capture, a dispatcher that must wait for the counts on the host (upstream then
    fails in CUDA with an event error) refuses at its wait, saying why and which scope captures around
    the experts; its copy point still runs upstream's (a partial scope captures the copy), and a
    dispatcher that leaves the counts on the GPU is unaffected."""
    monkeypatch.setattr(moe_counts_on_device, "capturing", lambda: True)
    waits_at, counts, calls = "before_finish", torch.tensor([2, 0, 1]), []
    wrapped = moe_counts_on_device.leaving_counts_on_device(lambda *a: calls.append(a[1]) or "upstream")

    left = _stand_in_dispatcher(cuda_sync_point=waits_at)
    assert wrapped(left, waits_at, counts) is counts and calls == []
    needs_host = _stand_in_dispatcher(cuda_sync_point=waits_at, **change)
    assert wrapped(needs_host, "before_permutation_1", counts) == "upstream"
    with pytest.raises(RuntimeError, match=why) as refused:
        wrapped(needs_host, waits_at, counts)
    assert "--cuda-graph-scope attn moe_router moe_preprocess" in str(refused.value)
    assert calls == ["before_permutation_1"]


def _routing(tokens: int, experts: int, topk: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """A dropless top-k routing map [tokens, experts], router probabilities and hidden states."""
    g = torch.Generator().manual_seed(seed)
    top = torch.rand(tokens, experts, generator=g).topk(topk, dim=1).indices
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool).scatter_(1, top, True)
    return routing_map, torch.rand(tokens, experts, generator=g), torch.randn(tokens, 6, generator=g)


@pytest.mark.parametrize("with_probs", [False, True], ids=["tokens", "tokens_and_probs"])
def test_fixed_size_permute_equals_upstreams(with_probs):
    """The dropless permute by argsort gives megatron's own permute's tokens, probabilities and indices bit
    for bit (on core 0.16 upstream takes them by masked_select, on 0.19 by the same argsort), and the
    masked_select of core 0.16 in the same order, without calling upstream."""
    from megatron.core.transformer.moe import moe_utils

    routing_map, probs, tokens = _routing(tokens=37, experts=8, topk=2)
    probs = probs if with_probs else None
    calls = []
    permute = moe_permute_fixed_size.fixed_size(lambda *a: calls.append(a))
    got = permute(tokens, routing_map, probs=probs, num_out_tokens=37 * 2)
    upstream = moe_utils.permute(tokens, routing_map, probs=probs, num_out_tokens=37 * 2)[:3]
    mask = routing_map.T.contiguous()
    selected = torch.arange(37).expand(8, -1).masked_select(mask)
    assert calls == []
    assert torch.equal(got[2], upstream[2]) and torch.equal(got[2], selected)
    assert torch.equal(got[0], upstream[0]) and torch.equal(got[0], tokens[selected])
    if with_probs:
        assert torch.equal(got[1], upstream[1]) and torch.equal(got[1], probs.T.contiguous()[mask])
    else:
        assert got[1] is None and upstream[1] is None


@pytest.mark.parametrize(
    "change",
    [{"fused": True}, {"drop_and_pad": True}, {"num_out_tokens": torch.tensor(74)}, {"num_out_tokens": None}],
    ids=["fused", "drop_and_pad", "size_on_gpu", "size_unknown"],
)
def test_fixed_size_permute_leaves_other_calls_to_upstream(change):
    """A fused permute, a capacity dispatch and a size the host does not hold go to upstream's permute
    with the arguments they came with."""
    routing_map, probs, tokens = _routing(tokens=37, experts=8, topk=2)
    calls = []
    permute = moe_permute_fixed_size.fixed_size(lambda *a: calls.append(a) or "upstream")
    args = {"probs": probs, "num_out_tokens": 74, "fused": False, "drop_and_pad": False, **change}
    assert permute(tokens, routing_map, **args) == "upstream"
    assert len(calls) == 1 and calls[0][:3] == (tokens, routing_map, probs)
    assert calls[0][3] is args["num_out_tokens"] and calls[0][4:] == (args["fused"], args["drop_and_pad"])


def test_fixed_size_permute_is_applied_to_the_dispatchers_name_on_core_0_16_only(monkeypatch):
    """Core 0.16's dispatcher module gets the wrapper once (applying twice wraps once); core 0.19, whose
    permute already takes the argsort, does not need it."""
    from megatron.core.transformer.moe import token_dispatcher
    from twinkle_specs.patches.gates import megatron_core_in

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert moe_permute_fixed_size.is_needed() == megatron_core_in("0.16", "0.17")
    upstream = token_dispatcher.permute
    monkeypatch.setattr(token_dispatcher, "permute", upstream)
    moe_permute_fixed_size.apply()
    moe_permute_fixed_size.apply()
    assert token_dispatcher.permute.fixed_size and token_dispatcher.permute.__wrapped__ is upstream
