"""One benchmark variant in this process: build, warm up, time complete training iterations, measure.

Variants (``VARIANTS``): Megatron-side runs use megatron-core's DistributedDataParallel and
``get_megatron_optimizer`` (distributed Adam, fp32 main weights) on a GPU; on CPU (the portable path
of the CI test) megatron's DDP cannot run (its buffers are CUDA tensors), so torch AdamW on the
trainable parameters stands in, and the result says so. The Hugging Face run uses torch AdamW.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.profiler import record_function

from . import telemetry
from .flops import peak_flops, step_flops
from .stats import spread

VARIANTS = {
    "mcore_te_full": "(a) megatron-core TE spec, full fine-tune",
    "twinkle_full": "(b) twinkle_specs spec, full fine-tune",
    "twinkle_lora": "(c) twinkle_specs LoRA all-linear",
    "hf_peft_lora": "(d) transformers + PEFT LoRA all-linear (sdpa)",
    "twinkle_frozen": "(e) twinkle_specs, all weights frozen (fwd+bwd, no optimizer; memory reference)",
    "hf_full": "(f) transformers full fine-tune (sdpa)",
}
MODE = {
    "mcore_te_full": "full",
    "twinkle_full": "full",
    "twinkle_lora": "lora",
    "hf_peft_lora": "lora",
    "twinkle_frozen": "frozen",
    "hf_full": "full",
}
GiB = 2**30


@dataclass
class Settings:
    """Knobs of one run (the same for every variant of it)."""

    seq_len: int = 4096
    micro_batch_size: int = 1
    warmup: int = 3
    steps: int = 10
    dtype: str = "bf16"  # bf16 | fp32
    lora_r: int = 16
    lora_alpha: float = 32.0
    lr: float = 1e-5
    ce_fusion: bool = True  # megatron cross_entropy_loss_fusion (GPU)
    ce_fusion_impl: str = "te"  # te | native
    cuda_graphs: str = "none"  # none | local | transformer_engine | full_iteration
    gpu_fusions: bool = True  # rope / swiglu fusions on the Megatron side (GPU)
    mcore_overrides: dict[str, Any] = field(default_factory=dict)
    optimizer_overrides: dict[str, Any] = field(default_factory=dict)  # megatron OptimizerConfig fields
    load: bool = True  # time HF -> Megatron loading in twinkle_full (needs the safetensors checkpoint)
    profile: bool = False
    profile_steps: int = 2
    profile_trace: bool = False
    telemetry: bool = True  # GPU clocks/power per timed step (bench/telemetry.py)
    seed: int = 1234

    def torch_dtype(self) -> torch.dtype:
        return {"bf16": torch.bfloat16, "fp32": torch.float32}[self.dtype]


def lora_config(s: Settings):
    from twinkle_specs.lora import LoraConfig

    return LoraConfig(r=s.lora_r, lora_alpha=s.lora_alpha, target_modules="all-linear")


def on_gpu() -> bool:
    return torch.cuda.is_available()


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if on_gpu() else torch.device("cpu")


def _sync() -> None:
    if on_gpu():
        torch.cuda.synchronize()


# --------------------------------------------------------------------------------------------- timing


class PhaseClock:
    """Where each step's time goes on the GPU's timeline, without a profiler or a host sync.

    ``phase(name)`` opens a ``record_function`` range (what the profiler shows) and, while timing, records
    a CUDA event where the phase's work enters the stream. The GPU stamps an event once it has finished
    everything queued before it, or when it is queued if the GPU was idle by then, so the span from one
    phase's event to the next is that phase's stretch of the GPU timeline, including the time the GPU
    waited for the host to queue it (a host-bound phase shows as a span longer than its kernels).
    """

    def __init__(self) -> None:
        self.steps: list[list[tuple[str, Any]]] | None = None

    @contextlib.contextmanager
    def phase(self, name: str):
        if self.steps is not None:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.steps[-1].append((name, event))
        with record_function(name):
            yield

    @staticmethod
    def spans(steps: list[list[tuple[str, Any]]], ends: list) -> dict[str, dict[str, Any]]:
        """Per phase, its spans over the recorded ``steps`` (seconds); ``ends[i]`` ends step ``i``'s last
        phase."""
        per_phase: dict[str, list[float]] = {}
        for marks, end in zip(steps, ends, strict=True):
            stops = [e for _, e in marks[1:]] + [end]
            for (name, start), stop in zip(marks, stops, strict=True):
                per_phase.setdefault(name, []).append(start.elapsed_time(stop) / 1e3)
        return {name: spread(v) for name, v in per_phase.items()}


CLOCK = PhaseClock()


@contextlib.contextmanager
def _gc_paused():
    """Python's cyclic GC off while timing, as megatron's --manual-gc does in pretrain_gpt.py: a gen-2
    collection over a model's worth of objects lands in a random step (host-bound MoE steps varied
    ±25 % between runs without this on an H100); the same for every variant."""
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.unfreeze()


def time_steps(step, warmup: int, steps: int, sample_gpu: bool = True) -> dict[str, Any]:
    """Runs ``warmup`` untimed and ``steps`` timed iterations of one variant (:func:`time_interleaved`
    with nothing to interleave). Returns per-step and per-phase times, the wall time of the timed loop,
    peak memory, losses and (``sample_gpu``) the GPU's clocks per step."""
    return time_interleaved({"": step}, warmup, steps, sample_gpu)[""]


