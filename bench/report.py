"""results.json -> ratios, target checks, a markdown table and a PNG plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .stats import spread

SCHEMA_VERSION = 1

# name, numerator variant, denominator variant, metric, target (None: reported only)
RATIOS = (
    ("c_over_a_tokens_per_s", "twinkle_lora", "mcore_te_full", "tokens_per_s_per_gpu", 1.3),
    # (c) under TE CUDA graphs against (a) as the group ran it (eager unless --cuda-graphs says otherwise)
    ("c_graphs_over_a_tokens_per_s", "twinkle_lora_graphs", "mcore_te_full", "tokens_per_s_per_gpu", None),
    # (d) as peft's defaults run it: reported, no target (the target is against the best peer, below)
    ("c_over_d_tokens_per_s", "twinkle_lora", "hf_peft_lora", "tokens_per_s_per_gpu", None),
    ("b_over_a_tokens_per_s", "twinkle_full", "mcore_te_full", "tokens_per_s_per_gpu", 0.98),
    ("c_over_e_peak_memory", "twinkle_lora", "twinkle_frozen", "peak_memory_gib", None),
    ("c_over_e_step_memory", "twinkle_lora", "twinkle_frozen", "step_memory_gib", None),
    ("c_over_e_activation_memory", "twinkle_lora", "twinkle_frozen", "activation_memory_gib", None),
    ("c_over_a_peak_memory", "twinkle_lora", "mcore_te_full", "peak_memory_gib", None),
    ("d_over_f_tokens_per_s", "hf_peft_lora", "hf_full", "tokens_per_s_per_gpu", None),
    # packed SFT rows (useful tokens only) against (c) on random full rows: packing's cost and gain
    ("sft_over_c_tokens_per_s", "twinkle_lora_sft", "twinkle_lora", "tokens_per_s_per_gpu", None),
    # the same packed rows with the attention on FlashAttention-4's varlen kernels against TE's THD attention
    (
        "sft_fa4_over_sft_tokens_per_s",
        "twinkle_lora_sft_fa4",
        "twinkle_lora_sft",
        "tokens_per_s_per_gpu",
        None,
    ),
    # the frozen base's GEMMs in FP8 (Transformer Engine), adapters bf16; the full fine-tune for reference
    ("fp8_lora_over_lora_tokens_per_s", "twinkle_lora_fp8", "twinkle_lora", "tokens_per_s_per_gpu", 1.3),
    # the same under TE CUDA graphs, where the host's kernel launches no longer hide FP8's shorter GEMMs
    (
        "fp8_lora_over_lora_graphs_tokens_per_s",
        "twinkle_lora_fp8_graphs",
        "twinkle_lora_graphs",
        "tokens_per_s_per_gpu",
        None,
    ),
    ("fp8_full_over_full_tokens_per_s", "mcore_te_full_fp8", "mcore_te_full", "tokens_per_s_per_gpu", None),
)
# (c) against the fastest LoRA peer of its group (every variant with a ``peer``, each configuration tried)
BEST_PEER_RATIO, BEST_PEER_TARGET = "c_over_best_peer_tokens_per_s", 1.3
# (h) against the fastest peer LoRA on an FP8 base (reported)
FP8_BEST_PEER_RATIO = "h_over_best_fp8_peer_tokens_per_s"
# full-depth Qwen3-8B LoRA (c) on one GPU: tokens/s and LoRA-aware MFU
LORA_8B_SHAPE, LORA_8B_TOKENS_TARGET, LORA_8B_MFU_TARGET = "qwen3-8b-L36", 16000.0, 0.55
# what a row's tokens/s counts (its ``tokens_counted``)
TOKENS_COUNTED = {
    "all": "every position: seq_len x micro_batch_size",
    "useful": "useful tokens: the packed conversations' (useful_tokens_per_step), not the row's padding",
}
# (c) memory <= 1.05 x (e) frozen base: what one forward keeps for backward (the activations).
# Under CUDA graphs the activations live in the graphs' pool and are not measured: the target is then
# listed as not measured, not judged on the peak (which also holds the adapters' optimizer state).
LORA_MEMORY_TARGET = 1.05
MFU_TARGET = 0.50  # dense full fine-tune, 8B shape, H100 bf16
# the GPU the absolute targets (the 8B shape's tokens/s and MFU) are stated for; ratios are judged on any GPU
ABSOLUTE_TARGETS_GPU = "H100"


def counted_tokens(r: dict[str, Any]) -> int:
    """The tokens per step that a row's tokens/s counts (:data:`TOKENS_COUNTED`)."""
    return r.get("useful_tokens_per_step", r["tokens_per_step"])


