"""A frozen RMSNorm's forward + backward on one GPU: Transformer Engine's (``TENorm``, whose backward
also computes the unused weight gradient) against twinkle_specs.lora.norm.TorchRMSNorm (torch's fused
RMSNorm; the backward computes the input gradient only), CUDA-graph-replayed ms per call, as JSON lines.
Shapes are a Qwen3-8B layer's at 4096 tokens: the q and k norms (rows of one 128-wide head) and the
hidden-size norm.

    PYTHONPATH=. python bench/frozen_norm.py [--tokens 4096 --iters 50]
"""

from __future__ import annotations

import argparse
import json

import torch
from megatron.core.extensions.transformer_engine import TENorm
from megatron.core.transformer.transformer_config import TransformerConfig
from swiglu_lora import graph_ms

from twinkle_specs.lora.norm import TorchRMSNorm

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
        for impl, cls in (("te", TENorm), ("torch", TorchRMSNorm)):
            norm = cls(config=config, hidden_size=width, eps=1e-6).cuda()
            norm.weight.requires_grad_(False)

            def step(norm=norm, x=x, dy=dy):
                x.grad = None
                y = norm(x)
                y.backward(dy)
                return y

            outs[impl] = (step().detach().clone(), x.grad.clone())
            print(
                json.dumps({"norm": name, "impl": impl, "fwd_bwd_ms": round(graph_ms(step, args.iters), 4)})
            )
        (y_te, dx_te), (y_t, dx_t) = outs["te"], outs["torch"]
        print(
            json.dumps(
                {
                    "norm": name,
                    "max_abs_diff_out": (y_te.float() - y_t.float()).abs().max().item(),
                    "max_abs_diff_dx": (dx_te.float() - dx_t.float()).abs().max().item(),
                    "max_abs_dx": dx_te.float().abs().max().item(),
                }
            )
        )


if __name__ == "__main__":
    main()
