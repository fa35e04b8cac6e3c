"""Run stock Megatron-LM ``pretrain_gpt.py`` on a Hugging Face Qwen checkpoint, full-parameter or LoRA.

    torchrun ... -m twinkle_specs.launch <Megatron-LM>/pretrain_gpt.py --hf-model DIR \\
        [--lora-rank 16 --lora-alpha 32 --lora-target all-linear] [--hf-export OUT] <Megatron flags>

The script runs unmodified (``runpy``). Before it starts, this module
1. turns the checkpoint's config.json into Megatron flags (user flags win where they may; a flag that
   contradicts the checkpoint's architecture is an error naming both), adds ``--spec twinkle_specs
   qwen_layer_spec`` and the HuggingFaceTokenizer flags;
2. registers its own flags with Megatron's parser by composing with the script's
   ``extra_args_provider`` (they show in ``--help`` and in the logged arguments), and once Megatron
   has parsed, compares every architecture field of its args with the checkpoint's
   (:func:`check_architecture`), so that flags the checkpoint never prints (``--rotary-interleaved``,
   ``--num-experts`` on a dense model) cannot change the model either;
3. hooks GPTModel construction: the LoRA config is attached to the layer config before the layers are
   built, the embedding is sized to the checkpoint's vocabulary, HF weights load right after
   construction (before Float16/DDP wrapping and the optimizer), and with LoRA the base is frozen and
   ``sharded_state_dict`` holds only the adapters, so ``--save``/``--load`` write and resume
   adapter-only checkpoints on top of the HF base;
4. exports to ``--hf-export`` after training (a PEFT adapter, or full/merged HF weights), or with
   ``--hf-export-on-save`` at every checkpoint save to ``--hf-export``/``iter_N``; the target is checked
   before training starts (:mod:`twinkle_specs.output_dir`).
"""

from __future__ import annotations

import argparse
import functools
import inspect
import math
import os
import runpy
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

import torch

from .cli import add_expert_layout_flag
from .config_mapping import architecture_settings, flag_values, installed_megatron_core, megatron_args_from_hf
from .hf_config import qwen_arch_from_hf

# Checkpoint-derived flags a user may override (precision, regularisation, padding, aux loss).
OVERRIDABLE = {
    "--bf16",
    "--fp16",
    "--attention-dropout",
    "--hidden-dropout",
    "--init-method-std",
    "--make-vocab-size-divisible-by",
    "--moe-aux-loss-coeff",
    "--moe-router-load-balancing-type",
    "--max-position-embeddings",
}
EXCLUSIVE = {"--bf16": "--fp16", "--fp16": "--bf16"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


class LaunchError(ValueError):
    """The command line cannot describe a run of this checkpoint."""


def _lora_rank(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(
            f"{text!r}: use a positive whole number (the LoRA rank), or 0 for none"
        )
    return value


def _lora_alpha(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value > 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"{text!r}: use a positive number (default: 2 * --lora-rank)")
    return value


def _lora_dropout(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"{text!r}: use a probability in [0, 1), e.g. 0.05")
    return value


def _lora_target(text: str) -> str:
    from .lora.config import HF_MODULES, MEGATRON_MODULES

    names = [t.strip() for t in text.split(",") if t.strip()]
    allowed = ("all-linear", *HF_MODULES, *MEGATRON_MODULES)
    unknown = [t for t in names if t not in allowed]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"{text!r}: {'unknown ' + ', '.join(map(repr, unknown)) if unknown else 'no module named'}; use "
            f"comma-separated names from {', '.join(allowed)}"
        )
    return text


def add_twinkle_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """twinkle-specs' flags, registered in Megatron's own parser."""
    g = parser.add_argument_group("twinkle-specs (Hugging Face Qwen)")
    g.add_argument(
        "--hf-model", type=str, default=None, help="Hugging Face Qwen checkpoint directory to start from"
    )
    g.add_argument("--lora-rank", type=_lora_rank, default=0, help="LoRA rank r; 0 trains every parameter")
    g.add_argument("--lora-alpha", type=_lora_alpha, default=None, help="LoRA alpha (default: 2 * rank)")
    g.add_argument(
        "--lora-dropout", type=_lora_dropout, default=0.0, help="LoRA dropout on the adapter input"
    )
    g.add_argument(
        "--lora-target",
        type=_lora_target,
        default="all-linear",
        help="comma-separated HF (q_proj,...,down_proj) or Megatron (linear_qkv,...) names, or all-linear",
    )
    g.add_argument("--lora-rslora", action="store_true", help="scale by alpha/sqrt(r) (rsLoRA)")
    g.add_argument(
        "--flash-attn-4",
        action="store_true",
        help="attention on FlashAttention-4 instead of Transformer Engine's cuDNN attention (causal rows, "
        "and the packed rows of --sft on its varlen kernels); needs the flash-attn-4 extra",
    )
    g.add_argument(
        "--hf-export", type=str, default=None, help="write an HF checkpoint/PEFT adapter here at the end"
    )
    g.add_argument(
        "--hf-export-merged",
        action="store_true",
        help="with LoRA: export merged full weights instead of a PEFT adapter",
    )
    g.add_argument(
        "--hf-export-on-save",
        action="store_true",
        help="export every --save checkpoint to --hf-export/iter_N instead (the last one is the final model)",
    )
    g.add_argument(
        "--hf-export-overwrite",
        action="store_true",
        help="replace an earlier export in a non-empty --hf-export",
    )
    add_expert_layout_flag(g, "--hf-export-expert-layout")
    return parser


def _flag_groups(flags: list[str]) -> list[list[str]]:
    groups: list[list[str]] = []
    for tok in flags:
        if tok.startswith("--"):
            groups.append([tok])
        else:
            groups[-1].append(tok)
    return groups


def _as_number(value: object) -> object:
    """``value`` as a number where it is one or its text parses as one (``"1e-6"``, ``"1000000.0"``);
    otherwise unchanged. Switches (bools) stay bools."""
    if isinstance(value, str):
        for kind in (int, float):
            try:
                return kind(value)
            except ValueError:
                pass
    return value


def same_value(a: object, b: object) -> bool:
    """Whether two flag values say the same thing: numbers compare as numbers (``1e-6`` is ``1e-06``,
    ``1000000`` is ``1000000.0``, ``0.001`` is ``1e-3``), lists element by element, the rest as they are."""
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b, strict=True))
    a, b = _as_number(a), _as_number(b)
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    return a == b


