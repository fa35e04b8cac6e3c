"""The adapter's autograd functions (twinkle_specs.lora.functions) and its banked factors, on CPU.

The input-gradient handoff (``IntoBaseGrad`` + ``LowRankDown``) against plain autograd of the same
expression: fp32 to rel 1e-6 (only where the input gradient's sum is rounded differs: measured 0 over
20 seeds), bf16 to rel 2e-2 (the sum is rounded once instead of twice: measured <= 7.6e-3; with the
scaling as the A GEMM's alpha, fp32 0 and bf16 <= 7.6e-3 over the same 20 seeds). Bank pieces:
one split per layer and forward, rebuilt where the parameter's storage moves (as megatron's DDP does).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_lora_support import make_checkpoint, randomize_megatron, single_rank, tokens  # noqa: F401

from twinkle_specs.lora.functions import AddLowRank, GradLink, IntoBaseGrad, LowRankDown

TOL = {torch.float32: 1e-6, torch.bfloat16: 2e-2}
S = 2.0  # the adapter's scaling


class _Base(torch.autograd.Function):
    """A frozen linear like TE's: its input gradient is a fresh 2-D GEMM output, returned as TE does
    (``dgrad.view(ctx.inp_shape)``, a reshape view) or, with ``strided``, as a strided view of a copy;
    records the 2-D tensor for the test."""

    dgrads: list[torch.Tensor] = []

    @staticmethod
    def forward(ctx, x, w, strided: bool):
        ctx.save_for_backward(w)
        ctx.strided, ctx.shape = strided, x.shape
        return F.linear(x, w)

    @staticmethod
    def backward(ctx, grad):
        (w,) = ctx.saved_tensors
        dx = grad.reshape(-1, grad.shape[-1]) @ w
        _Base.dgrads.append(dx)
        if ctx.strided:
            return dx.view(ctx.shape).transpose(0, 1).contiguous().transpose(0, 1), None, None
        return dx.view(ctx.shape), None, None


def _tensors(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(6, 3, 32, generator=g)
    w, a, b = (
        torch.randn(48, 32, generator=g) * 0.2,
        torch.randn(8, 32, generator=g),
        torch.randn(48, 8, generator=g),
    )
    grad = torch.randn(6, 3, 48, generator=g)
    return [t.to(dtype) for t in (x, w, a, b, grad)]


def _grads(forward, x, w, a, b, grad):
    xs, a_, b_ = (t.clone().requires_grad_(True) for t in (x, a, b))
    y = forward(xs, w, a_, b_)
    y.backward(grad)
    return [y.detach(), xs.grad, a_.grad, b_.grad]


def _linked(strided=False, alpha=False):
    """The adapted linear as the layers build it; with ``alpha`` the scaling is the A GEMM's alpha (the
    layers' path where the slots share one scaling), else a multiply of its own."""

    def forward(x, w, a, b):
        link = GradLink()
        xb = IntoBaseGrad.apply(x, link)
        if alpha:
            h = LowRankDown.apply(xb, a, link, None, None, S)
        else:
            h = LowRankDown.apply(xb, a, link, None, None) * S
        return AddLowRank.apply(_Base.apply(xb, w, strided), h, b)

    return forward


def _plain(x, w, a, b):
    return F.linear(x, w) + F.linear(F.linear(x, a) * S, b)


def _rel(got, want):
    return max(
        ((g.float() - e.float()).abs().max() / e.float().abs().max()).item()
        for g, e in zip(got, want, strict=True)
    )


