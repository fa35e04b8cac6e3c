"""A frozen RMSNorm's forward + backward on one GPU, CUDA-graph-replayed ms per call, as JSON lines:
Transformer Engine's (``TENorm``, whose backward also computes the unused weight gradient), torch's
fused ``rms_norm`` and twinkle_specs.lora.norm.QKNorm (its Triton kernels: input gradient only).
Shapes are a Qwen3-8B layer's at 4096 tokens: the q and k norms (rows of one 128-wide head) and the
hidden-size norm.

    PYTHONPATH=. python bench/frozen_norm.py [--tokens 4096 --iters 50]
"""

from __future__ import annotations

import argparse
import functools
import json

import torch
import torch.nn.functional as F
from megatron.core.extensions.transformer_engine import TENorm
from megatron.core.transformer.transformer_config import TransformerConfig
from swiglu_lora import graph_ms

from twinkle_specs.lora.norm import QKNorm

SHAPES = {"q_norm": (32, 128), "k_norm": (8, 128), "hidden_norm": (1, 4096)}  # (heads, width)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args()
    config = TransformerConfig(
        num_layers=1, hidden_size=4096, num_attention_heads=32, normalization="RMSNorm", bf16=True,
        params_dtype=torch.bfloat16,
    )  # fmt: skip
    print(json.dumps({"device": torch.cuda.get_device_name(), "tokens": args.tokens}))
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, (heads, width) in SHAPES.items():
        shape = (args.tokens, 1, heads, width) if heads > 1 else (args.tokens, 1, width)
        x = torch.randn(*shape, device="cuda", generator=g).to(torch.bfloat16).requires_grad_(True)
        dy = torch.randn(*shape, device="cuda", generator=g).to(torch.bfloat16)
        outs = {}
        for impl, cls in (("te", TENorm), ("torch", QKNorm), ("triton", QKNorm)):
            norm = cls(config=config, hidden_size=width, eps=1e-6).cuda()
            norm.weight.requires_grad_(False)
            if impl == "torch":  # QKNorm's weight, torch's kernels
                norm = functools.partial(F.rms_norm, normalized_shape=(width,), weight=norm.weight, eps=1e-6)

            def step(norm=norm, x=x, dy=dy):
                x.grad = None
                y = norm(x)
                y.backward(dy)
                return y

            outs[impl] = (step().detach().clone(), x.grad.clone())
            print(
                json.dumps({"norm": name, "impl": impl, "fwd_bwd_ms": round(graph_ms(step, args.iters), 4)})
            )
        y_te, dx_te = outs["te"]
        for impl in ("torch", "triton"):
            y, dx = outs[impl]
            diffs = {
                "max_abs_diff_out": (y_te.float() - y.float()).abs().max().item(),
                "max_abs_diff_dx": (dx_te.float() - dx.float()).abs().max().item(),
                "max_abs_dx": dx_te.float().abs().max().item(),
            }
            print(json.dumps({"norm": name, "vs_te": impl} | diffs))


if __name__ == "__main__":
    main()