def interleaved_order(names: list[str], round_: int) -> list[str]:
    """Round ``round_``'s order: as given, then reversed (a b, b a, a b, ...), so no variant always
    steps right after another one's step (the caches, allocator and clocks it leaves behind)."""
    return list(names) if round_ % 2 == 0 else list(reversed(names))


def _gpu_sampler() -> telemetry.Sampler:
    """nvidia-smi sampling of this process's GPU, named by UUID (CUDA_VISIBLE_DEVICES may renumber)."""
    uuid = str(torch.cuda.get_device_properties(_device()).uuid)
    return telemetry.Sampler(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}").start()


def time_interleaved(
    steps: dict[str, Any], warmup: int, n: int, sample_gpu: bool = True
) -> dict[str, dict[str, Any]]:
    """Times one or several variants in one process, one step of each per round
    (:func:`interleaved_order`), without a host sync between timed steps.

    Separate processes on the device's VM differ in host speed by up to 38 % on host-bound shapes
    (identical runs of (a) on an H100), which drowns a 2 % comparison; step
    by step in one process, that drift falls on every variant alike. On a GPU each step is timed from
    a CUDA event before it to one after it, and :class:`PhaseClock` splits it into forward / backward /
    optimizer. Memory figures are the process's, with every variant's model resident. With
    ``sample_gpu`` on a GPU, the SM clock and power during each step (:mod:`.telemetry`)."""
    names = list(steps)
    losses: dict[str, list[float]] = {v: [] for v in names}
    for i in range(warmup):
        for v in interleaved_order(names, i):
            losses[v].append(float(steps[v]()))
    _sync()
    clocks: dict[str, list] = {v: [] for v in names}
    marks: dict[str, list[tuple[Any, Any]]] = {v: [] for v in names}
    outs: dict[str, list] = {v: [] for v in names}

    def mark():
        if not on_gpu():
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    sampler = _gpu_sampler() if sample_gpu and on_gpu() else None
    with _gc_paused():
        mem_before = None
        if on_gpu():
            torch.cuda.reset_peak_memory_stats()
            mem_before = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        ref = mark()  # on an idle GPU (synced above): fires at host time t0
        for i in range(n):
            for v in interleaved_order(names, i):
                start = mark()
                if on_gpu():
                    CLOCK.steps = clocks[v]
                    CLOCK.steps.append([])
                outs[v].append(steps[v]())
                marks[v].append((start, mark()))
        CLOCK.steps = None
        _sync()
        wall = time.perf_counter() - t0
    if sampler is not None:
        sampler.stop()
    memory: dict[str, float] = {}
    if on_gpu():
        peak = torch.cuda.max_memory_allocated()
        memory = {
            "peak_memory_gib": peak / GiB,
            "peak_reserved_gib": torch.cuda.max_memory_reserved() / GiB,
            "memory_before_step_gib": mem_before / GiB,
        }
        if len(names) == 1:  # with several, the largest of all variants' steps: no one variant's
            memory["step_memory_gib"] = (peak - mem_before) / GiB
    results = {}
    for v in names:
        result: dict[str, Any] = {"timed_wall_s": wall, "gc": "off while timed"} | memory
        if on_gpu():
            times = [a.elapsed_time(b) / 1e3 for a, b in marks[v]]
            result["phase_time_s"] = PhaseClock.spans(clocks[v], [b for _, b in marks[v]])
            if sampler is not None:
                at = [(t0 + ref.elapsed_time(a) / 1e3, t0 + ref.elapsed_time(b) / 1e3) for a, b in marks[v]]
                result["gpu_telemetry"] = telemetry.summary(sampler, at)
        else:
            times = [b - a for a, b in marks[v]]
        result |= {"step_time_s": spread(times), "losses": losses[v] + [float(x) for x in outs[v]]}
        if len(names) > 1:
            result["interleaved_with"] = names
        results[v] = result
    return results


def activation_memory(forward, finish) -> dict[str, float]:
    """What one forward leaves allocated for its backward (the saved activations, plus the loss): the
    LoRA-vs-frozen memory comparison without the weights, optimizer state and transient peaks. Runs a
    whole step (``finish(forward())``) so that the model's state stays as training leaves it."""
    if not on_gpu():
        return {}
    _sync()
    before = torch.cuda.memory_allocated()
    loss = forward()
    _sync()
    held = torch.cuda.memory_allocated() - before
    finish(loss)
    _sync()
    return {"activation_memory_gib": held / GiB}


# -------------------------------------------------------------------------------------------- profile

