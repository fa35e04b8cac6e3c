"""The probe behind te-packed-attention-probe-668397c.json: Transformer Engine's packed-row (THD) attention
against an fp32 truth (each sequence alone, SDPA in fp32), per bounds set and head shape, beside
FlashAttention-4's varlen call. Run from the repository root on a GPU machine with the stack staged:

    python docs/evidence/2026-11-30-h200/te-packed-attention-probe.py OUT.json

with the environment of each run in the JSON (NVTE_ALLOW_NONDETERMINISTIC_ALGO=0, NVTE_FUSED_ATTN=0, or the
nvidia-cudnn wheel's library folder in LD_PRELOAD and LD_LIBRARY_PATH). The first run had no
``te_padded_eq`` column (bounds given again as padded bounds); the later runs took the 16/4 x 256 shape only.
"""

import json
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, "tests")
from megatron.core.extensions.transformer_engine import TEDotProductAttention  # noqa: E402
from megatron.core.transformer.enums import AttnMaskType  # noqa: E402
from test_flash_attention_gpu import _attention_config, _rel, _thd_params  # noqa: E402

from twinkle_specs import flash_attention  # noqa: E402

CASES = {
    "five-with-1": [700, 1, 1500, 297, 1598],
    "four-no-1": [700, 1500, 297, 1598],
    "even": [700, 2, 1500, 298, 1596],
    "mult8": [704, 8, 1504, 296, 1584],
    "mult64": [704, 64, 1536, 320, 1472],
    "one-4096": [4096],
    "two-odd": [2047, 2049],
    "one-4095": [4095],
}
SHAPES = [(16, 4, 256), (32, 8, 128), (8, 2, 256), (16, 4, 192)]


def probe(heads: int, groups: int, head_dim: int, real: list[int]) -> dict:
    config = _attention_config(heads, groups, head_dim)
    te_attn = TEDotProductAttention(config, 1, AttnMaskType.causal, "self")
    fa4 = flash_attention.flash_attention_4_class()(config, 1, AttnMaskType.causal, "self")
    tokens, starts = sum(real), [sum(real[:i]) for i in range(len(real))]
    g = torch.Generator(device="cuda").manual_seed(0)
    rand = lambda h: torch.randn(tokens, h, head_dim, device="cuda", generator=g, dtype=torch.bfloat16)  # noqa: E731
    q, k, v = (rand(h).requires_grad_() for h in (heads, groups, groups))
    dout = torch.randn(tokens, heads * head_dim, device="cuda", generator=g, dtype=torch.bfloat16)
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    pieces = []
    for a, n in zip(starts, real, strict=True):
        one = [t[a : a + n].transpose(0, 1)[None] for t in (qf, kf, vf)]
        pieces.append(
            F.scaled_dot_product_attention(*one, is_causal=True, enable_gqa=True)[0].transpose(0, 1)
        )
    truth_out = torch.cat(pieces).reshape(tokens, -1)
    truth = (truth_out, *torch.autograd.grad(truth_out, (qf, kf, vf), dout.float()))

    def run(attn, params):
        qi, ki, vi = (t.view_as(t) for t in (q, k, v))
        out = attn(qi, ki, vi, None, attn_mask_type=AttnMaskType.padding_causal, packed_seq_params=params)
        out = out.reshape(tokens, -1)
        return (out, *torch.autograd.grad(out, (qi, ki, vi), dout))

    row = {"heads": heads, "groups": groups, "head_dim": head_dim, "lengths": real}
    bounds, padded_eq = _thd_params(real, None), _thd_params(real, real)
    for label, attn, params in (
        ("te", te_attn, bounds),
        ("te_padded_eq", te_attn, padded_eq),
        ("fa4", fa4, bounds),
    ):
        res = run(attn, params)
        row[label] = {
            n: round(_rel(a, t), 5) for n, a, t in zip(("out", "dq", "dk", "dv"), res, truth, strict=True)
        }
    return row


if __name__ == "__main__":
    rows = [probe(*shape, real) | {"case": name} for shape in SHAPES for name, real in CASES.items()]
    with open(sys.argv[1], "w") as f:
        json.dump(rows, f, indent=1)
