"""Fuzzes the HF checkpoint reader: a few hundred seeded corruptions of a tiny sharded checkpoint (header
bytes and length, offsets, dtypes, shapes, names, truncation, NaN/inf, index entries, config.json fields),
each loaded through ``load_hf_weights``. Every one must be a clear error of ours naming the file, or load
exactly the clean weights; none may crash, hang or load different weights silently."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from models import make_checkpoint

# The HF safetensors reader's refusals: run on one leg of scripts/test.sh (pyproject.toml's one_leg marker).
pytestmark = pytest.mark.one_leg
WORKER = Path(__file__).parent / "fuzz_checkpoint_worker.py"
SEED, COUNT = 0, 300
PER_VARIANT_S = 5.0


@pytest.fixture(scope="module")
def fuzz_results(tmp_path_factory) -> tuple[dict, dict, subprocess.CompletedProcess]:
    root = tmp_path_factory.mktemp("fuzz")
    base = make_checkpoint("qwen3", root / "base", max_shard_size="100KB")
    assert len(list(base.glob("*.safetensors"))) > 4
    results = root / "results.jsonl"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, str(WORKER), str(base), str(root / "work"), str(results), str(SEED), str(COUNT)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    rows = [json.loads(line) for line in results.read_text().splitlines()] if results.exists() else []
    started = {r["i"]: r for r in rows if "kind" in r}
    finished = {r["i"]: r for r in rows if "outcome" in r}
    return started, finished, proc


def test_every_corruption_is_a_clear_error_or_an_exact_load(fuzz_results):
    started, finished, proc = fuzz_results
    unfinished = sorted(set(started) - set(finished))
    assert proc.returncode == 0 and not unfinished, (
        f"the fuzz worker exited with {proc.returncode} during variant "
        f"{started[unfinished[0]] if unfinished else '?'}:\n{proc.stderr[-3000:]}"
    )
    assert len(finished) == COUNT
    bad = [f"{started[i]['what']} => {r['detail']}" for i, r in finished.items() if r["outcome"] == "bad"]
    assert not bad, f"{len(bad)} corruptions were not a clear error of ours:\n" + "\n".join(bad[:20])
    slow = [(started[i]["what"], r["seconds"]) for i, r in finished.items() if r["seconds"] > PER_VARIANT_S]
    assert not slow, f"variants took over {PER_VARIANT_S}s: {slow[:10]}"


def test_the_fuzz_exercises_every_kind_and_its_control_loads(fuzz_results):
    """The oracle can tell: unchanged re-serialized headers load exactly, and every kind of corruption
    gives errors (so a reader that silently loaded them would fail the test above)."""
    started, finished, _ = fuzz_results
    outcomes = Counter((started[i]["kind"], r["outcome"]) for i, r in finished.items())
    print(sorted(outcomes.items()))
    kinds = {k for k, _ in outcomes}
    assert outcomes[("roundtrip", "same")] >= 1 and not outcomes[("roundtrip", "error")]
    assert all(outcomes[(k, "error")] >= 1 for k in kinds - {"roundtrip"}), outcomes
    corrupted = sum(n for (k, _), n in outcomes.items() if k != "roundtrip")
    assert sum(n for (k, o), n in outcomes.items() if k != "roundtrip" and o == "error") >= 0.9 * corrupted