# Kernel-name patterns -> category, for "where the time goes" (first match wins).
CATEGORIES = (
    ("attention", ("flash", "fmha", "attn", "sdpa", "scaled_dot_product", "cudnn")),
    (
        "gemm",
        (
            "gemm",
            "cutlass",
            "xmma",
            "cublas",
            "nvjet",
            "matmul",
            "wgrad",
            "dgrad",
            "aten::mm",
            "addmm",
            "bmm",
        ),
    ),
    ("cross_entropy", ("cross_entropy", "log_softmax", "softmax", "nll")),
    ("optimizer", ("adam", "multi_tensor", "foreach", "l2norm", "clip")),
    ("norm_rope_act", ("rmsnorm", "norm", "rope", "rotary", "swiglu", "silu", "gelu")),
    ("moe_routing", ("permute", "topk", "sort", "scatter", "gather", "index", "histc", "bincount")),
    ("copy_cast", ("copy", "cast", "convert", "fill", "zero")),
    ("elementwise", ("elementwise", "vectorized", "reduce", "mul", "add")),
)


RANGES = ("forward", "backward", "optimizer")  # record_function ranges of every step


def categorize(name: str) -> str:
    low = name.lower()
    for cat, keys in CATEGORIES:
        if any(k in low for k in keys):
            return cat
    return "other"


def profile_steps(step, n: int, out_dir: Path, tag: str, trace: bool) -> dict[str, Any]:
    """Profiles ``n`` iterations; writes the top-kernel table to ``profile-<tag>.txt`` (and a chrome
    trace with ``trace``) and returns the device-time breakdown by category and busy vs wall time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu() else [])
    _sync()
    t0 = time.perf_counter()
    with profile(activities=activities, record_shapes=False) as prof:
        for _ in range(n):
            step()
        _sync()
    wall = time.perf_counter() - t0
    gc.enable()
    gc.unfreeze()
    averages = prof.key_averages()
    sort_key = "self_device_time_total" if on_gpu() else "self_cpu_time_total"
    table = averages.table(sort_by=sort_key, row_limit=40)
    by_cat: dict[str, float] = {}
    kernels: list[tuple[float, int, str]] = []  # every kernel (self device time per step), for diffs
    device_total = 0.0
    for ev in averages:
        t = getattr(ev, "self_device_time_total", None)
        if t is None:
            t = getattr(ev, "self_cuda_time_total", 0.0)
        if not on_gpu():
            t = ev.self_cpu_time_total
        if t <= 0 or (on_gpu() and str(getattr(ev, "device_type", "")).endswith("CPU")):
            continue
        if ev.key in RANGES or ev.key.startswith("Optimizer."):
            continue  # annotations (ours, torch.optim's) span kernels that are counted themselves
        device_total += t
        kernels.append((t / 1e3 / n, ev.count, ev.key))
        cat = categorize(ev.key)
        by_cat[cat] = by_cat.get(cat, 0.0) + t
    per_step_ms = {k: v / 1e3 / n for k, v in sorted(by_cat.items(), key=lambda kv: -kv[1])}
    busy_ms = device_total / 1e3 / n
    wall_ms = wall * 1e3 / n
    summary = {
        "steps": n,
        "wall_ms_per_step": wall_ms,
        "device_busy_ms_per_step": busy_ms,
        "device_busy_fraction": busy_ms / wall_ms if wall_ms else None,
        "device_ms_per_step_by_category": per_step_ms,
        "note": "device time is summed kernel time (self); busy fraction well below 1 means host-bound"
        if on_gpu()
        else "CPU run: times are host self-time of operators",
    }
    gaps = timeline_gaps(prof.events(), n) if on_gpu() else None
    if gaps:
        summary["device_idle"] = {k: v for k, v in gaps.items() if k != "largest"}
    out_dir.mkdir(parents=True, exist_ok=True)
    lines = [f"== {tag}", f"wall {wall_ms:.1f} ms/step, device busy {busy_ms:.1f} ms/step"]
    lines += [f"  {k:<16} {v:9.2f} ms/step" for k, v in per_step_ms.items()]
    if gaps:
        lines += _gap_lines(gaps)
    cpu_table = averages.table(sort_by="cpu_time_total", row_limit=25)
    host = _host_profile(step, n)
    text = "\n\n".join(
        [
            "\n".join(lines),
            table,
            "host (CPU) time, by operator and range (forward/backward/optimizer):\n" + cpu_table,
            f"host Python functions, cProfile over {n} more steps (by own time):\n{host}",
            f"every device kernel over {n} steps (ms per step, calls in all, name):\n"
            + "\n".join(f"{ms:9.3f} {calls:6d}  {name}" for ms, calls, name in sorted(kernels, reverse=True)),
        ]
    )
    (out_dir / f"profile-{tag}.txt").write_text(text + "\n")
    if trace:
        prof.export_chrome_trace(str(out_dir / f"trace-{tag}.json"))
        summary["trace"] = f"trace-{tag}.json"
    return summary


SHORT_GAP_US = 20.0  # idle stretches below this are launch gaps between queued kernels (in a CUDA graph)


def timeline_gaps(events, n: int) -> dict[str, Any] | None:
    """Where the GPU sat idle over the profiled steps, from the kernels' (and copies') start and end
    times: the idle time per step inside each phase range (``RANGES``, by the GPU side of its
    annotation), split into short gaps (under ``SHORT_GAP_US``: the GPU between two queued kernels) and
    long ones (the GPU waiting for the host), and the longest gaps with the kernels either side. The
    summed kernel time of the table above double-counts nothing but says nothing of this."""
    spans, phases = [], []
    for ev in events:
        if not str(getattr(ev, "device_type", "")).endswith("CUDA"):
            continue
        start, end = ev.time_range.start, ev.time_range.end
        if ev.name in RANGES:
            phases.append((start, end, ev.name))
        elif ev.name != "Activity Buffer Request" and not ev.name.startswith("Optimizer.") and end > start:
            spans.append((start, end, ev.name))
    if not spans:
        return None
    spans.sort()
    idle: dict[str, list[float]] = {}
    largest: list[tuple[float, str, str, str]] = []
    reach, last = spans[0][1], spans[0][2]
    for start, end, name in spans[1:]:
        if start > reach:
            gap = start - reach
            mid = (start + reach) / 2
            phase = next((p for a, b, p in phases if a <= mid <= b), "between ranges")
            kind = "short" if gap < SHORT_GAP_US else "long"
            slot = idle.setdefault(f"{phase} {kind}", [0.0, 0])
            slot[0] += gap
            slot[1] += 1
            largest.append((gap, phase, last, name))
        if end >= reach:
            reach, last = end, name
    largest.sort(reverse=True)
    total = sum(v[0] for v in idle.values())
    return {
        "span_ms_per_step": (reach - spans[0][0]) / 1e3 / n,
        "idle_ms_per_step": total / 1e3 / n,
        "by_phase_ms_per_step": {k: v[0] / 1e3 / n for k, v in sorted(idle.items())},
        "gaps_per_step": {k: v[1] / n for k, v in sorted(idle.items())},
        "largest": [
            {"us": round(g, 1), "phase": p, "after": a[:70], "before": b[:70]} for g, p, a, b in largest[:12]
        ],
    }


def _gap_lines(gaps: dict[str, Any]) -> list[str]:
    lines = [
        f"GPU timeline: {gaps['span_ms_per_step']:.2f} ms/step from first to last kernel, "
        f"idle {gaps['idle_ms_per_step']:.2f} ms/step (short gaps < {SHORT_GAP_US:.0f} us):"
    ]
    for k, ms in gaps["by_phase_ms_per_step"].items():
        lines.append(f"  idle {k:<26} {ms:7.3f} ms/step in {gaps['gaps_per_step'][k]:7.1f} gaps")
    lines.append("  longest gaps (us, range, kernel before -> kernel after):")
    lines += [f"    {g['us']:8.1f}  {g['phase']:<10} {g['after']} -> {g['before']}" for g in gaps["largest"]]
    return lines


def _host_profile(step, n: int) -> str:
    """cProfile of ``n`` steps: where the host's time goes when the GPU waits on it (launch-bound)."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        step()
    _sync()
    prof.disable()
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf)
    stats.sort_stats("tottime").print_stats(30)
    buf.write("\nmegatron's optimizer and DDP calls, by cumulative time:\n")
    stats.sort_stats("cumulative").print_stats(
        r"megatron/core/(optimizer|distributed)|transformer_engine/pytorch/optimizers", 40
    )
    return buf.getvalue()


