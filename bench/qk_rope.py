"""An adapted Qwen3 attention's QKV split + frozen q/k norms + RoPE on one GPU, forward + backward,
CUDA-graph-replayed ms per call, as JSON lines: megatron-core's unfused path as it runs under LoRA
(megatron's split, the query's reshape copy, twinkle_specs' QKNorm, TE's fused RoPE via megatron's
``apply_rotary_pos_emb``) against twinkle_specs.lora.qk_rope (one kernel each way), over a sweep of the
fused kernels' launch sizes, with the largest differences between the two. Shape: a Qwen3-8B layer
(8 query groups of 4 heads, head 128) at 4096 tokens.

    PYTHONPATH=. python bench/qk_rope.py [--tokens 4096 --iters 50]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os

import torch
from megatron.core import parallel_state as ps
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.transformer.attention import SplitAlongDim
from megatron.core.transformer.transformer_config import TransformerConfig
from swiglu_lora import graph_ms

from twinkle_specs.lora import qk_rope
from twinkle_specs.lora.norm import QKNorm

GROUPS, QPG, HEAD = 8, 4, 128


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args()
    config = TransformerConfig(
        num_layers=1, hidden_size=4096, num_attention_heads=GROUPS * QPG, num_query_groups=GROUPS,
        kv_channels=HEAD, normalization="RMSNorm", bf16=True, params_dtype=torch.bfloat16,
        apply_rope_fusion=True,
    )  # fmt: skip
    print(json.dumps({"device": torch.cuda.get_device_name(), "tokens": args.tokens}))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29531"))
    torch.distributed.init_process_group("nccl", rank=0, world_size=1)
    ps.initialize_model_parallel()  # megatron's RoPE reads the context-parallel group
    g = torch.Generator(device="cuda").manual_seed(0)
    s = args.tokens
    mixed = torch.randn(s, 1, GROUPS * (QPG + 2) * HEAD, device="cuda", generator=g).to(torch.bfloat16)
    mixed.requires_grad_(True)
    shapes = ((s, 1, GROUPS * QPG, HEAD), (s, 1, GROUPS, HEAD), (s, 1, GROUPS, HEAD))
    grads = [torch.randn(*sh, device="cuda", generator=g).to(torch.bfloat16) for sh in shapes]
    inv = 1.0 / 1e6 ** (torch.arange(0, HEAD, 2, device="cuda", dtype=torch.float32) / HEAD)
    f = torch.outer(torch.arange(s, device="cuda", dtype=torch.float32), inv)
    freqs = torch.cat([f, f], -1)[:, None, None, :]
    norms = []
    for seed in (1, 2):
        norm = QKNorm(config, HEAD, eps=1e-6).cuda()
        with torch.no_grad():
            norm.weight.copy_(torch.rand(HEAD, generator=torch.Generator().manual_seed(seed)) + 0.5)
        norms.append(norm.requires_grad_(False))

    def unfused():
        sizes, grouped = [QPG * HEAD, HEAD, HEAD], mixed.view(s, 1, GROUPS, -1)
        # as megatron's attention splits: TE's SplitAlongDim where its extension has it, else torch's
        q, k, v = SplitAlongDim(grouped, 3, sizes) if SplitAlongDim else torch.split(grouped, sizes, 3)
        q = norms[0](q.reshape(s, 1, -1, HEAD))
        k = norms[1](k)
        return apply_rotary_pos_emb(q, freqs, config), apply_rotary_pos_emb(k, freqs, config), v

    def fused():
        return qk_rope.qk_norm_rope(mixed, GROUPS, norms[0], norms[1], freqs)

    def step(fn):
        mixed.grad = None
        outs = fn()
        torch.autograd.backward(outs, grads)
        return outs

    results = {}
    for name, fn in (("megatron", unfused), ("fused", fused)):
        outs = [t.detach().clone() for t in step(fn)]
        results[name] = (outs, mixed.grad.clone())
        print(
            json.dumps({"path": name, "fwd_bwd_ms": round(graph_ms(lambda fn=fn: step(fn), args.iters), 4)})
        )
    (ref, dref), (got, dgot) = results["megatron"], results["fused"]
    diffs = {
        f"max_abs_diff_{n}": (a.float() - b.float()).abs().max().item()
        for n, a, b in zip("qkv", ref, got, strict=True)
    }
    diffs |= {
        "max_abs_diff_dqkv": (dref.float() - dgot.float()).abs().max().item(),
        "max_abs_dqkv": dref.float().abs().max().item(),
        "max_abs_q": ref[0].float().abs().max().item(),
    }
    print(json.dumps({"fused_vs_megatron": diffs}))
    default = (qk_rope.TOKENS_PER_PROGRAM, qk_rope.WARPS)
    for bt, warps in itertools.product((8, 16, 32, 64), (2, 4, 8)):
        qk_rope.TOKENS_PER_PROGRAM, qk_rope.WARPS = bt, warps
        ms = graph_ms(lambda: step(fused), args.iters)
        print(
            json.dumps(
                {"path": "fused", "tokens_per_program": bt, "warps": warps, "fwd_bwd_ms": round(ms, 4)}
            )
        )
    qk_rope.TOKENS_PER_PROGRAM, qk_rope.WARPS = default


if __name__ == "__main__":
    main()
