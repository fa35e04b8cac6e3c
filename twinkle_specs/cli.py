"""The ``twinkle-specs`` command: Megatron flags for a checkpoint, parity check, HF <-> Megatron checkpoints,
the launch scripts."""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
import warnings
from pathlib import Path

from safetensors import SafetensorError

from .os_errors import os_error_line

# What megatron-core announces on a machine without Apex or Transformer Engine (any CPU host): the fallbacks
# it names are the expected ones there, and a screen of them would bury the command's report. megatron-core
# 0.16's and 0.19's own TransformerConfig default also warns on every config. Matched exactly; every other
# warning shows.
KNOWN_UPSTREAM_WARNINGS = (
    r"Transformer Engine and Apex are not installed\. Falling back to ",
    r"Apex is not installed\. Falling back to Torch Norm",
    r"full scope is deprecated\. Use empty cuda_graph_(scope|modules) to capture the whole layer\.",  # 0.16 | 0.19
    r"absl\.logging is not installed\. Using logging\.getLogger",  # megatron-core 0.19's hyper_comm_grid
)


def add_expert_layout_flag(parser, flag: str) -> None:
    """The flag choosing an adapter export's routed-expert layout (``export`` here, the launcher's
    ``--hf-export-expert-layout``); its choices are ``twinkle_specs.lora.config.EXPERT_LAYOUTS``, written out
    so that parsing flags imports no torch."""
    parser.add_argument(
        flag,
        choices=("fused", "per-expert"),
        default="fused",
        help="a PEFT adapter's routed experts: peft's fused target_parameters (transformers 5) or per-expert "
        "(transformers 4's names; what vLLM reads without options for Qwen3-MoE and Qwen3-Next)",
    )


def _quiet_upstream_warnings() -> None:
    for message in KNOWN_UPSTREAM_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=UserWarning, module="megatron")


def _apply_patches() -> None:
    """twinkle-specs' fixes to megatron-core; on a CPU host, those that building and running a model needs."""
    from .patches import apply_all

    apply_all()


def _args(ns: argparse.Namespace) -> int:
    from .config_mapping import megatron_args_from_hf

    print(shlex.join(megatron_args_from_hf(ns.hf_model)))
    return 0


def _parity(ns: argparse.Namespace) -> int:
    from transformers.utils import logging as hf_logging

    from .parity import run_parity

    hf_logging.disable_progress_bar()  # the report is the output
    _apply_patches()
    report, hf_dir = run_parity(ns.hf_model, seq_len=ns.seq_length)
    print(f"checkpoint: {hf_dir}")
    print(f"megatron-core (qwen_layer_spec) vs transformers, fp32 logits: {report}")
    ok = report.max_abs <= ns.tolerance
    print(f"parity {'OK' if ok else 'FAILED'} (tolerance max |Δ| <= {ns.tolerance:g})")
    return 0 if ok else 1


def _convert(ns: argparse.Namespace) -> int:
    from .checkpoint import NONFINITE_ENV
    from .megatron_checkpoint import Layout, convert

    _apply_patches()
    layout = Layout(tp=ns.tp, pp=ns.pp, ep=ns.ep, etp=ns.etp)
    if ns.allow_nonfinite_weights:
        os.environ[NONFINITE_ENV] = "1"  # read by load_hf_weights in every spawned rank
    out = convert(ns.hf_model, ns.save, layout, precision=ns.precision, force=ns.force)
    print(
        f"wrote Megatron-LM torch_dist checkpoint {out} (TP={ns.tp} PP={ns.pp} EP={ns.ep} ETP={ns.etp}, "
        f"{layout.world_size} ranks); load it with: pretrain_gpt.py $(twinkle-specs args --hf-model "
        f"{ns.hf_model}) --load {ns.save} --finetune ..."
    )
    return 0


def _export(ns: argparse.Namespace) -> int:
    from .megatron_checkpoint import export

    _apply_patches()
    lora = {
        "lora_rank": ns.lora_rank,
        "lora_alpha": ns.lora_alpha,
        "lora_target": ns.lora_target,
        "lora_dropout": None,
        "lora_rslora": ns.lora_rslora or None,
    }
    mode = "peft" if ns.peft else "merged" if ns.merged else None
    done = export(
        ns.load,
        ns.hf_model,
        ns.out,
        iteration=ns.iteration,
        mode=mode,
        lora_overrides=lora,
        force=ns.force,
        expert_layout=ns.expert_layout,
    )
    what = {"peft": "PEFT adapter", "merged": "merged HF weights", "full": "HF weights"}[done]
    print(f"wrote {what} to {ns.out}")
    return 0


def launch_scripts() -> dict[str, Path]:
    """The launch scripts by path relative to their folder: ``twinkle_specs/launch_scripts/`` in an
    install (pyproject maps the top-level ``launch/`` folder there), ``launch/`` in a source checkout."""
    here = Path(__file__).resolve().parent
    for folder in (here / "launch_scripts", here.parent / "launch"):
        if folder.is_dir():
            return {
                str(f.relative_to(folder)): f
                for f in sorted(folder.rglob("*"))
                if f.is_file() and "__pycache__" not in f.parts
            }
    raise FileNotFoundError(f"no launch scripts in {here / 'launch_scripts'}: reinstall twinkle-specs")


