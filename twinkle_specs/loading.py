"""Fills this rank's shard of every megatron parameter from a Hugging Face safetensors checkpoint."""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .checkpoint import NONFINITE_ENV, CheckpointError, CheckpointReader
from .hf_config import qwen_arch_from_hf, read_config_json
from .left_alone import describe, left_alone
from .parallel import bindings, model_chunks, tp_info
from .weight_map import hf_tensor_shapes

log = logging.getLogger(__name__)


@dataclass
class LoadReport:
    """What one rank loaded: parameters filled, bytes read from disk, dtype conversions made."""

    parameters: int = 0
    bytes_read: int = 0
    checkpoint_bytes: int = 0
    conversions: Counter = field(default_factory=Counter)
    left_alone: Counter = field(default_factory=Counter)  # rule (name prefix) -> tensors it left alone

    def __str__(self) -> str:
        conv = ", ".join(f"{k}: {v}" for k, v in sorted(self.conversions.items())) or "none"
        text = (
            f"loaded {self.parameters} parameters, read {self.bytes_read / 2**20:.1f} MiB of a "
            f"{self.checkpoint_bytes / 2**20:.1f} MiB checkpoint; dtype conversions: {conv}"
        )
        if self.left_alone:
            text += f"; left alone by rule: {describe(self.left_alone)}"
        return text


# Safetensors dtypes a weight may have (each is cast to the parameter's dtype, and reported).
FLOAT_DTYPES = ("BF16", "F16", "F32", "F64")


def check_checkpoint(
    reader: CheckpointReader, expected: dict[str, tuple[int, ...]], left: Iterable[str] = ()
) -> None:
    """Strictness: every expected tensor present with its shape and a float dtype, and no tensor left
    unused except those a named rule leaves alone (``left``, see :mod:`.left_alone`)."""
    keys = reader.keys() - set(left)
    missing = sorted(set(expected) - keys)
    unused = sorted(keys - set(expected))
    if missing:
        raise CheckpointError(
            f"{reader.dir}: missing tensor(s) {missing[:8]}{' ...' if len(missing) > 8 else ''}"
        )
    if unused:
        raise CheckpointError(
            f"{reader.dir}: tensor(s) {unused[:8]}{' ...' if len(unused) > 8 else ''} are not used by this "
            "architecture per config.json; refusing to drop them silently (wrong config or checkpoint?)"
        )
    for name, shape in expected.items():
        actual = reader.shape(name)
        if actual != shape:
            raise CheckpointError(
                f"{reader.dir}: tensor {name!r} has shape {list(actual)}, config.json implies {list(shape)}"
            )
        if (dtype := reader.dtype(name)) not in FLOAT_DTYPES:
            raise CheckpointError(
                f"{reader.files[name]}: tensor {name!r} has dtype {dtype}; weights must be one of "
                f"{', '.join(FLOAT_DTYPES)} (a quantized or corrupted checkpoint?)"
            )


def load_hf_weights(model, hf_dir: str | Path, *, allow_nonfinite: bool | None = None) -> LoadReport:
    """Loads ``hf_dir`` into this rank's ``model`` (a GPTModel stage, wrapper or VPP list).

    Reads only the slices this rank owns; every base parameter must be covered, and the checkpoint
    must hold exactly the tensors its config.json implies, each a float. Values are cast to each
    parameter's dtype. A NaN/inf in a slice is an error unless ``allow_nonfinite`` (default: whether
    ``$TWINKLE_ALLOW_NONFINITE_WEIGHTS`` is 1, the launcher's and ``convert``'s ranks' switch).
    """
    if allow_nonfinite is None:
        allow_nonfinite = os.environ.get(NONFINITE_ENV) == "1"
    arch = qwen_arch_from_hf(hf_dir)
    report = LoadReport()
    with CheckpointReader(hf_dir, allow_nonfinite=allow_nonfinite) as reader:
        left = left_alone(reader.keys(), arch)
        check_checkpoint(reader, hf_tensor_shapes(arch), left)
        report.left_alone.update(left.values())
        report.checkpoint_bytes = reader.total_bytes()
        for binding, param in bindings(model, arch):
            info = tp_info(binding.expert)
            value = binding.layout.load(reader.read, binding.hf_names, info.rank, info.size)
            if tuple(value.shape) != tuple(param.shape):
                raise CheckpointError(
                    f"{binding.hf_names} give shape {list(value.shape)} for megatron parameter "
                    f"{binding.param_name!r} of shape {list(param.shape)} (TP rank {info.rank}/{info.size})"
                )
            if value.dtype != param.dtype:
                report.conversions[f"{value.dtype}->{param.dtype}".replace("torch.", "")] += 1
            with torch.no_grad():
                param.copy_(value.to(param.dtype))
            report.parameters += 1
        report.bytes_read = reader.bytes_read
    for chunk in model_chunks(model):
        chunk.hf_config = read_config_json(hf_dir)
        chunk.hf_source_dir = str(hf_dir)
    log.info("twinkle_specs: rank %s %s", _rank(), report)
    return report


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
