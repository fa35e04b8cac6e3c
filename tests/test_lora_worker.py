"""One gloo CPU rank of the multi-rank LoRA tests (run by torchrun from the tests; no tests here).

Loads a PEFT adapter into a TP/PP/EP layout, writes full logits and the adapter gradients of a fixed
loss (PEFT names, gathered), then exports the adapter after randomising it. With --roundtrip it only
loads the adapter and exports it again. With ``--jobs FILE`` it runs several such jobs in turn in one
process group (tests/dist_jobs.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from dist_jobs import run_jobs  # this script's folder (tests/) is on sys.path


def _full_logits(model, toks: torch.Tensor, grad: bool) -> torch.Tensor | None:
    """Pipeline-aware forward on one micro-batch; full-vocabulary logits on the last stage."""
    from megatron.core import parallel_state as ps

    pos = torch.arange(toks.shape[1]).expand_as(toks)
    if not ps.is_pipeline_first_stage():
        hidden = torch.empty(toks.shape[1], toks.shape[0], model.config.hidden_size, requires_grad=grad)
        dist.recv(hidden.data, src=ps.get_pipeline_model_parallel_prev_rank())
        model.set_input_tensor(hidden)
        model._recv = hidden
    out = model(toks, pos, None)
    if not ps.is_pipeline_last_stage():
        model._sent = out
        dist.send(out.detach().contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
        return None
    return out


def _backward(model, logits: torch.Tensor | None, weights: torch.Tensor) -> None:
    """Loss = sum(logits * weights) over the full vocabulary, backward through every stage."""
    from megatron.core import parallel_state as ps

    if logits is not None:
        tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
        vocab = logits.shape[-1]
        w = torch.zeros(*weights.shape[:-1], vocab * tp)
        w[..., : weights.shape[-1]] = weights
        (logits * w[..., rank * vocab : (rank + 1) * vocab]).sum().backward()
    else:
        grad = torch.empty_like(model._sent)
        dist.recv(grad, src=ps.get_pipeline_model_parallel_next_rank())
        model._sent.backward(grad)
    if not ps.is_pipeline_first_stage():
        dist.send(model._recv.grad.contiguous(), dst=ps.get_pipeline_model_parallel_prev_rank())


def _finalize_grads(model) -> None:
    """What megatron's finalize_model_grads does for LoRA factors: sum sequence-parallel replicas."""
    from megatron.core import parallel_state as ps

    for p in model.parameters():
        if p.grad is not None and getattr(p, "sequence_parallel", False):
            dist.all_reduce(p.grad, group=ps.get_tensor_model_parallel_group())


def _assemble_sharded(model) -> dict[str, tuple[torch.Tensor, torch.Tensor]] | None:
    """Global tensors rebuilt from every rank's main-replica shards of the adapter sharded_state_dict,
    with a count of how often each element was written (exactly once when no shard is lost)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import apply_factories

    from twinkle_specs.lora.checkpoint import adapter_sharded_state_dict

    mine = []
    sharded = adapter_sharded_state_dict(model)
    apply_factories(sharded)
    for sh in nested_values(sharded):
        if all(r == 0 for r in (sh.replica_id if isinstance(sh.replica_id, tuple) else (sh.replica_id,))):
            mine.append(
                (sh.key, sh.global_shape, sh.global_offset, sh.prepend_axis_num, sh.data.detach().clone())
            )
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if dist.get_rank() != 0:
        return None
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for shards in everyone:
        for key, shape, offset, prepend, data in shards:
            full, count = out.setdefault(key, (torch.zeros(shape), torch.zeros(shape)))
            local = (1,) * prepend + tuple(data.shape)
            where = tuple(slice(o, o + n) for o, n in zip(offset, local, strict=True))
            full[where] = data.reshape(local)
            count[where] += 1
    return out


def _gather_logits(logits: torch.Tensor) -> torch.Tensor:
    from megatron.core import parallel_state as ps

    parts = [torch.empty_like(logits) for _ in range(ps.get_tensor_model_parallel_world_size())]
    dist.all_gather(parts, logits.detach().contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)


def main() -> None:
    from megatron.core import parallel_state as ps  # noqa: F401  (imported before the jobs start)

    import twinkle_specs as ts  # noqa: F401

    dist.init_process_group("gloo")
    run_jobs(_job, sys.argv[1:])
    dist.destroy_process_group()


def _job(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hf", required=True)
    ap.add_argument("--adapter", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--vpp", type=int, default=1, help="virtual pipeline chunks per stage (round trip only)")
    ap.add_argument("--sp", action="store_true")
    ap.add_argument("--roundtrip", action="store_true", help="only load the adapter and export it again")
    ap.add_argument("--sharded", action="store_true", help="only assemble the adapter sharded_state_dict")
    args = ap.parse_args(argv)

    from megatron.core import parallel_state as ps

    import twinkle_specs as ts
    from twinkle_specs.lora import LoraConfig

    vpp = args.vpp if args.vpp > 1 else None
    ps.initialize_model_parallel(
        args.tp,
        args.pp,
        expert_model_parallel_size=args.ep,
        expert_tensor_parallel_size=1,  # LoRA on routed experts needs it (as --expert-tensor-parallel-size 1)
        virtual_pipeline_model_parallel_size=vpp,
    )
    out = Path(args.out)
    lora = LoraConfig.from_peft(args.adapter)
    if vpp:  # a list of model chunks, as Megatron builds them for the interleaved schedule
        model = [ts.build_model(args.hf, lora=lora, vp_stage=i) for i in range(vpp)]
    else:
        model = ts.build_model(args.hf, lora=lora, sequence_parallel=args.sp, parallel_output=True)
    ts.load_peft_adapter(model, args.adapter)
    try:
        if args.roundtrip:
            ts.export_peft_adapter(model, out / "export")
        elif args.sharded:
            assembled = _assemble_sharded(model)
            if assembled is not None:
                torch.save(assembled, out / "sharded.pt")
        else:
            _check_against_peft(model, out)
        # every rank leaves together: a gloo group torn down at interpreter exit while a peer is
        # still talking aborts ("terminate called without an active exception")
        dist.barrier()
    finally:
        ps.destroy_model_parallel()


def _check_against_peft(model, out: Path) -> None:
    from megatron.core import parallel_state as ps
    from test_lora_support import VOCAB, randomize_megatron, tokens

    import twinkle_specs as ts
    from twinkle_specs.lora.peft_io import gather_peft_tensors

    # eval(): no MoE aux-loss gradient (the reference loss has none); gradients still flow.
    model.eval()
    toks = tokens()
    weights = torch.randn(*toks.shape, VOCAB, generator=torch.Generator().manual_seed(7))
    logits = _full_logits(model, toks, grad=True)
    _backward(model, logits, weights)
    _finalize_grads(model)
    grads = gather_peft_tensors(model, grads=True)
    last = ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
    if logits is not None and (full := _gather_logits(logits)) is not None and last:
        torch.save(full[..., :VOCAB], out / "logits_in.pt")
    if grads is not None:
        torch.save(grads, out / "grads.pt")
    randomize_megatron(model, seed=11)
    with torch.no_grad():
        logits = _full_logits(model, toks, grad=False)
        if logits is not None:
            full = _gather_logits(logits)
            if last:
                torch.save(full[..., :VOCAB], out / "logits_out.pt")
    ts.export_peft_adapter(model, out / "export")


if __name__ == "__main__":
    main()
