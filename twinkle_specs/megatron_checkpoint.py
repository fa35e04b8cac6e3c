"""Hugging Face <-> Megatron-LM ``torch_dist`` checkpoints, offline (``twinkle-specs convert/export``).

``convert`` writes a *release* checkpoint that stock ``pretrain_gpt.py --load CKPT`` reads:
``CKPT/latest_checkpointed_iteration.txt`` says ``release``, ``CKPT/release/`` holds a megatron-core
``dist_checkpointing`` save of ``{"model": GPTModel.sharded_state_dict(), "args", "checkpoint_version":
3.0, "iteration": 0}`` -- the keys and common state that ``megatron.training.checkpointing.
load_checkpoint`` (core_v0.16.1 and core_v0.19.0) reads. A release checkpoint never restores optimizer,
RNG or iteration, so it is a starting point (``--finetune`` is optional). Every rank of a TP x PP x EP
layout is built with :func:`twinkle_specs.model.build_model` (strict HF load) and saves its own shards;
the ranks are spawned here on gloo, on the host, so no GPU and no ``torchrun`` is needed.

``export`` reads a ``torch_dist`` checkpoint (from ``convert`` or from ``pretrain_gpt`` through the
launcher) back into one TP=1/PP=1/EP=1 model in this process -- ``torch_dist`` reshards on load, so the
training layout does not matter and no process group of the training size is needed -- and writes HF
safetensors, a PEFT adapter, or merged weights.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .config_mapping import flag_values, megatron_args_from_hf
from .hf_config import qwen_arch_from_hf
from .output_dir import check_target, staged_output
from .te_extra_state import TEExtraState

TRACKER = "latest_checkpointed_iteration.txt"
RELEASE = "release"
CHECKPOINT_VERSION = 3.0
# What Megatron-LM's save_checkpoint stores as content metadata (it shapes sharded_state_dict()).
CONTENT_METADATA = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_CONFIG_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


class MegatronCheckpointError(ValueError):
    """A Megatron checkpoint, or the request to write/read one, cannot be honoured."""


# ----------------------------------------------------------------------------------------------- layout


@dataclass(frozen=True)
class Layout:
    """The parallel layout a checkpoint is written at; any other layout can load it."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1

    @property
    def world_size(self) -> int:
        """Smallest world for this layout: each PP stage holds a multiple of TP and of EP x ETP ranks."""
        return self.pp * math.lcm(self.tp, self.ep * self.etp)


def check_layout(hf_dir: str | Path, layout: Layout) -> None:
    """Every divisibility Megatron requires, checked before any rank starts, naming flag and field."""
    arch = qwen_arch_from_hf(hf_dir)
    config = Path(hf_dir) / "config.json"
    for flag, value in (("--tp", layout.tp), ("--pp", layout.pp), ("--ep", layout.ep), ("--etp", layout.etp)):
        if value < 1:
            raise MegatronCheckpointError(f"{flag} {value}: must be >= 1")
    for field, value in (
        ("num_attention_heads", arch.num_attention_heads),
        ("num_key_value_heads", arch.num_query_groups),
    ):
        if value % layout.tp:
            raise MegatronCheckpointError(
                f"--tp {layout.tp} does not divide {field}={value} of {config}; pick a TP size that divides "
                f"both the attention heads ({arch.num_attention_heads}) and KV heads ({arch.num_query_groups})"
            )
    if arch.num_layers % layout.pp:
        raise MegatronCheckpointError(
            f"--pp {layout.pp} does not divide num_hidden_layers={arch.num_layers} of {config}"
        )
    if not arch.is_moe and (layout.ep > 1 or layout.etp > 1):
        raise MegatronCheckpointError(f"--ep/--etp need a mixture-of-experts model; {config} is dense")
    if arch.is_moe and arch.num_experts % layout.ep:
        raise MegatronCheckpointError(
            f"--ep {layout.ep} does not divide num_experts={arch.num_experts} of {config}"
        )


