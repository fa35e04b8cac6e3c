"""Builds a model the way stock Megatron-LM (core_v0.19+) pretrain_gpt.py does from our flags: its own
parse_args/validate_args and core_transformer_config_from_args, then GPTModel with qwen_layer_spec and
the args' position embedding; loads the HF weights and saves fp32 logits plus the config's yarn_*.

    python yarn_megatron_lm_worker.py MEGATRON_LM_ROOT HF_DIR OUT_DIR SEQ <Megatron flags>
"""

from __future__ import annotations

import json
import sys
import typing

import typing_extensions

# Megatron-LM core_v0.19's megatron/training imports typing.override (Python 3.12+).
if not hasattr(typing, "override"):
    typing.override = typing_extensions.override

root, hf_dir, out_dir, seq = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
sys.path.insert(0, root)  # this checkout's megatron (core and training) before any installed one

import torch  # noqa: E402
from megatron.training.argument_utils import core_transformer_config_from_args  # noqa: E402
from megatron.training.arguments import parse_args, validate_args  # noqa: E402

sys.argv = ["pretrain_gpt.py", *sys.argv[5:]]
args = parse_args()
validate_args(args, {})
config = core_transformer_config_from_args(args)

import megatron.core  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402

import twinkle_specs as ts  # noqa: E402
from twinkle_specs.parity import _init_single_process  # noqa: E402
from twinkle_specs.spec import qwen_layer_spec  # noqa: E402

ts.apply_patches()  # YaRN and RoPE frequencies on a CPU host; build_model would apply them itself
_init_single_process()
model = GPTModel(  # as Megatron-LM's gpt_builders does
    config=config,
    transformer_layer_spec=qwen_layer_spec,
    vocab_size=args.vocab_size,
    max_sequence_length=args.max_position_embeddings,
    parallel_output=False,
    share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
    position_embedding_type=args.position_embedding_type,
    rotary_percent=args.rotary_percent,
    rotary_base=args.rotary_base,
)
ts.load_hf_weights(model, hf_dir)
tokens = torch.randint(0, args.vocab_size, (2, seq), generator=torch.Generator().manual_seed(1))
with torch.no_grad():
    logits = model.eval()(tokens, torch.arange(seq).expand_as(tokens), None)
torch.save({"tokens": tokens, "logits": logits}, f"{out_dir}/logits.pt")
info = {name: getattr(config, name) for name in dir(config) if name.startswith("yarn_")}
info |= {
    "megatron_core": megatron.core.__version__,
    "megatron_core_file": megatron.core.__file__,
    "rotary_pos_emb": type(model.rotary_pos_emb).__name__,
    "apply_rope_fusion": config.apply_rope_fusion,
}
with open(f"{out_dir}/config.json", "w") as f:
    json.dump(info, f)
