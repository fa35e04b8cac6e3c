"""Two gloo ranks: a Gated DeltaNet layer at context parallel 2 against the same layer on the whole sequence.

    torchrun --nproc-per-node 2 tests/gdn_cp_worker.py HF_DIR OUT_JSON

Each rank feeds the layer its two of the sequence's four chunks (megatron's load-balanced split), runs
forward and backward, and compares its output rows, its input-gradient rows and the parameter gradients
summed over the context-parallel group (what megatron's gradient reduction does) with the layer at CP 1 on
the whole sequence. Rank 0 writes the largest differences, relative to each tensor's largest entry.
"""

from __future__ import annotations

import copy
import json
import sys

import torch
import torch.distributed as dist


def main() -> None:
    from megatron.core import parallel_state as ps

    import twinkle_specs as ts
    from twinkle_specs.hybrid_spec import _gdn_spec

    hf, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    ps.initialize_model_parallel(1, 1, context_parallel_size=2)
    cp, rank = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
    whole = ts.build_model(hf).decoder.layers[0].self_attention  # a Gated DeltaNet layer, CP 1
    config = copy.copy(whole.config)
    config.context_parallel_size = (
        cp  # megatron-core 0.16's TransformerConfig would refuse it at construction
    )
    split = type(whole)(config, _gdn_spec(config).submodules, layer_number=1)
    split.load_state_dict(whole.state_dict())

    torch.manual_seed(0)
    s, b = 8 * 2 * cp, 2  # 2 * cp chunks of 8 tokens
    x = torch.randn(s, b, config.hidden_size)
    dy = torch.randn(s, b, config.hidden_size)
    chunks = torch.tensor([rank, 2 * cp - 1 - rank])
    mine = torch.cat([torch.arange(c * s // (2 * cp), (c + 1) * s // (2 * cp)) for c in chunks.tolist()])

    x_whole = x.clone().requires_grad_()
    y_whole, _ = whole(x_whole)
    y_whole.backward(dy)
    x_mine = x[mine].clone().requires_grad_()
    y_mine, _ = split(x_mine)
    y_mine.backward(dy[mine])
    for p in split.parameters():
        dist.all_reduce(p.grad, group=ps.get_context_parallel_group())

    def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
        return ((a - ref).abs().max() / ref.abs().max()).item()

    diffs = {"output": rel(y_mine, y_whole[mine]), "input grad": rel(x_mine.grad, x_whole.grad[mine])}
    ref_grads = dict(whole.named_parameters())
    diffs |= {name: rel(p.grad, ref_grads[name].grad) for name, p in split.named_parameters()}
    gathered = [None] * cp
    dist.all_gather_object(gathered, diffs)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump({"per_rank": gathered, "params": sorted(ref_grads)}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
