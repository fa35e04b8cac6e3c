import os

import torch
from megatron.core import parallel_state as ps
from megatron.training.arguments import parse_args  # bound by name, as Megatron-LM 0.16's initialize does
from megatron.training.global_vars import set_args


def initialize_megatron(extra_args_provider=None):
    args = parse_args(extra_args_provider)
    set_args(args)
    if not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    ps.initialize_model_parallel(1, 1)
    return args
