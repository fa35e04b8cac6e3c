"""The Transformer Engine LoRA wrappers' own logic on CPU, over stand-ins for megatron's TE linears.

TE cannot run here; the stand-ins honour the interface the wrappers rely on (constructor arguments,
``forward(x) -> (out, bias)``, ``forward(x, m_splits)`` for grouped GEMMs, ``weight``/``weightN`` and
``layer_norm_weight`` parameters). Expected outputs are built independently: the fused QKV delta through
weight_map's QKV layout (the one HF loading uses), the others as merged dense weights. TE numerics are
covered by tests/test_lora_gpu.py.
"""

from __future__ import annotations

import functools
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import apply_factories
from test_lora_support import randomize_layer, single_rank  # noqa: F401  (fixture)

from twinkle_specs.lora.config import SlotSpec
from twinkle_specs.weight_map import QKV

TE_MODULE = "megatron.core.extensions.transformer_engine"
TOL = 1e-5  # fp32, same arithmetic up to summation order


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


class _Linear(torch.nn.Module):
    def __init__(self, input_size: int, output_size: int, *, config, **_):
        super().__init__()
        self.config = config
        self.weight = torch.nn.Parameter(torch.randn(output_size, input_size) * 0.1)
        self.is_first_microbatch = True  # as megatron's TE linears set it, before the LoRA mixin's own state

    def forward(self, x):
        return F.linear(x, self.weight), None


class _LayerNormLinear(_Linear):
    def __init__(self, input_size: int, output_size: int, *, config, **kw):
        super().__init__(input_size, output_size, config=config, **kw)
        self.layer_norm_weight = torch.nn.Parameter(torch.rand(input_size) + 0.5)

    def forward(self, x):
        w = self.layer_norm_weight + (1 if self.config.layernorm_zero_centered_gamma else 0)
        return F.linear(_rms(x, w, self.config.layernorm_epsilon), self.weight), None


class _Norm(torch.nn.Module):
    """TENorm's constructor (config, hidden_size, eps) over an RMSNorm."""

    def __init__(self, config, hidden_size: int, eps: float):
        super().__init__()
        self.config, self.eps = config, eps
        self.weight = torch.nn.Parameter(torch.rand(hidden_size) + 0.5)

    def forward(self, x):
        return _rms(x, self.weight, self.eps)


class _Grouped(torch.nn.Module):
    def __init__(self, num_gemms: int, input_size: int, output_size: int, *, config, **_):
        super().__init__()
        self.config, self.num_gemms = config, num_gemms
        for i in range(num_gemms):
            self.register_parameter(
                f"weight{i}", torch.nn.Parameter(torch.randn(output_size, input_size) * 0.1)
            )
        self.is_first_microbatch = True  # as megatron's TE grouped linears set it

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        return {}

    def forward(self, x, m_splits):
        parts = torch.split(x, list(m_splits))
        return torch.cat([F.linear(p, getattr(self, f"weight{i}")) for i, p in enumerate(parts)]), None


@pytest.fixture
def te(monkeypatch):
    """twinkle_specs.lora.te_layers imported over stand-in TE classes (and forgotten afterwards)."""
    fake = types.ModuleType(TE_MODULE)
    for name, base in [
        ("TELayerNormColumnParallelLinear", _LayerNormLinear),
        ("TEColumnParallelLinear", _Linear),
        ("TERowParallelLinear", _Linear),
        ("TEColumnParallelGroupedLinear", _Grouped),
        ("TERowParallelGroupedLinear", _Grouped),
        ("TENorm", _Norm),
    ]:
        setattr(fake, name, type(name, (base,), {"__module__": TE_MODULE}))
    monkeypatch.setitem(sys.modules, TE_MODULE, fake)
    monkeypatch.delitem(sys.modules, "twinkle_specs.lora.te_layers", raising=False)
    import twinkle_specs.lora.te_layers as te_layers

    yield te_layers
    sys.modules.pop("twinkle_specs.lora.te_layers", None)