def merge_flags(hf_dir: str, user: list[str]) -> list[str]:
    """Checkpoint flags + tokenizer flags + the user's, with conflicts reported.

    The user's flags come last (argparse keeps the last value), so where they may override they win;
    where they contradict the checkpoint's architecture this raises, naming the flag and both values.
    Values are compared as numbers where both are (:func:`same_value`).
    """
    given = flag_values(user)
    if "--save" in given and not {"--save-interval", "--persistent-save-interval"} & given.keys():
        # Megatron only asserts this (a bare AssertionError); the Slurm and Ray scripts add --save for you.
        raise LaunchError(
            f"--save {' '.join(given['--save'])} needs --save-interval N (iterations between checkpoints); "
            "add e.g. --save-interval 500"
        )
    merged: list[str] = []
    for group in _flag_groups(megatron_args_from_hf(hf_dir)):
        flag, values = group[0], group[1:]
        if flag == "--spec":
            if "--spec" in given and given["--spec"] != values:
                raise LaunchError(
                    f"--spec {' '.join(given['--spec'])}: the launcher runs --spec {' '.join(values)}"
                )
            merged += group
            continue
        if flag in given or EXCLUSIVE.get(flag) in given:
            if flag in OVERRIDABLE or same_value(given.get(flag), values):
                continue
            raise LaunchError(
                f"{flag} {' '.join(given[flag])} contradicts the checkpoint {Path(hf_dir) / 'config.json'}, "
                f"which needs {flag} {' '.join(values)}; drop the flag (the launcher sets it)"
            )
        merged += group
    if "--tokenizer-type" not in given:
        if not any((Path(hf_dir) / f).is_file() for f in TOKENIZER_FILES):
            raise LaunchError(
                f"{hf_dir} has no tokenizer files ({', '.join(TOKENIZER_FILES)}); save the tokenizer there or pass "
                "--tokenizer-type/--tokenizer-model (e.g. --tokenizer-type NullTokenizer --vocab-size N with --mock-data)"
            )
        merged += ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(hf_dir)]
    return merged + user


