"""The A/B of swiglu_lora's kernels behind swiglu_scale_ab.jsonl (H200, Qwen3-8B MLP: 4096 tokens, F 12288,
fc1 at rank 16 with gate and up apart, fc2's deferred A GEMM at rank 16), CUDA-graph-replayed ms per call:

- ``old``: the backward before the scaling moved into the A GEMM (07386b0; no S2 argument);
- ``new_s1``/``new_s2``: the backward of 6785a30 (fc2's scaling S2 multiplying the dot inside the token
  loop), S2 = 1 and 2;
- ``v2_s2``: S2 multiplying a2 once per program (what 55f5b33 ships), S2 = 2;
- ``old_fwd``/``new_fwd``: the forward kernel before and after (unchanged).

The ``old`` and ``v2`` modules were files beside this script when it ran (not kept: copies of library code):

    git show 07386b0:twinkle_specs/lora/swiglu.py > bench/_old_swiglu.py
    git show 55f5b33:twinkle_specs/lora/swiglu.py > bench/_v2_swiglu.py
    PYTHONPATH=. python bench/_ab_swiglu.py      # this file, from the repository root

Run again after 55f5b33 landed (swiglu_scale_ab_55f5b33.jsonl, the first round as printed), ``new_*`` are the
shipped kernel.
"""

import importlib.util
import json
import sys

import torch

sys.path.insert(0, "bench")
from swiglu_lora import graph_ms  # noqa: E402

from twinkle_specs.lora import swiglu as new  # noqa: E402


def load(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


old, v2 = load("old_swiglu", "bench/_old_swiglu.py"), load("v2_swiglu", "bench/_v2_swiglu.py")
g = torch.Generator(device="cuda").manual_seed(0)
T, F, R = 4096, 12288, 16


def rand(*shape, scale=1.0):
    return (torch.randn(*shape, generator=g, device="cuda") * scale).to(torch.bfloat16)


pre, h, b = rand(T, 2 * F), rand(T, 2 * R), rand(2 * F, R, scale=0.1)
a2, dh2, dout = rand(R, F, scale=0.1), rand(T, R), rand(T, F)
runs = {
    "old": lambda: old._triton_backward(dout, pre, h, b, dh2, a2),
    "new_s1": lambda: new._triton_backward(dout, pre, h, b, dh2, a2, 1.0),
    "new_s2": lambda: new._triton_backward(dout, pre, h, b, dh2, a2, 2.0),
    "v2_s2": lambda: v2._triton_backward(dout, pre, h, b, dh2, a2, 2.0),
    "old_fwd": lambda: old._triton_forward(pre, h, b),
    "new_fwd": lambda: new._triton_forward(pre, h, b),
}
for rep in range(3):
    for path, fn in runs.items():
        print(json.dumps({"rep": rep, "path": path, "bwd_ms": round(graph_ms(fn, 50), 4)}))
