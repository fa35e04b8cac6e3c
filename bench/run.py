"""twinkle-specs benchmark: one command, all variants, same GPU (see bench/README.md).

    python bench/run.py --preset quick --out /tmp/bench --export "$OUT"

Each (shape, variant) runs in its own child process (clean CUDA memory statistics, megatron global
state and CUDA-graph state); ``--in-process`` runs them in this process instead (the CPU test), and
``--interleave`` runs all Megatron variants of a shape in one child process, step by step in turn.
Results merge into ``<out>/results.json`` (same shape/variant/seq/mbs/tag replaced), and
``results.md`` and ``results.png`` are rewritten from it, so a long benchmark can be split over
several calls that share ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if sys.path and sys.path[0] and Path(sys.path[0]).resolve() == ROOT / "bench":
    # run as a script: bench/ heads the path, where its modules (timing, memory, ...) would shadow any
    # top-level module of the same name; the package is imported from the root instead
    sys.path[0] = str(ROOT)
elif str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import outputs, processes, report  # noqa: E402
from bench.environment import environment, pin_to_gpu_numa_node  # noqa: E402
from bench.shapes import SHAPES, shape_name, write_config  # noqa: E402
from bench.variants import VARIANTS  # noqa: E402

PRESETS = {
    # all five variants on the 1.7B shape: ~3-5 minutes on an H100 (fits one 600 s device call)
    "quick": {
        "shapes": ["qwen3-1.7b"],
        "warmup": 3,
        "steps": 10,
        "seq": 4096,
        "load_layouts": ["tp2", "pp2"],
    },
    # every shape; run it over several calls (--shapes a subset per call, same --out)
    "full": {
        "shapes": [
            "qwen3-1.7b",
            "qwen2.5-1.5b",
            "qwen3-8b",
            "qwen3-30b-a3b",
            "qwen3.5-9b",
            "qwen3.5-35b-a3b",
        ],
        "warmup": 3,
        "steps": 20,
        "seq": 4096,
    },
    # LoRA against its peers at the real models' depth (one call per shape: --shapes qwen3-8b)
    "peers": {
        "shapes": ["qwen3-8b", "qwen3-1.7b", "qwen2.5-1.5b"],
        "layers": {"qwen3-8b": 36},
        "variants": "lora",
        "warmup": 3,
        "steps": 20,
        "seq": 4096,
    },
    # CPU test
    "tiny": {"shapes": ["tiny-qwen3"], "warmup": 1, "steps": 2, "seq": 64},
}


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _literal(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="quick")
    ap.add_argument("--shapes", type=_csv, help=f"comma-separated, from {', '.join(SHAPES)}")
    ap.add_argument("--layers", type=_csv, default=[], help="SHAPE=N overrides of the layer count")
    ap.add_argument(
        "--variants",
        type=_csv,
        default=None,
        help=f"from {', '.join(VARIANTS)} (default: the preset's, else every default variant)",
    )
    ap.add_argument("--seq", type=int, help="sequence length (preset: 4096)")
    ap.add_argument("--mbs", type=int, default=1, help="micro-batch size (sequences per step)")
    ap.add_argument(
        "--grad-accum",
        type=int,
        default=1,
        help="micro-batches per optimizer step (gradient accumulation: global batch = mbs x this)",
    )
    ap.add_argument(
        "--fp8-format", choices=["hybrid", "e4m3"], default="hybrid", help="FP8 variants: --fp8-format"
    )
    ap.add_argument(
        "--fp8-recipe",
        choices=["tensorwise", "delayed", "blockwise"],
        default="tensorwise",
        help="FP8 variants: --fp8-recipe (Transformer Engine's Hopper recipes; tensorwise, current scaling, is "
        "the one whose LoRA loss follows bf16's)",
    )
    ap.add_argument("--warmup", type=int, help="untimed iterations before timing")
    ap.add_argument("--steps", type=int, help="timed iterations")
    ap.add_argument(
        "--dtype", choices=["bf16", "fp32"], default=None, help="default: bf16 on GPU, fp32 on CPU"
    )
    ap.add_argument("--lora-r", type=int, default=16)
    ap.add_argument("--lora-alpha", type=float, default=32.0)
    ap.add_argument(
        "--lora-targets",
        choices=["all-linear", "unsloth"],
        default="all-linear",
        help="twinkle's adapters: peft's all-linear (as (d) trains them), or the set Unsloth's LoRA trains "
        "(on Qwen3-MoE: no router, rank r on the experts' fused gate_up), so that (j) compares the same adapters",
    )
    ap.add_argument("--no-ce-fusion", action="store_true", help="megatron: unfused vocab-parallel CE")
    ap.add_argument("--ce-impl", choices=["te", "native"], default="te", help="fused CE implementation")
    ap.add_argument(
        "--cuda-graphs",
        choices=["none", "local", "transformer_engine", "full_iteration"],
        default="none",
        help="megatron-core cuda_graph_impl: per-layer CUDA graphs (megatron's local manager or TE's); "
        "full_iteration: megatron's whole-iteration graph (FullCudaGraphWrapper, as Megatron-LM's "
        "--cuda-graph-impl local --cuda-graph-scope full_iteration; dense shapes; stock pretrain_gpt.py "
        "of core_v0.16.1 cannot capture it, see bench/README.md)",
    )
    ap.add_argument("--no-gpu-fusions", action="store_true", help="megatron: no rope/swiglu fusions")
    ap.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="extra megatron TransformerConfig field (JSON value), e.g. --set moe_permute_fusion=true",
    )
    ap.add_argument(
        "--opt-set",
        dest="opt_overrides",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="extra megatron OptimizerConfig field (JSON value), e.g. --opt-set use_precision_aware_optimizer=true",
    )
    ap.add_argument("--no-load", action="store_true", help="skip writing/loading the HF checkpoint")
    ap.add_argument(
        "--load-layouts",
        type=_csv,
        default=None,
        help="also time the HF load on several ranks (torchrun), e.g. tp2,pp2,ep2 (preset quick: tp2,pp2)",
    )
    ap.add_argument("--load-on-gpu", action="store_true", help="--load-layouts ranks on GPUs (NCCL), not CPU")
    ap.add_argument("--profile", action="store_true", help="torch profiler after timing: profile.txt")
    ap.add_argument("--profile-trace", action="store_true", help="with --profile: chrome traces too")
    ap.add_argument(
        "--profile-stacks",
        action="store_true",
        help="with --profile: a table of device time by operator and Python call site (eager variants)",
    )
    ap.add_argument(
        "--no-telemetry", action="store_true", help="do not sample the GPU's clocks/power with nvidia-smi"
    )
    ap.add_argument("--tag", default="", help="label of this configuration (kept apart in ratios)")
    ap.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run the variant list this many times, interleaved (a b c.. a b c..): pooled step times, "
        "per-run medians in repeat_medians (run-to-run noise, e.g. for the 2%% (b)/(a) target)",
    )
    ap.add_argument(
        "--interleave",
        action="store_true",
        help="build the (Megatron, eager) variants side by side in one process and time them step by "
        "step in turn (a b, b a, ..): host drift between processes falls on all alike; needs memory "
        "for every model at once; no load timing, profiler or activation memory",
    )
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "latest")
    ap.add_argument("--work", type=Path, default=Path("/tmp/twinkle-bench"), help="configs and checkpoints")
    ap.add_argument("--export", type=Path, help="copy results.{json,md,png}, run.log, profile.txt here")
    ap.add_argument("--fresh", action="store_true", help="do not merge with an existing results.json")
    ap.add_argument("--in-process", action="store_true", help="run variants in this process")
    ap.add_argument(
        "--no-pin", action="store_true", help="do not restrict the run to the GPU's NUMA-node CPUs"
    )
    ap.add_argument("--variant-timeout", type=int, default=300, help="seconds per child process")
    ap.add_argument(
        "--budget",
        type=float,
        default=None,
        metavar="SECONDS",
        help="wall-time budget of this call: children are cut to fit, later ones skipped (results kept)",
    )
    ap.add_argument("--report-only", action="store_true", help="re-render results.md/png from results.json")
    ap.add_argument(
        "--merge",
        type=Path,
        nargs="+",
        default=[],
        metavar="RESULTS_JSON",
        help="with --report-only: merge these results.json files (later ones win) into --out first",
    )
    ap.add_argument("--child", nargs=2, metavar=("TASK_JSON", "RESULT_JSON"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    preset = PRESETS[args.preset]
    args.shapes = args.shapes or preset["shapes"]
    args.seq = args.seq or preset["seq"]
    args.warmup = preset["warmup"] if args.warmup is None else args.warmup
    args.steps = args.steps or preset["steps"]
    if args.variants is None:
        peers_only = preset.get("variants") == "lora"  # (c) in each configuration, and every LoRA peer
        args.variants = [
            v.name
            for v in VARIANTS.values()
            if ((v.base == "twinkle_lora" or (v.peer is not None and not v.fp8)) if peers_only else v.default)
        ]
    args.layers = [f"{s}={n}" for s, n in preset.get("layers", {}).items()] + args.layers
    if args.load_layouts is None:
        args.load_layouts = preset.get("load_layouts", [])
    for v in args.variants:
        if v not in VARIANTS:
            ap.error(f"unknown variant {v!r}; choose from {', '.join(VARIANTS)}")
    for s in args.shapes:
        if s not in SHAPES:
            ap.error(f"unknown shape {s!r}; choose from {', '.join(SHAPES)}")
    if args.interleave:
        other = [v for v in args.variants if not VARIANTS[v].interleavable]
        if other or len(args.variants) < 2:
            ap.error(f"--interleave takes two or more Megatron variants (not {', '.join(other) or 'one'})")
        if args.cuda_graphs != "none" or args.profile:
            ap.error("--interleave runs eager and unprofiled: drop --cuda-graphs / --profile")
        args.no_load, args.load_layouts = True, []  # load timing is its own measurement
    return args


def _layers(args) -> dict[str, int]:
    out = {}
    for item in args.layers:
        shape, _, n = item.partition("=")
        out[shape] = int(n)
    return out


def _settings(args, on_gpu: bool):
    from bench.settings import Settings

    return Settings(
        seq_len=args.seq,
        micro_batch_size=args.mbs,
        grad_accum=args.grad_accum,
        fp8_format=args.fp8_format,
        fp8_recipe=args.fp8_recipe,
        warmup=args.warmup,
        steps=args.steps,
        dtype=args.dtype or ("bf16" if on_gpu else "fp32"),
        lora_r=args.lora_r,
        lora_alpha=args.lora_alpha,
        lora_targets=args.lora_targets,
        ce_fusion=not args.no_ce_fusion,
        ce_fusion_impl=args.ce_impl,
        cuda_graphs=args.cuda_graphs,
        gpu_fusions=not args.no_gpu_fusions,
        mcore_overrides={k: _literal(v) for k, _, v in (o.partition("=") for o in args.overrides)},
        optimizer_overrides={k: _literal(v) for k, _, v in (o.partition("=") for o in args.opt_overrides)},
        load=not args.no_load,
        profile=args.profile,
        profile_trace=args.profile_trace,
        profile_stacks=args.profile_stacks,
        telemetry=not args.no_telemetry,
    )


def _report_only(args) -> int:
    """Re-renders (and with --merge, merges into) ``<out>/results.json`` without running anything."""
    sources = ([args.out / "results.json"] if (args.out / "results.json").exists() else []) + args.merge
    if not sources:
        raise SystemExit(f"--report-only: no {args.out / 'results.json'} and nothing to --merge")
    outputs.write_outputs(outputs.merge_files(sources), args.out)
    if args.export:
        outputs.export(args.out, args.export)
    print((args.out / "results.md").read_text())
    return 0


def _document(args, settings, on_gpu: bool, pinning: str, command: str) -> dict:
    """A new results document: when, what ran and where; no rows yet."""
    from bench.flops import peak_flops

    doc = {
        "schema_version": report.SCHEMA_VERSION,
        "date_utc": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": command,
        "environment": environment(args.in_process, args.out) | {"cpu_pinning": pinning},
        "settings": settings.__dict__,
        "flop_formula": {
            "full": "6*N*T + 3*(A + D)",
            "lora": "4*N*T + 6*N_lora*T + 3*(A + D)",
            "frozen": "4*N*T + 3*(A + D)",
            "T": "tokens per step: seq_len * micro_batch_size; a packed SFT row: its conversations' tokens",
            "A": "2 * full-attention layers * heads * head_dim * sum over sequences of length^2 "
            "(causal attention core, forward)",
            "D": "2 * Gated DeltaNet layers * 4 * value heads * key_head_dim * value_head_dim * T "
            "(chunked gated delta rule, forward)",
            "N": "matmul weights per token incl. output layer; MoE: router + top-k experts (+ shared); "
            "hybrid: gated attention (q twice as wide) or Gated DeltaNet in_proj + out_proj per layer",
        },
    }
    doc["peak_flops_per_gpu"] = peak_flops(doc["environment"]["device"]) if on_gpu else None
    return doc


def _write(doc: dict, args) -> None:
    outputs.write_outputs(doc, args.out)
    if args.export:
        outputs.export(args.out, args.export)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.started = time.monotonic()
    if args.child:
        return processes.child_main(*args.child)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.report_only:
        return _report_only(args)

    import torch

    on_gpu = torch.cuda.is_available()
    pinning = pin_to_gpu_numa_node() if on_gpu and not args.no_pin else "not pinned (--no-pin or no GPU)"
    print(f"[bench] CPU affinity: {pinning}", flush=True)
    settings = _settings(args, on_gpu)
    layers = _layers(args)
    command = "python bench/run.py " + " ".join(sys.argv[1:] if argv is None else argv)
    doc = _document(args, settings, on_gpu, pinning, command)
    previous, previous_loads = outputs.load_previous(args.out, args.fresh)
    fresh_results: list[dict] = []
    fresh_loads: list[dict] = []
    doc["results"], doc["load_scaling"] = list(previous), list(previous_loads)
    with open(args.out / "run.log", "a") as log:
        log.write(f"\n##### {doc['date_utc']} {command}\n")
        for shape in args.shapes:
            name = shape_name(shape, layers.get(shape))
            hf_dir = write_config(shape, layers.get(shape), args.work / name)
            chosen = [VARIANTS[v] for v in args.variants]
            needs_ckpt = any(v.reads_checkpoint for v in chosen) or (
                settings.load and any(v.times_load for v in chosen)
            )
            if needs_ckpt and not any(hf_dir.glob("*.safetensors")):
                print(f"[bench] {name}: writing a random-weight HF checkpoint to {hf_dir}", flush=True)
                info = processes.make_checkpoint(hf_dir, name, args, log)
                print(f"[bench] {name}: checkpoint {info}", flush=True)
            # one unit per child process: a variant, or with --interleave all of them together
            units = [[v] for v in args.variants] if not args.interleave else [list(args.variants)]
            for repeat, variants in [(r, u) for r in range(args.repeats) for u in units]:
                from bench.task import Task

                task = Task(name, variants[0], str(hf_dir), settings, str(args.out), args.tag)
                suffix = (f"__{args.tag}" if args.tag else "") + (f"__r{repeat}" if repeat else "")
                if repeat:
                    task.settings = dataclasses.replace(settings, load=False, profile=False)
                unit = f"{name}__{'+'.join(variants)}{suffix}"
                print(f"[bench] {unit} ...", flush=True)
                ran = processes.run_unit(task, variants, unit, args, log)
                for variant, result in zip(variants, ran, strict=True):
                    tag = f"{name}__{variant}{suffix}"
                    outputs.stamp(result, name, variant, settings, args.tag, command, doc)
                    earlier = [r for r in fresh_results if outputs.row_key(r) == outputs.row_key(result)]
                    if earlier:
                        outputs.combine_repeat(earlier[0], result)
                    else:
                        result["repeats"] = 1
                        fresh_results.append(result)
                    print(f"[bench] {tag}: {outputs.one_line(result)}", flush=True)
                    log.write(f"[bench] {tag}: {outputs.one_line(result)}\n")
                    log.flush()
                # write after every unit: a call cut short still leaves what it measured
                keys = {outputs.row_key(r) for r in fresh_results}
                doc["results"] = [r for r in previous if outputs.row_key(r) not in keys] + fresh_results
                _write(doc, args)
            has_ckpt = settings.load and any(hf_dir.glob("*.safetensors"))
            for layout in args.load_layouts if has_ckpt else []:
                print(f"[bench] {name} load {layout} ...", flush=True)
                row = processes.run_load_layout(name, hf_dir, layout, args, log)
                row |= {"command": command, "date_utc": doc["date_utc"]}
                fresh_loads.append(row)
                msg = (
                    f"{row['ranks']} ranks, {row['seconds_all_ranks']:.2f} s, max read/rank "
                    f"{row['max_read_fraction_per_rank']:.3f} of the checkpoint"
                    if row["status"] == "ok"
                    else f"{row['status']}: {row.get('reason') or row.get('error')}"
                )
                print(f"[bench] {name} load {layout}: {msg}", flush=True)
                log.write(f"[bench] {name} load {layout}: {msg}\n")
                keys = {outputs.load_key(r) for r in fresh_loads}
                doc["load_scaling"] = [
                    r for r in previous_loads if outputs.load_key(r) not in keys
                ] + fresh_loads
                _write(doc, args)
    print((args.out / "results.md").read_text(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
