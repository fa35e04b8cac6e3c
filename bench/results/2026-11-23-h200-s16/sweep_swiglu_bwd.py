"""The sweep behind swiglu_bwd_variants.jsonl (H200, tree 8506662, Qwen3-8B MLP shape, fc2 at scaling 2): the
shipped SwiGLU backward (``cur``) against ``v1``, which accumulates fc1's B gradient as ``hᵀ @ dy`` [R, F]
instead of ``dyᵀ @ h`` [F, R] (no transpose of the large tile), over launch configurations (token block,
F block, warps, stages, waves), each checked against the shipped kernel at its default configuration.
``v1`` was a copy of twinkle_specs/lora/swiglu.py at bench/_v1_swiglu.py with those three lines changed; it
was slower (287 against 274 us) and was not kept. Run from the repository root as bench/_ab2_swiglu.py.
"""

import importlib.util
import json
import sys

import torch

sys.path.insert(0, "bench")
from swiglu_lora import graph_ms  # noqa: E402

from twinkle_specs.lora import swiglu as cur  # noqa: E402


def load(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rand(*shape, scale=1.0):
    return (torch.randn(*shape, generator=g, device="cuda") * scale).to(torch.bfloat16)


def rel(x: torch.Tensor, y: torch.Tensor) -> float:
    return ((x.float() - y.float()).abs().max() / y.float().abs().max()).item()


v1 = load("v1_swiglu", "bench/_v1_swiglu.py")
g = torch.Generator(device="cuda").manual_seed(0)
T, F, R = 4096, 12288, 16
pre, h, b = rand(T, 2 * F), rand(T, 2 * R), rand(2 * F, R, scale=0.1)
a2, dh2, dout = rand(R, F, scale=0.1), rand(T, R), rand(T, F)
ref = cur._triton_backward(dout, pre, h, b, dh2, a2, 2.0)
configs = [
    (32, 64, 4, 3, 2),
    (32, 64, 8, 3, 2),
    (64, 64, 8, 3, 2),
    (32, 128, 8, 3, 2),
    (64, 32, 4, 3, 2),
    (32, 64, 4, 4, 2),
    (16, 64, 4, 3, 2),
    (32, 64, 4, 3, 1),
]
for name, module in (("cur", cur), ("v1", v1)):
    default = module.BWD_BLOCKS
    for cfg in configs:
        module.BWD_BLOCKS = cfg
        out = module._triton_backward(dout, pre, h, b, dh2, a2, 2.0)
        errs = [round(rel(x, y), 6) for x, y in zip(out, ref, strict=True)]
        ms = graph_ms(lambda m=module: m._triton_backward(dout, pre, h, b, dh2, a2, 2.0), 50)
        print(json.dumps({"kernel": name, "blocks": cfg, "bwd_ms": round(ms, 4), "rel_vs_shipped": errs}))
    module.BWD_BLOCKS = default
