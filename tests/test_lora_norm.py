"""The adapted attention's q/k norm (twinkle_specs.lora.norm.QKNorm) on CPU.

Against an independent fp64 RMSNorm: the torch path's fp32 output and gradients to rel 1e-6 (measured
<= 1.6e-7 over 20 seeds), its bf16 output within one rounding of the exact value (rel 8e-3; measured
<= 2.5e-3). With the weight frozen the backward gives the input gradient only; trainable, the
weight's too. The frozen path's Triton kernels, interpreted, on strided inputs and gradients: 2 ulps
relative to the largest value (fp32 1e-5, fp16 2e-3, bf16 1.6e-2; measured 1.5e-7, 3.8e-4, 6.2e-3,
the interpreter truncating bf16 casts). Checkpoint keys are a TE norm's (``weight``,
``_extra_state``). The swap in the LoRA spec is tests/test_lora_te_standin.py's.

HiddenNorm (the norm before an adapted QKV / fc1): on CPU against the same fp64 reference (fp32 1e-6,
bf16 8e-3), zero-centred gamma too; its row kernels interpreted (the tolerances above; measured fp32
1.4e-7, fp16 3.6e-4, bf16 7.3e-3), with the amax FP8 current scaling takes exactly the output's largest
magnitude and the output unchanged by taking it; with the residual returned, the input gradient is the
norm's plus the residual's (same tolerances), the output unchanged and the residual a view of the input;
an adapter's A gradient from the norm's input and the 1/rms the kernel left on its output (norm.RowScaled)
against the fp64 ``dhᵀ y`` (same tolerances).
Bit-for-bit equality of that fused sum with autograd's is tests/test_lora_gpu.py's (the interpreter's
bf16 casts truncate)."""

from __future__ import annotations

import importlib.util
import json
import types

import pytest
import torch
from megatron.core.transformer.transformer_config import TransformerConfig
from test_lora_support import CountingKernel, interpreted

from twinkle_specs.lora import norm as N
from twinkle_specs.lora.norm import QKNorm

EPS = 1e-6


def _config(**kw) -> TransformerConfig:
    return TransformerConfig(
        num_layers=1, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True, **kw
    )


def _reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    x64 = x.double()
    return x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + EPS) * w.double()


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).abs().max() / want.abs().max()).item()


def _norm(train_weight: bool, dtype=torch.float32, seed: int = 0, width: int = 16) -> QKNorm:
    norm = QKNorm(_config(normalization="RMSNorm"), hidden_size=width, eps=EPS).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(width, generator=torch.Generator().manual_seed(seed)) + 0.5)
    norm.weight.requires_grad_(train_weight)
    return norm


@pytest.mark.parametrize("train_weight", [False, True], ids=["frozen", "trainable"])
def test_matches_rmsnorm_and_its_gradients(train_weight):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(5, 2, 4, 16, generator=g) * 3).requires_grad_(True)
    grad = torch.randn(5, 2, 4, 16, generator=g)
    norm = _norm(train_weight)
    out = norm(x)
    out.backward(grad)

    xr = x.detach().double().requires_grad_(True)
    wr = norm.weight.detach().double().requires_grad_(True)
    want = _reference(xr, wr)
    want.backward(grad.double())
    assert _rel(out.detach(), want.detach()) <= 1e-6
    assert _rel(x.grad, xr.grad) <= 1e-6
    if train_weight:
        assert _rel(norm.weight.grad, wr.grad) <= 1e-6
    else:
        assert norm.weight.grad is None
    # the weight matters: without it the output differs by far more than the tolerance
    assert _rel(_reference(x.detach(), torch.ones(16)), want.detach()) > 0.1


def test_bf16_output_is_rounded_once():
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    norm = _norm(False, torch.bfloat16, seed=3)
    out = norm(x)
    assert out.dtype == torch.bfloat16
    assert _rel(out, _reference(x, norm.weight)) <= 8e-3


def test_checkpoint_keys_are_a_te_norms():
    sd = _norm(False).state_dict()
    assert set(sd) == {"weight", "_extra_state"}
    assert sd["_extra_state"].dtype == torch.uint8 and sd["_extra_state"].numel() == 0