def _config(**kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=1,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        kv_channels=8,
        normalization="RMSNorm",
        use_cpu_initialization=True,
        **kw,
    )


def _te_layer_submodules():
    """A dense layer as megatron's TE spec composes it, over the stand-ins (QKV and fc1 norm-fused)."""
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules

    fake = sys.modules[TE_MODULE]
    attention = SelfAttentionSubmodules(
        linear_qkv=fake.TELayerNormColumnParallelLinear,
        core_attention=torch.nn.Identity,  # not built here
        linear_proj=fake.TERowParallelLinear,
        q_layernorm=fake.TENorm,
        k_layernorm=fake.TENorm,
    )
    mlp = MLPSubmodules(linear_fc1=fake.TELayerNormColumnParallelLinear, linear_fc2=fake.TERowParallelLinear)
    return TransformerLayerSubmodules(
        self_attention=ModuleSpec(module=SelfAttention, submodules=attention),
        mlp=ModuleSpec(module=MLP, submodules=mlp),
        sharded_state_dict_keys_map={"mlp.0.weight": "mlp.linear_fc1.layer_norm_weight"},
    )


@pytest.mark.parametrize(
    "targets,split_qkv,split_fc1",
    [("all-linear", True, True), (["q_proj", "v_proj"], True, False), (["down_proj"], False, False)],
    ids=["all-linear", "q-v", "down-only"],
)
def test_targeted_norm_fused_linears_become_norm_and_linear(te, targets, split_qkv, split_fc1):  # noqa: F811
    """A targeted norm-fused TE linear is built as HiddenNorm (TENorm's constructor and keys) + plain TE
    linear (its adapter then shares the norm), keeping the fused module's checkpoint keys; an untargeted
    one stays fused. TE's q/k norms become QKNorm, the attention LoraSelfAttention."""
    from megatron.core.transformer.identity_op import IdentityOp

    from twinkle_specs.lora import LoraConfig
    from twinkle_specs.lora.attention import LoraSelfAttention
    from twinkle_specs.lora.mlp import LoraMLP
    from twinkle_specs.lora.norm import HiddenNorm, QKNorm
    from twinkle_specs.lora.spec import lora_layer_submodules

    fake = sys.modules[TE_MODULE]
    got = lora_layer_submodules(
        _te_layer_submodules(), LoraConfig(r=4, lora_alpha=8, target_modules=targets), _config()
    )
    qkv = got.self_attention.submodules.linear_qkv
    fc1 = got.mlp.submodules.linear_fc1
    assert got.input_layernorm is (HiddenNorm if split_qkv else IdentityOp)
    assert got.pre_mlp_layernorm is (HiddenNorm if split_fc1 else IdentityOp)
    assert (
        (qkv.module is te.LoraTEColumnParallelLinear)
        if split_qkv
        else qkv is fake.TELayerNormColumnParallelLinear
    )
    assert (
        (fc1.module is te.LoraTEColumnParallelLinear)
        if split_fc1
        else fc1 is fake.TELayerNormColumnParallelLinear
    )
    keys = got.sharded_state_dict_keys_map
    assert keys["mlp.0.weight"] == "mlp.linear_fc1.layer_norm_weight"  # megatron's own entries kept
    assert (keys.get("input_layernorm.") == "self_attention.linear_qkv.layer_norm_") is split_qkv
    assert (keys.get("pre_mlp_layernorm.") == "mlp.linear_fc1.layer_norm_") is split_fc1
    assert (got.mlp.module is LoraMLP) is split_fc1  # fc1's delta goes into SwiGLU
    # the frozen q/k norms compute no weight gradient, whatever the targets
    attn = got.self_attention.submodules
    assert attn.q_layernorm is QKNorm and attn.k_layernorm is QKNorm
    assert got.self_attention.module is LoraSelfAttention  # which fuses them with RoPE where it can