def checkpoint_args(hf_dir: str | Path, layout: Layout, precision: str) -> argparse.Namespace:
    """The ``args`` Megatron-LM stores in a checkpoint, as far as loading one reads them.

    ``load_checkpoint`` compares num_layers/hidden_size/num_attention_heads/add_position_embedding
    without ``--finetune``, reads the parallel sizes, and ``--use-checkpoint-args`` copies the model
    flags; all of them come from the same ``megatron_args_from_hf`` flags ``twinkle-specs args`` prints.
    Only plain values, so ``torch.load(weights_only=True)`` reads it.
    """
    ns: dict[str, Any] = {"add_position_embedding": True, "add_bias_linear": True}
    for flag, values in flag_values(megatron_args_from_hf(hf_dir)).items():
        if flag == "--disable-bias-linear":
            ns["add_bias_linear"] = False
            continue
        name = flag[2:].replace("-", "_")
        ns[name] = True if not values else (values if len(values) > 1 else _scalar(values[0]))
    arch = qwen_arch_from_hf(hf_dir)
    from .model import padded_vocab_size

    ns.update(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
        virtual_pipeline_model_parallel_size=None,
        world_size=layout.world_size,
        data_parallel_size=layout.world_size // (layout.tp * layout.pp),
        ckpt_format="torch_dist",
        use_dist_ckpt=True,
        padded_vocab_size=padded_vocab_size(arch.vocab_size, layout.tp),
        bf16=precision == "bf16",
        fp16=precision == "fp16",
        iteration=0,
        consumed_train_samples=0,
        consumed_valid_samples=0,
        skipped_train_samples=0,
        no_save_optim=True,
        no_save_rng=True,
        hf_model=str(Path(hf_dir).resolve()),
        lora_rank=0,
    )
    return argparse.Namespace(**ns)


def _scalar(text: str) -> int | float | str:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


# ---------------------------------------------------------------------------------------------- convert


def _refuse_training_dir(save: Path) -> None:
    """A tracker naming an iteration marks a training run's ``--save``: convert must never turn it into
    ``release`` (a later ``--load`` would silently restart from the HF weights)."""
    tracker = save / TRACKER
    text = tracker.read_text().strip() if tracker.is_file() else RELEASE
    if text != RELEASE:
        raise MegatronCheckpointError(
            f"--save {save}: is a training run's checkpoint directory ({TRACKER} names iteration {text!r}); "
            "convert writes a release checkpoint: choose a new --save directory"
        )


