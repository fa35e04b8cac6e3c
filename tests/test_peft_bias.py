"""PEFT adapters that train biases (``bias='all'`` / ``'lora_only'``) are refused by name: Megatron's
LoRA holds factors only, so loading one would drop the trained biases (it used to be blamed on a
different base model)."""

from __future__ import annotations

import peft
import pytest
from test_lora_support import hf_model, single_rank  # noqa: F401  (fixture)

import twinkle_specs as ts
from twinkle_specs import LoraConfig, load_peft_adapter


@pytest.mark.parametrize("bias", ["all", "lora_only"])
def test_bias_adapter_is_refused(lora_checkpoints, tmp_path, single_rank, bias):  # noqa: F811
    hf = lora_checkpoints("qwen2")  # q/k/v have biases: bias='all' saves them in the adapter
    ref = peft.get_peft_model(hf_model(hf), peft.LoraConfig(r=4, target_modules=["q_proj"], bias=bias))
    ref.save_pretrained(tmp_path)
    config = tmp_path / "adapter_config.json"
    with pytest.raises(ValueError, match=rf"{config}: bias='{bias}' is not supported"):
        LoraConfig.from_peft(tmp_path)
    model = ts.build_model(hf, lora=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]))
    with pytest.raises(ValueError, match=rf"{config}: bias='{bias}' is not supported"):
        load_peft_adapter(model, tmp_path)