# ----------------------------------------------------------------------------------- megatron side


def init_megatron(s: Settings) -> None:
    """World size 1: gloo on CPU, NCCL on a GPU; model-parallel RNG (cuda-graph safe when needed)."""
    import socket

    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if not dist.is_initialized():
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if on_gpu():
            torch.cuda.set_device(0)
        # a fresh port of our own (an inherited MASTER_PORT may belong to another process)
        dist.init_process_group(
            "nccl" if on_gpu() else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1
        )
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(1, 1)
    if on_gpu():
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        # CUDA graphs need TE's graph-safe RNG tracker (TE attention asserts it), local graphs also
        # megatron's graphable RNG; TE graphs size their warm-up by megatron's micro-batch calculator.
        graphs = s.cuda_graphs != "none"
        model_parallel_cuda_manual_seed(
            s.seed,
            te_rng_tracker=graphs,
            use_cudagraphable_rng=s.cuda_graphs in ("local", "full_iteration"),
            force_reset_rng=graphs,
        )
        if s.cuda_graphs == "transformer_engine":
            from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator

            mbs = s.micro_batch_size
            init_num_microbatches_calculator(0, None, mbs, mbs, 1)
    torch.manual_seed(s.seed)


def megatron_overrides(s: Settings, arch) -> dict[str, Any]:
    dtype = s.torch_dtype()
    o: dict[str, Any] = {"params_dtype": dtype, "bf16": dtype == torch.bfloat16}
    if on_gpu():
        if s.gpu_fusions:
            # Megatron-LM's defaults (twinkle's config mapping leaves them off for portability).
            o |= {"apply_rope_fusion": True, "bias_activation_fusion": True}
        if s.ce_fusion:
            o |= {"cross_entropy_loss_fusion": True, "cross_entropy_fusion_impl": s.ce_fusion_impl}
        if arch.is_moe:
            o |= {"moe_grouped_gemm": True}
            if s.gpu_fusions:
                # TE's fused token permutation, as NVIDIA's MoE recipes run (--moe-permute-fusion)
                o |= {"moe_permute_fusion": True}
        if s.cuda_graphs == "full_iteration":
            if arch.is_moe:
                raise ValueError(
                    "--cuda-graphs full_iteration captures the whole forward and backward; dropless MoE "
                    "routes a data-dependent number of tokens and cannot be captured (use "
                    "transformer_engine: megatron's partial MoE graphs)"
                )
            # Megatron-LM: --cuda-graph-impl local --cuda-graph-scope full_iteration
            o |= {
                "cuda_graph_impl": "local",
                "cuda_graph_scope": "full_iteration",
                "use_te_rng_tracker": True,
            }
        elif s.cuda_graphs != "none":
            o |= {"cuda_graph_impl": s.cuda_graphs, "use_te_rng_tracker": True}
            if arch.is_moe:
                # Dropless experts see a data-dependent token count and cannot be captured; megatron's
                # partial MoE graphs take attention, router and dispatch preprocessing per layer.
                o |= {"cuda_graph_scope": "attn,moe_router,moe_preprocess"}
    return o | s.mcore_overrides