def test_spec_helpers_follow_a_builder_classmethod():
    """megatron-core 0.19 specs a dense MLP as a partial of a builder classmethod
    (``partial(MLP.as_mlp_submodule, submodules=...)``): that spec builds the classmethod's class, and
    swapping the class keeps the builder, now on the new class, with the same arguments."""
    from twinkle_specs.lora.spec import _class_of, _with_class

    class Base:
        @classmethod
        def as_mlp_submodule(cls, **kwargs):
            return cls, kwargs

    class Sub(Base):
        pass

    spec = functools.partial(Base.as_mlp_submodule, submodules="sub")
    assert _class_of(spec) is Base
    swapped = _with_class(spec, Sub)
    assert _class_of(swapped) is Sub and swapped(config="c") == (Sub, {"submodules": "sub", "config": "c"})
    plain = functools.partial(Base, submodules="sub")  # a class partial (0.19's experts) as before
    assert _class_of(plain) is Base and _with_class(plain, Sub).func is Sub


def test_qkv_partial_targets(te, single_rank):  # noqa: F811
    """QKV with adapters on q and v only, of different ranks and scalings (rsLoRA on v): the delta lands
    in megatron's interleaved QKV layout, built independently through weight_map's QKV layout."""
    config = _config()
    slots = {"q_proj": SlotSpec(4, 8, False), "v_proj": SlotSpec(2, 8, True)}
    layer = te.LoraTEColumnParallelLinear(
        32, 64, config=config, lora_site="linear_qkv", lora_slots=slots, lora_dropout=0.0
    )
    randomize_layer(layer, std=0.2)
    x = torch.randn(5, 2, 32, requires_grad=True)
    out, bias = layer(x)
    assert bias is None
    hf = {
        "q": slots["q_proj"].scaling * layer.lora_factor("B", "q_proj") @ layer.lora_factor("A", "q_proj"),
        "k": torch.zeros(16, 32),
        "v": slots["v_proj"].scaling * layer.lora_factor("B", "v_proj") @ layer.lora_factor("A", "v_proj"),
    }
    delta = QKV(groups=2, heads_per_group=2, head_dim=8).load(
        lambda name, rows, cols: hf[name][rows[0] : rows[1]], ("q", "k", "v"), 0, 1
    )
    expected = F.linear(x, layer.weight + delta)
    assert (out - expected).abs().max().item() <= TOL
    assert (expected - F.linear(x, layer.weight)).abs().max() > 1e-2


def test_fp8_known_amax_casts_reach_the_base_only(te, single_rank, monkeypatch):  # noqa: F811
    """Under FP8 current scaling (stood in: a cast that triples its input): an input whose kernel took
    its amax (``fp8_amax.tag``) reaches the base as the cast made it while the adapter reads it as it is,
    and the input gradient passes through the cast; an untagged input, or one modified since its tag,
    reaches the base as it is. The base output's gradient passes through ``lora_out_grad`` after the
    adapter's GEMMs took it as it is."""
    from twinkle_specs.lora import fp8_amax, layers

    casts: list = []
    monkeypatch.setattr(layers, "input_cast", lambda module: lambda x, p: casts.append(p) or x * 3)
    config = _config()
    slots = {
        "q_proj": SlotSpec(4, 8, False),
        "k_proj": SlotSpec(4, 8, False),
        "v_proj": SlotSpec(4, 8, False),
    }
    layer = te.LoraTEColumnParallelLinear(
        32, 64, config=config, lora_site="linear_qkv", lora_slots=slots, lora_dropout=0.0
    )
    randomize_layer(layer, std=0.2)
    for p in layer.parameters():
        p.requires_grad_(p is not layer.weight)
    x0 = torch.randn(5, 2, 32)
    delta = layer.lora_delta_weight()

    def run(tagged: bool, bump: bool = False, out_grad=None):
        x = x0.clone().requires_grad_(True)
        y = x * 1.0
        if tagged:
            fp8_amax.tag(y, torch.ones(1))
        if bump:
            y.add_(0.0)
        out, _ = layer(y, lora_out_grad=out_grad)
        out.backward(torch.ones_like(out))
        return out.detach(), x.grad

    out, dx = run(tagged=True)
    assert len(casts) == 1
    want = F.linear(3 * x0, layer.weight) + F.linear(x0, delta)
    assert (out - want).abs().max().item() <= TOL
    g = torch.ones(5, 2, 64)
    assert (dx - (3 * g @ layer.weight + g @ delta)).abs().max().item() <= TOL
    for kw in ({"tagged": False}, {"tagged": True, "bump": True}):
        out, _ = run(**kw)
        assert (out - F.linear(x0, layer.weight + delta)).abs().max().item() <= TOL and len(casts) == 1, kw
    # the base output's gradient through lora_out_grad (a GradAmax whose cast doubles it)
    seen: list = []

    class Link:
        def __call__(self, grad):
            seen.append(grad.clone())
            return grad * 2

    _, dx = run(tagged=False, out_grad=Link())
    assert len(seen) == 1 and torch.equal(seen[0], g)
    assert (dx - (2 * g @ layer.weight + g @ delta)).abs().max().item() <= TOL


