"""Kernel by kernel: where one variant's device time goes beyond another's.

Reads the "every device kernel" lists that ``bench/run.py --profile`` writes into profile.txt (one
section per variant, ``== <shape>__<variant>__<tag>``) and prints a markdown table of the kernels whose
time per step differs most, e.g. LoRA against the frozen model it adds its adapters to:

    python bench/kernel_diff.py bench/results/DIR/profile.txt twinkle_lora twinkle_frozen --top 30
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

KERNELS_HEADER = re.compile(r"every device kernel over (\d+) steps")
KERNEL_LINE = re.compile(r"\s*([\d.]+)\s+(\d+)\s{2}(.+)")


def kernel_tables(text: str) -> dict[str, dict[str, tuple[float, float]]]:
    """Section name -> {kernel: (ms per step, calls per step)} for every profiled section of ``text``."""
    tables: dict[str, dict[str, tuple[float, float]]] = {}
    for section in re.split(r"^== ", text, flags=re.M)[1:]:
        name, _, body = section.partition("\n")
        found = KERNELS_HEADER.search(body)
        if not found:
            continue
        steps, table = int(found[1]), {}
        for line in body[found.end() :].splitlines()[1:]:
            m = KERNEL_LINE.fullmatch(line)
            if not m:
                break
            ms, calls = table.get(m[3], (0.0, 0.0))  # older profiles cut names short: add coinciding ones
            table[m[3]] = (ms + float(m[1]), calls + int(m[2]) / steps)
        tables[name.strip()] = table
    return tables


def pick(tables: dict, variant: str) -> str:
    """The one section whose name contains ``__<variant>__`` (or equals it)."""
    hits = [n for n in tables if n == variant or f"__{variant}__" in n or n.endswith(f"__{variant}")]
    if len(hits) != 1:
        raise SystemExit(f"{variant!r} matches {hits or 'no section'}; sections: {', '.join(tables)}")
    return hits[0]


def diff(a: dict[str, tuple[float, float]], b: dict[str, tuple[float, float]]) -> list[tuple]:
    """(Δ ms per step, a ms, a calls, b ms, b calls, kernel), largest difference first."""
    rows = []
    for k in a.keys() | b.keys():
        (ams, acalls), (bms, bcalls) = a.get(k, (0.0, 0.0)), b.get(k, (0.0, 0.0))
        rows.append((ams - bms, ams, acalls, bms, bcalls, k))
    return sorted(rows, key=lambda r: -abs(r[0]))


def markdown(name_a: str, name_b: str, rows: list[tuple], top: int) -> str:
    total_a = sum(r[1] for r in rows)
    total_b = sum(r[3] for r in rows)
    lines = [
        f"device time per step: {name_a} {total_a:.2f} ms, {name_b} {total_b:.2f} ms, "
        f"difference {total_a - total_b:+.2f} ms",
        "",
        "| Δ ms/step | A ms | A calls/step | B ms | B calls/step | kernel |",
        "|---|---|---|---|---|---|",
    ]
    for d, ams, ac, bms, bc, k in rows[:top]:
        lines.append(f"| {d:+.3f} | {ams:.3f} | {ac:g} | {bms:.3f} | {bc:g} | `{k[:90]}` |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("profile", type=Path, help="profile.txt of bench/run.py --profile")
    ap.add_argument("a", help="variant (or whole section name) A, e.g. twinkle_lora")
    ap.add_argument("b", help="variant (or whole section name) B, e.g. twinkle_frozen")
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args(argv)
    tables = kernel_tables(args.profile.read_text())
    if not tables:
        raise SystemExit(f"{args.profile}: no kernel lists (profile with a harness that writes them)")
    a, b = pick(tables, args.a), pick(tables, args.b)
    print(markdown(a, b, diff(tables[a], tables[b]), args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