@pytest.mark.parametrize("alpha", [False, True], ids=["multiply", "alpha"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_adapter_input_gradient_joins_the_base_dgrad_in_place(dtype, alpha):
    """The adapter's input gradient is added into the base's dgrad tensor itself (no second
    full-size tensor, no sum), and output and all gradients equal plain autograd's, with the scaling
    as a multiply or as the A GEMM's alpha (carried on the link into the dgrad sum)."""
    tensors = _tensors(dtype)
    _Base.dgrads.clear()
    got = _grads(_linked(alpha=alpha), *tensors)
    want = _grads(_plain, *tensors)
    assert _rel(got, want) <= TOL[dtype]
    # the base's dgrad tensor itself (TE's reshape view of it reached IntoBaseGrad) now holds the sum
    assert torch.equal(_Base.dgrads[-1].view(got[1].shape), got[1])
    # without the adapter's share the input gradient differs: the comparison above can fail
    assert _rel([F.linear(tensors[4], tensors[1].t())], [want[1]]) > 10 * TOL[dtype]


@pytest.mark.parametrize("alpha", [False, True], ids=["multiply", "alpha"])
def test_a_strided_view_gradient_is_summed_out_of_place(alpha):
    """Where the base's input gradient is a strided view, the sum is out of place (and still right)."""
    tensors = _tensors(torch.float32, seed=1)
    _Base.dgrads.clear()
    got = _grads(_linked(strided=True, alpha=alpha), *tensors)
    assert _rel(got, _grads(_plain, *tensors)) <= TOL[torch.float32]
    # the base's own dgrad was left alone
    assert not torch.equal(_Base.dgrads[-1].view(got[1].shape), got[1])


def test_only_whole_contiguous_gradients_are_summed_into():
    """``_whole``: a tensor of its own or a reshape view of all of one; not a slice, not strided."""
    from twinkle_specs.lora.functions import _whole

    t = torch.zeros(4, 6)
    assert _whole(t) and _whole(t.view(2, 2, 6)) and _whole(t.view(-1))
    assert not _whole(t[:2]) and not _whole(t[1:].reshape(-1)) and not _whole(t.t())


def test_without_a_link_the_a_gemm_returns_its_own_input_gradient():
    """LowRankDown alone (no link) is F.linear with its usual gradients, bit for bit."""
    x, _, a, b, grad = _tensors(torch.float32, seed=2)
    got = _grads(
        lambda x, w, a, b: F.linear(LowRankDown.apply(x, a, None, None, None), b), x, None, a, b, grad
    )
    want = _grads(lambda x, w, a, b: F.linear(F.linear(x, a), b), x, None, a, b, grad)
    assert all(torch.equal(g, e) for g, e in zip(got, want, strict=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_scaling_as_alpha_is_the_scaled_a_gemm(dtype):
    """``LowRankDown(..., scale)`` without a link: ``scale * x @ aᵀ`` and its gradients, against plain
    autograd of the multiply (rounded once instead of twice: the module docstring's tolerances), with
    no multiply kernel of its own: autograd records no MulBackward."""
    x, _, a, b, grad = _tensors(dtype, seed=3)

    def scaled(x, w, a, b):
        h = LowRankDown.apply(x, a, None, None, None, S)
        assert "Mul" not in type(h.grad_fn).__name__
        return F.linear(h, b)

    got = _grads(scaled, x, None, a, b, grad)
    want = _grads(lambda x, w, a, b: F.linear(F.linear(x, a) * S, b), x, None, a, b, grad)
    assert _rel(got, want) <= TOL[dtype]
    unscaled = _grads(lambda x, w, a, b: F.linear(F.linear(x, a), b), x, None, a, b, grad)
    assert _rel(got, unscaled) > 0.1  # the scaling is applied (the comparison above can fail)


def _bank_model(tmp_path):
    import twinkle_specs as ts
    from twinkle_specs.lora import LoraConfig

    model = ts.build_model(
        make_checkpoint("qwen3", tmp_path / "hf"), lora=LoraConfig(r=4, target_modules="all-linear")
    )
    randomize_megatron(model)
    return model


def _bank_splits(out: torch.Tensor, model) -> set:
    """The splits of a bank that ``out``'s autograd graph reaches (megatron's own splits left out)."""
    from twinkle_specs.lora import adapter_parameters

    banks = {id(p) for p in adapter_parameters(model)}

    def reaches_bank(node) -> bool:
        while node is not None and type(node).__name__ != "AccumulateGrad":
            node = node.next_functions[0][0] if node.next_functions else None
        return node is not None and id(node.variable) in banks

    seen, stack, splits = set(), [out.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == "SplitWithSizesBackward0" and reaches_bank(node):
            splits.add(node)
        stack.extend(n for n, _ in node.next_functions)
    return splits


def test_bank_pieces_come_from_one_split_per_layer_and_forward(tmp_path, single_rank):  # noqa: F811
    """Every factor of a layer is a piece of one split of its bank, made anew by each forward, so the
    bank's gradient is one concatenation (not a zero-filled bank per factor and their sums), also
    right after a forward that took only some of the factors (one linear merged): the gradients are a
    fresh model's."""
    from twinkle_specs.lora import adapter_parameters

    model, fresh = _bank_model(tmp_path), _bank_model(tmp_path)
    toks = tokens()
    pos = torch.arange(toks.shape[1]).expand_as(toks)
    first = _bank_splits(model(toks, pos, None), model)
    assert len(first) == 2  # two layers, one bank each
    qkv = model.decoder.layers[0].self_attention.linear_qkv
    qkv.lora_merged = True
    model(toks, pos, None)
    qkv.lora_merged = False
    out = model(toks, pos, None)
    second = _bank_splits(out, model)
    assert len(second) == 2 and second.isdisjoint(first)
    out.float().square().mean().backward()
    fresh(toks, pos, None).float().square().mean().backward()
    params = list(zip(adapter_parameters(model), adapter_parameters(fresh), strict=True))
    assert all(torch.equal(p.grad, q.grad) for p, q in params)


def test_bank_pieces_follow_the_parameter_storage(tmp_path, single_rank):  # noqa: F811
    """Moving a bank's data elsewhere (megatron's DDP puts parameters into its buffers) is seen by the
    next forward: its output and gradients are those of the new storage's values."""
    from twinkle_specs.lora import adapter_parameters

    model = _bank_model(tmp_path)
    toks = tokens()
    pos = torch.arange(toks.shape[1]).expand_as(toks)

    def step():
        model.zero_grad(set_to_none=True)
        loss = model(toks, pos, None).float().square().mean()
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in adapter_parameters(model)]

    step()  # pieces of the old storage exist now
    before = step()
    params = adapter_parameters(model)
    original = [p.data for p in params]
    for p in params:
        p.data = p.data * 1.5
    after = step()
    assert not torch.equal(after[0], before[0])
    assert all(g.abs().max() > 0 for g in after[1])
    for p, data in zip(params, original, strict=True):
        p.data = data
    again = step()
    assert torch.equal(again[0], before[0])
    assert all(torch.equal(g, w) for g, w in zip(again[1], before[1], strict=True))