def test_other_norms_are_refused():
    with pytest.raises(ValueError, match="LayerNorm"):
        QKNorm(_config(normalization="LayerNorm"), hidden_size=16)
    with pytest.raises(ValueError, match="zero_centered_gamma=True"):
        QKNorm(_config(normalization="RMSNorm", layernorm_zero_centered_gamma=True), hidden_size=16)


@pytest.mark.parametrize("zero_centered", [False, True], ids=["gamma", "zero-centred"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 8e-3)], ids=["fp32", "bf16"])
def test_hidden_norm_on_cpu_is_te_rmsnorm(zero_centered, dtype, tol):
    """HiddenNorm off the GPU: fp32 statistics and products, the weight (plus one where zero-centred) in
    fp32, the output rounded once; the input gradient only, the weight frozen."""
    config = _config(normalization="RMSNorm", layernorm_zero_centered_gamma=zero_centered)
    norm = N.HiddenNorm(config, hidden_size=48, eps=EPS).to(dtype)
    assert set(norm.state_dict()) == {"weight", "_extra_state"}  # TENorm's keys
    assert torch.equal(
        norm.weight, torch.full((48,), 0.0 if zero_centered else 1.0, dtype=dtype)
    )  # TE's init
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(48, generator=g) - 0.5)
    norm.weight.requires_grad_(False)
    x = (torch.randn(6, 2, 48, generator=g) * 3).to(dtype).requires_grad_(True)
    grad = torch.randn(6, 2, 48, generator=g).to(dtype)
    out = norm(x)
    out.backward(grad)
    xr = x.detach().double().requires_grad_(True)
    want = _row_reference(xr, norm.weight.detach(), zero_centered)
    want.backward(grad.double())
    assert out.dtype == dtype and _rel(out.detach(), want.detach()) <= tol
    assert _rel(x.grad, xr.grad) <= tol and norm.weight.grad is None
    # the gamma rule matters: the other one is far off
    assert _rel(_row_reference(x.detach(), norm.weight.detach(), not zero_centered), want.detach()) > 0.1


def test_hidden_norm_of_a_layernorm_config_is_tes_own(monkeypatch):
    """A config whose normalization is no RMSNorm gets TENorm's module, as the fused linear's norm was."""
    import sys
    import types

    built = []
    fake = types.SimpleNamespace(
        TENorm=lambda config, hidden_size, eps: built.append(hidden_size) or "te-norm"
    )
    monkeypatch.setitem(sys.modules, "megatron.core.extensions.transformer_engine", fake)
    assert N.HiddenNorm(_config(normalization="LayerNorm"), hidden_size=32, eps=EPS) == "te-norm"
    assert built == [32]


def _triton_errors(device: str, cases: tuple) -> dict[str, float]:
    """The frozen-weight Triton path (forced) against the fp64 reference: output and input gradient,
    per dtype and case; each case's input is a strided view (a key-like slice of a wider tensor), its
    output gradient a transposed copy (strided too). Also the kernel launches."""
    fwd, bwd = CountingKernel(N._fwd_kernel), CountingKernel(N._bwd_kernel)
    N._fwd_kernel, N._bwd_kernel = fwd, bwd
    use, N._use_triton = N._use_triton, lambda *_: True
    errors: dict[str, float] = {}
    try:
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            for tokens, heads, width in cases:
                g = torch.Generator().manual_seed(tokens + heads + width)
                wide = torch.randn(tokens, heads + 2, width, generator=g) * 2
                x = wide[:, 1 : 1 + heads].to(device=device, dtype=dtype)  # rows not contiguous
                dy = torch.randn(heads, tokens, width, generator=g).to(device=device, dtype=dtype)
                dy = dy.transpose(0, 1)
                norm = _norm(False, seed=width, width=width).to(device=device, dtype=dtype)
                xg = x.detach().clone().requires_grad_(True)
                out = norm(xg)
                out.backward(dy)
                xr = x.detach().double().requires_grad_(True)
                want = _reference(xr, norm.weight.detach())
                want.backward(dy.double())
                key = f"{str(dtype)[6:]}/{tokens}x{heads}x{width}"
                errors[f"{key}/out"] = _rel(out.detach().cpu(), want.detach().cpu())
                errors[f"{key}/dx"] = _rel(xg.grad.cpu(), xr.grad.cpu())
                errors[f"{key}/shape"] = float(out.shape != x.shape or xg.grad.shape != x.shape)
    finally:
        N._fwd_kernel, N._bwd_kernel = fwd.kernel, bwd.kernel
        N._use_triton = use
    errors["launches"] = (fwd.launches, bwd.launches)
    return errors


