"""Reads a megatron-core ``torch_dist`` checkpoint without running code that its files carry.

A ``torch_dist`` checkpoint holds three kinds of pickle: torch's ``FileSystemReader.read_metadata``
unpickles ``.metadata`` with plain :mod:`pickle`, megatron's common strategy ``torch.load``s
``common.pt`` (weights-only only by torch's default), and torch's load planner reads every requested
``ShardedObject`` (e.g. a layer's ``_extra_state``) with ``torch.load(weights_only=False)``. Any of them
runs code from a crafted checkpoint. Here ``.metadata`` must pass an unpickler that resolves only the
classes torch's distributed checkpoint writes (and megatron then reads exactly the bytes checked),
``common.pt`` is read with ``weights_only=True`` explicitly, and ``ShardedObject``\\ s are never read:
the model keeps its own value."""

from __future__ import annotations

import contextlib
import functools
import inspect
import io
import pickle
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

METADATA_NAME = ".metadata"
COMMON_NAME = "common.pt"

# What torch's distributed checkpoint pickles into ``.metadata`` (torch 2.13 under megatron-core 0.16.1:
# found by unpickling conversions of a dense and a MoE model), plus every torch dtype and megatron's
# stand-ins for its older classes.
_DCP_CLASSES = {
    "torch.distributed.checkpoint.metadata": (
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    ),
    "torch.distributed.checkpoint.planner": ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData"),
    "torch.distributed.checkpoint.filesystem": ("_StorageInfo",),
    "torch.serialization": ("_get_layout",),  # torch.strided and the other layouts, by name
    "torch": ("Size",),
    # Empty stand-ins megatron keeps so that older saves (0.15's metadata, older save plans) unpickle.
    "megatron.core.dist_checkpointing.strategies.torch": ("MCoreMetadata", "MCoreSavePlan"),
}


class UnsafeCheckpointError(ValueError):
    """A checkpoint file asks to load something other than checkpoint metadata (or is not one)."""


@functools.cache
def _allowed() -> dict[tuple[str, str], Any]:
    import importlib

    allowed = {("torch", name): v for name, v in vars(torch).items() if isinstance(v, torch.dtype)}
    for module_name, names in _DCP_CLASSES.items():
        module = importlib.import_module(module_name)
        allowed |= {(module_name, n): getattr(module, n) for n in names if hasattr(module, n)}
    return allowed


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only the exact (module, name) pairs of :data:`_DCP_CLASSES` (no dotted lookups)."""

    def __init__(self, data: bytes, path: Path) -> None:
        super().__init__(io.BytesIO(data))
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        try:
            return _allowed()[(module, name)]
        except KeyError:
            raise UnsafeCheckpointError(
                f"{self.path}: refusing to unpickle {module}.{name}: a torch_dist checkpoint's metadata "
                "holds only torch.distributed.checkpoint classes, so this file was crafted or corrupted "
                "(do not load it with torch or megatron either)"
            ) from None


def read_metadata(ckpt_dir: str | Path):
    """The ``torch.distributed.checkpoint.Metadata`` of ``ckpt_dir``, unpickled without running code; its
    storage entries must name plain files of ``ckpt_dir`` (no ``../`` or absolute paths)."""
    path = Path(ckpt_dir) / METADATA_NAME
    return _parse_metadata(path.read_bytes(), path)


def _parse_metadata(data: bytes, path: Path):
    from megatron.core.dist_checkpointing.strategies.torch import MCoreMetadata
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        metadata = _MetadataUnpickler(data, path).load()
    except UnsafeCheckpointError:
        raise
    except Exception as err:  # noqa: BLE001 - a truncated/garbled pickle raises anything
        raise UnsafeCheckpointError(
            f"{path}: not a torch_dist metadata file ({type(err).__name__}: {err})"
        ) from err
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(metadata, (Metadata, MCoreMetadata)) or not isinstance(storage, dict):
        raise UnsafeCheckpointError(f"{path}: holds a {type(metadata).__name__}, not a torch_dist Metadata")
    for info in storage.values():
        rel = getattr(info, "relative_path", None)
        if not isinstance(info, _StorageInfo) or not _is_plain_name(rel):
            raise UnsafeCheckpointError(
                f"{path}: a storage entry points at {rel!r}, outside {path.parent}; refusing to read it"
            )
    return metadata


def _is_plain_name(rel: object) -> bool:
    return isinstance(rel, str) and rel not in ("", ".", "..") and Path(rel).name == rel


def read_common(ckpt_dir: str | Path) -> dict:
    """The common state (args, iteration, ...) without running code: ``common.pt`` (megatron-core 0.16's
    format) through ``torch.load(weights_only=True)`` (megatron-core registers the classes it stores
    there, argparse.Namespace and its enums, as safe globals); from 0.19 on, the ``common_state`` object
    inside the torch_dist files, which megatron-core reads with ``weights_only=True`` itself, from a
    staged copy whose ``.metadata`` passed :func:`read_metadata`'s checks."""
    import megatron.core  # noqa: F401 - registers megatron's safe globals with torch

    path = Path(ckpt_dir) / COMMON_NAME
    if not path.is_file():
        try:
            from megatron.core.dist_checkpointing.serialization import load_common_state_dict
        except ImportError:
            raise UnsafeCheckpointError(f"{path}: missing (every torch_dist checkpoint has one)") from None
        with _staged(ckpt_dir) as stage:
            try:
                return load_common_state_dict(str(stage))
            except Exception as err:  # noqa: BLE001 - a missing or garbled object raises anything
                raise UnsafeCheckpointError(
                    f"{ckpt_dir}: no common.pt and no readable common_state in the torch_dist files ({err})"
                ) from err
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UnsafeCheckpointError(
            f"{path}: refusing to load it: it holds objects other than plain values ({first})"
        ) from err


