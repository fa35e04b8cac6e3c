"""What every config.json reader shares (the dense Qwen families' in :mod:`.hf_config`, the hybrid ones' in
:mod:`.hybrid_config`): the architecture record, the refusal error, typed field access with transformers'
defaults, and the fields that fix the weights' shapes. Imports nothing of the package, so both readers
build on it without importing each other."""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class UnsupportedConfigError(ValueError):
    """The checkpoint's config.json asks for something twinkle-specs cannot reproduce exactly."""


# Fields a config.json must carry: they fix the weights' shapes, and transformers would fill them in
# from its config class (the sizes of a 7B model) without a word.
REQUIRED_FIELDS = (
    "num_hidden_layers",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "vocab_size",
    "max_position_embeddings",
)


MOE_REQUIRED_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size")


@dataclass(frozen=True)
class YarnRope:
    """YaRN in megatron-core's terms (its ``yarn_*`` config attributes / Megatron-LM >= 0.19 flags).

    ``attention_factor`` is transformers' cos/sin scale; ``mscale``/``mscale_all_dim`` are chosen so that
    megatron-core's concentration factor ``get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)``
    equals it.
    """

    field: str  # the config.json field it came from: rope_parameters or rope_scaling
    factor: float
    original_max_position_embeddings: int
    beta_fast: float
    beta_slow: float
    mscale: float
    mscale_all_dim: float
    correction_range_round_to_int: bool
    attention_factor: float


@dataclass(frozen=True)
class QwenArch:
    """The architecture facts of one Qwen checkpoint, in the units Megatron needs."""

    architecture: str
    family: str  # qwen2 | qwen3 | qwen3_moe | qwen2_moe
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    norm_epsilon: float
    vocab_size: int
    max_position_embeddings: int
    rotary_base: float
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_layernorm: bool
    attention_dropout: float
    init_method_std: float
    dtype: str | None
    num_experts: int | None = None
    moe_router_topk: int | None = None
    moe_ffn_hidden_size: int | None = None
    norm_topk_prob: bool = True
    shared_expert_intermediate_size: int | None = None
    moe_aux_loss_coeff: float = 0.0
    yarn: YarnRope | None = None
    hybrid: HybridArch | None = None  # Qwen3-Next / Qwen3.5: see hybrid_config

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

    @property
    def position_embedding_type(self) -> str:
        return "yarn" if self.yarn is not None else "rope"


def read_config_json(hf_dir: str | Path) -> dict[str, Any]:
    """Loads ``config.json`` from a checkpoint directory with an error that says what is missing."""
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: --hf-model must be a Hugging Face checkpoint directory holding config.json"
        )
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise UnsupportedConfigError(f"{path} is not valid JSON: {err}") from err


def _reject(path: str, field: str, value: Any, what: str) -> UnsupportedConfigError:
    return UnsupportedConfigError(f"{path}: {field}={value!r} is not supported ({what}).")


def require_fields(raw: dict[str, Any], fields: tuple[str, ...], where: str, arch: str) -> None:
    """One error listing every shape field ``raw`` lacks (absent or null), naming the file."""
    missing = [f for f in fields if raw.get(f) is None]
    if missing:
        raise UnsupportedConfigError(
            f"{where}: missing field(s) {missing}; {arch} needs them (they fix the weights' shapes). "
            "Use the config.json saved with the weights."
        )


@dataclass(frozen=True)
class ConfigFields:
    """Typed reads of one config's fields, each bad value an error naming the file and the field.

    A field config.json leaves out takes ``defaults`` (transformers' config class defaults, see
    :func:`transformers_defaults`); a null one takes the caller's ``default``."""

    raw: dict[str, Any]
    where: str
    defaults: dict[str, Any]

    def get(self, field: str, default: Any = None) -> Any:
        value = self.raw[field] if field in self.raw else self.defaults.get(field)
        return default if value is None else value

    def count(self, field: str, default: Any = None, minimum: int = 1) -> int:
        """A whole number >= ``minimum`` (2.7, "4", true, 0 layers are errors)."""
        return _integer(self.get(field, default), self.where, field, minimum)

    def real(self, field: str, low: float = 0.0, positive: bool = False) -> float:
        value = _number(self.get(field), self.where, field)
        if value is None or value < low or (positive and value == low):
            raise _reject(self.where, field, value, f"must be a number {'>' if positive else '>='} {low}")
        return float(value)

    def flag(self, field: str, default: bool = False) -> bool:
        value = self.get(field, default)
        if not isinstance(value, bool):
            raise _reject(self.where, field, value, "must be true or false")
        return value


@functools.cache
def transformers_defaults(model_type: str) -> dict[str, Any]:
    """What transformers uses for a field config.json leaves out: the defaults of the model type's own
    config class, and its ``default_theta`` as ``rope_theta``."""
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    defaults = {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}
    return defaults | {"rope_theta": cls.default_theta}


def _integer(value: Any, where: str, name: str, minimum: int = 1) -> int:
    """``value`` if it is a whole number >= ``minimum`` (2.7, "4", 0 layers are errors naming the field)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _reject(where, name, value, f"must be an integer >= {minimum}")
    return value


def _number(value: Any, where: str, name: str) -> Any:
    """``value`` if it is a number or None, else an error naming the field."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise _reject(where, name, value, "must be a number")
    return value


@dataclass(frozen=True)
class HybridArch:
    """What the hybrid Qwen models add to :class:`QwenArch`."""

    layer_types: tuple[str, ...]  # per layer: linear_attention | full_attention
    conv_kernel: int
    key_head_dim: int
    value_head_dim: int
    num_key_heads: int
    num_value_heads: int
    rotary_percent: float
    fused_projections: bool  # Qwen3-Next: in_proj_qkvz / in_proj_ba grouped per key head
    text_prefix: str  # "model." or "model.language_model." (multimodal checkpoints)
    multimodal: bool

    @property
    def linear_attention_pattern(self) -> list[int]:
        """megatron-core's ``linear_attention_freq`` list: 1 = Gated DeltaNet, 0 = full attention."""
        return [int(t == "linear_attention") for t in self.layer_types]