def architecture_conflicts(
    args: argparse.Namespace, parser: argparse.ArgumentParser, hf_dir: str | Path
) -> list[str]:
    """Every architecture field of Megatron's parsed ``args`` that differs from what the checkpoint needs.

    The fields are the flags of :func:`config_mapping.architecture_settings` (the table that writes the
    flags and the TransformerConfig), overridable ones aside; the checkpoint's value of each is what
    Megatron's own ``parser`` makes of the checkpoint's flags alone (its default where the checkpoint
    gives none), so a flag that only the user gave (``--rotary-interleaved``, ``--num-experts`` on a
    dense model) is compared too. A flag this Megatron version does not have is skipped.
    """
    expected, _ = parser.parse_known_args(megatron_args_from_hf(hf_dir))
    config = Path(hf_dir) / "config.json"
    conflicts, seen = [], set()
    for setting in architecture_settings(hf_dir):
        for flag in setting.arch_flags:
            action = parser._option_string_actions.get(flag)  # argparse has no public lookup
            if flag in OVERRIDABLE or action is None or action.dest in seen:
                continue
            seen.add(action.dest)
            given, needed = getattr(args, action.dest, None), getattr(expected, action.dest)
            if not same_value(given, needed):
                field = f" (config.json field {setting.source})" if setting.source else ""
                conflicts.append(
                    f"{flag} gives {action.dest}={given!r} but {config} needs {action.dest}={needed!r}{field}"
                )
    return conflicts


def check_architecture(args: argparse.Namespace, parser: argparse.ArgumentParser, hf_dir: str | Path) -> None:
    """Raises :class:`LaunchError` naming every flag that contradicts the checkpoint's architecture."""
    conflicts = architecture_conflicts(args, parser, hf_dir)
    if conflicts:
        raise LaunchError(
            "; ".join(conflicts) + ". Drop these flags: the launcher sets the checkpoint's architecture."
        )


def check_context_parallel(args: argparse.Namespace, hf_dir: str | Path, arch=None) -> None:
    """Raises :class:`LaunchError` for a context-parallel layout the checkpoint's Gated DeltaNet layers cannot
    run, before any rank builds a model (the layers refuse it too, for runs without the launcher). ``arch``:
    the checkpoint's architecture where the caller has read it."""
    cp = getattr(args, "context_parallel_size", 1)
    hybrid = (arch or qwen_arch_from_hf(hf_dir)).hybrid
    if cp == 1 or hybrid is None:
        return
    from packaging.version import Version

    from .gdn import context_parallel_problem

    where, version = Path(hf_dir) / "config.json", installed_megatron_core()
    if Version(version) < Version("0.19"):
        raise LaunchError(
            f"{where}: --context-parallel-size {cp} with Gated DeltaNet layers needs megatron-core 0.19+ (0.16's "
            f"TransformerConfig refuses it; megatron-core here is {version}): use --context-parallel-size 1, "
            "or Megatron-LM core_v0.19"
        )
    tp = getattr(args, "tensor_model_parallel_size", 1)
    packed = bool(getattr(args, "sft", False))
    problem = context_parallel_problem(cp, tp, hybrid.num_key_heads, hybrid.num_value_heads, packed)
    if problem:
        raise LaunchError(f"{where}: {problem}")


@dataclass
class Run:
    """What the hooks need to know about this launch, filled from Megatron's parsed args."""

    hf_dir: str
    lora: object | None = None
    flash_attn_4: bool = False
    models: list = field(default_factory=list)
    last_export: Path | None = None  # the latest --hf-export-on-save export of this run

    @functools.cached_property
    def arch(self):
        """The checkpoint's architecture, read once (every GPTModel built by this run asks for it)."""
        return qwen_arch_from_hf(self.hf_dir)


_RUN: Run | None = None


def _lora_from_args(args) -> object | None:
    if not args.lora_rank:
        return None
    from .lora import LoraConfig

    targets = [t.strip() for t in args.lora_target.split(",") if t.strip()]
    return LoraConfig(
        r=args.lora_rank,
        lora_alpha=args.lora_alpha if args.lora_alpha is not None else 2 * args.lora_rank,
        lora_dropout=args.lora_dropout,
        target_modules=tuple(targets),
        use_rslora=args.lora_rslora,
    )


def _wrap_parse_args(original):
    @functools.wraps(original)
    def parse_args(extra_args_provider=None, ignore_unknown_args=False):
        parsers = []

        def composed(parser):
            if extra_args_provider is not None:
                parser = extra_args_provider(parser)
            parsers.append(add_twinkle_args(parser))
            return parsers[-1]

        args = original(composed, ignore_unknown_args)
        run = Run(hf_dir=args.hf_model)
        if args.hf_model:
            check_architecture(args, parsers[-1], args.hf_model)  # a LaunchError ends in main's refuse()
            check_context_parallel(args, args.hf_model, run.arch)
        run.lora = _lora_from_args(args)
        run.flash_attn_4 = args.flash_attn_4
        if run.flash_attn_4:
            from .flash_attention import launch_refusal

            if refusal := launch_refusal(args):
                raise LaunchError(refusal)  # ends in main's refuse(), as the architecture checks' do
        from .packed_attention_check import launch_refusal as packed_attention_refusal

        if refusal := packed_attention_refusal(args):
            raise LaunchError(refusal)
        global _RUN
        _RUN = run
        return args

    return parse_args


