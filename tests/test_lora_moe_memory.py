"""What an adapted MoE layer's routed experts keep for backward, on CPU over the TE stand-ins.

A LoRA model's routed experts run their frozen base as one grouped GEMM that keeps only the weights
(twinkle_specs.lora.experts), so the adapters' own saves are the routed experts' whole activation
excess over the frozen model: fc1's input (the permuted tokens, top-k times the layer's input) and
fc2's input (the weighted SwiGLU output). fc1's adapter keeps the router's input and the routing map
instead (recompute.RoutedTokens) and fc2's input is dropped after fc2 and recomputed by megatron's
``moe_act`` recompute (mlp.LoraGroupedMLP). Gradients must not change: the same kernels run on the
same values, so the comparison is bit for bit. torch's grouped GEMM is forced here (CPU runs torch's
own kernel); megatron's unfused permute runs (the GPU tests run the fused one).

Memory is the bytes of the distinct storages autograd keeps at the end of the forward (saved-tensor
hooks; a storage megatron frees after use, as its ``moe_act`` recompute does, counts 0).
"""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch
import torch.nn.functional as F
from test_lora_support import randomize_layer, single_rank  # noqa: F401  (fixture)
from test_lora_te_standin import TE_MODULE, _config, te  # noqa: F401  (fixture)

from twinkle_specs.lora import LoraConfig
from twinkle_specs.lora import mlp as lora_mlp
from twinkle_specs.lora.model import link_input_recipes
from twinkle_specs.lora.recompute import RoutedTokens

TOKENS, HIDDEN, FFN, EXPERTS, TOPK, RANK = 24, 32, 16, 6, 2, 4


def _moe_layer(te, targets=("gate_proj", "up_proj", "down_proj"), **overrides):  # noqa: F811
    """A Qwen3-MoE-like layer's MoE block as megatron's TE spec composes it (TEGroupedMLP over the
    stand-in grouped linears, TopKRouter, all-to-all dispatcher) after LoRA's spec pass (adapting
    ``targets``), base frozen."""
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import TEGroupedMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules

    from twinkle_specs.lora.spec import lora_layer_submodules

    fake = sys.modules[TE_MODULE]
    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    later = {k: overrides.pop(k) for k in list(overrides) if k not in fields}  # a newer megatron's fields
    config = _config(
        **dict(
            num_moe_experts=EXPERTS,
            moe_router_topk=TOPK,
            moe_ffn_hidden_size=FFN,
            moe_grouped_gemm=True,
            moe_token_dispatcher_type="allgather",  # the all-to-all one needs CUDA streams
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            gated_linear_unit=True,
            activation_func=F.silu,
            add_bias_linear=False,
            bias_activation_fusion=False,
            qk_layernorm=True,  # Qwen3-MoE: peft's gate_up_proj/down_proj are the routed experts
        )
        | overrides
    )
    for name, value in later.items():
        setattr(config, name, value)
    experts = ModuleSpec(
        module=TEGroupedMLP,
        submodules=MLPSubmodules(
            linear_fc1=fake.TEColumnParallelGroupedLinear, linear_fc2=fake.TERowParallelGroupedLinear
        ),
    )
    sub = TransformerLayerSubmodules(
        self_attention=ModuleSpec(
            module=SelfAttention,
            submodules=SelfAttentionSubmodules(
                linear_qkv=fake.TEColumnParallelLinear,
                core_attention=torch.nn.Identity,  # not built here
                linear_proj=fake.TERowParallelLinear,
            ),
        ),
        mlp=ModuleSpec(module=MoELayer, submodules=MoESubmodules(experts=experts, router=TopKRouter)),
    )
    lora = LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=list(targets))
    moe = build_module(lora_layer_submodules(sub, lora, config).mlp, config=config)
    adapted = {"gate_proj", "up_proj", "down_proj"} & set(targets)
    assert isinstance(moe.experts, lora_mlp.LoraGroupedMLP) == bool(adapted)
    for lin in (moe.experts.linear_fc1, moe.experts.linear_fc2):
        if hasattr(lin, "lora_slots"):
            randomize_layer(lin, std=0.2)
        for name, w in lin.named_parameters():
            w.requires_grad_(name.startswith("lora_"))
    moe.router.weight.requires_grad_(False)
    return moe


