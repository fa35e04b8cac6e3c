"""The subset of Megatron-LM's flags the launcher emits, parsed the way Megatron-LM does."""

import argparse

import torch
import torch.nn.functional as F
from megatron.core.transformer.transformer_config import TransformerConfig


def add_megatron_arguments(parser):
    ints = [
        "--num-layers",
        "--hidden-size",
        "--ffn-hidden-size",
        "--num-attention-heads",
        "--num-query-groups",
        "--kv-channels",
        "--max-position-embeddings",
        "--make-vocab-size-divisible-by",
        "--num-experts",
        "--moe-router-topk",
        "--moe-ffn-hidden-size",
        "--moe-shared-expert-intermediate-size",
        "--vocab-size",
        "--seq-length",
        "--micro-batch-size",
        "--train-iters",
        "--save-interval",
        "--rotary-base",  # an int in Megatron-LM too
    ]
    floats_default = {"--rotary-percent": 1.0}
    floats = [
        "--attention-dropout",
        "--hidden-dropout",
        "--init-method-std",
        "--moe-aux-loss-coeff",
        "--lr",
    ]
    strs = [
        "--normalization",
        "--position-embedding-type",
        "--moe-router-load-balancing-type",
        "--tokenizer-type",
        "--tokenizer-model",
        "--save",
        "--load",
    ]
    switches = [
        "--group-query-attention",
        "--swiglu",
        "--rotary-interleaved",
        "--qk-layernorm",
        "--add-qkv-bias",
        "--untie-embeddings-and-output-weights",
        "--bf16",
        "--fp16",
        "--moe-router-pre-softmax",
        "--moe-shared-expert-gate",
    ]
    for f in ints:
        parser.add_argument(f, type=int, default=None)
    for f in floats:
        parser.add_argument(f, type=float, default=None)
    for f in strs:
        parser.add_argument(f, type=str, default=None)
    for f in switches:
        parser.add_argument(f, action="store_true")
    for f, default in floats_default.items():
        parser.add_argument(f, type=float, default=default)
    # Megatron-LM generates these from TransformerConfig fields: the dest is the field's name.
    parser.add_argument("--norm-epsilon", dest="layernorm_epsilon", type=float, default=1e-5)
    parser.add_argument("--disable-bias-linear", dest="add_bias_linear", action="store_false")
    parser.add_argument("--moe-router-score-function", type=str, default="softmax")
    parser.add_argument("--apply-layernorm-1p", dest="layernorm_zero_centered_gamma", action="store_true")
    parser.add_argument("--spec", nargs="*", default=None)
    return parser


def parse_args(extra_args_provider=None, ignore_unknown_args=False):
    parser = argparse.ArgumentParser(description="Megatron-LM Arguments (stand-in)", allow_abbrev=False)
    parser = add_megatron_arguments(parser)
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    args = parser.parse_args()
    multiple = args.make_vocab_size_divisible_by or 128
    args.padded_vocab_size = -(-(args.vocab_size + 1) // multiple) * multiple  # NullTokenizer: vocab + 1
    return args


def core_transformer_config_from_args(args):
    return TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        kv_channels=args.kv_channels,
        normalization=args.normalization,
        layernorm_epsilon=args.layernorm_epsilon,
        layernorm_zero_centered_gamma=args.layernorm_zero_centered_gamma,
        gated_linear_unit=args.swiglu,
        activation_func=F.silu,
        add_bias_linear=args.add_bias_linear,
        rotary_interleaved=args.rotary_interleaved,
        add_qkv_bias=args.add_qkv_bias,
        qk_layernorm=args.qk_layernorm,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        num_moe_experts=args.num_experts,
        moe_router_topk=args.moe_router_topk or 2,
        moe_ffn_hidden_size=args.moe_ffn_hidden_size,
        moe_router_pre_softmax=args.moe_router_pre_softmax,
        moe_router_score_function=args.moe_router_score_function,
        moe_token_dispatcher_type="allgather",
        moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
        moe_shared_expert_gate=args.moe_shared_expert_gate,
        use_cpu_initialization=True,
        transformer_impl="local",
        params_dtype=torch.float32,
        bias_activation_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
    )
