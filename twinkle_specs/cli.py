"""The ``twinkle-specs`` command: print Megatron flags for a checkpoint, or check parity."""

from __future__ import annotations

import argparse
import shlex
import sys


def _args(ns: argparse.Namespace) -> int:
    from .config_mapping import megatron_args_from_hf

    print(shlex.join(megatron_args_from_hf(ns.hf_model)))
    return 0


def _parity(ns: argparse.Namespace) -> int:
    from .parity import run_parity

    report, hf_dir = run_parity(ns.hf_model, seq_len=ns.seq_length)
    print(f"checkpoint: {hf_dir}")
    print(f"megatron-core (qwen_layer_spec) vs transformers, fp32 logits: {report}")
    ok = report.max_abs <= ns.tolerance
    print(f"parity {'OK' if ok else 'FAILED'} (tolerance max |Δ| <= {ns.tolerance:g})")
    return 0 if ok else 1


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
    ns = parser.parse_args(argv)
    try:
        return ns.func(ns)
    except (ValueError, FileNotFoundError) as err:
        print(f"twinkle-specs: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