@pytest.fixture
def cpu_recompute(monkeypatch):
    """What megatron's ``moe_act`` recompute (``CheckpointWithoutOutput``) needs besides the CPU: it saves
    and restores the CUDA RNG states too (left out: nothing here draws random numbers on a GPU), and it
    asks TE's fp8 state whether fp8 is on (stood in: it is off; megatron passes ``fp8=False`` as "maybe
    fp8", so it asks even then)."""
    import contextlib
    import types

    from megatron.core.tensor_parallel import random as mrandom

    monkeypatch.setattr(mrandom, "_get_all_rng_states", lambda: (torch.get_rng_state(), None, None))
    monkeypatch.setattr(mrandom, "_set_all_rng_states", lambda cpu, *_: torch.set_rng_state(cpu))
    if not mrandom.HAVE_TE:
        off = types.SimpleNamespace(is_fp8_enabled=lambda: False, get_fp8_recipe=lambda: None)
        monkeypatch.setattr(mrandom, "FP8GlobalStateManager", off, raising=False)
        for name in ("activation_recompute_forward", "fp8_autocast"):
            monkeypatch.setattr(mrandom, name, lambda **_: contextlib.nullcontext(), raising=False)


def _step(moe, x: torch.Tensor, grad: torch.Tensor) -> list[torch.Tensor]:
    """Output, input gradient and every adapter factor's gradient of one forward and backward."""
    factors = [p for p in moe.parameters() if p.requires_grad]
    for p in factors:
        p.grad = None
    x = x.clone().requires_grad_(True)
    out, _ = moe(x)
    out.backward(grad)
    return [out.detach(), x.grad] + [p.grad.clone() for p in factors]


def _kept_bytes(moe, x: torch.Tensor, drop_fc2_input: bool) -> int:
    """Bytes of the distinct storages autograd keeps after one forward. The counting hooks are
    saved-tensor hooks themselves, which the adapters take for a checkpoint's (they then leave every
    save to them), so ``recompute_allowed`` is held at what the test wants while counting."""
    storages: dict[int, torch.UntypedStorage] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage())
        return t

    te_layers = sys.modules["twinkle_specs.lora.te_layers"]
    saved = te_layers.recompute_allowed, lora_mlp.recompute_allowed
    te_layers.recompute_allowed, lora_mlp.recompute_allowed = (lambda: True), (lambda: drop_fc2_input)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out, _ = moe(x.clone().requires_grad_(True))
    finally:
        te_layers.recompute_allowed, lora_mlp.recompute_allowed = saved
    kept = sum(s.nbytes() for s in storages.values())
    out.sum().backward()  # runs the recomputations (the freed storage is restored for backward)
    return kept