def _stock_te_model(hf_dir: Path, overrides: dict[str, Any]):
    """(a): megatron-core's own get_gpt_layer_with_transformer_engine_spec, same config as (b)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    from twinkle_specs.config_mapping import transformer_config_from_hf
    from twinkle_specs.hf_config import qwen_arch_from_hf
    from twinkle_specs.model import padded_vocab_size

    arch = qwen_arch_from_hf(hf_dir)
    config = transformer_config_from_hf(hf_dir, **overrides)
    spec = get_gpt_layer_with_transformer_engine_spec(
        num_experts=config.num_moe_experts,
        moe_grouped_gemm=config.moe_grouped_gemm,
        qk_layernorm=config.qk_layernorm,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=padded_vocab_size(arch.vocab_size, ps.get_tensor_model_parallel_world_size()),
        max_sequence_length=arch.max_position_embeddings,
        pre_process=True,
        post_process=True,
        parallel_output=True,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=arch.rotary_base,
    )
    return model.cuda(torch.cuda.current_device())


def _require_grad_hook(_module, _inputs, output):
    return output.requires_grad_(True) if not output.requires_grad else output


def _count(model) -> tuple[int, int]:
    params = list(model.parameters())
    return sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)


def _megatron_optimizer(s: Settings, model, config):
    """megatron-core DDP + distributed optimizer on a GPU; torch AdamW on CPU (see module doc)."""
    if not on_gpu():
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=s.lr, betas=(0.9, 0.95), weight_decay=0.01)

        def finish():
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)

        return model, finish, "torch.optim.AdamW (CPU stand-in: megatron-core DDP buffers need CUDA)"
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    # --opt-set use_distributed_optimizer=false selects megatron's Float16Optimizer (DDP must agree).
    fields = {"use_distributed_optimizer": True, "clip_grad": 1.0} | s.optimizer_overrides
    distributed = bool(fields["use_distributed_optimizer"])
    # As Megatron-LM's get_model: DDP keeps each parameter's grad-accumulator node, which remembers the
    # stream it was made on; made on the default stream, it makes a CUDA-graph capture of the backward
    # fail ("operation would make the legacy stream depend on a capturing blocking stream").
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ddp = DistributedDataParallel(
            config=config,
            ddp_config=DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=distributed
            ),
            module=model,
        )
    torch.cuda.current_stream().wait_stream(side)
    dtype = s.torch_dtype()
    opt = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=s.lr,
            weight_decay=0.01,
            adam_beta1=0.9,
            adam_beta2=0.95,
            bf16=dtype == torch.bfloat16,
            params_dtype=dtype,
            **fields,
        ),
        [ddp],
    )

    def finish():
        ddp.finish_grad_sync()
        opt.step()
        ddp.zero_grad_buffer()
        opt.zero_grad()

    extra = "".join(
        f", {k}={v}" for k, v in s.optimizer_overrides.items() if k != "use_distributed_optimizer"
    )
    kind = "distributed Adam" if distributed else "Float16Optimizer Adam"
    return (
        ddp,
        finish,
        f"megatron-core DistributedDataParallel + get_megatron_optimizer ({kind}{extra})",
    )


def _prepare_megatron(variant: str, hf_dir: Path, s: Settings) -> tuple[dict[str, Any], Any, Any, Any]:
    """Builds one Megatron variant (seeded afresh: its initial weights do not depend on what was built
    before it in this process) with its optimizer and data, CUDA graphs captured if asked. Returns the
    result so far, ``step()``, ``forward()`` and ``backward_and_update(loss)``."""
    from twinkle_specs.hf_config import qwen_arch_from_hf

    init_megatron(s)
    arch = qwen_arch_from_hf(hf_dir)
    overrides = megatron_overrides(s, arch)
    result: dict[str, Any] = {}
    if variant == "mcore_te_full":
        model = _stock_te_model(hf_dir, overrides)
    else:
        import twinkle_specs as ts

        lora = lora_config(s) if variant == "twinkle_lora" else None
        model = ts.build_model(hf_dir, load_weights=False, lora=lora, **overrides)
        if variant == "twinkle_full" and s.load:
            if any(hf_dir.glob("*.safetensors")):
                result["load"] = time_load(model, hf_dir)
            else:
                result["load_note"] = f"no safetensors checkpoint in {hf_dir}: load not measured"
        if variant == "twinkle_frozen":
            for p in model.parameters():
                p.requires_grad_(False)
            model.embedding.register_forward_hook(_require_grad_hook)
    config = model.config
    result["impl"] = config.transformer_impl
    import twinkle_specs

    # in this process, so for (a) too: upstream fixes that every variant shares (patches/README.md)
    result["twinkle_patches"] = [p.rpartition(".")[2] for p in twinkle_specs.patches.apply_all()]
    result["total_params"], result["trainable_params"] = _count(model)
    result["config"] = {
        k: getattr(config, k, None)
        for k in (
            "cross_entropy_loss_fusion",
            "cross_entropy_fusion_impl",
            "apply_rope_fusion",
            "bias_activation_fusion",
            "moe_grouped_gemm",
            "moe_token_dispatcher_type",
            "moe_permute_fusion",
            "cuda_graph_impl",
            "cuda_graph_scope",
        )
    }
    if result["config"]["cuda_graph_scope"] is not None:  # CudaGraphScope members
        result["config"]["cuda_graph_scope"] = [
            getattr(v, "name", v) for v in result["config"]["cuda_graph_scope"]
        ]
    if variant == "twinkle_frozen":
        wrapped, finish, result["optimizer"] = model, (lambda: None), "none (nothing trainable)"
    else:
        wrapped, finish, result["optimizer"] = _megatron_optimizer(s, model, config)
    model.train()

    dev = _device()
    gen = torch.Generator().manual_seed(s.seed)
    shape = (s.micro_batch_size, s.seq_len + 1)
    data = torch.randint(0, arch.vocab_size, shape, generator=gen).to(dev)
    tokens, labels = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    position_ids = torch.arange(s.seq_len, device=dev).expand_as(tokens).contiguous()

    te_graphs = None
    if on_gpu() and s.cuda_graphs == "transformer_engine":
        from megatron.core.transformer.cuda_graphs import TECudaGraphHelper

        if not hasattr(wrapped, "zero_grad_buffer"):  # (e) has no DDP: nothing for the helper to clear
            wrapped.zero_grad_buffer = lambda: None
        te_graphs = TECudaGraphHelper(
            model=[wrapped],
            config=config,
            seq_length=s.seq_len,
            micro_batch_size=s.micro_batch_size,
            optimizers=[],
        )
    local_graphs = on_gpu() and s.cuda_graphs == "local"
    if on_gpu() and s.cuda_graphs == "full_iteration":
        step = _full_iteration_step(wrapped, finish, config, tokens, labels, position_ids, s)
        result["step"] = "forward + backward (one CUDA graph) + optimizer step"
        return result, step, None, None

    def forward():
        with CLOCK.phase("forward"):
            return wrapped(tokens, position_ids, None, labels=labels).float().mean()

    def backward_and_update(loss):
        with CLOCK.phase("backward"):
            loss.backward()
        if local_graphs:
            from megatron.core.transformer.cuda_graphs import create_cudagraphs

            create_cudagraphs()
        with CLOCK.phase("optimizer"):
            finish()
        return loss.detach()

    def step():
        return backward_and_update(forward())

    if te_graphs is not None:
        for _ in range(max(s.warmup, config.cuda_graph_warmup_steps)):
            step()
        # No cuda_graph_set_manual_hooks(): as in Megatron-LM's train(), those are DDP's param-gather
        # pre-hooks, which exist only with overlap_param_gather (DDP asserts so when one is called).
        te_graphs.create_cudagraphs()
    result["step"] = "forward + backward" + (" + optimizer step" if variant != "twinkle_frozen" else "")
    return result, step, forward, backward_and_update


def _full_iteration_step(wrapped, finish, config, tokens, labels, position_ids, s: Settings):
    """A training step as Megatron-LM's train_step runs it under ``--cuda-graph-impl local
    --cuda-graph-scope full_iteration``: megatron's forward-backward schedule wrapped in its
    ``FullCudaGraphWrapper`` (eager for ``cuda_graph_warmup_steps`` iterations, then the whole forward
    and backward captured as one graph and replayed; the batch copied into static buffers each step),
    then the optimizer step outside the graph. Warmed up and captured here, before any timing."""
    import itertools

    from megatron.core.full_cuda_graph import FullCudaGraphWrapper
    from megatron.core.pipeline_parallel import get_forward_backward_func

    batch = {"tokens": tokens, "labels": labels, "position_ids": position_ids}

    def forward_step(data_iterator, model):
        b = next(data_iterator)
        out = model(b["tokens"], b["position_ids"], None, labels=b["labels"])

        def loss_func(output):
            loss = output.float().mean()
            return loss, {"loss": loss.detach()}

        return out, loss_func

    forward_backward = FullCudaGraphWrapper(
        get_forward_backward_func(), cuda_graph_warmup_steps=config.cuda_graph_warmup_steps
    )

    def step():
        with CLOCK.phase("forward_backward"):
            losses = forward_backward(
                forward_step_func=forward_step,
                data_iterator=itertools.repeat(batch),
                model=[wrapped],
                num_microbatches=1,
                seq_length=s.seq_len,
                micro_batch_size=s.micro_batch_size,
                forward_only=False,
            )
            loss = losses[0]["loss"].clone()  # the graph's output buffer is rewritten by the next replay
        with CLOCK.phase("optimizer"):
            finish()
        return loss

    for _ in range(config.cuda_graph_warmup_steps + 1):  # the last one captures
        step()
    return step


def run_megatron(variant: str, hf_dir: Path, s: Settings, out_dir: Path, tag: str) -> dict[str, Any]:
    result, step, forward, backward_and_update = _prepare_megatron(variant, hf_dir, s)
    result |= time_steps(step, s.warmup, s.steps, s.telemetry)
    if s.cuda_graphs == "none":
        result |= activation_memory(forward, backward_and_update)
    else:
        result["activation_memory_note"] = "not measured: CUDA graphs keep activations in their static pool"
    if s.profile:
        result["profile"] = profile_steps(step, s.profile_steps, out_dir, tag, s.profile_trace)
    return result


def _drop_page_cache(files: list[Path]) -> bool:
    """Asks the kernel to forget the checkpoint's cached pages (no root needed for clean pages)."""
    if not hasattr(os, "posix_fadvise"):
        return False
    try:
        for f in files:
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    except OSError:
        return False
    return True


