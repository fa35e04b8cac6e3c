"""Streaming, strict access to a Hugging Face safetensors checkpoint (single file or sharded)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

INDEX_NAME = "model.safetensors.index.json"
_ITEMSIZE = {
    "F64": 8,
    "I64": 8,
    "F32": 4,
    "I32": 4,
    "BF16": 2,
    "F16": 2,
    "I16": 2,
    "U8": 1,
    "I8": 1,
    "BOOL": 1,
}
SINGLE_NAME = "model.safetensors"

# How to load non-finite weights on purpose, from each entry point.
NONFINITE_ENV = "TWINKLE_ALLOW_NONFINITE_WEIGHTS"
NONFINITE_OPT_OUT = (
    f"load_hf_weights(..., allow_nonfinite=True), `twinkle-specs convert --allow-nonfinite-weights`, "
    f"or {NONFINITE_ENV}=1 for the launcher"
)


class CheckpointError(ValueError):
    """The checkpoint's files do not hold what its config says they should."""


class CheckpointReader:
    """Reads only the requested rows/columns of each tensor (``safe_open(...).get_slice``).

    Every shard must lie in the checkpoint directory and hold exactly the tensors the index assigns it.
    Each slice handed out must be finite unless ``allow_nonfinite``. ``bytes_read`` counts the bytes of
    every slice handed out, so callers can report per-rank I/O.
    """

    def __init__(self, hf_dir: str | Path, *, allow_nonfinite: bool = False) -> None:
        self.dir = Path(hf_dir)
        self.allow_nonfinite = allow_nonfinite
        self._handles: dict[Path, object] = {}
        self.bytes_read = 0
        index = self.dir / INDEX_NAME
        if index.is_file() and (self.dir / SINGLE_NAME).exists():
            raise CheckpointError(
                f"{self.dir} holds both {SINGLE_NAME} and {INDEX_NAME} (transformers would load the first, "
                "an index-driven loader the shards): remove the stale one"
            )
        if index.is_file():
            self.files = self._read_index(index)
        elif (self.dir / SINGLE_NAME).is_file():
            self._check_inside(self.dir / SINGLE_NAME, str(self.dir / SINGLE_NAME))
            self.files = {k: self.dir / SINGLE_NAME for k in self._shard(self.dir / SINGLE_NAME).keys()}
        else:
            raise FileNotFoundError(
                f"{self.dir} has neither {INDEX_NAME} nor {SINGLE_NAME}: twinkle-specs reads safetensors "
                "checkpoints (convert .bin files with transformers' save_pretrained(safe_serialization=True))"
            )
        if index.is_file():
            self._check_shards_match(index)

    def _read_index(self, index: Path) -> dict[str, Path]:
        """``weight_map`` of the index, each shard a file of this directory."""
        try:
            weight_map = json.loads(index.read_text()).get("weight_map")
        except (ValueError, AttributeError) as err:  # bad JSON / encoding, or not a JSON object
            raise CheckpointError(f"{index} is not a safetensors index ({err})") from err
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
        ):
            raise CheckpointError(f"{index}: 'weight_map' must map each tensor name to a shard file name")
        files = {}
        for name, shard in weight_map.items():
            where = f"{index} maps tensor {name!r} to {shard!r}"
            if Path(shard).is_absolute() or ".." in Path(shard).parts:
                raise CheckpointError(f"{where}, outside {self.dir}; shards must be files of the checkpoint")
            path = self.dir / shard
            if not path.is_file():
                raise FileNotFoundError(f"{where}, which does not exist in {self.dir}")
            self._check_inside(path, where)
            files[name] = path
        return files

    def _check_inside(self, path: Path, where: str) -> None:
        """Refuses a shard whose symlinks lead out of the directory (the Hugging Face hub cache's
        ``snapshots/REV/x -> ../../blobs/SHA`` links are the one outside place allowed)."""
        real, root = path.resolve(), self.dir.resolve()
        hub_blob = root.parent.name == "snapshots" and real.parent == root.parent.parent / "blobs"
        if not (real.is_relative_to(root) or hub_blob):
            raise CheckpointError(f"{where}: a link to {real}, outside {self.dir}; refusing to read it")

    def _check_shards_match(self, index: Path) -> None:
        """Every shard holds exactly the tensors the index assigns it: nothing unlisted is ignored."""
        listed: dict[Path, set[str]] = {}
        for name, path in self.files.items():
            listed.setdefault(path, set()).add(name)
        held = {path: set(self._shard(path).keys()) for path in sorted(listed)}
        for path, names in listed.items():
            if wrong := sorted(names - held[path]):
                found = [p.name for p, keys in held.items() if wrong[0] in keys]
                raise CheckpointError(
                    f"{index} maps tensor {wrong[0]!r} to {path.name}, which does not hold it"
                    + (f" (it is in {found[0]})" if found else "")
                    + "; the index does not belong to these shards"
                )
            if unlisted := sorted(held[path] - names):
                raise CheckpointError(
                    f"{path} holds tensor(s) {unlisted[:8]}{' ...' if len(unlisted) > 8 else ''} that "
                    f"{index.name} does not list; refusing to ignore them (stale index or shard?)"
                )

    @staticmethod
    def _open(path: Path):
        try:
            return safe_open(str(path), framework="pt")
        except (SafetensorError, OSError) as err:
            raise CheckpointError(
                f"{path} cannot be read as safetensors ({err}): the file is truncated or corrupted"
            ) from err

    def _shard(self, path: Path):
        if path not in self._handles:
            self._handles[path] = self._open(path).__enter__()
        return self._handles[path]

    def _handle(self, name: str):
        return self._shard(self.files[name])

    def keys(self) -> set[str]:
        return set(self.files)

    def total_bytes(self) -> int:
        return sum(p.stat().st_size for p in set(self.files.values()))

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def dtype(self, name: str) -> str:
        """The safetensors dtype of ``name`` ("BF16", "F32", "I32", ...), from the header."""
        return self._handle(name).get_slice(name).get_dtype()

    def nbytes(self, name: str) -> int:
        """Size of tensor ``name`` in its stored dtype (from the header; nothing is read)."""
        sl = self._handle(name).get_slice(name)
        return int(torch.Size(sl.get_shape()).numel()) * _ITEMSIZE[sl.get_dtype()]

    def read(self, name: str, rows: tuple[int, int] | None, cols: tuple[int, int] | None) -> torch.Tensor:
        """Rows [r0, r1) or columns [c0, c1) of tensor ``name`` (or all of it)."""
        if name not in self.files:
            raise CheckpointError(f"tensor {name!r} is missing from the checkpoint in {self.dir}")
        sl = self._handle(name).get_slice(name)
        try:
            if rows is not None:
                t = sl[rows[0] : rows[1]]
            elif cols is not None:
                t = sl[:, cols[0] : cols[1]]
            else:
                t = sl[:]
        except (SafetensorError, RuntimeError, ValueError) as err:
            raise CheckpointError(
                f"reading {name!r} from {self.files[name]} failed ({err}); is it truncated?"
            ) from err
        # One reduction, ~20x cheaper than isfinite(t).all(): any NaN/inf makes the sum non-finite, and
        # a sum that only overflowed falls through to the exact check.
        if not self.allow_nonfinite and not torch.isfinite(t.sum()) and not torch.isfinite(t).all():
            raise CheckpointError(self._nonfinite(name))
        self.bytes_read += t.numel() * t.element_size()
        return t

    def _nonfinite(self, name: str) -> str:
        whole = self._handle(name).get_slice(name)[:]
        nan, inf = int(whole.isnan().sum()), int(whole.isinf().sum())
        return (
            f"{self.files[name]}: tensor {name!r} holds {nan} NaN and {inf} inf value(s) of {whole.numel()}: "
            f"a corrupt or diverged checkpoint (to load it anyway: {NONFINITE_OPT_OUT})"
        )

    def close(self) -> None:
        for h in self._handles.values():
            h.__exit__(None, None, None)
        self._handles.clear()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