def _run_ranks(
    world: int, env: dict[str, str], logs: Path, timeout: float | None
) -> tuple[list[str], list[int | None]]:
    """Runs the ``convert`` ranks; returns each one's output and exit code (None: stopped here).

    Output goes to files, not pipes: a rank blocked on a full pipe that nobody reads would stall the
    collective save of every other rank. The first rank to fail stops the others (they would wait for it
    in a collective until gloo's timeout)."""
    procs, files = [], []
    for rank in range(world):
        log = open(logs / f"rank-{rank}.log", "wb")  # noqa: SIM115 - closed below
        files.append(log)
        procs.append(
            subprocess.Popen(
                # -c, not -m: dist_checkpointing's writer starts a "spawn" multiprocessing Manager,
                # which re-imports a -m/-file __main__ (seconds of megatron imports per rank).
                [sys.executable, "-c", "from twinkle_specs.megatron_checkpoint import main; main()"],
                env=env | {"RANK": str(rank), "LOCAL_RANK": str(rank)},
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        )
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while True:
            codes = [p.poll() for p in procs]
            if all(code is not None for code in codes) or any(codes):
                break
            if deadline is not None and time.monotonic() > deadline:
                raise MegatronCheckpointError(f"convert: ranks did not finish within {timeout}s")
            time.sleep(0.1)
    finally:
        stopped = [p.poll() is None for p in procs]
        for p, stop in zip(procs, stopped, strict=True):
            if stop:
                p.kill()
            p.wait()
        for log in files:
            log.close()
    outputs = [(logs / f"rank-{r}.log").read_text(errors="replace") for r in range(world)]
    return outputs, [None if stop else p.returncode for p, stop in zip(procs, stopped, strict=True)]


def convert(
    hf_dir: str | Path,
    save: str | Path,
    layout: Layout = Layout(),
    *,
    precision: str | None = None,
    force: bool = False,
    timeout: float | None = None,
) -> Path:
    """Writes ``hf_dir`` as a Megatron-LM ``torch_dist`` release checkpoint in ``save``; returns its
    iteration directory. Spawns ``layout.world_size`` ranks (gloo, host memory)."""
    hf_dir, save = Path(hf_dir), Path(save)
    if not (hf_dir / "config.json").is_file():
        raise MegatronCheckpointError(f"--hf-model {hf_dir}: no config.json (a Hugging Face checkpoint dir?)")
    check_layout(hf_dir, layout)
    arch = qwen_arch_from_hf(hf_dir)
    precision = precision or _CONFIG_DTYPES.get(arch.dtype or "", "fp32")
    if precision not in _DTYPES:
        raise MegatronCheckpointError(f"precision {precision!r}: use --bf16, --fp16 or --fp32")
    _refuse_training_dir(save)
    # The previous conversion stays in place until the new one is complete (output_dir).
    with staged_output(
        save,
        sources={"--hf-model": hf_dir},
        overwrite=force,
        flag="--save",
        force_hint="pass --force",
        replaceable=(TRACKER, RELEASE),
        error=MegatronCheckpointError,
    ) as staging:
        (staging / RELEASE).mkdir()
        _run_convert_ranks(hf_dir, staging / RELEASE, layout, precision, timeout)
        (staging / TRACKER).write_text(RELEASE)
    return save / RELEASE


def _run_convert_ranks(
    hf_dir: Path, release: Path, layout: Layout, precision: str, timeout: float | None
) -> None:
    """Spawns the ranks that write ``release``; raises naming the first failure."""
    job = {
        "hf": str(hf_dir.resolve()),
        "save": str(release),
        "layout": dataclasses.asdict(layout),
        "precision": precision,
        "args": vars(checkpoint_args(hf_dir, layout, precision)),
    }
    world = layout.world_size
    with tempfile.TemporaryDirectory(prefix="twinkle-convert-") as tmp:
        job["errors"] = tmp
        # The ranks meet through a file, not a TCP port: a port picked free here could be taken by another
        # program before rank 0 listens on it (seen with several jobs starting on one machine).
        job["rendezvous"] = f"file://{Path(tmp) / 'rendezvous'}"
        env = dict(
            os.environ,
            WORLD_SIZE=str(world),
            CUDA_VISIBLE_DEVICES="",
            OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
            TWINKLE_CONVERT_JOB=json.dumps(job),
        )
        outputs, codes = _run_ranks(world, env, Path(tmp), timeout)
        errors = sorted(Path(tmp).glob("error-*.txt"))
        if errors:
            raise MegatronCheckpointError(f"convert failed: {errors[0].read_text().strip()}")
        failed = [r for r, code in enumerate(codes) if code]
        if failed:
            raise MegatronCheckpointError(
                f"convert: rank {failed[0]} exited with {codes[failed[0]]}:\n{outputs[failed[0]][-4000:]}"
            )


# Modules that are Transformer Engine modules in the TE spec, by their name in the model. A TE module has an
# ``_extra_state`` (its FP8 metadata: an empty uint8 tensor without FP8) that a TE model asks for on load;
# the input norms are fused into linear_qkv / dense linear_fc1 there (no module of their own), while the
# MoE layer's pre_mlp_layernorm is a TENorm.
TE_MODULE_NAMES = frozenset(
    {"linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "core_attention", "q_layernorm", "k_layernorm"}
)
_EXTRA_STATE_CLASSES: dict[type, type] = {}


def give_te_extra_state(model: torch.nn.Module) -> None:
    """Gives the portable modules that stand for TE modules TE's (empty, non-FP8) ``_extra_state``, so the
    checkpoint holds every key a Transformer Engine model of the same checkpoint loads -- stock
    ``load_checkpoint`` at its default strictness fails on a key the model asks for and the file lacks."""
    from megatron.core.transformer.identity_op import IdentityOp

    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        wanted = leaf in TE_MODULE_NAMES or leaf == "final_layernorm"
        if leaf == "pre_mlp_layernorm":
            wanted = _is_moe_layer(model, name)
        if not wanted or isinstance(module, IdentityOp):
            continue
        cls = type(module)
        if cls not in _EXTRA_STATE_CLASSES:
            _EXTRA_STATE_CLASSES[cls] = type(
                cls.__name__, (TEExtraState, cls), {"__module__": cls.__module__}
            )
        module.__class__ = _EXTRA_STATE_CLASSES[cls]


def _is_moe_layer(model: torch.nn.Module, norm_name: str) -> bool:
    from megatron.core.transformer.moe.moe_layer import MoELayer

    layer = model.get_submodule(norm_name.rsplit(".", 1)[0])
    return isinstance(getattr(layer, "mlp", None), MoELayer)


def _convert_rank(job: dict) -> None:
    """One rank of ``convert``: build + strict HF load of this rank's shards, then a collective save."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    from .model import build_model

    layout = Layout(**job["layout"])
    dist.init_process_group(
        "gloo",
        init_method=job["rendezvous"],
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
    )
    try:
        ps.initialize_model_parallel(
            layout.tp,
            layout.pp,
            expert_model_parallel_size=layout.ep,
            expert_tensor_parallel_size=layout.etp,
        )
        model = build_model(job["hf"], params_dtype=_DTYPES[job["precision"]])
        give_te_extra_state(model)
        metadata = dict(CONTENT_METADATA, dp_cp_group=ps.get_data_parallel_group(with_context_parallel=True))
        state = {
            "model": model.sharded_state_dict(metadata=metadata),
            "args": argparse.Namespace(**job["args"]),
            "checkpoint_version": CHECKPOINT_VERSION,
            "iteration": 0,
            "num_floating_point_operations_so_far": 0,
        }
        dist_checkpointing.save(state, job["save"], content_metadata=dict(CONTENT_METADATA))
        dist.barrier()
    finally:
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------- export


@dataclass(frozen=True)
class CheckpointInfo:
    """A resolved ``torch_dist`` iteration directory and what its common state says."""

    dir: Path
    iteration: int | None  # None for a release checkpoint
    common: dict
    tensors: dict  # ShardedTensor key -> ShardedTensor (global shape, dtype), from the metadata

    @property
    def args(self) -> argparse.Namespace | None:
        return self.common.get("args")

    def model_keys(self) -> set[str]:
        """Tensor keys of the model (not optimizer state, not TE/objects)."""
        return {k for k in self.tensors if not k.startswith("optimizer.")}


def resolve_checkpoint(load: str | Path, iteration: int | None = None) -> CheckpointInfo:
    """Finds the iteration directory of ``load`` as Megatron-LM does (tracker file, ``--iteration``)."""
    from megatron.core import dist_checkpointing

    load = Path(load)
    if not load.is_dir():
        raise MegatronCheckpointError(f"--load {load}: no such directory")
    tracker = load / TRACKER
    if iteration is not None:
        ckpt = load / f"iter_{iteration:07d}"
    elif dist_checkpointing.check_is_distributed_checkpoint(str(load)):
        ckpt = load  # an iteration directory given directly
    elif not tracker.is_file():
        raise MegatronCheckpointError(
            f"--load {load}: no {TRACKER} (the tracker Megatron-LM writes next to iter_*/ or release/); "
            "pass --iteration N or the iteration directory itself"
        )
    else:
        text = tracker.read_text().strip()
        if text == RELEASE:
            ckpt = load / RELEASE
        elif text.isdigit():
            iteration = int(text)
            ckpt = load / f"iter_{iteration:07d}"
        else:
            raise MegatronCheckpointError(
                f"{tracker}: holds {text!r}, expected an iteration number or 'release'"
            )
    if not ckpt.is_dir():
        raise MegatronCheckpointError(f"--load {load}: {ckpt.name}/ does not exist")
    if not dist_checkpointing.check_is_distributed_checkpoint(str(ckpt)):
        legacy = any(p.name.startswith("mp_rank_") for p in ckpt.iterdir())
        raise MegatronCheckpointError(
            f"{ckpt}: not a torch_dist checkpoint (no metadata.json)"
            + (
                "; it is the legacy per-rank 'torch' format: re-save it with --ckpt-format torch_dist"
                if legacy
                else ""
            )
        )
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy

    from .safe_load import UnsafeCheckpointError, read_common, read_metadata

    try:
        metadata = read_metadata(ckpt)  # no code from the checkpoint runs: see safe_load
        common = read_common(ckpt)
        tensors = TorchDistLoadShardedStrategy().load_tensors_metadata(ckpt, metadata)
    except UnsafeCheckpointError as err:
        raise MegatronCheckpointError(str(err)) from err
    except Exception as err:  # noqa: BLE001 - any reader failure means the same thing to the user
        raise MegatronCheckpointError(f"{ckpt}: cannot read the checkpoint metadata ({err})") from err
    return CheckpointInfo(ckpt, iteration, common, dict(tensors))


def lora_from_checkpoint(info: CheckpointInfo, overrides: dict[str, Any]):
    """The LoraConfig the launcher trained with (its ``--lora-*`` flags are in the saved args);
    ``overrides`` (export's own ``--lora-*`` flags) fill in or replace them."""
    from .lora import LoraConfig

    args = info.args
    saved = {k: getattr(args, k) for k in vars(args)} if args is not None else {}
    get = {**saved, **{k: v for k, v in overrides.items() if v is not None}}
    rank = get.get("lora_rank")
    if not rank:
        raise MegatronCheckpointError(
            f"{info.dir}: holds LoRA factors only, but its saved args have no lora_rank "
            f"(saved by something other than twinkle_specs.launch?); pass --lora-rank R, and --lora-alpha A "
            "--lora-target T if they were not the defaults (alpha 2*R, all-linear)"
        )
    targets = get.get("lora_target") or "all-linear"
    alpha = get.get("lora_alpha")
    return LoraConfig(
        r=int(rank),
        lora_alpha=float(alpha) if alpha is not None else 2.0 * int(rank),
        lora_dropout=float(get.get("lora_dropout") or 0.0),
        target_modules=tuple(t.strip() for t in str(targets).split(",") if t.strip()),
        use_rslora=bool(get.get("lora_rslora") or False),
    )


def _sharded_tensors(sharded: dict) -> dict:
    """Key -> ShardedTensor of a sharded state dict, factories (e.g. the fused SwiGLU fc1) expanded;
    ``sharded`` is consumed (build a fresh one for the actual load)."""
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import apply_factories

    apply_factories(sharded)
    return {v.key: v for v in nested_values(sharded) if isinstance(v, ShardedTensor)}


def check_against_model(info: CheckpointInfo, wanted: dict, hf_dir: Path, adapters_only: bool) -> None:
    """Every tensor the model needs is in the checkpoint with its global shape, and (for a full
    checkpoint) every model tensor of the checkpoint is used: names the first mismatches."""
    from .parallel import is_adapter_param

    have = info.tensors
    missing = sorted(k for k in wanted if k not in have)
    if missing:
        raise MegatronCheckpointError(
            f"{info.dir}: tensor(s) {missing[:6]}{' ...' if len(missing) > 6 else ''} that a model of "
            f"--hf-model {hf_dir} needs are not in the checkpoint (another model, or other LoRA targets?)"
        )
    for key, st in wanted.items():
        theirs, ours = tuple(have[key].global_shape), tuple(st.global_shape)
        vocab = getattr(st, "allow_shape_mismatch", False)  # embedding/output: padding may differ
        if theirs != ours and not (vocab and theirs[1:] == ours[1:]):
            raise MegatronCheckpointError(
                f"{info.dir}: tensor {key!r} has shape {list(theirs)}, a model of --hf-model {hf_dir} has "
                f"{list(ours)} (another model or LoRA rank?)"
            )
    # An adapter-only model asks for the factors only; the base then comes from the HF checkpoint.
    unused = info.model_keys() - set(wanted)
    extra = sorted(k for k in unused if not adapters_only or is_adapter_param(k))
    if extra:
        raise MegatronCheckpointError(
            f"{info.dir}: tensor(s) {extra[:6]}{' ...' if len(extra) > 6 else ''} match nothing in a model "
            f"of --hf-model {hf_dir}; refusing to drop them (wrong --hf-model or LoRA flags?)"
        )


def export(
    load: str | Path,
    hf_model: str | Path,
    out: str | Path,
    *,
    iteration: int | None = None,
    mode: str | None = None,
    dtype: torch.dtype | None = None,
    lora_overrides: dict[str, Any] | None = None,
    force: bool = False,
    expert_layout: str = "fused",
) -> str:
    """Writes a ``torch_dist`` checkpoint as HF weights (``mode`` "full"), a PEFT adapter ("peft", the
    default for adapter-only LoRA checkpoints) or merged weights ("merged"). Returns the mode used.

    Runs in this process at TP=1/PP=1/EP=1 (``torch_dist`` reshards on load), so it needs the model's
    size in host memory. Adapter-only checkpoints take their base weights from ``hf_model``.
    """
    from .export import HF_OUTPUTS, save_hf_weights
    from .lora import export_peft_adapter, merge_lora
    from .lora.checkpoint import adapters_only
    from .lora.peft_io import PEFT_OUTPUTS
    from .model import build_model
    from .parallel import is_adapter_param
    from .parity import _init_single_process
    from .safe_load import load_dist_checkpoint

    hf_model, out = Path(hf_model), Path(out)
    # Refused before anything is read or written; checked again when the output is staged.
    target = dict(
        sources={"--hf-model": hf_model, "--load": load},
        overwrite=force,
        flag="--out",
        force_hint="pass --force",
        replaceable=HF_OUTPUTS + PEFT_OUTPUTS,
        error=MegatronCheckpointError,
    )
    check_target(out, **target)
    if not (hf_model / "config.json").is_file():
        raise MegatronCheckpointError(f"--hf-model {hf_model}: no config.json (the HF base checkpoint dir)")
    info = resolve_checkpoint(load, iteration)
    keys = info.model_keys()
    if not keys:
        raise MegatronCheckpointError(f"{info.dir}: holds no model tensors")
    adapter_keys = {k for k in keys if is_adapter_param(k)}
    is_adapter_only = keys == adapter_keys
    is_lora = bool(adapter_keys)
    if mode is None:
        mode = "peft" if is_lora else "full"
    if mode in ("peft", "merged") and not is_lora:
        raise MegatronCheckpointError(
            f"{info.dir}: has no LoRA factors; --{mode} needs a LoRA checkpoint (drop the flag for full weights)"
        )
    if mode == "full" and is_lora:
        raise MegatronCheckpointError(
            f"{info.dir}: is a LoRA checkpoint; export it with --peft (adapter) or --merged (full weights)"
        )
    if expert_layout != "fused" and mode != "peft":
        raise MegatronCheckpointError(
            f"--expert-layout {expert_layout} lays out a PEFT adapter's routed experts; this export writes "
            f"{mode} weights (drop --expert-layout, or export the LoRA checkpoint with --peft)"
        )
    lora = lora_from_checkpoint(info, lora_overrides or {}) if is_lora else None
    ckpt_dtype = next(iter(info.tensors[k].dtype for k in sorted(keys)))

    _init_single_process()
    model = build_model(hf_model, load_weights=is_adapter_only, lora=lora, params_dtype=ckpt_dtype).eval()

    def requested() -> dict:
        sharded = model.sharded_state_dict()
        return adapters_only(sharded) if is_adapter_only else sharded

    check_against_model(info, _sharded_tensors(requested()), hf_model, is_adapter_only)
    sharded = requested()
    # Megatron nests the model under "model" (VPP: "model0".. with the same tensor keys); the common
    # state (args, iteration, ...) comes back beside it.
    loaded = load_dist_checkpoint({"model": sharded}, info.dir)["model"]
    if is_adapter_only:
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, value in loaded.items():
                params[name].copy_(value)
    else:
        model.load_state_dict(loaded, strict=True)

    with staged_output(out, **target) as staging:
        if mode == "peft":
            export_peft_adapter(
                model, staging, base_model_name_or_path=str(hf_model), expert_layout=expert_layout
            )
        else:
            if mode == "merged":
                merge_lora(model)
            save_hf_weights(model, staging, hf_dir=hf_model, dtype=dtype)
    return mode


def main() -> None:
    """Entry of a spawned ``convert`` rank (its job description is in $TWINKLE_CONVERT_JOB)."""
    job = json.loads(os.environ["TWINKLE_CONVERT_JOB"])
    try:
        _convert_rank(job)
    except Exception as err:
        rank = os.environ.get("RANK", "?")
        Path(job["errors"], f"error-{rank}.txt").write_text(f"rank {rank}: {type(err).__name__}: {err}")
        raise


if __name__ == "__main__":
    main()
