"""Causal attention at one model shape through each backend the device stack has, forward and forward +
backward, with the cuDNN that each one loaded.

Transformer Engine's ``DotProductAttention`` (what megatron-core's TE spec runs: cuDNN's fused attention)
takes the cuDNN its loader finds first: ``$CUDNN_HOME``/``$CUDNN_PATH``, then the CUDA toolkit, then the
system's library path, and only then the ``nvidia-cudnn`` wheel torch ships. An image with an older system
cuDNN therefore gives TE a different cuDNN from torch's, and the one loaded first is the process's (torch
then refuses its own version check; the two cannot be mixed). ``--cudnn wheel`` points ``CUDNN_HOME`` at
the wheel's library, and puts that folder first on ``LD_LIBRARY_PATH`` (cuDNN opens its sub-libraries by
name), before TE is imported: a child process per setting, so that the two can be timed side by side.
torch's SDPA backends (cuDNN, flash, memory-efficient) and, where installed, FlashAttention-4 (twinkle's
``--flash-attn-4`` path, :func:`twinkle_specs.flash_attention.attend`) run beside TE in each.

Times are device times (the calls queued behind a sleep kernel, as under CUDA graphs). TFLOPS count the
harness's causal forward (bench/flops.py) and 3.5 x that for forward + backward: the backward's five
matmuls, its recomputed scores included, as attention kernels' own benchmarks count (the harness's MFU
counts 3 x, the model work).

    python bench/attention_backends.py --cudnn system,wheel --json out.json   # default: qwen3-8b, seq 4096
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: bench/ is importable as a package from the root
    sys.path.insert(0, str(ROOT))

from twinkle_specs.packed_attention_check import wheel_cudnn_dir  # noqa: E402


def torch_cudnn_version() -> int | str:
    """torch's cuDNN version, or why torch refuses the cuDNN in this process (another one loaded first)."""
    import torch

    try:
        return torch.backends.cudnn.version()
    except RuntimeError as err:
        return str(err).splitlines()[0][:200]


def shape_attention(shape: str, seq: int, batch: int) -> tuple[int, int, int, float]:
    """(query heads, key/value heads, head dim, causal forward FLOPs of one full-attention layer) of a
    benchmark shape, counted as the harness counts them (:func:`bench.flops.attention_flops_forward`)."""
    from bench import flops, shapes
    from twinkle_specs.hf_config import qwen_arch_from_hf

    with tempfile.TemporaryDirectory() as tmp:
        arch = qwen_arch_from_hf(shapes.write_config(shape, 1, Path(tmp)))
    forward = flops.attention_flops_forward(arch, [seq] * batch)
    return arch.num_attention_heads, arch.num_query_groups, arch.kv_channels, forward


def measure(args: argparse.Namespace) -> dict:
    """One process: TE's fused attention and torch's SDPA backends at the shape, timed by CUDA events."""
    # TE first: its loader picks the process's cuDNN (in a training run, torch first, TE takes the same
    # system cuDNN beside torch's front library only: the harness's results record it, ``cudnn``)
    import transformer_engine  # noqa: I001
    import transformer_engine.pytorch as te
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from bench.environment import loaded_cudnn
    from bench.peer_kits import flash_attn_4_missing
    from bench.timing import queued_cuda_ms

    torch.manual_seed(0)
    s, b = args.seq, args.batch
    hq, hkv, d, fwd_flops = shape_attention(args.shape, s, b)
    make = lambda h: torch.randn(s, b, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)  # noqa: E731
    q, k, v = make(hq), make(hkv), make(hkv)
    dout = torch.randn(s, b, hq * d, device="cuda", dtype=torch.bfloat16)
    rows: dict[str, dict] = {}

    def time_pair(name: str, forward) -> None:
        def fwd_only():
            with torch.no_grad():
                forward()

        def fwd_bwd():
            out = forward()
            torch.autograd.grad(out, (q, k, v), dout.view_as(out))

        try:
            fwd_ms = queued_cuda_ms(fwd_only, args.iters, args.warmup)
            step_ms = queued_cuda_ms(fwd_bwd, args.iters, args.warmup)
        except RuntimeError as err:  # a backend that refuses the shape is reported, not fatal
            rows[name] = {"error": str(err).splitlines()[0][:300]}
            return
        rows[name] = {
            "forward_ms": round(fwd_ms, 4),
            "forward_backward_ms": round(step_ms, 4),
            "backward_ms": round(step_ms - fwd_ms, 4),
            "forward_tflops": round(fwd_flops / fwd_ms / 1e9, 1),
            "forward_backward_tflops": round(3.5 * fwd_flops / step_ms / 1e9, 1),
        }

    attn = te.DotProductAttention(hq, d, num_gqa_groups=hkv, attn_mask_type="causal", qkv_format="sbhd")
    time_pair("te_fused_attention", lambda: attn(q, k, v))

    qb, kb, vb = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, h, s, d] views for SDPA
    for name, backend in (
        ("torch_sdpa_cudnn", SDPBackend.CUDNN_ATTENTION),
        ("torch_sdpa_flash", SDPBackend.FLASH_ATTENTION),
        ("torch_sdpa_efficient", SDPBackend.EFFICIENT_ATTENTION),
    ):

        def sdpa(backend=backend):
            with sdpa_kernel(backend):
                out = torch.nn.functional.scaled_dot_product_attention(
                    qb, kb, vb, is_causal=True, enable_gqa=True
                )
            return out.permute(2, 0, 1, 3)

        time_pair(name, sdpa)

    if missing := flash_attn_4_missing():
        rows["flash_attn_4"] = {"error": missing}
    else:
        from twinkle_specs.flash_attention import attend

        scale = d**-0.5
        time_pair("flash_attn_4", lambda: attend(q, k, v, scale, deterministic=False))

    return {
        "cudnn_env": {key: os.environ.get(key) for key in ("CUDNN_HOME", "CUDNN_PATH")},
        "torch_cudnn_version": torch_cudnn_version(),
        "cudnn": loaded_cudnn(),
        "te": transformer_engine.__version__,
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(),
        "shape": {"name": args.shape, "seq": s, "batch": b, "heads": hq, "kv_heads": hkv, "head_dim": d},
        "rows": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument(
        "--shape", default="qwen3-8b", help="a shape of bench/shapes.py (its attention layer)"
    )
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--cudnn", default="system,wheel", help="comma list: system (TE's own search), wheel")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args)))
        return
    results = {}
    for setting in args.cudnn.split(","):
        env = dict(os.environ)
        if setting == "wheel":
            folder = wheel_cudnn_dir()
            if folder is None:
                results[setting] = {"error": "no nvidia-cudnn wheel in this interpreter's site-packages"}
                continue
            # its sub-libraries are opened by name: the folder goes first on the search path too
            env["CUDNN_HOME"] = folder
            env["LD_LIBRARY_PATH"] = f"{folder}:{env.get('LD_LIBRARY_PATH', '')}"
        elif setting != "system":
            parser.error(f"--cudnn: unknown setting {setting!r} (system, wheel)")
        argv = [sys.executable, __file__, "--child"] + [
            f"--{key.replace('_', '-')}={getattr(args, key)}"
            for key in ("shape", "seq", "batch", "iters", "warmup")
        ]
        done = subprocess.run(argv, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            results[setting] = {"error": done.stderr.strip().splitlines()[-5:]}
        else:
            results[setting] = json.loads(done.stdout.strip().splitlines()[-1])
        print(setting, json.dumps(results[setting], indent=1))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