def test_row_and_column_linears_and_merge(te, single_rank):  # noqa: F811
    config = _config()
    row = te.LoraTERowParallelLinear(
        32,
        32,
        config=config,
        lora_site="linear_proj",
        lora_slots={"o_proj": SlotSpec(4, 16, False)},
        lora_dropout=0.0,
    )
    col = te.LoraTEColumnParallelLinear(
        32,
        48,
        config=config,
        lora_site="linear_fc1",
        lora_slots={"up_proj": SlotSpec(4, 8, False)},
        lora_dropout=0.0,
    )
    for layer in (row, col):
        randomize_layer(layer, std=0.2)
    x = torch.randn(3, 2, 32)
    expected_row = F.linear(x, row.weight + 4.0 * row.lora_B @ row.lora_A)
    up = 2.0 * col.lora_B @ col.lora_A
    expected_col = F.linear(x, col.weight + torch.cat([torch.zeros_like(up), up]))  # [gate; up]
    assert (row(x)[0] - expected_row).abs().max().item() <= TOL
    assert (col(x)[0] - expected_col).abs().max().item() <= TOL
    base = col.weight.detach().clone()
    col.merge()
    assert (col(x)[0] - expected_col).abs().max().item() <= TOL  # merged weight, adapter skipped
    col.unmerge()
    assert torch.equal(col.weight, base)


def test_grouped_experts_per_expert_adapters(te, single_rank):  # noqa: F811
    config = _config()
    layer = te.LoraTEColumnParallelGroupedLinear(
        3,
        32,
        24,
        config=config,
        is_expert=True,
        lora_site="experts.linear_fc1",
        lora_slots={"gate_up_proj": SlotSpec(2, 4, False)},
        lora_dropout=0.0,
    )
    assert layer.lora_A.shape == (3, 2, 32) and layer.lora_B.shape == (3, 24, 2)
    assert layer.lora_A.allreduce is False  # expert-parallel, like the base weights
    randomize_layer(layer, std=0.2)
    splits = [2, 0, 3]
    x = torch.randn(sum(splits), 32)
    parts = torch.split(x, splits)
    expected = torch.cat(
        [
            F.linear(
                p,
                getattr(layer, f"weight{e}") + 2.0 * layer.lora_B[e] @ layer.lora_A[e],
            )
            for e, p in enumerate(parts)
        ]
    )
    assert (layer(x, torch.tensor(splits))[0] - expected).abs().max().item() <= TOL
    bases = [getattr(layer, f"weight{e}").detach().clone() for e in range(3)]
    layer.merge()
    assert (layer(x, splits)[0] - expected).abs().max().item() <= TOL
    layer.unmerge()
    assert all(torch.equal(getattr(layer, f"weight{e}"), b) for e, b in enumerate(bases))
    # Adapter checkpoint entries: one factory per parameter, one tensor per factor over the global
    # (layer, expert) axes.
    sd = layer.sharded_state_dict("experts.linear_fc1.", ((0, 1, 2),), {"dp_cp_group": None})
    assert sorted(sd) == ["experts.linear_fc1.lora_A", "experts.linear_fc1.lora_B"]
    apply_factories(sd)
    tensors = {t.key: t for t in nested_values(sd)}
    a = tensors["experts.linear_fc1.lora_A.gate_up_proj"]
    assert a.global_shape == (2, 3, 2, 32) and a.global_offset == (1, 0, 0, 0)
    assert sorted(tensors) == [
        "experts.linear_fc1.lora_A.gate_up_proj",
        "experts.linear_fc1.lora_B.gate_up_proj",
    ]


