"""What the adapter saves for backward, on CPU: the A GEMM's input is recomputed (twinkle_specs.lora
.recompute) from what the module producing it keeps (a norm, SwiGLU), the layers' forward (``out +=
h @ B^T`` in place) equals the per-slot reference, and the in-place sum is safe on a TE-like output.

Memory is measured as the bytes of the distinct storages that autograd saves (saved-tensor hooks), so
a tensor the base layer saves anyway costs nothing twice. The stand-ins of test_lora_te_standin.py
behave like TE with a frozen weight: no GEMM input is saved. Tolerances: fp32, rel 1e-5 where the
summation order differs (measured <= 3e-7); bit-exact where the same kernels run.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from test_lora_fused import CASES, SIZES, _factors, _portable, _rel, _run
from test_lora_support import randomize_layer, single_rank  # noqa: F401  (fixture)
from test_lora_te_standin import _config, _Norm, te  # noqa: F401  (fixture)

from twinkle_specs.lora import functions, layers
from twinkle_specs.lora.config import SlotSpec
from twinkle_specs.lora.model import link_input_recipes, on_2d, swiglu_eager
from twinkle_specs.lora.recompute import InputRecipe

REL_TOL = 1e-5
S = SlotSpec


def saved_bytes(fn) -> tuple[torch.Tensor, int]:
    """``fn()`` and the bytes of the distinct storages autograd saved for its backward.

    The counting hooks are saved-tensor hooks themselves, which the adapter takes for a checkpoint's
    (it then leaves every save to them); ``recompute_allowed`` is held true while counting so that
    what is counted is what the adapter saves on its own.
    """
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return t

    allowed, layers.recompute_allowed = layers.recompute_allowed, lambda: True
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = fn()
    finally:
        layers.recompute_allowed = allowed
    return out, sum(storages.values())


@pytest.mark.parametrize("site,slots", list(CASES.values()), ids=list(CASES))
def test_layer_forward_equals_per_slot_reference(site, slots, single_rank):  # noqa: F811
    """The layer's forward (A GEMM, then the B GEMM accumulating into the base output) vs base + per-slot
    delta: output and the gradients of the input and of every factor."""
    layer = _portable(site, slots)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, 2, SIZES[site][0], generator=g)
    grad = torch.randn(6, 2, SIZES[site][1], generator=g)
    got = _run(layer, lambda x: layer(x)[0], x, grad)
    want = _run(layer, lambda x: F.linear(x, layer.weight) + layer.lora_delta_per_slot(x), x, grad)
    assert _rel(got, want) <= REL_TOL
    assert all(t.abs().max() > 0 for t in got[1:])


class _ViewOutput(torch.autograd.Function):
    """A linear that returns a view made inside its forward, as Transformer Engine's do."""

    @staticmethod
    def forward(ctx, x, w, save_output):
        out = F.linear(x, w)
        ctx.save_for_backward(w, out if save_output else None)
        return out.view(out.shape)

    @staticmethod
    def backward(ctx, grad):
        w, out = ctx.saved_tensors
        if out is not None:  # a base that needs its output in backward
            grad = grad + 0 * out
        return grad @ w, None, None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_in_place_sum_on_a_te_like_output(dtype):
    """``AddLowRank`` on a view made inside an autograd function (TE's output): autograd refuses
    ``addmm_`` there, the function gives addmm's output and every gradient bit for bit."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 8, 16, generator=g, dtype=dtype), torch.randn(24, 16, generator=g, dtype=dtype)
    h, b = torch.randn(2, 8, 4, generator=g, dtype=dtype), torch.randn(24, 4, generator=g, dtype=dtype)
    grad = torch.randn(2, 8, 24, generator=g, dtype=dtype)

    def run(add):
        xs, hs, bs = (t.clone().requires_grad_(True) for t in (x, h, b))
        y = add(_ViewOutput.apply(xs, w, False), hs, bs)
        y.backward(grad)
        return [y.detach(), xs.grad, hs.grad, bs.grad]

    with pytest.raises(RuntimeError, match="view"):
        run(lambda out, h, b: out.view(-1, 24).addmm_(h.view(-1, 4), b.t()))
    want = run(lambda out, h, b: torch.addmm(out.view(-1, 24), h.view(-1, 4), b.t()).view(out.shape))
    got = run(functions.AddLowRank.apply)
    assert all(torch.equal(a, e) for a, e in zip(got, want, strict=True))


def test_in_place_sum_fails_loudly_on_a_saved_output():
    """A base that saved its output would see it changed: autograd raises, no gradient is wrong."""
    x = torch.randn(4, 16, requires_grad=True)
    w, h, b = torch.randn(24, 16), torch.randn(4, 4, requires_grad=True), torch.randn(24, 4)
    y = functions.AddLowRank.apply(_ViewOutput.apply(x, w, True), h, b)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


class _NormThenQKV(torch.nn.Module):
    """A norm module feeding an adapted QKV over the TE stand-ins, base frozen: how both the portable
    spec and the TE spec (as LoRA builds it) compose a layer's input norm and linear_qkv."""

    def __init__(self, te):  # noqa: F811
        super().__init__()
        config = _config()
        slots = {"q_proj": S(4, 8, False), "k_proj": S(2, 4, False), "v_proj": S(4, 8, False)}
        self.norm = _Norm(config, 32, config.layernorm_epsilon)
        self.qkv = te.LoraTEColumnParallelLinear(
            32, 64, config=config, lora_site="linear_qkv", lora_slots=slots, lora_dropout=0.0
        )
        randomize_layer(self.qkv)
        for p in (self.qkv.weight, self.norm.weight):
            p.requires_grad_(False)  # a LoRA model's frozen base
        self.calls = 0  # calls of the recipe's function

    def link(self) -> InputRecipe:
        def norm(x):
            self.calls += 1
            return self.norm.forward(x)

        recipe = InputRecipe(norm, "qkv", from_input=True)
        self.norm.register_forward_hook(recipe.put)
        self.qkv.lora_input_recipe = recipe
        return recipe

    def forward(self, x):
        return self.qkv(self.norm(x))[0]


