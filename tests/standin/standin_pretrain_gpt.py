"""Stand-in for Megatron-LM's pretrain_gpt.py: builds the GPTModel from --spec, as core_v0.16.1 does."""

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.spec_utils import import_module
from megatron.training import get_args, pretrain
from megatron.training.arguments import core_transformer_config_from_args


def model_provider(pre_process=True, post_process=True):
    args = get_args()
    return GPTModel(
        config=core_transformer_config_from_args(args),
        transformer_layer_spec=import_module(args.spec),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_base=args.rotary_base,
        rotary_percent=args.rotary_percent,
    )


def forward_step(tokens, model):
    inp, labels = tokens[:, :-1], tokens[:, 1:]
    return model(inp, torch.arange(inp.shape[1]).expand_as(inp), None, labels=labels).float().mean()


if __name__ == "__main__":
    pretrain(None, model_provider, None, forward_step, extra_args_provider=None)