@contextlib.contextmanager
def _staged(ckpt_dir: str | Path) -> Iterator[Path]:
    """A temporary directory standing for ``ckpt_dir`` that torch and megatron read instead: ``.metadata``
    and ``common.pt`` as the bytes just checked (a file replaced meanwhile is never read), the tensor
    files as links."""
    ckpt_dir = Path(ckpt_dir)
    data = (ckpt_dir / METADATA_NAME).read_bytes()
    _parse_metadata(data, ckpt_dir / METADATA_NAME)
    with tempfile.TemporaryDirectory(prefix="twinkle-checkpoint-") as tmp:
        stage = Path(tmp)
        (stage / METADATA_NAME).write_bytes(data)
        common = ckpt_dir / COMMON_NAME
        if common.is_file():
            common_bytes = common.read_bytes()
            (stage / COMMON_NAME).write_bytes(common_bytes)
            read_common(stage)
        for path in ckpt_dir.iterdir():
            if path.name not in (METADATA_NAME, COMMON_NAME):
                (stage / path.name).symlink_to(path.absolute())
        yield stage


def _common_strategy():
    from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy

    class WeightsOnlyCommonLoadStrategy(TorchCommonLoadStrategy):
        """Megatron's common strategy with ``common.pt`` read by :func:`read_common`."""

        def load_common(self, checkpoint_dir: str | Path) -> dict:
            return read_common(checkpoint_dir)

    return WeightsOnlyCommonLoadStrategy()


def without_sharded_objects(sharded: dict) -> dict:
    """``sharded`` with every ``ShardedObject`` replaced by the model's own value: torch reads the
    objects with ``torch.load(weights_only=False)``, and none of them is a weight."""
    from megatron.core.dist_checkpointing import ShardedObject
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_outplace
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject

    return dict_list_map_outplace(
        lambda v: LocalNonpersistentObject(v.data) if isinstance(v, ShardedObject) else v, sharded
    )


def load_dist_checkpoint(sharded: dict, ckpt_dir: str | Path) -> dict:
    """``megatron.core.dist_checkpointing.load`` of the tensors of ``sharded``, with no pickle of the
    checkpoint read unchecked (see the module docstring)."""
    from megatron.core import dist_checkpointing

    # megatron-core 0.16 reads common.pt through a strategy (given ours); 0.19 with weights_only=True itself.
    takes_strategy = "common_strategy" in inspect.signature(dist_checkpointing.load).parameters
    extra = {"common_strategy": _common_strategy()} if takes_strategy else {}
    with _staged(ckpt_dir) as stage:
        return dist_checkpointing.load(without_sharded_objects(sharded), str(stage), **extra)
