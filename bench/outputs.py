"""The results document of an ``--out`` folder: rows merged with an earlier call's (same shape,
variant, seq, mbs, tag replaced), repeated runs folded into one row, and results.json, results.md,
results.png and profile.txt written (and copied to ``--export``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from . import report
from .stats import spread

EXPORT_FILES = ("results.json", "results.md", "results.png", "run.log", "profile.txt")


def row_key(r: dict) -> tuple:
    return (
        r.get("shape"),
        r.get("variant"),
        r.get("seq_len"),
        r.get("micro_batch_size"),
        r.get("tag", ""),
        r.get("grad_accum", 1),
    )


def load_key(r: dict) -> tuple:
    return (r.get("shape"), r.get("layout"), r.get("on_gpu"))


def load_previous(out: Path, fresh: bool) -> tuple[list[dict], list[dict]]:
    """The rows and load rows of ``<out>/results.json`` (none with ``fresh`` or when unreadable)."""
    path = out / "results.json"
    if fresh or not path.exists():
        return [], []
    try:
        old = json.loads(path.read_text())
    except (json.JSONDecodeError, OSError):
        return [], []
    return old.get("results", []), old.get("load_scaling", [])


def merge_files(sources: list[Path]) -> dict:
    """The first document with every source's rows merged in (later ones win), for --report-only."""
    docs = [json.loads(src.read_text()) for src in sources]
    doc = docs[0]
    doc["results"] = list({row_key(r): r for d in docs for r in d["results"]}.values())
    doc["load_scaling"] = list({load_key(r): r for d in docs for r in d.get("load_scaling", [])}.values())
    devices = {d["environment"].get("device") for d in docs}
    if len(devices) > 1:
        print(f"[bench] warning: merged results come from different devices: {sorted(devices)}")
        doc["environment"]["device"] = " / ".join(sorted(d for d in devices if d))
    return doc


def stamp(result: dict, shape: str, variant: str, settings, tag: str | None, command: str, doc: dict) -> None:
    """What a row says of itself even when its child died before reporting it, and where it came from
    (command, date, tree: merged files mix them)."""
    defaults = {"shape": shape, "variant": variant, "label": variant, "seq_len": settings.seq_len}
    defaults |= {"micro_batch_size": settings.micro_batch_size, "tag": tag, "grad_accum": settings.grad_accum}
    for key, value in defaults.items():
        result.setdefault(key, value)
    result |= {
        "command": command,
        "date_utc": doc["date_utc"],
        "git_commit": doc["environment"]["git_commit"],
        "source_sha256": doc["environment"]["source_sha256"],
        # the switches this row ran with: a later command merged into the same file replaces the document's
        "env_vars": doc["environment"]["env_vars"],
    }


def combine_repeat(first: dict, again: dict) -> None:
    """Folds a repeated run of the same variant into ``first``: all step times pooled (median and
    spread over them, phase spans too), each run's median kept in ``repeat_medians``, memory the larger
    peak."""
    if first.get("status") != "ok" or again.get("status") != "ok":
        first.setdefault("repeat_errors", []).append(
            again.get("error") or again.get("reason") or again["status"]
        )
        if first.get("status") != "ok" and again.get("status") == "ok":
            first.clear()
            first.update(again | {"repeats": 1})
        return
    first.setdefault("repeat_medians", [first["step_time_s"]["median"]])
    first["repeat_medians"].append(again["step_time_s"]["median"])
    first["repeats"] = first.get("repeats", 1) + 1
    times = first["step_time_s"]["all"] + again["step_time_s"]["all"]
    first["step_time_s"] = spread(times)
    phases, more = first.get("phase_time_s") or {}, again.get("phase_time_s") or {}
    for name in phases.keys() & more.keys():
        phases[name] = spread(phases[name]["all"] + more[name]["all"])
    first["losses"] = first["losses"] + again["losses"]
    first["losses_finite"] = first["losses_finite"] and again["losses_finite"]
    for key in ("peak_memory_gib", "peak_reserved_gib", "step_memory_gib"):
        if first.get(key) is not None and again.get(key) is not None:
            first[key] = max(first[key], again[key])
    median = first["step_time_s"]["median"]
    first["tokens_per_s_per_gpu"] = report.counted_tokens(first) / median
    first["tflops_per_s_per_gpu"] = first["model_flops"]["total"] / median / 1e12
    peak = first.get("peak_flops_per_gpu")
    first["mfu"] = first["model_flops"]["total"] / median / peak if peak else None


def write_outputs(doc: dict, out: Path) -> None:
    report.summarize(doc)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(doc, indent=1, default=str))
    try:
        report.plot(doc, out / "results.png")
        doc.pop("plot_missing", None)
    except ImportError:
        doc["plot_missing"] = (
            "matplotlib is not installed here: render the PNG elsewhere with "
            "`python bench/run.py --report-only --out DIR` (pip install -e .[bench])"
        )
        print(f"[bench] {doc['plot_missing']}", flush=True)
    (out / "results.md").write_text(report.markdown(doc))
    (out / "results.json").write_text(json.dumps(doc, indent=1, default=str))
    profiles = sorted(out.glob("profile-*.txt"))
    if profiles:
        (out / "profile.txt").write_text("\n".join(p.read_text() for p in profiles))


def export(out: Path, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for name in EXPORT_FILES:
        if (out / name).exists():
            shutil.copy2(out / name, dest / name)


def one_line(r: dict) -> str:
    """A row as the console and run.log show it."""
    if r.get("status") != "ok":
        return f"{r.get('status')}: {r.get('reason') or r.get('error')}"
    mfu = r.get("mfu")
    mem = r.get("peak_memory_gib")
    return (
        f"{r['tokens_per_s_per_gpu']:,.0f} tok/s, step {r['step_time_s']['median'] * 1e3:.1f} ms "
        f"(min {r['step_time_s']['min'] * 1e3:.1f}, max {r['step_time_s']['max'] * 1e3:.1f})"
        + (f", MFU {mfu:.1%}" if mfu is not None else "")
        + (f", peak {mem:.2f} GiB" if mem is not None else "")
        + _phases(r)
    )


def _phases(r: dict) -> str:
    """Median span of each phase on the GPU timeline (see bench.timing.PhaseClock)."""
    phases = r.get("phase_time_s") or {}
    return "".join(f", {name} {t['median'] * 1e3:.1f}" for name, t in phases.items()) + (
        " ms" if phases else ""
    )