def time_load(model, hf_dir: Path) -> dict[str, Any]:
    """HF safetensors -> Megatron parameters on this rank: seconds and bytes read vs checkpoint size.

    The model gets its own initial weights back afterwards, so (b) trains on the same kind of weights as (a)
    (megatron's initialisation), not on the checkpoint's: GEMM speed depends a little on the values (power),
    and (b)/(a) is to measure the spec alone."""
    from twinkle_specs.loading import load_hf_weights

    initial = {name: p.detach().to("cpu", copy=True) for name, p in model.named_parameters()}
    dropped = _drop_page_cache(sorted(hf_dir.glob("*.safetensors")))
    _sync()
    t0 = time.perf_counter()
    report = load_hf_weights(model, hf_dir)
    _sync()
    seconds = time.perf_counter() - t0
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(initial.pop(name))
    return {
        "seconds": seconds,
        "bytes_read": report.bytes_read,
        "checkpoint_bytes": report.checkpoint_bytes,
        "read_fraction": report.bytes_read / report.checkpoint_bytes if report.checkpoint_bytes else None,
        "gib_per_s": report.bytes_read / GiB / seconds if seconds else None,
        "parameters": report.parameters,
        "page_cache_dropped": dropped,
        "ranks": 1,
    }


# ----------------------------------------------------------------------------------------- HF side


