"""Generates docs/config-fields.md from the field policy table (python -m twinkle_specs.docs)."""

from __future__ import annotations

from .hf_config import FIELD_POLICY, MOE_REQUIRED_FIELDS, REQUIRED_FIELDS, ROPE_KEY_POLICY


def config_fields_markdown() -> str:
    rows = "\n".join(f"| `{k}` | {p} | {what} |" for k, (p, what) in sorted(FIELD_POLICY.items()))
    rope_rows = "\n".join(f"| `{k}` | {types} | {what} |" for k, (types, what) in ROPE_KEY_POLICY.items())
    return (
        "# config.json fields\n\n"
        "Every field of a Hugging Face Qwen config.json is *mapped* to Megatron flags, *checked* (accepted\n"
        "only with the value we can reproduce exactly; anything else is an error naming the field) or\n"
        "*ignored* (with the reason). A field not in this table is an error. Generated from\n"
        "`twinkle_specs.hf_config.FIELD_POLICY` by `python -m twinkle_specs.docs`.\n\n"
        "A field config.json leaves out takes the default of the model type's transformers config class\n"
        "(what transformers itself uses), except those that fix the weights' shapes, which must be present:\n"
        f"{', '.join(f'`{f}`' for f in REQUIRED_FIELDS)} and, for MoE models, "
        f"{', '.join(f'`{f}`' for f in MOE_REQUIRED_FIELDS)} (or `num_local_experts`). Counts must be\n"
        "integers (`2.7` layers is an error, not 2), sizes at least 1, switches true or false.\n\n"
        "| field | policy | Megatron / reason |\n|---|---|---|\n" + rows + "\n\n"
        "## rope_parameters / rope_scaling keys\n\n"
        "Resolved as transformers' `_compute_yarn_parameters` resolves them; any other key, or a key with a\n"
        "rope type that does not take it, is an error naming it. YaRN runs through megatron-core's own\n"
        "`YarnRotaryEmbedding` (same inverse frequencies) and its attention, which multiplies RoPE's cos and\n"
        "sin by the concentration factor `get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)`\n"
        "(as transformers does with `attention_factor`). `build_model` / `transformer_config_from_hf` set\n"
        "the `yarn_*` attributes on the TransformerConfig (megatron-core 0.16 and 0.19); the flags need\n"
        "Megatron-LM core_v0.19+ (`--position-embedding-type yarn`), and `megatron_args_from_hf` / the\n"
        "launcher raise on an older megatron-core. `--no-rope-fusion` comes with them: TE's fused RoPE\n"
        "cannot apply the factor (it falls back to the unfused path on `bshd` and drops it on packed `thd`).\n\n"
        "| key | rope types | Megatron / reason |\n|---|---|---|\n" + rope_rows + "\n" + _hybrid_markdown()
    )


def _hybrid_markdown() -> str:
    from .hybrid_config import (
        HYBRID_FIELD_POLICY,
        HYBRID_ROPE_KEY_POLICY,
        LEFT_ALONE,
        MULTIMODAL_FIELD_POLICY,
    )

    def table(policy: dict[str, tuple[str, str]]) -> str:
        rows = "\n".join(f"| `{k}` | {p} | {what} |" for k, (p, what) in sorted(policy.items()))
        return "| field | policy | Megatron / reason |\n|---|---|---|\n" + rows + "\n"

    rope = "\n".join(f"| `{k}` | {what} |" for k, what in HYBRID_ROPE_KEY_POLICY.items())
    left = "\n".join(f"| `{p}*` | {why} |" for p, why in LEFT_ALONE.items())
    return (
        "\n## Hybrid models: Qwen3-Next, Qwen3.5, Qwen3.5-MoE\n\n"
        "`Qwen3NextForCausalLM`, `Qwen3_5ForCausalLM`, `Qwen3_5MoeForCausalLM`, and the multimodal\n"
        "`Qwen3_5ForConditionalGeneration` / `Qwen3_5MoeForConditionalGeneration` (whose language model is read\n"
        "from `text_config`). Generated from `twinkle_specs.hybrid_config.HYBRID_FIELD_POLICY`.\n\n"
        + table(HYBRID_FIELD_POLICY)
        + "\n### Top level of the multimodal Qwen3.5 configs\n\n"
        + table(MULTIMODAL_FIELD_POLICY)
        + "\n### rope_parameters keys (hybrid models)\n\n| key | Megatron / reason |\n|---|---|\n"
        + rope
        + "\n\n### Checkpoint tensors left alone by rule\n\n"
        "Counted per rule in the load report and copied back byte-identical by export.\n\n"
        "| tensors | rule |\n|---|---|\n" + left + "\n"
    )


if __name__ == "__main__":
    print(config_fields_markdown(), end="")
