"""Generates docs/config-fields.md from the field policy table (python -m twinkle_specs.docs)."""

from __future__ import annotations

from .hf_config import FIELD_POLICY


def config_fields_markdown() -> str:
    rows = "\n".join(f"| `{k}` | {p} | {what} |" for k, (p, what) in sorted(FIELD_POLICY.items()))
    return (
        "# config.json fields\n\n"
        "Every field of a Hugging Face Qwen config.json is *mapped* to Megatron flags, *checked* (accepted\n"
        "only with the value we can reproduce exactly; anything else is an error naming the field) or\n"
        "*ignored* (with the reason). A field not in this table is an error. Generated from\n"
        "`twinkle_specs.hf_config.FIELD_POLICY` by `python -m twinkle_specs.docs`.\n\n"
        "| field | policy | Megatron / reason |\n|---|---|---|\n" + rows + "\n"
    )


if __name__ == "__main__":
    print(config_fields_markdown(), end="")
