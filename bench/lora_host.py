"""Host time of one adapted norm-fused linear's forward + backward on CPU, tiny tensors (no GPU timings).

At micro-batch 1 the LoRA step on an H100 is bound by the host (bench/results/2026-11-22-h100: GPU busy
99.5 ms of a 239 ms step), so what an adapter design costs there is mostly Python and dispatch time.
With tensors this small the CPU time is that overhead. Four ways to compute ``out + s * B(A(norm(x)))``
with the gradients of x and of every factor:

* ``keeps norm(x)``: plain autograd ops; the A GEMM saves ``norm(x)`` (the adapter before 9499d08);
* ``recompute hooks``: the A GEMM keeps ``x`` and recomputes ``norm(x)`` in backward through
  saved-tensor hooks (``twinkle_specs.lora.recompute``), B GEMM and sum as one addmm (515d0f2);
* ``hooks + in-place B``: what the layers do now: the same A side, the B GEMM accumulating into the
  base output in place (``twinkle_specs.lora.layers._AddLowRank``, a custom function: it saves the
  GPU a full-size copy per linear and costs this much host time);
* ``autograd.Function``: the same memory behaviour as one custom function per GEMM side with the norm
  recomputed by a nested backward (the design of 9499d08, replaced because of this cost).

    python bench/lora_host.py [--iters 3000]
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from twinkle_specs.lora.layers import _AddLowRank  # noqa: E402
from twinkle_specs.lora.recompute import linear_recomputing_input  # noqa: E402

T, IN, OUT, RANKS, SCALE = 8, 64, 256, (16, 16, 16), 2.0


class _Down(torch.autograd.Function):
    """scale * (norm(x) @ A^T), keeping x; the norm's backward by a nested autograd call."""

    @staticmethod
    def forward(ctx, x, norm, a):
        ctx.norm = norm
        ctx.save_for_backward(x, a)
        return F.linear(norm(x), a) * SCALE

    @staticmethod
    def backward(ctx, dh):
        x, a = ctx.saved_tensors
        dh = dh * SCALE
        with torch.enable_grad():
            xr = x.detach().requires_grad_(True)
            n = ctx.norm(xr)
        da = dh.reshape(-1, dh.shape[-1]).t().mm(n.detach().reshape(-1, n.shape[-1]))
        (dx,) = torch.autograd.grad(n, xr, dh.matmul(a))
        return dx, None, da


class _Up(torch.autograd.Function):
    """out + h @ B^T, out's gradient passed through."""

    @staticmethod
    def forward(ctx, out, h, b):
        ctx.save_for_backward(h, b)
        return torch.addmm(out.reshape(-1, out.shape[-1]), h.reshape(-1, h.shape[-1]), b.t()).view(out.shape)

    @staticmethod
    def backward(ctx, dy):
        h, b = ctx.saved_tensors
        return dy, dy.matmul(b), dy.reshape(-1, dy.shape[-1]).t().mm(h.reshape(-1, h.shape[-1]))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=3000)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    weight = torch.rand(IN) + 0.5
    norm = functools.partial(F.rms_norm, normalized_shape=(IN,), weight=weight, eps=1e-6)
    a_slots = [torch.randn(r, IN, requires_grad=True) for r in RANKS]
    b = torch.randn(OUT, sum(RANKS), requires_grad=True)

    def keeps_input(x, out):
        return out + F.linear(F.linear(norm(x), torch.cat(a_slots)) * SCALE, b)

    def recompute_hooks(x, out):
        n = norm(x)
        h = linear_recomputing_input(n, torch.cat(a_slots), x, norm) * SCALE
        return torch.addmm(out.reshape(-1, OUT), h.reshape(-1, h.shape[-1]), b.t()).view(out.shape)

    def in_place_b(x, out):
        n = norm(x)
        h = linear_recomputing_input(n, torch.cat(a_slots), x, norm) * SCALE
        return _AddLowRank.apply(out.view_as(out), h, b)  # a view, as TE's output (values drift: timing only)

    def function(x, out):
        return _Up.apply(out, _Down.apply(x, norm, torch.cat(a_slots)), b)

    def time_us(fn) -> float:
        x = torch.randn(T, 1, IN, requires_grad=True)
        out = torch.randn(T, 1, OUT, requires_grad=True)
        for _ in range(200):
            fn(x, out).sum().backward()
        t0 = time.perf_counter()
        for _ in range(args.iters):
            fn(x, out).sum().backward()
        return (time.perf_counter() - t0) / args.iters * 1e6

    variants = {
        "keeps norm(x)": keeps_input,
        "recompute hooks": recompute_hooks,
        "hooks + in-place B": in_place_b,
        "autograd.Function": function,
    }
    for _ in range(2):  # interleaved twice: the spread is the noise
        for name, fn in variants.items():
            print(f"{name:19s} {time_us(fn):7.1f} us per forward + backward")


if __name__ == "__main__":
    main()