@pytest.mark.parametrize("grouped", [False, True], ids=["linear", "grouped"])
def test_frozen_base_keeps_its_fp8_copy_across_iterations(te, single_rank, grouped):  # noqa: F811
    """Under FP8 a frozen base's ``is_first_microbatch`` stays False once training forwards have made its
    final FP8 copy (megatron's reset at each iteration is ignored): under delayed scaling the second copy
    (the first scaled by the weight's own amax), under current scaling the first; until the weight changes
    in place (merge, unmerge, a load) or trains. Without FP8, or with a recipe whose quantizer it does not
    know, the flag is megatron's. The flag moves as megatron's TE linears move it: True at an iteration's
    start, False after each forward."""
    slot = {"gate_up_proj": SlotSpec(2, 4, False)} if grouped else {"o_proj": SlotSpec(4, 16, False)}

    def build(fp8, recipe="delayed"):
        config = _config(fp8=fp8)
        config.fp8_recipe = recipe  # after the checks: "custom" would want a quantizer factory
        kw = dict(config=config, lora_slots=slot, lora_dropout=0.0)
        if grouped:
            layer = te.LoraTEColumnParallelGroupedLinear(
                2, 32, 24, is_expert=True, lora_site="experts.linear_fc1", **kw
            )
        else:
            layer = te.LoraTERowParallelLinear(32, 32, lora_site="linear_proj", **kw)
        for _, w in layer.lora_base_weights():
            w.requires_grad_(False)  # as prepare_lora_model freezes the base
        layer.is_first_microbatch = True  # megatron's TE linear constructor
        return layer

    def iteration(layer, grad=True) -> bool:
        """megatron's set_is_first_microbatch, then one forward: whether TE was told to quantize."""
        layer.is_first_microbatch = True
        quantize = layer.is_first_microbatch
        with torch.set_grad_enabled(grad):
            layer.is_first_microbatch = False  # what megatron's TE linear does after its forward
        return quantize

    layer = build("hybrid")
    assert iteration(layer, grad=False)  # an evaluation forward's copy (no transpose) is not kept
    assert [iteration(layer) for _ in range(4)] == [True, True, False, False]
    layer.merge()  # writes the base in place: quantized again until settled, then kept
    assert [iteration(layer) for _ in range(3)] == [True, True, False]
    layer.unmerge()
    assert iteration(layer)
    with torch.no_grad():
        layer.lora_base_weights()[0][1].copy_(torch.randn_like(layer.lora_base_weights()[0][1]))  # a load
    assert [iteration(layer) for _ in range(3)] == [True, True, False]
    layer.lora_base_weights()[-1][1].requires_grad_(True)  # a base that trains: megatron's flag again
    assert [iteration(layer) for _ in range(3)] == [True, True, True]
    current = build("hybrid", "tensorwise")  # each copy scaled by the weight itself: the first is final
    assert [iteration(current) for _ in range(3)] == [True, False, False]
    custom = build("hybrid", "custom")  # a quantizer of the user's: megatron's flag
    assert [iteration(custom) for _ in range(3)] == [True, True, True]
    bf16 = build(None)
    assert [iteration(bf16) for _ in range(3)] == [True, True, True]
