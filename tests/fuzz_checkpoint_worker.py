"""Loads seeded corruptions of a sharded HF checkpoint through ``load_hf_weights`` and classifies each.

Run by ``test_checkpoint_fuzz.py`` in a subprocess, so that a crash names its variant: each variant's
description is written (and flushed) to the results file before it loads, its outcome after:

- ``error``: one of our exception types, naming the variant's directory (the file, or the tensor in it);
- ``same``: loaded, and every parameter equals the clean load bit for bit (a corruption with no effect,
  e.g. a space in the header's padding or a byte of its free-text ``__metadata__``);
- ``bad``: anything else -- another exception type, a message naming no file, or different weights.

Usage: fuzz_checkpoint_worker.py BASE_DIR WORK_DIR RESULTS_FILE SEED COUNT
"""

from __future__ import annotations

import json
import math
import random
import shutil
import struct
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

INDEX = "model.safetensors.index.json"
Files = dict[str, bytes]

# --------------------------------------------------------------------------------------------- helpers


def _shards(files: Files) -> list[str]:
    return sorted(n for n in files if n.endswith(".safetensors"))


def _header(data: bytes) -> tuple[dict, int]:
    n = struct.unpack("<Q", data[:8])[0]
    return json.loads(data[8 : 8 + n]), n


