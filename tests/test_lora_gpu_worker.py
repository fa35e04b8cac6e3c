"""One NCCL rank of the multi-GPU LoRA test (run by torchrun from tests/test_lora_gpu.py; no tests here).

Transformer Engine path, fp32 parameters, TP=2 with sequence parallelism: loads a PEFT adapter, wraps
the model in megatron's DDP (checking that only adapter factors get gradient buffers), runs a fixed
loss through forward/backward/finalize_model_grads, writes full logits and the adapter gradients (PEFT
names), then saves and reloads an adapter-only dist checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hf", required=True)
    ap.add_argument("--adapter", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tp", type=int, default=2)
    args = ap.parse_args()

    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from test_lora_support import VOCAB, tokens

    import twinkle_specs as ts
    from twinkle_specs.lora import LoraConfig, adapter_parameters
    from twinkle_specs.lora.checkpoint import load_adapter_checkpoint, save_adapter_checkpoint
    from twinkle_specs.lora.peft_io import gather_peft_tensors

    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    ps.initialize_model_parallel(args.tp, 1)
    model_parallel_cuda_manual_seed(0)
    out = Path(args.out)
    lora = LoraConfig.from_peft(args.adapter)
    kwargs = dict(lora=lora, sequence_parallel=True, params_dtype=torch.float32, parallel_output=True)
    model = ts.build_model(args.hf, **kwargs)
    assert model.config.transformer_impl == "transformer_engine"
    ts.load_peft_adapter(model, args.adapter)
    model.eval()  # no dropout, no MoE aux loss: the reference loss has neither

    ddp = DistributedDataParallel(
        config=model.config,
        ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True),
        module=model,
    )
    in_buffers = {id(p) for buf in ddp.buffers + ddp.expert_parallel_buffers for p in buf.params}
    only_adapters = in_buffers == {id(p) for p in adapter_parameters(model)}

    toks = tokens().cuda()
    pos = torch.arange(toks.shape[1], device="cuda").expand_as(toks)
    weights = torch.randn(*toks.shape, VOCAB, generator=torch.Generator().manual_seed(7)).cuda()
    logits = ddp(toks, pos, None)  # [b, s, vocab / tp]
    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    vocab = logits.shape[-1]
    w = torch.zeros(*weights.shape[:-1], vocab * tp, device="cuda")
    w[..., :VOCAB] = weights
    (logits * w[..., rank * vocab : (rank + 1) * vocab]).sum().backward()
    finalize_model_grads([ddp])  # sums sequence-parallel replicas of the replicated factors over TP
    for p in adapter_parameters(model):
        p.grad = p.main_grad.float()
    parts = [torch.empty_like(logits) for _ in range(tp)]
    dist.all_gather(parts, logits.detach().contiguous(), group=ps.get_tensor_model_parallel_group())
    grads = gather_peft_tensors(model, grads=True)
    if dist.get_rank() == 0:
        torch.save(torch.cat(parts, dim=-1)[..., :VOCAB].cpu(), out / "logits.pt")
        torch.save(grads, out / "grads.pt")

    save_adapter_checkpoint(model, out / "ckpt")
    fresh = ts.build_model(args.hf, **kwargs)
    load_adapter_checkpoint(fresh, out / "ckpt")
    same = all(
        torch.equal(a, b) for a, b in zip(adapter_parameters(model), adapter_parameters(fresh), strict=True)
    )
    if dist.get_rank() == 0:
        (out / "checks.json").write_text(
            json.dumps({"only_adapters_in_ddp": only_adapters, "ckpt_equal": same})
        )
    dist.barrier()
    ps.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