def test_qkv_adapter_recomputes_the_norm(te, single_rank):  # noqa: F811
    """Linked to the norm before it, the QKV adapter keeps the norm's input (which the norm keeps
    anyway), not the norm's output: the same output and gradients bit for bit, and one hidden-size
    activation less saved."""
    m = _NormThenQKV(te)
    x = torch.randn(64, 2, 32)
    grad = torch.randn(64, 2, 64)
    xr = x.clone().requires_grad_(True)
    plain = _run(m.qkv, m, x, grad)
    _, plain_bytes = saved_bytes(lambda: m(xr))
    recipe = m.link()
    linked = _run(m.qkv, m, x, grad)
    assert recipe.checked and recipe.ok and recipe.pending is None
    _, linked_bytes = saved_bytes(lambda: m(xr))
    assert all(torch.equal(a, b) for a, b in zip(linked, plain, strict=True))
    assert plain_bytes - linked_bytes >= 4 * 128 * 32  # one fp32 [tokens, hidden] tensor


def test_outer_saved_tensor_hooks_keep_the_plain_saves(te, single_rank):  # noqa: F811
    """Under a non-reentrant checkpoint (its own saved-tensor hooks, like activation offloading) the
    adapter recomputes nothing itself and leaves every saved tensor to the checkpoint: same gradients."""
    from torch.utils.checkpoint import checkpoint

    m = _NormThenQKV(te)
    x = torch.randn(16, 2, 32)
    grad = torch.randn(16, 2, 64)
    plain = _run(m.qkv, m, x, grad)
    m.link()
    m(x)  # the recipe's first-use check calls it once
    m.calls = 0
    checkpointed = _run(m.qkv, lambda x: checkpoint(m, x, use_reentrant=False), x, grad)
    assert m.calls == 0
    assert all(torch.equal(a, b) for a, b in zip(checkpointed, plain, strict=True))
    _run(m.qkv, m, x, grad)
    assert m.calls == 1  # without the checkpoint the recomputation is used: the check above can fail


class _MLP(torch.nn.Module):
    """fc1 -> SwiGLU -> fc2 over TE stand-ins, with a frozen base and an adapter on fc2."""

    def __init__(self, te, scale_after: float = 1.0):  # noqa: F811
        super().__init__()
        self.config = _config(gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False)

        def adapted(cls, sizes, site, slot):
            return cls(
                *sizes,
                config=self.config,
                lora_site=site,
                lora_slots={slot: S(4, 8, False)},
                lora_dropout=0.0,
            )

        self.linear_fc1 = adapted(te.LoraTEColumnParallelLinear, (32, 96), "linear_fc1", "up_proj")
        self.linear_fc2 = adapted(te.LoraTERowParallelLinear, (48, 32), "linear_fc2", "down_proj")
        self.scale_after = scale_after  # != 1: the MLP's activation is not plain SwiGLU
        for lin in (self.linear_fc1, self.linear_fc2):
            randomize_layer(lin)
            lin.weight.requires_grad_(False)

    def forward(self, x):
        pre, _ = self.linear_fc1(x)
        return self.linear_fc2(swiglu_eager(pre) * self.scale_after)[0]