def _with_header(data: bytes, header: dict) -> bytes:
    _, n = _header(data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + data[8 + n :]


def _tensors(header: dict) -> list[str]:
    return sorted(k for k in header if k != "__metadata__")


def _pick(rng: random.Random, files: Files) -> tuple[str, dict, list[str]]:
    shard = rng.choice(_shards(files))
    header, _ = _header(files[shard])
    return shard, header, _tensors(header)


# ------------------------------------------------------------------------------------------- mutations
# Each takes the RNG and a copy of the checkpoint's files, edits the copy and describes the edit.


def header_byte(rng: random.Random, files: Files) -> str:
    shard = rng.choice(_shards(files))
    data = bytearray(files[shard])
    n = struct.unpack("<Q", data[:8])[0]
    pos = rng.randrange(8, 8 + n)
    new = rng.choice(b'0123456789"{}[],:.- \x00\xffAFIUZaz') if rng.random() < 0.6 else rng.randrange(256)
    if new == data[pos]:
        new ^= 1
    old, data[pos] = data[pos], new
    files[shard] = bytes(data)
    return f"{shard}: header byte {pos} {bytes([old])!r} -> {bytes([new])!r}"


def header_length(rng: random.Random, files: Files) -> str:
    shard = rng.choice(_shards(files))
    data = files[shard]
    n, size = struct.unpack("<Q", data[:8])[0], len(data)
    value = rng.choice([0, 1, 7, n - 1, n + 1, n + 8, size - 8, size, size + 1, 2**32, 2**63 - 1, 2**64 - 1])
    files[shard] = struct.pack("<Q", value) + data[8:]
    return f"{shard}: header length {n} -> {value}"


def offsets(rng: random.Random, files: Files) -> str:
    shard, header, names = _pick(rng, files)
    name = rng.choice(names)
    b, e = header[name]["data_offsets"]
    end = max(header[k]["data_offsets"][1] for k in names)
    new = rng.choice(
        [
            [e, b],
            [b + 4, e + 4],
            [b, e - 4],
            [b, e + 4],
            [b - 4, e],
            [0, e - b],
            [b, end + 4],
            [2**40, 2**40 + e - b],
        ]
    )
    if new == [b, e] or (b == 0 and new == [0, e - b]):
        new = [b + 4, e + 4]
    header[name]["data_offsets"] = new
    files[shard] = _with_header(files[shard], header)
    return f"{shard}: {name} data_offsets {[b, e]} -> {new}"


def dtype(rng: random.Random, files: Files) -> str:
    shard, header, names = _pick(rng, files)
    name = rng.choice(names)
    new = rng.choice(
        ["I32", "U32", "F16", "BF16", "F64", "I64", "BOOL", "U8", "F8_E4M3", "XYZ", "", "f32", 5, None]
    )
    old, header[name]["dtype"] = header[name]["dtype"], new
    files[shard] = _with_header(files[shard], header)
    return f"{shard}: {name} dtype {old} -> {new!r}"


def shape(rng: random.Random, files: Files) -> str:
    shard, header, names = _pick(rng, files)
    name = rng.choice(names)
    old = header[name]["shape"]
    new = rng.choice(
        [
            old[::-1],
            [math.prod(old)],
            [1, *old],
            [*old, 1],
            [old[0] + 1, *old[1:]],
            [old[0] - 1, *old[1:]],
            [],
            [-old[0], *old[1:]],
            [2**62, *old[1:]],
            [str(old[0]), *old[1:]],
        ]
    )
    header[name]["shape"] = new
    files[shard] = _with_header(files[shard], header)
    return f"{shard}: {name} shape {old} -> {new}"


def truncate(rng: random.Random, files: Files) -> str:
    shard = rng.choice(_shards(files))
    data = files[shard]
    n = struct.unpack("<Q", data[:8])[0]
    at = rng.choice([0, 4, 8, 8 + n // 2, 8 + n, rng.randrange(8 + n, len(data)), len(data) - 1])
    files[shard] = data[:at]
    return f"{shard}: truncated to {at} of {len(data)} bytes"


def append(rng: random.Random, files: Files) -> str:
    shard = rng.choice(_shards(files))
    extra = rng.randbytes(rng.randint(1, 16))
    files[shard] += extra
    return f"{shard}: {len(extra)} bytes appended"


def nonfinite(rng: random.Random, files: Files) -> str:
    shard, header, names = _pick(rng, files)
    name = rng.choice(names)
    data, (_, n) = bytearray(files[shard]), _header(files[shard])
    b, e = header[name]["data_offsets"]
    assert header[name]["dtype"] == "F32"
    value = rng.choice([float("nan"), float("inf"), float("-inf")])
    at = [rng.randrange((e - b) // 4) for _ in range(rng.randint(1, 3))]
    for i in at:
        data[8 + n + b + 4 * i : 8 + n + b + 4 * i + 4] = struct.pack("<f", value)
    files[shard] = bytes(data)
    return f"{shard}: {name} elements {at} = {value}"


def rename(rng: random.Random, files: Files) -> str:
    shard, header, names = _pick(rng, files)
    name = rng.choice(names)
    elsewhere = [k for s in _shards(files) if s != shard for k in _tensors(_header(files[s])[0])]
    others = [k for k in names if k != name] or [name + "Y"]
    new = rng.choice([name + "X", "model.extra.weight", rng.choice(elsewhere), rng.choice(others)])
    header[new] = header.pop(name)
    files[shard] = _with_header(files[shard], header)
    return f"{shard}: tensor {name} renamed {new}"


def index(rng: random.Random, files: Files) -> str:
    doc = json.loads(files[INDEX])
    wm = doc["weight_map"]
    name = rng.choice(sorted(wm))
    others = [s for s in _shards(files) if s != wm[name]]
    op = rng.choice(
        [
            "drop",
            "other",
            "missing",
            "parent",
            "absolute",
            "empty",
            "extra",
            "rename",
            "cut",
            "list",
            "int",
            "gone",
        ]
    )
    if op == "drop":
        del wm[name]
    elif op == "other":
        wm[name] = rng.choice(others)
    elif op == "missing":
        wm[name] = "model-99999-of-99999.safetensors"
    elif op == "parent":
        wm[name] = "../" + wm[name]
    elif op == "absolute":
        wm[name] = "/etc/passwd"
    elif op == "empty":
        wm[name] = ""
    elif op == "extra":
        wm["model.extra.weight"] = wm[name]
    elif op == "rename":
        wm[name + "X"] = wm.pop(name)
    elif op == "int":
        wm[name] = 3
    elif op == "list":
        doc["weight_map"] = sorted(wm)
    if op == "cut":
        text = files[INDEX]
        files[INDEX] = text[: rng.randrange(len(text))]
    elif op == "gone":
        del files[INDEX]
    else:
        files[INDEX] = json.dumps(doc).encode()
    return f"{INDEX}: {op} {name}"


def config(rng: random.Random, files: Files) -> str:
    cfg = json.loads(files["config.json"])
    field, value = rng.choice(
        [
            ("intermediate_size", 95),
            ("intermediate_size", 128),
            ("hidden_size", 32),
            ("hidden_size", 128),
            ("num_hidden_layers", 3),
            ("num_hidden_layers", 5),
            ("vocab_size", 255),
            ("vocab_size", 300),
            ("tie_word_embeddings", not cfg["tie_word_embeddings"]),
            ("head_dim", 16),
            ("head_dim", 32),
            ("num_key_value_heads", 1),
            ("num_key_value_heads", 4),
            ("num_attention_heads", 8),
            ("architectures", ["LlamaForCausalLM"]),
            ("model_type", "llama"),
            ("(truncated)", None),
        ]
    )
    if field == "(truncated)":
        files["config.json"] = files["config.json"][: rng.randrange(len(files["config.json"]))]
    else:
        cfg[field] = value
        files["config.json"] = json.dumps(cfg).encode()
    return f"config.json: {field} = {value!r}"


def roundtrip(rng: random.Random, files: Files) -> str:
    """Control: a header re-serialized unchanged must load exactly."""
    shard = rng.choice(_shards(files))
    files[shard] = _with_header(files[shard], _header(files[shard])[0])
    return f"{shard}: header re-serialized (control)"


# mutation -> share of the variants
MUTATIONS: dict[Callable[[random.Random, Files], str], int] = {
    header_byte: 60,
    header_length: 15,
    offsets: 25,
    dtype: 25,
    shape: 25,
    truncate: 25,
    append: 5,
    nonfinite: 20,
    rename: 15,
    index: 45,
    config: 30,
    roundtrip: 5,
}


# ------------------------------------------------------------------------------------------------- run


def main(base: Path, work: Path, results: Path, seed: int, count: int) -> None:
    import twinkle_specs as ts
    from twinkle_specs.checkpoint import CheckpointError
    from twinkle_specs.hf_config import UnsupportedConfigError
    from twinkle_specs.parity import _init_single_process

    ours = (CheckpointError, UnsupportedConfigError, FileNotFoundError)
    _init_single_process()
    files = {p.name: p.read_bytes() for p in sorted(base.iterdir())}
    model = ts.build_model(base, load_weights=False)
    ts.load_hf_weights(model, base)
    reference = {k: v.detach().clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}
    params = list(model.parameters())

    rng = random.Random(seed)
    kinds = [m for m, share in MUTATIONS.items() for _ in range(share)]
    with results.open("w") as out:
        for i in range(count):
            variant = dict(files)
            mutate = rng.choice(kinds)
            what = mutate(rng, variant)
            d = work / f"v{i:04d}"
            d.mkdir(parents=True)
            for name, data in variant.items():
                (d / name).write_bytes(data)
            out.write(json.dumps({"i": i, "kind": mutate.__name__, "what": what}) + "\n")
            out.flush()
            with torch.no_grad():
                for p in params:
                    p.fill_(0.123)  # a parameter the load skips shows as a difference
            start = time.perf_counter()
            try:
                ts.load_hf_weights(model, d)
            except ours as err:
                outcome, detail = ("error" if str(d) in str(err) else "bad"), f"{type(err).__name__}: {err}"
            except Exception as err:  # noqa: BLE001 - the point: any other exception is a finding
                outcome, detail = "bad", f"{type(err).__name__}: {err}"
            else:
                state = model.state_dict()
                same = all(torch.equal(state[k], v) for k, v in reference.items())
                outcome, detail = (
                    ("same" if same else "bad"),
                    "loaded" + ("" if same else " DIFFERENT weights"),
                )
            seconds = time.perf_counter() - start
            out.write(
                json.dumps({"i": i, "outcome": outcome, "seconds": seconds, "detail": detail[:400]}) + "\n"
            )
            out.flush()
            shutil.rmtree(d)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