def _launch_scripts(ns: argparse.Namespace) -> int:
    scripts = launch_scripts()
    if ns.copy is None:
        for name, path in scripts.items():
            print(f"{name}\t{path}")
        return 0
    out = Path(ns.copy)
    existing = [str(out / name) for name in scripts if (out / name).exists()]
    if existing and not ns.force:
        raise FileExistsError(f"{', '.join(existing)}: already there; pass --force to overwrite")
    for name, path in scripts.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        print(shutil.copy2(path, out / name))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="twinkle-specs", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("args", help="print the Megatron-LM flags for a Hugging Face Qwen checkpoint")
    p.add_argument("--hf-model", required=True, help="Hugging Face checkpoint directory (config.json)")
    p.set_defaults(func=_args)
    p = sub.add_parser(
        "parity", help="load a checkpoint into megatron-core and compare logits with transformers"
    )
    p.add_argument("--hf-model", default=None, help="checkpoint directory (default: an embedded small Qwen3)")
    p.add_argument("--seq-length", type=int, default=64)
    p.add_argument("--tolerance", type=float, default=1e-4)
    p.set_defaults(func=_parity)

    p = sub.add_parser(
        "convert", help="write a HF checkpoint as a Megatron-LM torch_dist checkpoint (pretrain_gpt --load)"
    )
    p.add_argument("--hf-model", required=True, help="Hugging Face checkpoint directory")
    p.add_argument("--save", required=True, help="Megatron checkpoint directory to write (new or empty)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size to write at (any size loads it)")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size to write at")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size (MoE)")
    p.add_argument("--etp", type=int, default=1, help="expert tensor-parallel size (MoE)")
    precision = p.add_mutually_exclusive_group()
    for flag in ("bf16", "fp16", "fp32"):
        precision.add_argument(
            f"--{flag}",
            dest="precision",
            action="store_const",
            const=flag,
            help=f"store weights as {flag} (default: config.json's dtype)",
        )
    p.add_argument(
        "--force",
        action="store_true",
        help="replace a previous conversion in --save (once the new one is complete)",
    )
    p.add_argument(
        "--allow-nonfinite-weights",
        action="store_true",
        help="convert weights that hold NaN/inf (by default an error naming the tensor)",
    )
    p.set_defaults(func=_convert, precision=None)

    p = sub.add_parser(
        "export", help="write a Megatron torch_dist checkpoint as HF weights or a PEFT adapter"
    )
    p.add_argument("--load", required=True, help="Megatron checkpoint directory (with the tracker file)")
    p.add_argument("--iteration", type=int, default=None, help="iter_N to export (default: the tracker's)")
    p.add_argument("--hf-model", required=True, help="the HF base checkpoint (config, tokenizer, LoRA base)")
    p.add_argument("--out", required=True, help="output directory (new or empty)")
    kind = p.add_mutually_exclusive_group()
    kind.add_argument("--peft", action="store_true", help="LoRA checkpoint -> PEFT adapter (the default)")
    kind.add_argument("--merged", action="store_true", help="LoRA checkpoint -> merged full HF weights")
    p.add_argument("--lora-rank", type=int, default=None, help="if the checkpoint's args lack it")
    p.add_argument("--lora-alpha", type=float, default=None, help="if the checkpoint's args lack it")
    p.add_argument("--lora-target", default=None, help="if the checkpoint's args lack it")
    p.add_argument("--lora-rslora", action="store_true", help="if the checkpoint's args lack it")
    add_expert_layout_flag(p, "--expert-layout")
    p.add_argument("--force", action="store_true", help="replace an earlier export in a non-empty --out")
    p.set_defaults(func=_export)

    p = sub.add_parser(
        "launch-scripts", help="print the installed Slurm and Ray launch scripts' paths, or copy them"
    )
    p.add_argument("--copy", metavar="DIR", default=None, help="copy them into DIR (keeping slurm/, ray/)")
    p.add_argument("--force", action="store_true", help="with --copy: overwrite files already there")
    p.set_defaults(func=_launch_scripts)
    ns = parser.parse_args(argv)
    _quiet_upstream_warnings()
    try:
        return ns.func(ns)
    except OSError as err:
        if err.filename is None and not isinstance(err, (FileNotFoundError, FileExistsError)):
            raise  # not about a path the user gave: a bug, keep the traceback
        print(f"twinkle-specs: error: {os_error_line(err)}", file=sys.stderr)
        return 2
    except ValueError as err:  # MegatronCheckpointError and the config readers' errors
        print(f"twinkle-specs: error: {err}", file=sys.stderr)
        return 2
    except SafetensorError as err:  # reads are wrapped in ValueErrors naming the file: this is a write
        out = getattr(ns, "out", None) or getattr(ns, "save", None)
        print(f"twinkle-specs: error: writing {out} failed: {err}; check its free space", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