def test_hidden_norm_returns_the_residual_where_megatron_takes_it(monkeypatch):
    """megatron-core 0.19+ takes ``(output, residual)`` from a layer norm: HiddenNorm gives it there (in
    training on the GPU), not below 0.19, nor with the norms recomputed selectively or activations
    offloaded (both wrap the norm's call); on the CPU (torch's RMSNorm) it returns the output alone."""
    import megatron.core
    from packaging.version import Version

    takes = Version(megatron.core.__version__) >= Version("0.19")
    assert N.layer_takes_residual(_config(normalization="RMSNorm")) is takes
    recomputed = _config(
        normalization="RMSNorm", recompute_granularity="selective", recompute_modules=["layernorm"]
    )
    assert not N.layer_takes_residual(recomputed)
    monkeypatch.setattr(megatron.core, "__version__", "0.19.0")
    assert N.layer_takes_residual(_config(normalization="RMSNorm"))
    monkeypatch.setattr(megatron.core, "__version__", "0.16.1")
    assert not N.layer_takes_residual(_config(normalization="RMSNorm"))
    norm = N.HiddenNorm(_config(normalization="RMSNorm"), hidden_size=32, eps=EPS)
    norm.returns_residual = True
    out = norm(torch.randn(3, 32, requires_grad=True))
    assert isinstance(out, torch.Tensor) and out.shape == (3, 32)


def test_norm_output_recomputes_without_the_modules_hooks():
    """The adapter's recipe runs the norm's forward, not the module call: the forward hooks on the norm (an
    InputRecipe records its input there) do not fire in the recompute, which would keep that input alive."""
    norm = N.HiddenNorm(_config(normalization="RMSNorm"), hidden_size=32, eps=EPS)
    calls = []
    norm.register_forward_hook(lambda *_: calls.append(1))
    x = torch.randn(3, 32)
    assert torch.equal(N.NormOutput(norm)(x), norm(x)) and calls == [1]


def _row_reference(x: torch.Tensor, w: torch.Tensor, zero_centered: bool) -> torch.Tensor:
    return _reference(x, w.double() + 1.0 if zero_centered else w)


def _row_errors(device: str, cases: tuple) -> dict:
    """HiddenNorm's row kernels (forced) against the fp64 reference: output, input gradient (from a
    strided output gradient), and with the amax on, the partial maxima's largest against the output's
    largest magnitude (exact) and the output the same bit for bit as without; per dtype and case."""
    from twinkle_specs.lora import fp8_amax

    fwd, bwd = CountingKernel(N._row_fwd_kernel), CountingKernel(N._row_bwd_kernel)
    N._row_fwd_kernel, N._row_bwd_kernel = fwd, bwd
    errors: dict = {}
    try:
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            for lead, width, zc in cases:
                g = torch.Generator().manual_seed(width + sum(lead))
                x = (torch.randn(*lead, width, generator=g) * 2).to(device=device, dtype=dtype)
                w = (torch.rand(width, generator=g) - 0.5).to(device=device, dtype=dtype)
                dy = torch.randn(width, *lead, generator=g).movedim(0, -1).to(device=device, dtype=dtype)
                xg = x.detach().clone().requires_grad_(True)
                out = N.FrozenRowRMSNorm.apply(xg, w, EPS, zc, True)
                out.backward(dy)
                plain = N.FrozenRowRMSNorm.apply(x, w, EPS, zc, False)
                xr = x.detach().double().cpu().requires_grad_(True)
                want = _row_reference(xr, w.cpu(), zc)
                want.backward(dy.double().cpu())
                key = f"{str(dtype)[6:]}/rows-{'x'.join(map(str, lead))}x{width}{'-zc' if zc else ''}"
                errors[f"{key}/out"] = _rel(out.detach().cpu(), want.detach())
                errors[f"{key}/dx"] = _rel(xg.grad.cpu(), xr.grad)
                errors[f"{key}/shape"] = float(out.shape != x.shape or xg.grad.shape != x.shape)
                partials = fp8_amax.tagged(out)
                errors[f"{key}/amax-exact"] = (partials.max() - out.float().abs().max()).abs().item()
                errors[f"{key}/same-exact"] = float(
                    not torch.equal(out, plain) or fp8_amax.tagged(plain) is not None
                )
                # with the residual: (output, x as a view); the backward adds the residual's gradient
                dr = torch.randn(width, *lead, generator=g).movedim(0, -1).to(device=device, dtype=dtype)
                xt = x.detach().clone().requires_grad_(True)
                out_r, res = N.FrozenRowRMSNorm.apply(xt, w, EPS, zc, False, True)
                torch.autograd.backward([out_r, res], [dy, dr])
                errors[f"{key}/residual-dx"] = _rel(xt.grad.cpu(), xr.grad + dr.double().cpu())
                errors[f"{key}/residual-exact"] = float(
                    not torch.equal(out_r, plain) or not torch.equal(res, xt) or res._base is not xt
                )
                # an adapter's A gradient from the norm's input and the rows' 1/rms the kernel left on y
                rank = 3
                dh = torch.randn(*lead, rank, generator=g).to(device=device, dtype=dtype)
                norm = types.SimpleNamespace(weight=w, zero_centered_gamma=zc)
                bound = N.NormOutput(norm).bind(plain)
                da = bound.a_grad(x, dh.reshape(-1, rank), 0.5)
                want_da = (
                    0.5
                    * dh.double().cpu().reshape(-1, rank).t()
                    @ _row_reference(x.double().cpu(), w.cpu(), zc).reshape(-1, width)
                )
                errors[f"{key}/a-grad"] = _rel(da.cpu(), want_da)
                errors[f"{key}/a-grad-bound"] = float(type(bound) is not N.RowScaled)
    finally:
        N._row_fwd_kernel, N._row_bwd_kernel = fwd.kernel, bwd.kernel
    errors["row-launches"] = (fwd.launches, bwd.launches)
    return errors


