"""Loads a ``twinkle-specs convert`` checkpoint with stock Megatron-LM's own ``load_checkpoint``.

    PYTHONPATH=$MEGATRON_LM_ROOT python tests/megatron_lm_load.py --hf-model DIR --load CKPT [--finetune]

Megatron-LM's parser gets ``twinkle-specs args`` plus ``--load``; the model is what pretrain_gpt.py
builds for ``--spec twinkle_specs qwen_layer_spec`` (GPTModel over qwen_layer_spec, no HF weights);
then ``megatron.training.checkpointing.load_checkpoint([model], None, None)`` runs unmodified and every
parameter must equal the HF checkpoint's, loaded by twinkle-specs' strict loader. Prints ``LOADED OK``.

On a host without CUDA one line of load_checkpoint cannot run: ``read_metadata`` all-reduces the
tracker's iteration in a ``device='cuda'`` tensor. There (only) the checkpointing module sees a
``torch.tensor`` that places ``device='cuda'`` tensors on the host; everything else is Megatron-LM's code.
Megatron-LM core_v0.19's training package imports ``typing.override`` (Python 3.12); on Python 3.11
it is aliased to ``typing_extensions.override`` first.
"""

from __future__ import annotations

import argparse
import sys
import types
import typing

import torch
import torch.distributed as dist


def _host_tensor_torch(module: types.ModuleType) -> None:
    real = torch

    class TorchOnHost(types.ModuleType):
        def __getattr__(self, name):
            return getattr(real, name)

        @staticmethod
        def tensor(*args, **kwargs):
            if str(kwargs.get("device", "")).startswith("cuda"):
                kwargs["device"] = "cpu"
            return real.tensor(*args, **kwargs)

    module.torch = TorchOnHost("torch")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hf-model", required=True)
    ap.add_argument("--load", required=True)
    ap.add_argument("--finetune", action="store_true")
    ns = ap.parse_args()

    if not hasattr(typing, "override"):  # Megatron-LM core_v0.19 training code needs Python >= 3.12
        import typing_extensions

        typing.override = typing_extensions.override

    import twinkle_specs as ts
    from twinkle_specs.parity import _init_single_process

    _init_single_process()
    from megatron.training import checkpointing
    from megatron.training.arguments import parse_args
    from megatron.training.global_vars import set_args

    if not torch.cuda.is_available():
        _host_tensor_torch(checkpointing)
    sys.argv = [
        "pretrain_gpt.py",
        *ts.megatron_args_from_hf(ns.hf_model),
        *("--micro-batch-size 1 --global-batch-size 1 --seq-length 32 --lr 1e-4 --train-iters 1".split()),
        *("--tokenizer-type NullTokenizer --vocab-size 255 --ckpt-format torch_dist".split()),
        "--load",
        ns.load,
        *(["--finetune"] if ns.finetune else []),
    ]
    args = parse_args()
    args.world_size, args.data_parallel_size, args.rank = 1, 1, 0  # what validate_args sets
    args.use_dist_ckpt = True
    set_args(args)
    if not ns.finetune:  # without --finetune load_checkpoint updates the micro-batch calculator
        from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator

        init_num_microbatches_calculator(0, None, 1, 1, 1)

    model = ts.build_model(ns.hf_model, load_weights=False)
    reference = dict(ts.build_model(ns.hf_model).named_parameters())
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    iteration, _ = checkpointing.load_checkpoint([model], None, None)
    assert iteration == 0, iteration
    bad = [n for n, p in model.named_parameters() if not torch.equal(p, reference[n])]
    assert not bad, f"parameters differ from the HF checkpoint after load_checkpoint: {bad}"
    print(f"LOADED OK {len(reference)} parameters, iteration {iteration}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
