"""Operator counts of the LoRA adapter path on CPU, before and after the fusion (no GPU timings).

The Qwen3-1.7B shape at seq 4096 on an H100 is bound by host-side launch overhead, so what the adapter
costs there is mostly how many operators it dispatches. This script counts on CPU the aten operators
of one forward and one backward of

* ``layer``: one Qwen3-1.7B-shaped decoder layer (portable path: h 2048, 16/8 heads x 128, ffn 6144),
  LoRA r=16 all-linear, with the per-slot reference (``LoraLayerMixin.lora_delta_per_slot``, what the
  forward did before) and with the layers' forward (fused slots, in-place B, input-gradient handoff,
  bank pieces); and the same layer without adapters, all frozen (the base cost both add to);
* ``experts``: the routed-expert adapter of one grouped linear (128 experts, rank 32 as
  Qwen3-30B-A3B's all-linear ``gate_up_proj``, uneven routing with zero-token experts), per-expert
  loop vs ``torch._grouped_mm`` (torch's CPU fallback kernel here; CUTLASS on an H100).

Counted with a ``TorchDispatchMode`` rather than ``torch.profiler``: it sees each operator that reaches
the backend exactly once, after autograd and composite decomposition (``F.linear`` is a transpose
view and one ``mm``), while the profiler also lists composite wrappers and the allocations a kernel
makes, so its leaf events miscount. "compute" = without views, allocations and other metadata: a
rough stand-in for GPU kernel launches (a CPU operator can be several GPU kernels or none; the CPU
RMSNorm is a chain of elementwise operators where CUDA has one fused kernel each way; torch's CPU
``_grouped_mm`` is one operator that loops over the groups inside, CUDA's is one CUTLASS kernel).
Sizes do not change the counts; the sequence is short for speed.

    python bench/lora_ops.py [--seq 128] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: bench/ is importable as a package from the root
    sys.path.insert(0, str(ROOT))

NOT_KERNELS = {  # allocations, aliasing and metadata: no kernel on a GPU
    "empty",
    "empty_like",
    "empty_strided",
    "new_empty",
    "new_empty_strided",
    "resize_",
    "detach",
    "lift_fresh",
    "_unsafe_view",
    "set_",
    "_local_scalar_dense",
}


class _Counter(TorchDispatchMode):
    """Every aten operator that reaches a backend, once (after autograd and composite decomposition;
    the operators a backend kernel calls internally are not seen)."""

    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[(func.__name__.split(".")[0], func.is_view)] += 1
        return func(*args, **(kwargs or {}))


def count(fn) -> dict:
    """Operators dispatched by ``fn()`` (forward, or the autograd engine's backward), by name."""
    with _Counter() as c:
        fn()
    compute = Counter()
    for (name, view), n in c.ops.items():
        if not view and name not in NOT_KERNELS:
            compute[name] += n
    return {"ops": sum(c.ops.values()), "compute_ops": sum(compute.values()), "by_op": dict(compute)}


def fwd_bwd(fn, *inputs: torch.Tensor, params=()) -> dict:
    """Counts of ``fn(*inputs)`` (forward) and of the backward of a weighted sum of its output, with
    no gradient accumulated yet in ``inputs`` or ``params`` (a first micro-batch)."""
    for t in (*inputs, *params):
        t.grad = None
    box = {}

    def forward():
        box["out"] = fn(*inputs)

    result = {"forward": count(forward)}
    out = box["out"]
    grad = torch.randn_like(out)
    result["backward"] = count(lambda: out.backward(grad))
    return result


# -- one decoder layer ------------------------------------------------------------------------------


def _layer_model(lora):
    """One decoder layer of the benchmark's Qwen3-1.7B shape (a small vocabulary: not counted here)."""
    import twinkle_specs as ts
    from bench.shapes import hf_config

    hf = hf_config("qwen3-1.7b", layers=1)
    hf.vocab_size, hf.dtype = 256, "float32"  # the counts: fp32 on CPU, as the layer's inputs
    hf.architectures = ["Qwen3ForCausalLM"]
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        return ts.build_model(Path(d), load_weights=False, lora=lora)


def layer_counts(seq: int) -> dict:
    from twinkle_specs.lora import LoraConfig
    from twinkle_specs.lora.layers import LoraLinearMixin
    from twinkle_specs.parity import _init_single_process

    _init_single_process()
    torch.manual_seed(0)
    results = {}
    lora = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear")
    for cfg in (None, lora):
        model = _layer_model(cfg)
        if cfg is None:  # the same layer without adapters, all frozen
            model.requires_grad_(False)
        layer = model.decoder.layers[0]
        rope = model.rotary_pos_emb(seq)
        x = torch.randn(seq, 1, 2048, requires_grad=True)

        def run(x, layer=layer, rope=rope):
            return layer(x, attention_mask=None, rotary_pos_emb=rope)[0]

        run(x)  # warm-up (lazy initialisation, layout caches)
        params = [p for p in layer.parameters() if p.requires_grad]
        if cfg is None:
            results["base_frozen"] = fwd_bwd(run, x)
            continue
        current = LoraLinearMixin.forward
        try:
            LoraLinearMixin.forward = _per_slot_forward
            results["lora_before"] = fwd_bwd(run, x, params=params)
        finally:
            LoraLinearMixin.forward = current
        results["lora_after"] = fwd_bwd(run, x, params=params)
    return results


def _per_slot_forward(self, input_: torch.Tensor, *args, **kwargs):
    """A linear's forward before the fusion: base output plus the per-slot reference delta."""
    from twinkle_specs.lora.layers import LoraLinearMixin

    out, bias = super(LoraLinearMixin, self).forward(input_, *args, **kwargs)
    if self.lora_merged or not self.lora_slots:
        return out, bias
    return out + self.lora_delta_per_slot(input_).to(out.dtype), bias


# -- routed experts ----------------------------------------------------------------------------------


def expert_counts() -> dict:
    from twinkle_specs.lora.experts import expert_delta_grouped, expert_delta_loop

    g = torch.Generator().manual_seed(0)
    experts, n_in, n_out, r = 128, 256, 192, 32
    splits = [int(v) for v in torch.randint(0, 24, (experts,), generator=g)]
    for e in (3, 50, 127):
        splits[e] = 0
    x = torch.randn(sum(splits), n_in, generator=g)
    a = (torch.randn(experts, r, n_in, generator=g) * 0.05).requires_grad_(True)
    b = (torch.randn(experts, n_out, r, generator=g) * 0.05).requires_grad_(True)
    out = {}
    for name, fn in (("before_loop", expert_delta_loop), ("after_grouped_mm", expert_delta_grouped)):
        xg = x.clone().requires_grad_(True)
        out[name] = fwd_bwd(lambda x, fn=fn: fn(x, a, b, splits, 2.0), xg, params=(a, b))
    return out


def _row(name: str, r: dict) -> str:
    f, b = r["forward"], r["backward"]
    total = f["compute_ops"] + b["compute_ops"]
    return (
        f"| {name} | {f['compute_ops']} | {b['compute_ops']} | {total} | "
        f"{f['ops']} | {b['ops']} | {f['ops'] + b['ops']} |"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--json", type=Path, help="write every count (per operator too) here")
    args = ap.parse_args()
    torch.set_num_threads(min(2, torch.get_num_threads()))
    results = {
        "layer": layer_counts(args.seq),
        "experts": expert_counts(),
        "torch": torch.__version__,
    }
    head = (
        "| what | compute fwd | compute bwd | compute total | all ops fwd | all ops bwd | all ops total |\n"
        "|---|---|---|---|---|---|---|"
    )
    lines = [
        "aten operators on CPU (compute: without views, allocations, metadata), one forward + backward",
        head,
    ]
    for section in ("layer", "experts"):
        for name, r in results[section].items():
            lines.append(_row(f"{section}: {name}", r))
    layer = results["layer"]

    def total(r):
        return r["forward"]["compute_ops"] + r["backward"]["compute_ops"]

    base = total(layer["base_frozen"])
    lines.append(
        f"\nadapter overhead per decoder layer (compute ops): before {total(layer['lora_before']) - base}, "
        f"after {total(layer['lora_after']) - base}"
    )
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    sys.exit(main())