# HiddenNorm rows: one ragged program of 16 rows, a zero-centred width that is no power of two over three
# programs, two rows a program of a 1536-wide hidden size
ROWS_INTERPRETED = (((5,), 48, False), ((37,), 40, True), ((3, 2), 1536, True))

# rows below, at and above the rows per program (32), a ragged last block, one head and several
INTERPRETED = ((5, 1, 16), (9, 7, 16), (33, 3, 128))
TRITON_TOL = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1.6e-2}


def _assert_within_tolerance(errors: dict[str, float]) -> None:
    """Shapes exact; output and input gradient within :data:`TRITON_TOL` of their dtype."""
    for key, err in errors.items():
        tol = 0.0 if key.endswith(("/shape", "-exact", "-bound")) else TRITON_TOL[key.split("/")[0]]
        assert err <= tol, (key, err, tol)


@pytest.mark.one_leg  # the row kernels alone: torch and Triton, nothing of megatron-core
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_kernels_under_interpreter():
    """The Triton forward/backward (interpreted on CPU) against fp64, strided inputs and gradients.
    Tolerance: 2 ulps of the dtype relative to the largest value (fp32 1e-5); the interpreter rounds
    fp32 -> bf16 by truncation where the GPU rounds to nearest (measured: see the module docstring)."""
    errors = interpreted(__file__)
    assert errors.pop("launches") == [3 * len(INTERPRETED)] * 2, errors
    rows = 3 * len(ROWS_INTERPRETED)  # three dtypes; per case: with the amax, without, with the residual
    assert errors.pop("row-launches") == [3 * rows, 2 * rows], errors
    _assert_within_tolerance(errors)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or N.triton is None, reason="needs a CUDA GPU and Triton")
def test_triton_kernels_on_cuda_match_the_reference():
    """The compiled kernels against fp64 at a Qwen3 key norm's shape (300 tokens, 8 heads of 128,
    strided) and ragged small shapes; same tolerances as the interpreted test."""
    errors = _triton_errors("cuda", ((300, 8, 128), (9, 7, 16)))
    errors |= _row_errors("cuda", (((4096, 1), 4096, False), ((1000,), 5120, False), ((37,), 40, True)))
    print(json.dumps(errors))
    errors.pop("launches"), errors.pop("row-launches")
    _assert_within_tolerance(errors)


if __name__ == "__main__":
    print(json.dumps(_triton_errors("cpu", INTERPRETED) | _row_errors("cpu", ROWS_INTERPRETED)))
