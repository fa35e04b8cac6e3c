import json
from pathlib import Path

import torch
from megatron.training import checkpointing
from megatron.training.global_vars import get_args
from megatron.training.initialize import initialize_megatron


def pretrain(
    train_valid_test_dataset_provider,
    model_provider,
    model_type,
    forward_step_func,
    extra_args_provider=None,
    args_defaults=None,
    **kwargs,
):
    """A few SGD steps on one fixed batch; writes losses, the batch and final logits to --save."""
    initialize_megatron(extra_args_provider)
    args = get_args()
    model = model_provider(pre_process=True, post_process=True)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(trainable, lr=args.lr or 0.5)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, args.vocab_size, (args.micro_batch_size, args.seq_length + 1), generator=g)
    losses = []
    for it in range(1, args.train_iters + 1):
        loss = forward_step_func(tokens, model)
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
        if args.save:
            checkpointing.save_checkpoint(it, [model])
    model.eval()
    with torch.no_grad():
        inp = tokens[:, :-1]
        logits = model(inp, torch.arange(inp.shape[1]).expand_as(inp), None)
    out = Path(args.save)
    out.mkdir(parents=True, exist_ok=True)
    (out / "losses.json").write_text(json.dumps(losses))
    inv_freq = model.rotary_pos_emb.inv_freq
    torch.save(
        {"tokens": tokens, "logits": logits, "trainable": len(trainable), "inv_freq": inv_freq},
        out / "run.pt",
    )
