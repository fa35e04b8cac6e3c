"""Host time of one adapted norm + linear's forward + backward on CPU, tiny tensors (no GPU timings).

At micro-batch 1 the LoRA step on an H100 is bound by the host without CUDA graphs (a profile showed
the GPU busy 99.5 ms of a 239 ms step), so what an adapter design costs there is mostly
Python and dispatch time. With tensors this small the CPU time is that overhead. Five ways to compute
``W norm(x) + s * B(A(norm(x)))`` for a frozen ``W``, with the gradients of x and of every factor (the
first four beside TE's norm-fused linear, which normalises for the base only, the last beside a norm of
its own):

* ``keeps norm(x)``: plain autograd ops; the A GEMM saves ``norm(x)`` (the adapter before 9499d08);
* ``recompute hooks``: the A GEMM keeps ``x`` and recomputes ``norm(x)`` in backward through
  saved-tensor hooks, B GEMM and sum as one addmm (515d0f2);
* ``hooks + in-place B``: the same A side, the B GEMM accumulating into the base output in place
  (``AddLowRank``; 0033f32 to 49bdbde);
* ``autograd.Function``: the same memory behaviour as one custom function per GEMM side with the norm
  recomputed by a nested backward (the design of 9499d08, replaced because of this cost);
* ``shared norm, handoff``: what the layers do now (``twinkle_specs.lora.functions``): one norm for
  base and adapter, the A GEMM keeps the norm's input (``LowRankDown`` with a recipe) and hands its
  input gradient to the base's (``IntoBaseGrad``), in-place B.

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

from twinkle_specs.lora.functions import AddLowRank, GradLink, IntoBaseGrad, LowRankDown  # noqa: E402

T, IN, OUT, RANKS, SCALE = 8, 64, 256, (16, 16, 16), 2.0


def linear_recomputing_input(inp, weight, source, fn):
    """``F.linear(inp, weight)`` saving ``source`` instead of ``inp`` through saved-tensor hooks and
    recomputing ``inp = fn(source)`` in backward (the layers' A GEMM from 515d0f2 to 49bdbde)."""
    storage = inp.untyped_storage().data_ptr()

    def pack(t):
        return (
            (source, t.shape, t.stride(), t.storage_offset())
            if t.untyped_storage().data_ptr() == storage
            else t
        )

    def unpack(p):
        if not isinstance(p, tuple):
            return p
        with torch.no_grad():
            return fn(p[0]).as_strided(*p[1:])

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        return F.linear(inp, weight)


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
    w = torch.randn(OUT, IN)  # the frozen base weight
    a = torch.randn(sum(RANKS), IN, requires_grad=True)  # the slots' A stacked, as lora_A is
    b = torch.randn(OUT, sum(RANKS), requires_grad=True)

    def base(x):  # TE's norm-fused linear: its own norm, for the base GEMM only
        return F.linear(norm(x), w)

    def keeps_input(x):
        return base(x) + F.linear(F.linear(norm(x), a) * SCALE, b)

    def recompute_hooks(x):
        h = linear_recomputing_input(norm(x), a, x, norm) * SCALE
        return torch.addmm(base(x).reshape(-1, OUT), h.reshape(-1, h.shape[-1]), b.t()).view(-1, 1, OUT)

    def in_place_b(x):
        h = linear_recomputing_input(norm(x), a, x, norm) * SCALE
        return AddLowRank.apply(base(x), h, b)

    def function(x):
        return _Up.apply(base(x), _Down.apply(x, norm, a), b)

    def shared_norm_handoff(x):
        link = GradLink()
        n = IntoBaseGrad.apply(norm(x), link)
        h = LowRankDown.apply(n, a, link, x, norm) * SCALE
        return AddLowRank.apply(F.linear(n, w), h, b)

    def time_us(fn) -> float:
        x = torch.randn(T, 1, IN, requires_grad=True)
        for _ in range(200):
            fn(x).sum().backward()
        t0 = time.perf_counter()
        for _ in range(args.iters):
            fn(x).sum().backward()
        return (time.perf_counter() - t0) / args.iters * 1e6

    variants = {
        "keeps norm(x)": keeps_input,
        "recompute hooks": recompute_hooks,
        "hooks + in-place B": in_place_b,
        "autograd.Function": function,
        "shared norm, handoff": shared_norm_handoff,
    }
    for _ in range(2):  # interleaved twice: the spread is the noise
        for name, fn in variants.items():
            print(f"{name:20s} {time_us(fn):7.1f} us per forward + backward")


if __name__ == "__main__":
    main()