def _tokenizer_vocab(megatron_padded: int | None) -> int | None:
    """The tokenizer's own vocabulary size; Megatron's padded size where no tokenizer is reachable."""
    try:
        from megatron.training import get_tokenizer

        return get_tokenizer().vocab_size
    except (ImportError, AssertionError, AttributeError):
        return megatron_padded


def _checkpoint_vocab(megatron_padded: int | None) -> int:
    """Embedding rows: the checkpoint's vocabulary padded to TP (the tokenizer must fit inside it;
    Megatron's own padding of the tokenizer, which grows with TP, does not matter)."""
    from megatron.core import parallel_state as ps

    from .model import padded_vocab_size

    arch = _RUN.arch
    rows = padded_vocab_size(arch.vocab_size, ps.get_tensor_model_parallel_world_size())
    tokens = _tokenizer_vocab(megatron_padded)
    if tokens is not None and tokens > rows:
        raise LaunchError(
            f"the tokenizer has {tokens} tokens but {_RUN.hf_dir} has {arch.vocab_size} embedding rows; "
            "use the checkpoint's own tokenizer"
        )
    return rows


def _adapter_only(sharded_state_dict):
    """Keeps only LoRA factors in a model's sharded state dict (adapter-only checkpoints)."""

    @functools.wraps(sharded_state_dict)
    def filtered(*args, **kwargs):
        from .lora.checkpoint import adapters_only

        return adapters_only(sharded_state_dict(*args, **kwargs))

    return filtered