def test_fc2_adapter_saves_the_pre_activation(te, single_rank):  # noqa: F811
    """With the fc1 -> fc2 link the fc2 adapter saves SwiGLU's input (kept by SwiGLU anyway) and
    recomputes its own input: identical gradients, one FFN-size tensor less saved per MLP."""
    mlp = _MLP(te)
    x = torch.randn(16, 2, 32)
    grad = torch.randn(16, 2, 32)
    plain = _run(mlp.linear_fc2, mlp, x, grad) + [p.grad for p in _factors(mlp.linear_fc1)]
    xr = x.clone().requires_grad_(True)
    _, plain_bytes = saved_bytes(lambda: mlp(xr))
    link_input_recipes(mlp)
    link = mlp.linear_fc2.lora_input_recipe
    assert isinstance(link, InputRecipe)
    linked = _run(mlp.linear_fc2, mlp, x, grad) + [p.grad for p in _factors(mlp.linear_fc1)]
    assert link.checked and link.ok and link.pending is None
    _, linked_bytes = saved_bytes(lambda: mlp(xr))
    assert all(torch.equal(a, b) for a, b in zip(linked, plain, strict=True))
    assert plain_bytes - linked_bytes >= 4 * 32 * 48  # fc2's input [tokens, ffn] no longer saved
    link_input_recipes(mlp)  # idempotent: still the one link
    assert mlp.linear_fc2.lora_input_recipe is link


def test_fc2_link_switches_itself_off_when_the_activation_differs(te, single_rank, caplog):  # noqa: F811
    """An MLP whose fc2 input is not swiglu(fc1 output) (here scaled after the activation): the first
    forward's check fails, the link is off and says so, and the gradients are those of the plain path."""
    mlp = _MLP(te, scale_after=2.0)
    x = torch.randn(8, 2, 32)
    grad = torch.randn(8, 2, 32)
    plain = _run(mlp.linear_fc2, mlp, x, grad)
    link_input_recipes(mlp)
    with caplog.at_level(logging.WARNING, logger="twinkle_specs.lora.recompute"):
        linked = _run(mlp.linear_fc2, mlp, x, grad)
    link = mlp.linear_fc2.lora_input_recipe
    assert link.checked and not link.ok
    assert "linear_fc2: the adapter input is not fn(source)" in caplog.text
    assert all(torch.equal(a, b) for a, b in zip(linked, plain, strict=True))


def test_model_links_every_adapted_input(tmp_path, single_rank):  # noqa: F811
    """build_model(lora=...) links each layer's QKV and fc1 to the norm before them and fc2 to fc1;
    after a training step every link has checked itself (megatron applies the same norm and SwiGLU)
    and the gradients equal those without links."""
    from test_lora_support import make_checkpoint, tokens

    import twinkle_specs as ts
    from twinkle_specs.lora import LoraConfig, adapter_parameters

    hf = make_checkpoint("qwen3", tmp_path / "hf")
    model = ts.build_model(hf, lora=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    for p in adapter_parameters(model):
        with torch.no_grad():
            p.normal_(0, 0.05)
    sites = ("self_attention.linear_qkv", "mlp.linear_fc1", "mlp.linear_fc2")
    adapted = [m for n, m in model.named_modules() if n.endswith(sites)]
    links = [m.lora_input_recipe for m in adapted]
    assert len(links) == 3 * 2 and all(isinstance(k, InputRecipe) for k in links)
    device = next(model.parameters()).device  # build_model puts the model on the GPU where there is one
    toks = tokens().to(device)
    pos = torch.arange(toks.shape[1], device=device).expand_as(toks)

    def grads():
        for p in adapter_parameters(model):
            p.grad = None
        model(toks, pos, None).float().square().mean().backward()
        return [p.grad.clone() for p in adapter_parameters(model)]

    linked = grads()
    assert all(k.checked and k.ok for k in links)
    for m in adapted:
        m.lora_input_recipe = None
    plain = grads()
    assert all(torch.equal(a, b) for a, b in zip(linked, plain, strict=True))
    assert all(g.abs().max() > 0 for g in linked)


@pytest.mark.parametrize(
    "field,value",
    [
        ("add_bias_linear", True),
        ("gated_linear_unit", False),
        ("activation_func", F.gelu),
        ("activation_func_clamp_value", 7.0),
        ("glu_linear_offset", 1.0),
        ("use_te_activation_func", True),
        ("activation_func_fp8_input_store", True),
        ("cpu_offloading", True),
        ("fine_grained_activation_offloading", True),
    ],
)
def test_fc2_link_only_for_plain_swiglu(field, value):
    """The fc1 -> fc2 link exists only where the MLP's activation is plain SwiGLU over a saved input;
    megatron's fused SwiGLU kernel is the recomputation when bias_activation_fusion is on, called on
    the 2-D view as megatron calls it (torch.compile specialises on the rank)."""
    from types import SimpleNamespace

    from megatron.core.fusions.fused_bias_swiglu import swiglu

    from twinkle_specs.lora.model import swiglu_fn

    plain = dict(
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, bias_activation_fusion=False
    )
    assert swiglu_fn(SimpleNamespace(**plain)) is swiglu_eager
    fused = swiglu_fn(SimpleNamespace(**plain | {"bias_activation_fusion": True}))
    assert fused.func is on_2d and fused.args == (swiglu,)
    assert swiglu_fn(SimpleNamespace(**plain | {field: value})) is None
