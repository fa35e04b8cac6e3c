"""What the adapter saves for backward, on CPU: the A GEMM's input is recomputed (twinkle_specs.lora
.recompute) from what the frozen base keeps, the layers' forward (``out += h @ B^T`` in place) equals
the per-slot reference, and the in-place sum is safe on a TE-like base output.

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
from test_lora_te_standin import _config, te  # noqa: F401  (fixture)

from twinkle_specs.lora import layers
from twinkle_specs.lora.config import SlotSpec
from twinkle_specs.lora.model import PreActivation, link_activation_inputs, swiglu_eager

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
    """``_AddLowRank`` on a view made inside an autograd function (TE's output): autograd refuses
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
    got = run(layers._AddLowRank.apply)
    assert all(torch.equal(a, e) for a, e in zip(got, want, strict=True))


def test_in_place_sum_fails_loudly_on_a_saved_output():
    """A base that saved its output would see it changed: autograd raises, no gradient is wrong."""
    x = torch.randn(4, 16, requires_grad=True)
    w, h, b = torch.randn(24, 16), torch.randn(4, 4, requires_grad=True), torch.randn(24, 4)
    y = layers._AddLowRank.apply(_ViewOutput.apply(x, w, True), h, b)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def _norm_fused(te, slots=None):  # noqa: F811
    slots = slots or {"q_proj": S(4, 8, False), "k_proj": S(2, 4, False), "v_proj": S(4, 8, False)}
    layer = te.LoraTELayerNormColumnParallelLinear(
        32, 64, config=_config(), lora_site="linear_qkv", lora_slots=slots, lora_dropout=0.0
    )
    randomize_layer(layer)
    for p in (layer.weight, layer.layer_norm_weight):
        p.requires_grad_(False)  # a LoRA model's frozen base
    return layer


def _saves_its_input(monkeypatch) -> None:
    """The A GEMM without recomputation: it keeps its own input (what the adapter did before)."""
    monkeypatch.setattr(layers, "linear_recomputing_input", lambda inp, a, source, fn: F.linear(inp, a))


@pytest.mark.parametrize("trainable_norm", [False, True], ids=["frozen-norm", "trainable-norm"])
def test_norm_fused_adapter_recomputes_the_norm(te, single_rank, monkeypatch, trainable_norm):  # noqa: F811
    """The norm-fused QKV adapter keeps x (which the base's norm keeps too), not norm(x): the same
    output and gradients (the norm weight's too, when it trains) as an adapter that keeps norm(x), and
    with a frozen norm no hidden-size tensor saved beyond the base's."""
    layer = _norm_fused(te)
    layer.layer_norm_weight.requires_grad_(trainable_norm)
    x = torch.randn(64, 2, 32)
    grad = torch.randn(64, 2, 64)

    def forward(x):
        return layer(x)[0]

    def run():
        layer.layer_norm_weight.grad = None
        got = _run(layer, forward, x, grad)
        return got + ([layer.layer_norm_weight.grad] if trainable_norm else [])

    recomputed = run()
    xr = x.clone().requires_grad_(True)
    _, recomputed_bytes = saved_bytes(lambda: forward(xr))
    layer.lora_merged = True  # the base alone (merge() would change the weight; this only skips)
    _, base_bytes = saved_bytes(lambda: forward(xr))
    layer.lora_merged = False
    _saves_its_input(monkeypatch)
    kept = run()
    _, kept_bytes = saved_bytes(lambda: forward(xr))
    assert all(torch.equal(a, b) for a, b in zip(recomputed, kept, strict=True))
    if trainable_norm:
        return  # torch's CPU RMSNorm then keeps its own [tokens, hidden] product for the weight gradient
    activation = 4 * 128 * 32  # one fp32 [tokens, hidden] tensor
    # saved beyond the base: h [tokens, r], the norm's [tokens] statistics and small constants, less
    # than one hidden-size activation; keeping norm(x) adds one (so the check can fail)
    assert recomputed_bytes - base_bytes < activation
    assert kept_bytes - recomputed_bytes >= activation


def test_outer_saved_tensor_hooks_keep_the_plain_saves(te, single_rank, monkeypatch):  # noqa: F811
    """Under a non-reentrant checkpoint (its own saved-tensor hooks, like activation offloading) the
    adapter recomputes nothing itself and leaves every saved tensor to the checkpoint: same gradients."""
    from torch.utils.checkpoint import checkpoint

    layer = _norm_fused(te)
    x = torch.randn(16, 2, 32)
    grad = torch.randn(16, 2, 64)
    plain = _run(layer, lambda x: layer(x)[0], x, grad)
    calls = []
    real = layers.linear_recomputing_input
    monkeypatch.setattr(layers, "linear_recomputing_input", lambda *a: calls.append(1) or real(*a))
    checkpointed = _run(layer, lambda x: checkpoint(lambda y: layer(y)[0], x, use_reentrant=False), x, grad)
    assert not calls
    assert all(torch.equal(a, b) for a, b in zip(checkpointed, plain, strict=True))
    _run(layer, lambda x: layer(x)[0], x, grad)
    assert calls  # without the checkpoint the recomputation is used: the check above can fail


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
    link_activation_inputs(mlp)
    link = mlp.linear_fc2.lora_activation_input
    assert isinstance(link, PreActivation)
    linked = _run(mlp.linear_fc2, mlp, x, grad) + [p.grad for p in _factors(mlp.linear_fc1)]
    assert link.checked and link.ok and link.pending is None
    _, linked_bytes = saved_bytes(lambda: mlp(xr))
    assert all(torch.equal(a, b) for a, b in zip(linked, plain, strict=True))
    assert plain_bytes - linked_bytes >= 4 * 32 * 48  # fc2's input [tokens, ffn] no longer saved
    link_activation_inputs(mlp)  # idempotent: still the one link
    assert mlp.linear_fc2.lora_activation_input is link


def test_fc2_link_switches_itself_off_when_the_activation_differs(te, single_rank, caplog):  # noqa: F811
    """An MLP whose fc2 input is not swiglu(fc1 output) (here scaled after the activation): the first
    forward's check fails, the link is off and says so, and the gradients are those of the plain path."""
    mlp = _MLP(te, scale_after=2.0)
    x = torch.randn(8, 2, 32)
    grad = torch.randn(8, 2, 32)
    plain = _run(mlp.linear_fc2, mlp, x, grad)
    link_activation_inputs(mlp)
    with caplog.at_level(logging.WARNING, logger="twinkle_specs.lora.model"):
        linked = _run(mlp.linear_fc2, mlp, x, grad)
    link = mlp.linear_fc2.lora_activation_input
    assert link.checked and not link.ok
    assert "not swiglu" in caplog.text
    assert all(torch.equal(a, b) for a, b in zip(linked, plain, strict=True))


def test_model_links_every_dense_fc2(tmp_path, single_rank):  # noqa: F811
    """build_model(lora=...) links each layer's MLP; after a training step every link has checked
    itself (megatron's MLP applies the same SwiGLU) and the gradients equal those without links."""
    from test_lora_support import make_checkpoint, tokens

    import twinkle_specs as ts
    from twinkle_specs.lora import LoraConfig, adapter_parameters

    hf = make_checkpoint("qwen3", tmp_path / "hf")
    model = ts.build_model(hf, lora=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    for p in adapter_parameters(model):
        with torch.no_grad():
            p.normal_(0, 0.05)
    links = [m.lora_activation_input for n, m in model.named_modules() if n.endswith("mlp.linear_fc2")]
    assert links and all(isinstance(k, PreActivation) for k in links)
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
    for n, m in model.named_modules():
        if n.endswith("mlp.linear_fc2"):
            m.lora_activation_input = None
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
    megatron's fused SwiGLU kernel is the recomputation when bias_activation_fusion is on."""
    from types import SimpleNamespace

    from megatron.core.fusions.fused_bias_swiglu import swiglu

    from twinkle_specs.lora.model import _activation_fn

    plain = dict(
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, bias_activation_fusion=False
    )
    assert _activation_fn(SimpleNamespace(**plain)) is swiglu_eager
    assert _activation_fn(SimpleNamespace(**plain | {"bias_activation_fusion": True})) is swiglu
    assert _activation_fn(SimpleNamespace(**plain | {field: value})) is None