def _wrap_gpt_init(original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def init(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        config = bound.arguments["config"]
        if _RUN is not None:
            config.flash_attn_4 = _RUN.flash_attn_4  # read by qwen_layer_submodules
        if _RUN is None or _RUN.hf_dir is None:
            return original(*bound.args, **bound.kwargs)
        if _RUN.lora is not None:
            from .lora.config import set_model_facts

            config.lora = _RUN.lora
            set_model_facts(config, _RUN.arch)
        bound.arguments["vocab_size"] = _checkpoint_vocab(bound.arguments.get("vocab_size"))
        _exact_rotary_base(bound.arguments)
        _set_megatron_padded_vocab(bound.arguments["vocab_size"])
        original(*bound.args, **bound.kwargs)
        from .loading import load_hf_weights

        print(f"twinkle_specs: {load_hf_weights(self, _RUN.hf_dir)}", flush=True)
        if _RUN.lora is not None:
            from .lora import prepare_lora_model

            prepare_lora_model(self)
            self.sharded_state_dict = _adapter_only(self.sharded_state_dict)
            _check_expert_layout(self)
        if config.flash_attn_4:
            from .flash_attention import flash_attention_4_class

            layers = sum(isinstance(m, flash_attention_4_class()) for m in self.modules())
            print(f"twinkle_specs: attention on FlashAttention-4 in {layers} layers", flush=True)
        _maybe_dump_batches(self)
        _RUN.models.append(self)

    return init


def _check_expert_layout(model) -> None:
    """Refuses, before training, an --hf-export-expert-layout the end-of-run export could not write."""
    from megatron.training import get_args

    from .lora.peft_io import check_expert_layout

    margs = get_args()
    if margs.hf_export and not margs.hf_export_merged:
        try:
            check_expert_layout(model, margs.hf_export_expert_layout)
        except ValueError as err:
            raise LaunchError(f"--hf-export-expert-layout: {err}") from err


def _exact_rotary_base(arguments: dict) -> None:
    """GPTModel gets the checkpoint's ``rope_theta`` itself: Megatron-LM parses ``--rotary-base`` as an
    int, so a fractional one arrives truncated (the flag carries ``int(rope_theta)``, see
    ``config_mapping._rope_setting``) and would rotate every position by slightly wrong angles."""
    exact = _RUN.arch.rotary_base
    if arguments.get("rotary_base") == int(exact) != exact:
        arguments["rotary_base"] = exact


def _set_megatron_padded_vocab(rows: int) -> None:
    try:
        from megatron.training import get_args
    except ImportError:
        return
    args = get_args()
    if args is not None:
        args.padded_vocab_size = rows


def _maybe_dump_batches(model) -> None:
    """With $TWINKLE_DUMP_BATCHES set to a directory, saves the tokens and labels (and, where given, the
    loss mask and packed-sequence bounds) of the first training micro-batches this stage sees
    ($TWINKLE_DUMP_BATCHES_COUNT of them, from micro-batch $TWINKLE_DUMP_BATCHES_FROM on), so the
    iteration-1 loss, or a later iteration's after an export, can be checked against transformers.

    Under pipeline parallelism Megatron-LM core_v0.19 gives the first stage no labels and the last stage
    no tokens, so each stage saves what it has; files of one data-parallel rank and micro-batch share
    the prefix ``dp<D>-mb<N>`` and together hold both. Under context parallelism a rank holds only parts
    of each sequence (and the ranks of one context-parallel group would write the same files): nothing is
    saved."""
    from megatron.core import parallel_state as ps

    out = os.environ.get("TWINKLE_DUMP_BATCHES")
    stage_saves = (model.pre_process or model.post_process) and ps.get_tensor_model_parallel_rank() == 0
    if not out or not stage_saves or ps.get_context_parallel_world_size() > 1:
        return
    count = {"n": 0}
    start = int(os.environ.get("TWINKLE_DUMP_BATCHES_FROM", "0"))
    limit = start + int(os.environ.get("TWINKLE_DUMP_BATCHES_COUNT", "8"))

    def hook(_module, args, kwargs):
        if count["n"] >= limit or not _module.training:
            return
        if count["n"] < start:
            count["n"] += 1
            return
        tokens = kwargs.get("input_ids", args[0] if args else None) if model.pre_process else None
        labels = kwargs.get("labels") if model.post_process else None
        if tokens is None and labels is None:
            return
        Path(out).mkdir(parents=True, exist_ok=True)
        name = f"dp{ps.get_data_parallel_rank()}-mb{count['n']}-pp{ps.get_pipeline_model_parallel_rank()}.pt"
        mask, packed = kwargs.get("loss_mask"), kwargs.get("packed_seq_params")
        torch.save(
            {
                "tokens": None if tokens is None else tokens.cpu(),
                "labels": None if labels is None else labels.cpu(),
                "loss_mask": None if mask is None or labels is None else mask.cpu(),
                "cu_seqlens": None if packed is None else packed.cu_seqlens_q.cpu(),
            },
            Path(out) / name,
        )
        count["n"] += 1

    model.register_forward_pre_hook(hook, with_kwargs=True)


def _maybe_dump_trained(models) -> None:
    """With $TWINKLE_DUMP_TRAINED set to a directory, each rank saves its local shards of the trainable
    parameters after training (``rank<R>.pt``, with the rank's parallel coordinates and which of them
    are expert parameters), so that data-parallel replicas can be compared: they must be identical."""
    from megatron.core import parallel_state as ps

    out = os.environ.get("TWINKLE_DUMP_TRAINED")
    if not out:
        return
    params, expert = {}, []
    for i, model in enumerate(models):
        for name, p in model.named_parameters():
            if p.requires_grad:
                params[f"{i}.{name}"] = p.detach().cpu()
                if not getattr(p, "allreduce", True):  # megatron's mark of expert-parallel parameters
                    expert.append(f"{i}.{name}")
    coords = {
        "tp": ps.get_tensor_model_parallel_rank(),
        "pp": ps.get_pipeline_model_parallel_rank(),
        "dp": ps.get_data_parallel_rank(),
        "cp": ps.get_context_parallel_rank(),
        "ep": ps.get_expert_model_parallel_rank(),
        "etp": ps.get_expert_tensor_parallel_rank(),
        "edp": ps.get_expert_data_parallel_rank(),
    }
    Path(out).mkdir(parents=True, exist_ok=True)
    rank = torch.distributed.get_rank()
    torch.save({"coords": coords, "params": params, "expert": expert}, Path(out) / f"rank{rank}.pt")


# Checkpoints an --hf-export directory must stay apart from (an overwrite replaces the directory).
_EXPORT_SOURCES = ("--hf-model", "--load", "--save", "--pretrained-checkpoint")


def _export_target(sources: dict[str, str | None], overwrite: bool, on_save_root: bool = False) -> dict:
    """How :mod:`twinkle_specs.output_dir` treats an --hf-export target; the --hf-export-on-save root is
    never replaced, only added to (a resumed run adds iter_N exports)."""
    from .export import HF_OUTPUTS
    from .lora.peft_io import PEFT_OUTPUTS

    return dict(
        sources=sources,
        overwrite=overwrite or on_save_root,
        flag="--hf-export",
        force_hint="pass --hf-export-overwrite",
        replaceable=("iter_*",) if on_save_root else HF_OUTPUTS + PEFT_OUTPUTS,
        error=LaunchError,
    )


def _sources_from_args(margs) -> dict[str, str | None]:
    return {f: getattr(margs, f[2:].replace("-", "_"), None) for f in _EXPORT_SOURCES}


def check_hf_export(user: list[str]) -> None:
    """Refuses, before training, an --hf-export target that the export would refuse at its end: one
    overlapping a checkpoint of the run, or a non-empty directory without --hf-export-overwrite."""
    from .output_dir import check_target

    pre = add_twinkle_args(argparse.ArgumentParser(add_help=False)).parse_known_args(user)[0]
    if not pre.hf_export:
        return
    flags = flag_values(user)
    if pre.hf_export_on_save and not flags.get("--save"):
        raise LaunchError("--hf-export-on-save exports every --save checkpoint: pass --save DIR, or drop it")
    sources = {f: flags[f][-1] if flags.get(f) else None for f in _EXPORT_SOURCES}
    check_target(pre.hf_export, **_export_target(sources, pre.hf_export_overwrite, pre.hf_export_on_save))


SFT_CUDA_GRAPH_FLAGS = ("--enable-cuda-graph", "--external-cuda-graph", "--cuda-graph-impl")


def sft_flags(hf_dir: str, user: list[str]) -> list[str]:
    """``--sft`` (Megatron-LM's packed conversation data): refuses what cannot run before anything starts,
    checks that the checkpoint's tokenizer gives the loss mask (:mod:`twinkle_specs.sft`), and returns the
    flag Megatron's SFT dataset needs (no attention mask from the dataloader: the rows are packed)."""
    given = flag_values(user)
    if "--sft" not in given:
        return []
    mbs = given.get("--micro-batch-size", ["1"])
    if mbs and mbs[0] != "1":
        raise LaunchError(
            f"--sft packs conversations into rows of --seq-length tokens, one row per micro-batch: "
            f"--micro-batch-size {mbs[0]} must be 1 (raise --seq-length for more tokens per step)"
        )
    graphs = [f for f in SFT_CUDA_GRAPH_FLAGS if f in given and given[f] != ["none"]]
    if graphs:
        raise LaunchError(
            f"--sft with {graphs[0]}: CUDA graphs capture one sequence layout and packed rows change it every "
            "step; drop the CUDA graph flags for SFT"
        )
    if "--tokenizer-type" not in given:
        from .sft import QwenChatTokenizer

        QwenChatTokenizer(hf_dir)  # a tokenizer without a chat template or Qwen's tokens is refused here
    import importlib.util

    if importlib.util.find_spec("datasets") is None:
        raise LaunchError(
            "--sft: Megatron-LM reads the JSONL conversations with the datasets library, which is not "
            "installed; pip install 'twinkle-specs[sft]'"
        )
    return (
        []
        if "--no-create-attention-mask-in-dataloader" in given
        else ["--no-create-attention-mask-in-dataloader"]
    )


def _wrap_build_tokenizer(original):
    """The tokenizer Megatron builds, wrapped in :class:`~twinkle_specs.sft.QwenChatTokenizer` (chat
    template, answer-only targets, Qwen's pad/eod)."""

    @functools.wraps(original)
    def build_tokenizer(args, *rest, **kwargs):
        tokenizer = original(args, *rest, **kwargs)
        from .sft import ChatDataError, QwenChatTokenizer

        try:
            return QwenChatTokenizer(args.hf_model, base=tokenizer)
        except ChatDataError as err:
            raise LaunchError(str(err)) from err

    return build_tokenizer


# Where Megatron-LM defines the ``build_tokenizer`` that global_vars and pretrain_gpt.py's SFT dataset
# config call (pretrain_gpt.py builds its own): core_v0.19, core_v0.16.1, and the legacy tokenizers.
TOKENIZER_BUILDERS = (
    "megatron.core.tokenizers.utils.build_tokenizer",
    "megatron.core.tokenizers.text.utils.build_tokenizer",
    "megatron.training.tokenizer.tokenizer",
)


def install_tokenizer_hook() -> None:
    """Wraps each ``build_tokenizer`` (:func:`_wrap_build_tokenizer`) where it is defined and where
    megatron.training has imported it; the training script imports the wrapped one. Installed by
    :func:`main` for ``--sft`` with the checkpoint's own tokenizer."""
    import importlib

    for name in TOKENIZER_BUILDERS:
        try:
            module = importlib.import_module(name)
        except ImportError:  # not on this megatron-core line
            continue
        original = getattr(module, "build_tokenizer", None)
        if original is None:
            continue
        wrapped = _wrap_build_tokenizer(original)
        module.build_tokenizer = wrapped
        _rebind("build_tokenizer", original, wrapped)  # megatron.training.tokenizer's re-export included


def export(models, out_dir: str | Path, *, merged: bool = False, overwrite: bool = False) -> None:
    """Writes this run's model to ``out_dir``: a PEFT adapter for LoRA runs (merged HF weights with
    ``merged``), full HF weights otherwise. Called on every rank; ``out_dir`` appears complete or not at
    all (:mod:`twinkle_specs.output_dir`)."""
    from megatron.training import get_args

    from .export import save_hf_weights
    from .output_dir import staged_output

    margs = get_args()
    target = _export_target(_sources_from_args(margs), overwrite)
    with staged_output(out_dir, **target) as staging:
        if _RUN is not None and _RUN.lora is not None and not merged:
            from .lora import export_peft_adapter

            export_peft_adapter(
                models,
                staging,
                base_model_name_or_path=_RUN.hf_dir,
                expert_layout=margs.hf_export_expert_layout,
            )
        elif _RUN is not None and _RUN.lora is not None:
            from .lora import merge_lora, unmerge_lora

            merge_lora(models)
            try:
                save_hf_weights(models, staging, hf_dir=_RUN.hf_dir)
            finally:
                unmerge_lora(models)
        else:
            save_hf_weights(models, staging, hf_dir=_RUN.hf_dir if _RUN else None)


def _export_or_refuse(models, out_dir: str | Path, *, merged: bool, overwrite: bool) -> None:
    """:func:`export`, with a write that fails (read-only, full, over a size limit) turned into a
    configuration error naming the path and the system's reason (restarting the job cannot help)."""
    from safetensors import SafetensorError

    from .os_errors import os_error_line

    try:
        export(models, out_dir, merged=merged, overwrite=overwrite)
    except (OSError, SafetensorError) as err:
        raise LaunchError(f"--hf-export: writing the export failed: {os_error_line(err, out_dir)}") from err


def _wrap_pretrain(original):
    @functools.wraps(original)
    def pretrain(*args, **kwargs):
        result = original(*args, **kwargs)
        from megatron.training import get_args

        if _RUN is not None:
            _maybe_dump_trained(_RUN.models)
        margs = get_args()
        if margs.hf_export and _RUN is not None and _RUN.models:
            if not margs.hf_export_on_save:
                _export_or_refuse(
                    _RUN.models,
                    margs.hf_export,
                    merged=margs.hf_export_merged,
                    overwrite=margs.hf_export_overwrite,
                )
                print(f"twinkle_specs: exported to {margs.hf_export}", flush=True)
            elif _RUN.last_export is not None:  # Megatron saves the final state when --save is set
                print(f"twinkle_specs: the final export is {_RUN.last_export}", flush=True)
            else:
                print(
                    f"twinkle_specs: no checkpoint was saved in this run: nothing exported to {margs.hf_export}"
                )
        return result

    return pretrain


def _wrap_save_checkpoint(original):
    @functools.wraps(original)
    def save_checkpoint(iteration, *args, **kwargs):
        result = original(iteration, *args, **kwargs)
        from megatron.training import get_args

        margs = get_args()
        if margs.hf_export and margs.hf_export_on_save and _RUN is not None and _RUN.models:
            # The checkpoint of this iteration was just (re)written: its export is replaced to match.
            out = Path(margs.hf_export) / f"iter_{iteration:07d}"
            _export_or_refuse(_RUN.models, out, merged=margs.hf_export_merged, overwrite=True)
            _RUN.last_export = out
        return result

    return save_checkpoint


def _rebind(name: str, original, replacement) -> None:
    """Points every ``megatron.training`` module's binding of ``original`` to ``replacement``."""
    for mod_name, module in list(sys.modules.items()):
        if mod_name.startswith("megatron.training") and getattr(module, name, None) is original:
            setattr(module, name, replacement)


def install_hooks() -> None:
    """Installs the argument, model and export hooks (before the training script is run)."""
    import megatron.training  # noqa: F401  (imports the modules whose bindings are rebound)
    import megatron.training.arguments as arguments
    import megatron.training.checkpointing as checkpointing
    import megatron.training.training as training
    from megatron.core.models.gpt.gpt_model import GPTModel

    _rebind("parse_args", arguments.parse_args, _wrap_parse_args(arguments.parse_args))
    _rebind("pretrain", training.pretrain, _wrap_pretrain(training.pretrain))
    _rebind(
        "save_checkpoint", checkpointing.save_checkpoint, _wrap_save_checkpoint(checkpointing.save_checkpoint)
    )
    GPTModel.__init__ = _wrap_gpt_init(GPTModel.__init__)


CONFIG_ERROR_EXIT = 2  # bad flags or inputs (argparse's code too): restarting the job cannot help
LORA_ONLY_FLAGS = (
    "--lora-alpha",
    "--lora-dropout",
    "--lora-target",
    "--lora-rslora",
    "--hf-export-expert-layout",
)


def refuse(message: str) -> NoReturn:
    """Ends the run on a configuration error: one line, exit code 2, and the message in
    $TWINKLE_CONFIG_ERROR_FILE when set (the Slurm script reads it to tell such an error from a crash)."""
    print(f"twinkle_specs.launch: error: {message}", file=sys.stderr, flush=True)
    marker = os.environ.get("TWINKLE_CONFIG_ERROR_FILE")
    if marker:
        try:
            Path(marker).write_text(message + "\n")
        except OSError:
            pass  # the exit code still says it
    raise SystemExit(CONFIG_ERROR_EXIT)


class _OwnFlagsParser(argparse.ArgumentParser):
    """Parses twinkle-specs' flags ahead of Megatron; a bad value is one line naming flag and choices."""

    def error(self, message: str) -> NoReturn:
        refuse(message)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-"):
        refuse("usage: python -m twinkle_specs.launch <Megatron-LM>/pretrain_gpt.py --hf-model DIR [flags]")
    script, user = argv[0], argv[1:]
    pre = add_twinkle_args(_OwnFlagsParser(add_help=False)).parse_known_args(user)[0]
    given = {w.split("=", 1)[0] for w in user}
    lora_only = [f for f in LORA_ONLY_FLAGS if f in given]
    if "-h" in user or "--help" in user:
        flags = user  # Megatron's --help, with twinkle-specs' flags listed
    elif not pre.hf_model:
        refuse("--hf-model DIR is required (a Hugging Face Qwen checkpoint)")
    elif lora_only and not pre.lora_rank:
        refuse(f"{', '.join(lora_only)} need(s) --lora-rank R (R > 0); without it every parameter trains")
    elif (pre.hf_export_merged or pre.hf_export_on_save) and not pre.hf_export:
        flag = "--hf-export-merged" if pre.hf_export_merged else "--hf-export-on-save"
        refuse(f"{flag} needs --hf-export DIR (where to write the Hugging Face checkpoint)")
    elif pre.hf_export_expert_layout != "fused" and (pre.hf_export_merged or not pre.hf_export):
        refuse(
            "--hf-export-expert-layout lays out a PEFT adapter's routed experts: it needs --hf-export DIR "
            "without --hf-export-merged"
        )
    else:
        try:
            flags = merge_flags(pre.hf_model, user)
            check_hf_export(user)
            flags += sft_flags(pre.hf_model, user)
        except (LaunchError, ValueError, FileNotFoundError) as err:
            refuse(str(err))
    script_dir = str(Path(script).resolve().parent)
    if script_dir not in sys.path:
        sys.path.insert(0, script_dir)  # the script imports its siblings (gpt_builders, model_provider)
    from .patches import apply_all as apply_patches

    apply_patches()
    install_hooks()
    if "--sft" in given and "--tokenizer-type" not in given and pre.hf_model:
        install_tokenizer_hook()
    sys.argv = [script, *flags]
    try:
        runpy.run_path(script, run_name="__main__")
    except LaunchError as err:  # raised by the hooks, e.g. a tokenizer that does not fit the checkpoint
        refuse(str(err))
    except SystemExit as err:
        if err.code == CONFIG_ERROR_EXIT and _RUN is None:  # Megatron's argparse refused a flag (said above)
            refuse("Megatron-LM's argument parser refused the command line (its message is above)")
        raise


if __name__ == "__main__":
    main()