def run_hf(variant: str, hf_dir: Path, s: Settings, out_dir: Path, tag: str) -> dict[str, Any]:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(s.seed)
    dev = _device()
    config = AutoConfig.from_pretrained(hf_dir)
    config.use_cache = False
    with dev:
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=s.torch_dtype())
    result: dict[str, Any] = {"impl": f"transformers {model.config._attn_implementation}"}
    experts = getattr(model.config, "_experts_implementation", None)
    if experts and getattr(config, "num_experts", None):
        result["impl"] += f", experts {experts}"
    if variant == "hf_peft_lora":
        import peft

        model = peft.get_peft_model(
            model,
            peft.LoraConfig(
                r=s.lora_r, lora_alpha=s.lora_alpha, target_modules="all-linear", lora_dropout=0.0
            ),
        )
        dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters() if p.requires_grad})
        result["adapter_dtypes"] = dtypes  # peft upcasts adapters to fp32 by default (autocast_adapter_dtype)
    model.train()
    result["total_params"], result["trainable_params"] = _count(model)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=s.lr, betas=(0.9, 0.95), weight_decay=0.01, fused=on_gpu())
    result["optimizer"] = "torch.optim.AdamW" + (" (fused)" if on_gpu() else "")
    gen = torch.Generator().manual_seed(s.seed)
    tokens = torch.randint(0, config.vocab_size, (s.micro_batch_size, s.seq_len), generator=gen).to(dev)

    def forward():
        with CLOCK.phase("forward"):
            return model(input_ids=tokens, labels=tokens).loss

    def backward_and_update(loss):
        with CLOCK.phase("backward"):
            loss.backward()
        with CLOCK.phase("optimizer"):
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        return loss.detach()

    def step():
        return backward_and_update(forward())

    result["step"] = "forward + backward + optimizer step"
    result |= time_steps(step, s.warmup, s.steps, s.telemetry)
    result |= activation_memory(forward, backward_and_update)
    if s.profile:
        result["profile"] = profile_steps(step, s.profile_steps, out_dir, tag, s.profile_trace)
    return result


# -------------------------------------------------------------------------------------------- entry