def test_routed_experts_keep_no_routed_activation(te, single_rank, cpu_recompute, monkeypatch):  # noqa: F811
    """Linked, the routed adapters keep neither fc1's input nor fc2's: the same output and gradients bit
    for bit, and at least both of those tensors fewer bytes kept (fp32: [tokens × top-k, hidden] and
    [tokens × top-k, ffn])."""
    moe = _moe_layer(te)
    experts = moe.experts
    g = torch.Generator().manual_seed(0)
    x = torch.randn(TOKENS // 2, 2, HIDDEN, generator=g)
    grad = torch.randn(TOKENS // 2, 2, HIDDEN, generator=g)
    monkeypatch.setattr(te, "grouped_mm_fits", lambda *a: True)

    with monkeypatch.context() as m:  # megatron's path: fc2's adapter keeps its input, fc1's too (no link)
        m.setattr(lora_mlp, "recompute_allowed", lambda: False)
        plain = _step(moe, x, grad)
        assert not experts.activation_recompute
    plain_bytes = _kept_bytes(moe, x, drop_fc2_input=False)

    link_input_recipes(moe)
    recipe = experts.linear_fc1.lora_input_recipe
    assert isinstance(recipe, RoutedTokens)
    linked = _step(moe, x, grad)
    assert recipe.checked and recipe.ok and recipe.pending is None
    assert experts.activation_recompute
    linked_bytes = _kept_bytes(moe, x, drop_fc2_input=True)

    assert all(torch.equal(a, b) for a, b in zip(linked, plain, strict=True))
    assert all(t.abs().max() > 0 for t in linked[2:])  # every factor trained
    routed = TOKENS * TOPK
    assert plain_bytes - linked_bytes >= 4 * routed * (HIDDEN + FFN), (plain_bytes, linked_bytes)


@pytest.mark.parametrize("targets", [("q_proj",), ("q_proj", "down_proj")], ids=["none", "fc2-only"])
def test_unadapted_experts_base_is_one_grouped_gemm(te, single_rank, cpu_recompute, monkeypatch, targets):  # noqa: F811
    """Routed experts LoRA leaves unadapted (all of them, or fc1 where only down_proj is targeted) are
    built as the frozen grouped linears, whose base is one grouped GEMM over the stacked expert weights
    instead of TE's GEMM per expert (forced here: CPU runs torch's own kernel): the MoE block's output and
    input gradient equal the per-expert run's (fp32, 1e-5 of the largest value), the weights keep their
    names and values, and a weight that trains sends the base back to TE's GroupedLinear."""
    moe = _moe_layer(te, targets)
    fc1 = moe.experts.linear_fc1
    assert isinstance(fc1, te.FrozenTEColumnParallelGroupedLinear)
    assert isinstance(moe.experts.linear_fc2, te.FrozenTERowParallelGroupedLinear) == (targets == ("q_proj",))
    assert not any(n.startswith("lora_") for n, _ in fc1.named_parameters())
    g = torch.Generator().manual_seed(2)
    x = torch.randn(TOKENS // 2, 2, HIDDEN, generator=g)
    grad = torch.randn(TOKENS // 2, 2, HIDDEN, generator=g)
    before = {n: t.clone() for n, t in moe.state_dict().items()}

    monkeypatch.setattr(te, "grouped_mm_fits", lambda *a: False)
    per_expert = _step(moe, x, grad)
    assert not hasattr(fc1, "_grouped_stack")
    monkeypatch.setattr(te, "grouped_mm_fits", lambda *a: True)
    grouped = _step(moe, x, grad)
    assert fc1._grouped_stack.get([getattr(fc1, f"weight{e}") for e in range(EXPERTS)]).shape == (
        EXPERTS,
        2 * FFN,
        HIDDEN,
    )
    scale = max(t.abs().max() for t in per_expert)
    assert max((a - b).abs().max() for a, b in zip(grouped, per_expert, strict=True)) <= 1e-5 * scale
    assert grouped[1].abs().max() > 0
    after = moe.state_dict()
    assert sorted(after) == sorted(before) and all(torch.equal(after[n], t) for n, t in before.items())

    fc1.weight0.requires_grad_(True)  # the experts' base trains: TE's GroupedLinear computes its gradient
    del fc1._grouped_stack
    _step(moe, x, grad)
    assert not hasattr(fc1, "_grouped_stack") and fc1.weight0.grad is not None


def test_routed_tokens_switch_off_when_the_order_differs(caplog):
    """The recipe's first use checks that gathering the router's input in routing order gives the
    experts' input; tokens ordered otherwise fail it once, loudly, and the adapter keeps its input from
    then on. In order, the recipe rebuilds the input exactly (here megatron's own unfused permute)."""
    from megatron.core.transformer.moe.moe_utils import permute

    g = torch.Generator().manual_seed(1)
    h = torch.randn(5, 2, HIDDEN, generator=g)
    scores = torch.rand(10, EXPERTS, generator=g)
    routing_map = torch.zeros_like(scores, dtype=torch.bool).scatter(1, scores.topk(TOPK).indices, True)
    x, *_ = permute(h.view(-1, HIDDEN), routing_map, num_out_tokens=int(routing_map.sum()))  # 0.19 needs it

    recipe = RoutedTokens("layers.0.mlp.experts.linear_fc1")
    recipe.put(None, (h,), (scores, routing_map))
    source, fn = recipe.take(x)
    assert recipe.ok and recipe.pending is None and torch.equal(fn(source), x)
    assert recipe.take(x) is None  # one record, one take

    wrong = RoutedTokens("layers.1.mlp.experts.linear_fc1")
    with caplog.at_level("WARNING", logger="twinkle_specs.lora.recompute"):
        wrong.put(None, (h,), (scores, routing_map))
        assert wrong.take(x.flip(0)) is None
    assert wrong.checked and not wrong.ok
    assert "layers.1.mlp.experts.linear_fc1: the experts' input is not the router's input" in caplog.text
    wrong.put(None, (h,), (scores, routing_map))
    assert wrong.take(x) is None  # off for good


@pytest.mark.parametrize(
    "overrides",
    [
        {"moe_expert_capacity_factor": 1.0},
        {"moe_expert_capacity_factor": 1.0, "moe_pad_expert_input_to_capacity": True},
        {"cuda_graph_impl": "transformer_engine"},
    ],
    ids=["capacity", "padded", "cuda-graphs"],
)
def test_no_routed_recipe_where_tokens_are_dropped_padded_or_captured(te, single_rank, overrides):  # noqa: F811
    """Dropped or capacity-padded tokens, or a router inside a CUDA graph (its hooks do not run at
    replay), get no recipe: fc1's adapter keeps its input."""
    moe = _moe_layer(te, **overrides)
    link_input_recipes(moe)
    assert moe.experts.linear_fc1.lora_input_recipe is None


def test_op_fuser_experts_refuse_adapters(te, single_rank):  # noqa: F811
    """megatron-core 0.19's TE op-fuser experts bypass linear_fc1/fc2's forward, so the adapters would
    never run: building adapted experts with it is an error that says what to change."""
    with pytest.raises(ValueError, match="use_transformer_engine_op_fuser"):
        _moe_layer(te, use_transformer_engine_op_fuser=True)


def test_merged_fc1_drops_the_routers_record(te, single_rank, cpu_recompute, monkeypatch):  # noqa: F811
    """With fc1's adapter merged the router's record is dropped unused (no gather index, no check), so
    nothing stale is left for a later forward; unmerged, the next forward takes and checks it."""
    moe = _moe_layer(te)
    monkeypatch.setattr(te, "grouped_mm_fits", lambda *a: True)
    link_input_recipes(moe)
    fc1 = moe.experts.linear_fc1
    recipe = fc1.lora_input_recipe
    x = torch.randn(TOKENS // 2, 2, HIDDEN)
    fc1.merge()
    with torch.no_grad():
        moe(x)
    assert recipe.pending is None and not recipe.checked
    fc1.unmerge()
    with torch.no_grad():
        moe(x)
    assert recipe.pending is None and recipe.checked and recipe.ok


def test_group_ends_are_the_blocks_ends_copied_once_per_splits():
    """The grouped GEMMs' offsets: the token blocks' running ends (int32, an empty expert an empty block),
    and the last answer reused for equal splits (fc1 and fc2 of one MoE layer), a new one for others."""
    from twinkle_specs.lora.experts import group_ends

    ends = group_ends([3, 0, 5, 2], torch.device("cpu"))
    assert ends.dtype == torch.int32 and ends.tolist() == [3, 3, 8, 10]
    assert group_ends([3, 0, 5, 2], torch.device("cpu")) is ends
    assert group_ends([3, 1, 5, 2], torch.device("cpu")).tolist() == [3, 4, 9, 11]
