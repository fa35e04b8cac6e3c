"""vLLM's prompt log-probabilities with and without a PEFT adapter, for tests/test_vllm_gpu.py. Runs in a
process of its own: vLLM takes the GPU for its engine and comes from its own kit (first on this process's
path, see scripts/gpu/vllm_kit.sh), so neither leaks into the test's process.

    python tests/vllm_worker.py --model HF_DIR --adapter ADAPTER_DIR --rank R --tokens T.json --out O.json
        [--moe-3d] [--watchdog S]

``--moe-3d``: the adapter adapts the routed experts in peft's ``target_parameters`` layout (one fused
``gate_up_proj`` and ``down_proj`` per layer). vLLM 0.26 reads that layout by the model's ``is_3d_moe_weight``
flag, which its Qwen3-MoE and Qwen3-Next lack (their fallback splits gate and up as GPT-OSS interleaves
them); the engine's ``enable_mixed_moe_lora_format`` with the request's ``is_3d_lora_weight`` takes it as peft
wrote it. Its Qwen3.5-MoE has the flag and needs neither.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--adapter", required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--tokens", required=True, help="JSON: a list of prompts, each a list of token ids")
    ap.add_argument("--out", required=True)
    ap.add_argument("--moe-3d", action="store_true")
    ap.add_argument(
        "--watchdog",
        type=float,
        default=480.0,
        help="seconds after which every thread's stack goes to stderr and the process exits (a hang shows where)",
    )
    args = ap.parse_args()
    faulthandler.dump_traceback_later(args.watchdog, exit=True)
    # the engine in this process rather than a child of its own: one process to clean up
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # the kit leaves flashinfer out; vLLM's sampler imports it on CUDA unless told not to (greedy, one token)
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")

    import vllm
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    prompts = json.loads(Path(args.tokens).read_text())
    config = json.loads((Path(args.model) / "config.json").read_text())
    # a multimodal checkpoint (Qwen3.5) on token-id prompts: its language model only, no vision tower
    multimodal = "vision_config" in config
    # Gated DeltaNet layers: vLLM's own Triton kernels for their prefill (on Hopper it would pick
    # flashinfer's, which the kit leaves out)
    gated_delta_net = "linear_num_value_heads" in config.get("text_config", config)
    llm = LLM(
        model=args.model,
        dtype="bfloat16",
        enforce_eager=True,
        skip_tokenizer_init=True,
        enable_lora=True,
        max_lora_rank=args.rank,
        max_loras=1,
        max_model_len=max(len(p) for p in prompts) + 8,
        gpu_memory_utilization=0.3,
        seed=0,
        **({"enable_mixed_moe_lora_format": True} if args.moe_3d else {}),
        **({"language_model_only": True} if multimodal else {}),
        **({"gdn_prefill_backend": "triton"} if gated_delta_net else {}),
    )
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
    request = LoRARequest("twinkle", 1, args.adapter, **({"is_3d_lora_weight": True} if args.moe_3d else {}))

    def logprobs(lora: LoRARequest | None) -> list[list[float]]:
        """Each prompt's log-probability of its own next token, position 1 on (vLLM gives none for 0)."""
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts], params, lora_request=lora, use_tqdm=False
        )
        return [
            [pos[t].logprob for pos, t in zip(o.prompt_logprobs[1:], p[1:], strict=True)]
            for o, p in zip(outs, prompts, strict=True)
        ]

    result = {"base": logprobs(None), "lora": logprobs(request), "vllm": vllm.__version__}
    Path(args.out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