def _why(r: dict[str, Any], limit: int) -> str:
    """A failed result's reason or error on one line (a table cell), cut to ``limit`` characters."""
    return " ".join((r.get("reason") or r.get("error") or "").split())[:limit]


def configuration_of(r: dict[str, Any]) -> str:
    """The variant a row measures a configuration of (its own where it is no other's: ``configuration_of``)."""
    return r.get("configuration_of") or r["variant"]


def group_key(r: dict[str, Any]) -> tuple:
    return (r["shape"], r["seq_len"], r["micro_batch_size"], r.get("tag", ""), r.get("grad_accum", 1))


def group_name(key: tuple) -> str:
    shape, seq, mbs, tag, accum = key
    batch = f" gbs{mbs * accum} (accumulating {accum})" if accum > 1 else ""
    return f"{shape} seq{seq} mbs{mbs}{batch}" + (f" [{tag}]" if tag else "")


def ratios(results: list[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    groups: dict[tuple, dict[str, dict]] = {}
    for r in results:
        if r.get("status") == "ok":
            groups.setdefault(group_key(r), {})[r["variant"]] = r
    out: dict[str, dict[str, float | None]] = {}
    for key, by_variant in groups.items():
        row: dict[str, float | None] = {}
        for name, num, den, metric, _ in RATIOS:
            a, b = by_variant.get(num, {}).get(metric), by_variant.get(den, {}).get(metric)
            row[name] = a / b if a is not None and b else None
            if metric != "tokens_per_s_per_gpu":
                continue  # run-to-run spreads are of throughput only
            if pairs := _paired(by_variant.get(num, {}), by_variant.get(den, {})):
                row[f"{name}_pairs"] = pairs
            if rounds := _rounds(by_variant.get(num, {}), by_variant.get(den, {})):
                row[f"{name}_rounds"] = rounds
        row |= _best_peer(by_variant)
        row |= _best_peer(by_variant, fp8=True)
        out[group_name(key)] = row
    return out


def _best_peer(by_variant: dict[str, dict], fp8: bool = False) -> dict[str, Any]:
    """The fastest LoRA peer row of a group (``best_peer``: its variant, ``best_peer_framework``), each
    framework's fastest configuration (``peer_tokens_per_s``) and (c) over the best, (c) at its fastest
    configuration (``ours_configuration``: eager or a ``configuration_of`` it, such as CUDA graphs), as
    each peer is taken at its fastest; ``fp8``: the same among the peers on an FP8 base, against (h),
    under keys prefixed ``fp8_``. A peer row that trains another number of parameters than (c) trains other
    adapters: it is listed (``peers_with_other_adapters``: variant -> trainable parameters), never compared."""
    prefix = "fp8_" if fp8 else ""
    base = "twinkle_lora_fp8" if fp8 else "twinkle_lora"
    configurations = [
        r for r in by_variant.values() if configuration_of(r) == base and r.get("tokens_per_s_per_gpu")
    ]
    fastest_ours = max(configurations, key=lambda r: r["tokens_per_s_per_gpu"], default={})
    ours, trainable = fastest_ours.get("tokens_per_s_per_gpu"), fastest_ours.get("trainable_params")
    peers, other = [], {}
    for r in by_variant.values():
        if not (r.get("peer") and r.get("tokens_per_s_per_gpu") and bool(r.get("fp8")) == fp8):
            continue
        if trainable and r.get("trainable_params") and r["trainable_params"] != trainable:
            other[r["variant"]] = r["trainable_params"]
        else:
            peers.append(r)
    listed = (
        {f"{prefix}peers_with_other_adapters": other, f"{prefix}ours_trainable_params": trainable}
        if other
        else {}
    )
    if not peers:
        return listed
    fastest: dict[str, dict] = {}
    for r in peers:
        if r["tokens_per_s_per_gpu"] > fastest.get(r["peer"], {}).get("tokens_per_s_per_gpu", 0.0):
            fastest[r["peer"]] = r
    best = max(fastest.values(), key=lambda r: r["tokens_per_s_per_gpu"])
    out = {
        "best_peer": best["variant"],
        "best_peer_framework": best["peer"],
        "peer_tokens_per_s": {f: r["tokens_per_s_per_gpu"] for f, r in fastest.items()},
        "peer_configuration": {f: r["variant"] for f, r in fastest.items()},
        "ours_configuration": fastest_ours.get("variant"),
    }
    if fp8:  # reported, no target
        return (
            {f"fp8_{k}": v for k, v in out.items()}
            | listed
            | {FP8_BEST_PEER_RATIO: ours / best["tokens_per_s_per_gpu"] if ours else None}
        )
    return out | listed | {BEST_PEER_RATIO: ours / best["tokens_per_s_per_gpu"] if ours else None}


def _paired(num: dict[str, Any], den: dict[str, Any]) -> list[float] | None:
    """Throughput ratio of each interleaved repeat (``--repeats``: num and den ran back to back, so a
    pair shares the machine's state): den's median step time over num's, per run."""
    a, b = num.get("repeat_medians"), den.get("repeat_medians")
    if not a or not b or len(a) != len(b):
        return None
    return [tb / ta for ta, tb in zip(a, b, strict=True)]


def _rounds(num: dict[str, Any], den: dict[str, Any]) -> dict[str, float | int] | None:
    """For rows timed together (``--interleave``): the throughput ratio of each round's two steps (den's
    step time over num's; they ran in one process, a moment apart), as median and 10th-90th percentile
    (interpolated, as every spread here)."""
    together = set(num.get("interleaved_with") or ()) & set(den.get("interleaved_with") or ())
    a, b = num.get("step_time_s", {}).get("all"), den.get("step_time_s", {}).get("all")
    if not {num.get("variant"), den.get("variant")} <= together or not a or not b or len(a) != len(b):
        return None
    per_round = spread([tb / ta for ta, tb in zip(a, b, strict=True)])
    return {key: per_round[key] for key in ("median", "p10", "p90")} | {"rounds": len(a)}


def _judged(group: str, target: str, value: float | None, bound: float, spread_: tuple | None, cpu: bool):
    """A target check: ``value >= bound`` met, judged on the run-to-run ``spread_`` (low, high) where the
    report has one: a spread that straddles the bound is noise, not a verdict (``met`` None, with a
    ``note``), and a CPU run is never a performance verdict."""
    check: dict[str, Any] = {"group": group, "target": target, "value": value}
    if value is None:
        return check | {"met": None}
    if cpu:
        return check | {"met": None, "note": "CPU run: not a performance result"}
    if spread_ is not None:
        low, high = spread_
        check["spread"] = [low, high]
        if low < bound <= high:
            return check | {"met": None, "note": f"within run-to-run noise ({low:.3f}–{high:.3f})"}
        return check | {"met": low >= bound}
    return check | {"met": value >= bound}


def _judged_absolute(
    group: str, target: str, value: float | None, bound: float, device: str | None
) -> dict[str, Any]:
    """An absolute target (tokens/s, MFU) check for a row measured on ``device``: judged as :func:`_judged`
    judges it (a CPU run judges nothing); on a GPU other than the one it is stated for, the value is reported,
    not judged (another GPU's clocks, memory and power cap decide it), and the note says on which side of the
    bound it fell there. A row that does not name its GPU is judged."""
    check = _judged(group, target, value, bound, None, device == "cpu")
    if check["met"] is None or device is None or ABSOLUTE_TARGETS_GPU in device:
        return check
    side = "at or above" if check["met"] else "below"
    note = f"stated for the {ABSOLUTE_TARGETS_GPU}, not judged on an {device} ({side} the bound there)"
    return check | {"met": None, "note": note}


def _ratio_spread(row: dict[str, Any], name: str) -> tuple[float, float] | None:
    """The run-to-run spread of a ratio: its interleaved rounds' 10th–90th percentile, else the range of
    its back-to-back repeat pairs."""
    if rounds := row.get(f"{name}_rounds"):
        return rounds["p10"], rounds["p90"]
    if pairs := row.get(f"{name}_pairs"):
        return min(pairs), max(pairs)
    return None


def targets(results: list[dict[str, Any]], ratio_table: dict[str, dict]) -> list[dict[str, Any]]:
    """Each target with the measured value and whether it is met (None: not measured in this run, or
    not decidable: within the report's own run-to-run noise, or a CPU run)."""
    cpu_groups = {group_name(group_key(r)) for r in results if r.get("device") == "cpu"}
    checks = []
    for group, row in ratio_table.items():
        cpu = group in cpu_groups
        ratio_targets = [(name, target) for name, _, _, _, target in RATIOS if target is not None]
        for name, target in [*ratio_targets, (BEST_PEER_RATIO, BEST_PEER_TARGET)]:
            if row.get(name) is not None:
                checks.append(
                    _judged(group, f"{name} >= {target}", row[name], target, _ratio_spread(row, name), cpu)
                )
        activations = row.get("c_over_e_activation_memory")
        if activations is not None or row.get("c_over_e_peak_memory") is not None:
            checks.append(
                {
                    "group": group,
                    "target": f"c_over_e_activation_memory <= {LORA_MEMORY_TARGET}",
                    "value": activations,
                    "met": None if activations is None else activations <= LORA_MEMORY_TARGET,
                }
            )
    for r in results:
        if r.get("status") != "ok":
            continue
        group, device = group_name(group_key(r)), r.get("device")
        if r["shape"].startswith("qwen3-8b") and r["variant"] in ("mcore_te_full", "twinkle_full"):
            if r.get("mfu") is not None:
                target = f"{r['variant']} MFU >= {MFU_TARGET} (dense 8B shape)"
                checks.append(_judged_absolute(group, target, r["mfu"], MFU_TARGET, device))
        full_depth_8b = r["shape"] == LORA_8B_SHAPE and (r["seq_len"], r["micro_batch_size"]) == (4096, 1)
        if full_depth_8b and configuration_of(r) == "twinkle_lora" and r.get("grad_accum", 1) == 1:
            v = r["variant"]
            target = f"{v} tokens/s >= {LORA_8B_TOKENS_TARGET:,.0f} (Qwen3-8B, all 36 layers)"
            checks.append(
                _judged_absolute(group, target, r["tokens_per_s_per_gpu"], LORA_8B_TOKENS_TARGET, device)
            )
            if r.get("mfu") is not None:
                target = f"{v} LoRA-aware MFU >= {LORA_8B_MFU_TARGET} (Qwen3-8B, all 36 layers)"
                checks.append(_judged_absolute(group, target, r["mfu"], LORA_8B_MFU_TARGET, device))
    return checks


def summarize(doc: dict[str, Any]) -> dict[str, Any]:
    """Adds ratios and target checks to a results document."""
    doc["ratios"] = ratios(doc["results"])
    doc["targets"] = targets(doc["results"], doc["ratios"])
    return doc


def _fmt(x: float | None, spec: str = ".2f", scale: float = 1.0) -> str:
    return "–" if x is None else format(x * scale, spec)


def _repeats(r: dict[str, Any]) -> str:
    medians = r.get("repeat_medians")
    if not medians:
        return ""
    return f" ({len(medians)} runs, medians {min(medians):.4f}–{max(medians):.4f})"


def _commit(doc: dict[str, Any], r: dict[str, Any]) -> str | None:
    """The tree a row was measured on: its commit, or where none was known (a copy without git and without a
    COMMIT file whose hash matches) its sources' hash; the file's commit for rows from before rows carried
    one."""
    if "git_commit" not in r:
        return doc["environment"].get("git_commit")
    return r["git_commit"] or f"no commit, sources sha256 {str(r.get('source_sha256'))[:12]}"


def _commits(doc: dict[str, Any]) -> list[str | None]:
    return list(dict.fromkeys(_commit(doc, r) for r in doc["results"]))


def peer_lines(ratio_table: dict[str, dict]) -> list[str]:
    """The markdown lines naming each group's best LoRA peer and every framework's fastest configuration."""
    lines = []
    for group, row in ratio_table.items():
        for prefix, ours, ratio in (("", "(c)", BEST_PEER_RATIO), ("fp8_", "(h)", FP8_BEST_PEER_RATIO)):
            if other := row.get(f"{prefix}peers_with_other_adapters"):
                each = ", ".join(f"`{v}` {n:,}" for v, n in other.items())
                lines.append(
                    f"- {group}{' FP8' if prefix else ''}: not compared, other adapters (trainable parameters "
                    f"against {ours}'s {row[f'{prefix}ours_trainable_params']:,}): {each}"
                )
            if not row.get(f"{prefix}best_peer"):
                continue
            configuration = row[f"{prefix}peer_configuration"]
            each = ", ".join(
                f"{f} {tok:,.0f} ({configuration[f]})" for f, tok in row[f"{prefix}peer_tokens_per_s"].items()
            )
            lines.append(
                f"- {group}{' FP8' if prefix else ''}: best peer `{row[f'{prefix}best_peer']}` "
                f"({row[f'{prefix}best_peer_framework']}); {ours} as `{row.get(f'{prefix}ours_configuration')}` / "
                f"best peer {_fmt(row.get(ratio), '.3f')}; "
                f"fastest configuration per framework, tokens/s: {each}"
            )
    return (
        ["", "LoRA peers (each framework's configurations tried; the fastest is its peer):", "", *lines]
        if lines
        else []
    )


def accumulation_lines(results: list[dict[str, Any]]) -> list[str]:
    """For rows that accumulate gradients: the unfused accumulation's cost (``main_grad.add_`` per
    micro-batch, measured), beside their tokens/s, since stock pretrain_gpt.py fuses it only with apex."""
    lines = [
        f"- {group_name(group_key(r))}, {r['variant']}: {r['unfused_grad_accumulation_ms']:.2f} ms per "
        f"micro-batch, {r['grad_accum'] * r['unfused_grad_accumulation_ms'] / 1e3 / r['step_time_s']['median']:.1%} "
        "of its step"
        for r in results
        if r.get("status") == "ok" and r.get("unfused_grad_accumulation_ms") is not None
    ]
    head = "Unfused gradient accumulation (no apex: main_grad.add_ per trained weight and micro-batch), measured:"
    return ["", head, "", *lines] if lines else []


def paired_lines(ratio_table: dict[str, dict]) -> list[str]:
    """The markdown lines listing each interleaved repeat's ratio (:func:`_paired`), if any."""
    lines: list[str] = []
    for group, row in ratio_table.items():
        for name, *_ in RATIOS:
            pairs = row.get(f"{name}_pairs")
            if not pairs:
                continue
            values = ", ".join(f"{p:.3f}" for p in pairs)
            lines.append(f"- {group}, {name}: {values} (median {spread(pairs)['median']:.3f})")
    out = ["", "Per interleaved repeat (each pair ran back to back):", "", *lines] if lines else []
    rounds = [
        f"- {group}, {name}: median {r['median']:.3f} over {r['rounds']} rounds "
        f"(10th–90th percentile {r['p10']:.3f}–{r['p90']:.3f})"
        for group, row in ratio_table.items()
        for name, *_ in RATIOS
        if (r := row.get(f"{name}_rounds"))
    ]
    if rounds:
        out += ["", "Step by step in one process (`--interleave`), each round's ratio:", "", *rounds]
    return out


def target_lines(checks: list[dict[str, Any]]) -> list[str]:
    """The Targets table: each check's measured value and verdict (``met`` None: not measured)."""
    lines = ["", "## Targets", "", "| group | target | measured | met |", "|---|---|---|---|"]
    verdict = {True: "yes", False: "NO", None: "not measured in this run (a plain eager run measures it)"}
    for c in checks:
        said = c.get("note") or verdict[c["met"]]
        lines.append(f"| {c['group']} | {c['target']} | {_fmt(c['value'], '.3f')} | {said} |")
    if not checks:
        lines.append("| – | no target could be evaluated in this run | – | – |")
    return lines


def markdown(doc: dict[str, Any]) -> str:
    env = doc["environment"]
    commits = _commits(doc)
    lines = [
        "# twinkle-specs benchmark results",
        "",
        f"- date (UTC): {doc['date_utc']}",
        "- command(s): "
        + "; ".join(
            f"`{c}`" for c in dict.fromkeys(r.get("command", doc["command"]) for r in doc["results"])
        ),
        f"- device: {env.get('device')} × {env.get('gpu_count', 0)} (one GPU used)"
        if env.get("device") != "cpu"
        else "- device: CPU (portable path; proves the harness runs, these are NOT performance results)",
        "- versions: " + ", ".join(f"{k} {v}" for k, v in env.get("versions", {}).items() if v is not None),
        f"- twinkle-specs commit(s): {', '.join(str(c) for c in commits)}"
        + (" (each row's after its label)" if len(commits) > 1 else ""),
        *(
            [f"- measured sources (sha256, bench/provenance.py): {env['source_sha256']}"]
            if env.get("source_sha256")
            else []
        ),
        f"- peak FLOP/s used for MFU: {_fmt(doc.get('peak_flops_per_gpu'), '.1f', 1e-12)} TFLOP/s (dense bf16)",
        "- every step is a complete training iteration (forward, backward, optimizer step) unless the "
        "'step' column says otherwise; times are the median over the timed steps, spread is min–max",
        *([f"- plot: {doc['plot_missing']}"] if doc.get("plot_missing") else []),
        "",
        "## Throughput and memory",
        "",
        "| shape | seq | mbs | variant | impl | tokens/s/GPU | step s (median) | spread (min–max) | TFLOP/s | MFU | "
        "MFU (6N) | peak mem GiB | step mem GiB | act mem GiB | trainable | status |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["results"]:
        tag = f" [{r['tag']}]" if r.get("tag") else ""  # groups of one shape told apart
        tag += f" @{_commit(doc, r)}" if len(commits) > 1 else ""
        tag += " (interleaved; memory: all models)" if r.get("interleaved_with") else ""
        if (accum := r.get("grad_accum", 1)) > 1:
            tag += (
                f" (global batch {accum * r['micro_batch_size']}: {accum} micro-batches per optimizer step)"
            )
        if "useful_tokens_per_step" in r:  # packed SFT row: tokens/s counts these
            tag += (
                f" ({r['useful_tokens_per_step']:,} useful tokens of {r['tokens_per_step']:,}, "
                f"{r['answer_tokens_per_step']:,} answer tokens)"
            )
        head = f"| {r['shape']} | {r['seq_len']} | {r['micro_batch_size']} | {r['label']}{tag} "
        if r.get("status") != "ok":
            lines.append(
                head + f"| – | – | – | – | – | – | – | – | – | – | – | {r.get('status')}: {_why(r, 160)} |"
            )
            continue
        t = r["step_time_s"]
        lines.append(
            head + f"| {r.get('impl', '')} | {r['tokens_per_s_per_gpu']:,.0f} | {t['median']:.4f} | "
            f"{t['min']:.4f}–{t['max']:.4f}{_repeats(r)} | {_fmt(r.get('tflops_per_s_per_gpu'), '.1f')} | "
            f"{_fmt(r.get('mfu'), '.1%')} | {_fmt(r.get('mfu_6n'), '.1%')} | {_fmt(r.get('peak_memory_gib'))} | "
            f"{_fmt(r.get('step_memory_gib'))} | {_fmt(r.get('activation_memory_gib'))} | "
            f"{r.get('trainable_params', 0):,} | ok |"
        )
    lines += ["", "## Ratios", "", "| group | " + " | ".join(n for n, *_ in RATIOS) + " |"]
    lines.append("|---" * (len(RATIOS) + 1) + "|")
    for group, row in doc["ratios"].items():
        lines.append(f"| {group} | " + " | ".join(_fmt(row.get(n), ".3f") for n, *_ in RATIOS) + " |")
    lines += peer_lines(doc["ratios"])
    lines += accumulation_lines(doc["results"])
    lines += paired_lines(doc["ratios"])
    lines += target_lines(doc["targets"])
    loads = [r for r in doc["results"] if r.get("load")]
    if loads:
        lines += [
            "",
            "## HF → Megatron load (twinkle_specs.load_hf_weights, 1 rank)",
            "",
            "| shape | seconds | GiB/s | bytes read | checkpoint bytes | read / checkpoint | page cache dropped |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in loads:
            ld = r["load"]
            lines.append(
                f"| {r['shape']} | {ld['seconds']:.2f} | {_fmt(ld.get('gib_per_s'))} | {ld['bytes_read']:,} | "
                f"{ld['checkpoint_bytes']:,} | {_fmt(ld.get('read_fraction'), '.3f')} | {ld['page_cache_dropped']} |"
            )
    scaling = doc.get("load_scaling") or []
    if scaling:
        lines += [
            "",
            "## HF → Megatron load across ranks (bench/load.py under torchrun)",
            "",
            "| shape | layout | ranks | device | seconds (all ranks) | max bytes read / rank | "
            "max read / checkpoint per rank | all ranks' reads / checkpoint | status |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in scaling:
            if r.get("status") != "ok":
                lines.append(
                    f"| {r['shape']} | {r['layout']} | – | – | – | – | – | – | {r.get('status')}: {_why(r, 120)} |"
                )
                continue
            lines.append(
                f"| {r['shape']} | {r['layout']} | {r['ranks']} | {r['device']} ({r['impl']}) | "
                f"{r['seconds_all_ranks']:.2f} | {r['max_bytes_read_per_rank']:,} | "
                f"{r['max_read_fraction_per_rank']:.3f} | {r['total_read_fraction']:.3f} | ok |"
            )
    lines += telemetry_lines(doc["results"])
    profiled = [r for r in doc["results"] if r.get("profile")]
    if profiled:
        lines += ["", "## Profile (per step)", ""]
        for r in profiled:
            p = r["profile"]
            cats = ", ".join(f"{k} {v:.1f} ms" for k, v in p["device_ms_per_step_by_category"].items())
            lines.append(
                f"- {r['shape']} {r['variant']}: wall {p['wall_ms_per_step']:.1f} ms, device busy "
                f"{p['device_busy_ms_per_step']:.1f} ms ({_fmt(p.get('device_busy_fraction'), '.0%')}); {cats}"
            )
    return "\n".join(lines) + "\n"


def _reasons(g: dict[str, Any]) -> str:
    """``sw_power_cap 85 %, ...``; results from before the shares were kept list the names seen."""
    if "reason_share" in g:
        return ", ".join(f"{k} {v:.0%}" for k, v in g["reason_share"].items()) or "–"
    return ", ".join(g.get("reasons_seen", [])) or "–"


def telemetry_lines(results: list[dict[str, Any]]) -> list[str]:
    """The GPU's clock, power and clock-event reasons over each variant's timed steps
    (bench/telemetry.py), so a slower step can be told from a slower GPU."""
    rows = [r for r in results if r.get("status") == "ok" and (r.get("gpu_telemetry") or {}).get("available")]
    missing = {
        r["gpu_telemetry"]["reason"]
        for r in results
        if r.get("status") == "ok" and r.get("gpu_telemetry") and not r["gpu_telemetry"]["available"]
    }
    if not rows and not missing:
        return []
    lines = [
        "",
        "## GPU clocks while timed (nvidia-smi samples, mean per step)",
        "",
        "| shape | variant | steps sampled | SM MHz median | SM MHz min–max | power W median | max °C | "
        "clock-event reasons (share of samples where kept) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        g = r["gpu_telemetry"]
        clocks = [s["sm_mhz"] for s in g["per_step"] if s]
        tag = f" [{r['tag']}]" if r.get("tag") else ""
        span = f"{min(clocks):.0f}–{max(clocks):.0f}" if clocks else "–"
        lines.append(
            f"| {r['shape']} | {r['variant']}{tag} | {g['steps_with_samples']}/{len(g['per_step'])} | "
            f"{_fmt(g.get('sm_mhz_median'), '.0f')} | {span} | {_fmt(g.get('power_w_median'), '.0f')} | "
            f"{_fmt(g.get('temp_c_max'), '.0f')} | {_reasons(g)} |"
        )
    lines += [f"- not sampled: {why}" for why in sorted(missing)]
    return lines


def plot(doc: dict[str, Any], path: Path) -> Path:
    """Grouped bars: tokens/s/GPU (top) and peak memory (bottom) per shape and variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in doc["results"] if r.get("status") == "ok"]
    groups = sorted({group_name(group_key(r)) for r in ok}) or ["(no results)"]
    variants = [v for v in dict.fromkeys(r["variant"] for r in ok)]
    fig, axes = plt.subplots(2, 1, figsize=(max(6, 2.5 * len(groups) + 3), 8))
    width = 0.8 / max(1, len(variants))
    for ax, metric, ylabel in (
        (axes[0], "tokens_per_s_per_gpu", "tokens / s / GPU"),
        (axes[1], "peak_memory_gib", "peak memory (GiB)"),
    ):
        drawn = 0.0
        for i, v in enumerate(variants):
            ys = []
            for g in groups:
                match = [r for r in ok if r["variant"] == v and group_name(group_key(r)) == g]
                ys.append((match[0].get(metric) or 0.0) if match else 0.0)
            drawn += sum(ys)
            label = next((r["label"].split(")")[0] + ") " for r in ok if r["variant"] == v), "") + v
            ax.bar([j + i * width for j in range(len(groups))], ys, width, label=label)
        ax.set_xticks([j + width * (len(variants) - 1) / 2 for j in range(len(groups))], groups, fontsize=8)
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=0)
        if not drawn:
            ax.text(0.5, 0.5, "not measured (no GPU)", ha="center", va="center", transform=ax.transAxes)
    axes[0].legend(fontsize=8)
    axes[0].set_title(
        f"twinkle-specs benchmark — {doc['environment'].get('device')} — {doc['date_utc'][:10]}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
