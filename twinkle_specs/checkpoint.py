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


class CheckpointError(ValueError):
    """The checkpoint's files do not hold what its config says they should."""


class CheckpointReader:
    """Reads only the requested rows/columns of each tensor (``safe_open(...).get_slice``).

    ``bytes_read`` counts the bytes of every slice handed out, so callers can report per-rank I/O.
    """

    def __init__(self, hf_dir: str | Path) -> None:
        self.dir = Path(hf_dir)
        index = self.dir / INDEX_NAME
        if index.is_file():
            self.files = {k: self.dir / v for k, v in json.loads(index.read_text())["weight_map"].items()}
        elif (self.dir / SINGLE_NAME).is_file():
            with self._open(self.dir / SINGLE_NAME) as f:
                self.files = {k: self.dir / SINGLE_NAME for k in f.keys()}
        else:
            raise FileNotFoundError(
                f"{self.dir} has neither {INDEX_NAME} nor {SINGLE_NAME}: twinkle-specs reads safetensors "
                "checkpoints (convert .bin files with transformers' save_pretrained(safe_serialization=True))"
            )
        for path in set(self.files.values()):
            if not path.is_file():
                raise FileNotFoundError(f"{index} lists {path.name}, which does not exist in {self.dir}")
        self._handles: dict[Path, object] = {}
        self.bytes_read = 0

    @staticmethod
    def _open(path: Path):
        try:
            return safe_open(str(path), framework="pt")
        except (SafetensorError, OSError) as err:
            raise CheckpointError(f"{path} cannot be read as safetensors ({err}); is it truncated?") from err

    def _handle(self, name: str):
        path = self.files[name]
        if path not in self._handles:
            self._handles[path] = self._open(path).__enter__()
        return self._handles[path]

    def keys(self) -> set[str]:
        return set(self.files)

    def total_bytes(self) -> int:
        return sum(p.stat().st_size for p in set(self.files.values()))

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

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
        self.bytes_read += t.numel() * t.element_size()
        return t

    def close(self) -> None:
        for h in self._handles.values():
            h.__exit__(None, None, None)
        self._handles.clear()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