def make_checkpoint(hf_dir: Path, seed: int = 0) -> dict[str, Any]:
    """Random weights for the config in ``hf_dir``, saved as safetensors (bf16 as the config says)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.from_pretrained(hf_dir)
    t0 = time.perf_counter()
    with _device():
        model = AutoModelForCausalLM.from_config(
            config, dtype=getattr(config, "dtype", None) or torch.float32
        )
    model.save_pretrained(hf_dir)
    del model
    files = sorted(hf_dir.glob("*.safetensors"))
    return {"seconds": time.perf_counter() - t0, "bytes": sum(f.stat().st_size for f in files)}


def skip_reason(variant: str) -> str | None:
    if variant == "mcore_te_full" and not on_gpu():
        return (
            "needs a CUDA GPU with Transformer Engine (get_gpt_layer_with_transformer_engine_spec); "
            "megatron-core's local spec is no CPU substitute either (its DotProductAttention needs CUDA)"
        )
    if variant == "mcore_te_full":
        try:
            import transformer_engine  # noqa: F401
        except ImportError:
            return "Transformer Engine is not installed"
    return None


@dataclass
class Task:
    shape: str
    variant: str
    hf_dir: str
    settings: Settings
    out_dir: str
    tag: str = ""

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Task:
        return cls(**(d | {"settings": Settings(**d["settings"])}))


def _base(task: Task, variant: str) -> dict[str, Any]:
    s = task.settings
    return {
        "shape": task.shape,
        "variant": variant,
        "label": VARIANTS[variant],
        "tag": task.tag,
        "seq_len": s.seq_len,
        "micro_batch_size": s.micro_batch_size,
        "tokens_per_step": s.seq_len * s.micro_batch_size,
        "dtype": s.dtype,
        "device": torch.cuda.get_device_name() if on_gpu() else "cpu",
    }


def _error(err: Exception) -> dict[str, Any]:
    return {
        "status": "error",
        "error": f"{type(err).__name__}: {err}",
        "traceback": traceback.format_exc()[-4000:],
    }


def _release_memory() -> None:
    with contextlib.suppress(Exception):
        gc.collect()
        if on_gpu():
            torch.cuda.empty_cache()


def run_task(task: Task) -> dict[str, Any]:
    """Runs one variant; never raises (errors are recorded in the result)."""
    s, hf_dir = task.settings, Path(task.hf_dir)
    base = _base(task, task.variant)
    reason = skip_reason(task.variant)
    if reason:
        return base | {"status": "skipped", "reason": reason}
    runner = run_hf if task.variant.startswith("hf_") else run_megatron
    name = f"{task.shape}__{task.variant}" + (f"__{task.tag}" if task.tag else "")
    t0 = time.perf_counter()
    try:
        measured = runner(task.variant, hf_dir, s, Path(task.out_dir), name)
    except Exception as err:  # noqa: BLE001  (recorded; the other variants still run)
        return base | _error(err)
    finally:
        _release_memory()
    out = base | {"status": "ok", "wall_s": time.perf_counter() - t0} | measured
    return out | derived_metrics(out, hf_dir, s)


def run_interleaved(task: Task, variants: list[str]) -> list[dict[str, Any]]:
    """Megatron ``variants`` built side by side in this process and timed step by step in turn
    (:func:`time_interleaved`); one result per variant, as :func:`run_task` gives. Errors while running
    are recorded in the results; settings that cannot be interleaved raise ValueError (run.py checks)."""
    s, hf_dir = task.settings, Path(task.hf_dir)
    if s.load or s.profile or s.cuda_graphs != "none" or any(v.startswith("hf_") for v in variants):
        raise ValueError("interleaving times Megatron variants, eager, without load timing or profiler")
    skipped = {v: reason for v in variants if (reason := skip_reason(v))}
    runnable = [v for v in variants if v not in skipped]
    results = {v: _base(task, v) | {"status": "skipped", "reason": r} for v, r in skipped.items()}
    t0 = time.perf_counter()
    try:
        prepared = {v: _prepare_megatron(v, hf_dir, s)[0:2] for v in runnable}
        steps = {v: step for v, (_, step) in prepared.items()}
        timed = time_interleaved(steps, s.warmup, s.steps, s.telemetry)
    except Exception as err:  # noqa: BLE001  (recorded, as run_task does)
        results |= {v: _base(task, v) | _error(err) for v in runnable}
        return [results[v] for v in variants]
    finally:
        _release_memory()
    wall = time.perf_counter() - t0
    for v in runnable:
        out = _base(task, v) | {"status": "ok", "wall_s": wall} | prepared[v][0] | timed[v]
        out["activation_memory_note"] = "not measured when interleaved (every variant's model is resident)"
        results[v] = out | derived_metrics(out, hf_dir, s)
    return [results[v] for v in variants]


def derived_metrics(r: dict[str, Any], hf_dir: Path, s: Settings) -> dict[str, Any]:
    """tokens/s/GPU, model FLOPs, TFLOP/s and MFU from the median step time."""
    from twinkle_specs.hf_config import qwen_arch_from_hf

    arch = qwen_arch_from_hf(hf_dir)
    mode = MODE[r["variant"]]
    flops = step_flops(
        arch,
        seq_len=s.seq_len,
        micro_batch_size=s.micro_batch_size,
        mode=mode,
        lora=lora_config(s) if mode == "lora" else None,
    )
    median = r["step_time_s"]["median"]
    peak = peak_flops(r["device"]) if r["device"] != "cpu" else None
    achieved = flops.total / median
    return {
        "tokens_per_s_per_gpu": r["tokens_per_step"] / median,
        "model_flops": flops.as_dict(),
        "tflops_per_s_per_gpu": achieved / 1e12,
        "peak_flops_per_gpu": peak,
        "mfu": achieved / peak if peak else None,
        "losses_finite": all(math.isfinite(x) for x in r["losses"]),
    }
