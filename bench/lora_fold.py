"""What folding a LoRA adapter's rank-r sums into its frozen base GEMM would save, per adapted linear of a
dense benchmark shape: the probe to run before building it.

Today (``twinkle_specs.lora.functions``) an adapted linear's forward is the base GEMM ``y = x Wᵀ``, the A
GEMM ``u = s x Aᵀ`` and ``y += u Bᵀ``, a cuBLAS beta = 1 GEMM that reads and writes all of ``y`` again;
its backward likewise adds ``(s dy B) A`` into the base's input gradient ``dy W``. Each sum is one GEMM over
a reduction widened by r:

* forward ``y = [x | u] @ [W | B]ᵀ``, backward ``dx = [dy | v] @ [W ; A]`` with ``v = s dy B``;
* one buffer ``[N + r, K + r]`` holds ``W`` (top left), ``B`` (top right) and ``A`` (bottom left), so both
  weights are strided views of it (the rows ``[:N]``, the columns ``[:, :K]``) and the frozen weight is
  not stored twice;
* the activations the same way: ``x`` in the first K columns of a ``[T, K + r]`` buffer that its producer
  (the norm, attention, SwiGLU) would write into, ``u`` in the last r; ``dy`` and ``v`` likewise.

Timed on the device (the calls queued behind a sleep kernel, as under CUDA graphs), bf16, for each linear:
the base GEMM alone (the floor), the unfused sequence and the folded one, forward and input gradient (the
adapter's own weight gradients are the same either way, not timed), where the model runs the sum as its own
GEMM. Not so for two: fc1's forward delta goes into the SwiGLU forward kernel and fc2's input-gradient share
into the SwiGLU backward kernel, which reads that gradient anyway (``twinkle_specs.lora.swiglu``), so folding
has no sum to take there. ``--layers`` scales a layer's saving to a step.

    python bench/lora_fold.py --shape qwen3-8b --layers 36 --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: bench/ is importable as a package from the root
    sys.path.insert(0, str(ROOT))


def adapted_linears(shape: str) -> dict[str, tuple[int, int, tuple[str, ...]]]:
    """Each adapted linear of a dense shape's layer: (input width K, output width N, the passes whose sum the
    model runs as a GEMM of its own: timed), from bench/shapes.py's config."""
    from bench import shapes

    config = shapes.hf_config(shape)
    if getattr(config, "num_experts", None) or shapes.SHAPES[shape].full_attention_every:
        raise SystemExit(f"--shape {shape}: a dense shape (MoE and hybrid layers adapt other linears)")
    h, f = config.hidden_size, config.intermediate_size
    d = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    return {
        "linear_qkv": (h, q + 2 * kv, ("forward", "dgrad")),
        "linear_proj": (q, h, ("forward", "dgrad")),
        "linear_fc1": (h, 2 * f, ("dgrad",)),  # forward: in the SwiGLU forward kernel
        "linear_fc2": (f, h, ("forward",)),  # input gradient: in the SwiGLU backward kernel
    }


def _scaled_mm(a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """``scale * a @ b`` as ``twinkle_specs.lora.functions.scaled_mm`` runs it (alpha = scale, beta = 0),
    written out: importing twinkle_specs imports megatron-core, which this probe, torch only, does not need
    on the device machine (its image has torch, not megatron-core)."""
    return torch.addmm(a.new_empty(a.shape[0], b.shape[1]), a, b, beta=0, alpha=scale)


class Folded:
    """The buffers of one folded linear: weights ``[N + r, K + r]`` and activations ``[T, K + r]`` and
    ``[T, N + r]``, with the unfused path's own tensors beside them (the same values)."""

    def __init__(self, t: int, k: int, n: int, r: int, scale: float, device: str, dtype: torch.dtype):
        g = torch.Generator(device=device).manual_seed(0)

        def rand(*size: int, std: float = 1.0) -> torch.Tensor:
            return (torch.randn(*size, generator=g, device=device) * std).to(dtype)

        self.k, self.n, self.scale = k, n, scale
        self.w, self.a, self.b = rand(n, k, std=k**-0.5), rand(r, k, std=k**-0.5), rand(n, r, std=0.1)
        self.x, self.dy = rand(t, k), rand(t, n)
        self.weights = torch.zeros(n + r, k + r, device=device, dtype=dtype)
        self.weights[:n, :k], self.weights[:n, k:], self.weights[n:, :k] = self.w, self.b, self.a
        self.xu = torch.empty(t, k + r, device=device, dtype=dtype)
        self.xu[:, :k] = self.x
        self.dyv = torch.empty(t, n + r, device=device, dtype=dtype)
        self.dyv[:, :n] = self.dy

    def base_forward(self) -> torch.Tensor:
        return self.x @ self.w.t()

    def unfused_forward(self) -> torch.Tensor:
        y = self.x @ self.w.t()
        u = _scaled_mm(self.x, self.a.t(), self.scale)
        return y.addmm_(u, self.b.t())

    def folded_forward(self) -> torch.Tensor:
        k = self.k
        torch.addmm(self.xu[:, k:], self.xu[:, :k], self.a.t(), beta=0, alpha=self.scale, out=self.xu[:, k:])
        return self.xu @ self.weights[: self.n].t()

    def base_dgrad(self) -> torch.Tensor:
        return self.dy @ self.w

    def unfused_dgrad(self) -> torch.Tensor:
        dx = self.dy @ self.w
        v = _scaled_mm(self.dy, self.b, self.scale)
        return dx.addmm_(v, self.a)

    def folded_dgrad(self) -> torch.Tensor:
        n = self.n
        torch.addmm(self.dyv[:, n:], self.dyv[:, :n], self.b, beta=0, alpha=self.scale, out=self.dyv[:, n:])
        return self.dyv @ self.weights[:, : self.k]


def saved_ms_per_layer(rows: dict[str, dict]) -> float:
    """What folding saves a layer: each timed pass where the folded GEMM is the faster (a pass it slows
    stays unfused, so it counts nothing rather than a negative saving)."""
    return sum(
        max(0.0, row[key] - row[key.replace("_unfused_", "_folded_")])
        for row in rows.values()
        for key in row
        if key.endswith("_unfused_ms")
    )


def measure(args: argparse.Namespace) -> dict:
    from bench.timing import queued_cuda_ms

    rows: dict[str, dict] = {}
    for name, (k, n, passes) in adapted_linears(args.shape).items():
        lin = Folded(args.seq, k, n, args.rank, 2.0, "cuda", torch.bfloat16)
        row: dict[str, float] = {"K": k, "N": n}
        for which in passes:
            for path in ("base", "unfused", "folded"):
                fn = getattr(lin, f"{path}_{which}")
                row[f"{which}_{path}_ms"] = round(queued_cuda_ms(fn, args.iters, args.warmup), 4)
            ref, got = getattr(lin, f"unfused_{which}")().float(), getattr(lin, f"folded_{which}")().float()
            row[f"{which}_rel_diff"] = ((got - ref).norm() / ref.norm()).item()
        rows[name] = row
    saved_ms = saved_ms_per_layer(rows)
    return {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "shape": {"name": args.shape, "seq": args.seq, "rank": args.rank, "layers": args.layers},
        "rows": rows,
        "saved_ms_per_layer": round(saved_ms, 4),
        "saved_ms_per_step": round(saved_ms * args.layers, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", default="qwen3-8b", help="a dense shape of bench/shapes.py")
    parser.add_argument("--seq", type=int, default=4096, help="tokens per micro-batch")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--layers", type=int, default=36, help="layers of the step the saving is scaled to")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    result = measure(args)
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
