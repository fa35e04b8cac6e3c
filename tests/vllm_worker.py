"""vLLM's prompt log-probabilities with and without a PEFT adapter, for tests/test_vllm_gpu.py. Runs in a
process of its own: vLLM takes the GPU for its engine and comes from its own kit (first on this process's
path, see scripts/gpu/vllm_kit.sh), so neither leaks into the test's process.

    python tests/vllm_worker.py --model HF_DIR --adapter ADAPTER_DIR --rank R --tokens T.json --out O.json
        [--moe-3d] [--serve] [--watchdog S]

``--moe-3d``: the adapter adapts the routed experts in peft's ``target_parameters`` layout (one fused
``gate_up_proj`` and ``down_proj`` per layer). vLLM 0.26 reads that layout by the model's ``is_3d_moe_weight``
flag, which its Qwen3-MoE and Qwen3-Next lack (their fallback splits gate and up as GPT-OSS interleaves
them); the engine's ``enable_mixed_moe_lora_format`` with the request's ``is_3d_lora_weight`` takes it as peft
wrote it. Its Qwen3.5-MoE has the flag and needs neither.

``--serve``: the same engine options as ``vllm serve``'s flags, the adapter in its ``--lora-modules`` JSON form,
and the log-probabilities from the OpenAI-compatible server's ``/v1/completions`` (``prompt_logprobs``), as a
user's client would read them; otherwise vLLM's Python API (``LLM`` and a ``LoRARequest``).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ADAPTER_NAME = "twinkle"
START = time.monotonic()
REQUEST_TIMEOUT = 60  # seconds, each of the server's requests (a few short prompts) and its stop


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--adapter", required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--tokens", required=True, help="JSON: a list of prompts, each a list of token ids")
    ap.add_argument("--out", required=True)
    ap.add_argument("--moe-3d", action="store_true")
    ap.add_argument("--serve", action="store_true", help="through vllm serve and its OpenAI API")
    ap.add_argument(
        "--watchdog",
        type=float,
        default=480.0,
        help="seconds after which every thread's stack goes to stderr and the process exits (a hang shows where)",
    )
    args = ap.parse_args()
    faulthandler.dump_traceback_later(args.watchdog, exit=True)
    # the kit leaves flashinfer out; vLLM's sampler imports it on CUDA unless told not to (greedy, one token)
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    prompts = json.loads(Path(args.tokens).read_text())
    options = engine_options(args, prompts)
    if args.serve:
        result = served_logprobs(args, options, prompts)
    else:
        result = offline_logprobs(args, options, prompts)
    Path(args.out).write_text(json.dumps(result))


def engine_options(args: argparse.Namespace, prompts: list[list[int]]) -> dict:
    """vLLM's engine arguments for the checkpoint: ``LLM``'s keywords, and ``vllm serve``'s flags by name."""
    config = json.loads((Path(args.model) / "config.json").read_text())
    # a multimodal checkpoint (Qwen3.5) on token-id prompts: its language model only, no vision tower
    multimodal = "vision_config" in config
    # Gated DeltaNet layers: vLLM's own Triton kernels for their prefill (on Hopper it would pick
    # flashinfer's, which the kit leaves out)
    gated_delta_net = "linear_num_value_heads" in config.get("text_config", config)
    return dict(
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


def adapter_fields(args: argparse.Namespace) -> dict:
    """The adapter's request fields beside its name and path: ``LoRARequest``'s keywords, and the same keys
    in ``--lora-modules``' JSON."""
    return {"is_3d_lora_weight": True} if args.moe_3d else {}


def offline_logprobs(args: argparse.Namespace, options: dict, prompts: list[list[int]]) -> dict:
    """Through vLLM's Python API: ``LLM`` and a ``LoRARequest``."""
    # the engine in this process rather than a child of its own: one process to clean up
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    llm = LLM(model=args.model, **options)
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
    request = LoRARequest(ADAPTER_NAME, 1, args.adapter, **adapter_fields(args))

    def logprobs(lora: LoRARequest | None) -> list[list[float]]:
        """Each prompt's log-probability of its own next token, position 1 on (vLLM gives none for 0)."""
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts], params, lora_request=lora, use_tqdm=False
        )
        return [
            [pos[t].logprob for pos, t in zip(o.prompt_logprobs[1:], p[1:], strict=True)]
            for o, p in zip(outs, prompts, strict=True)
        ]

    return {"base": logprobs(None), "lora": logprobs(request), "vllm": vllm.__version__}


def serve_flags(options: dict) -> list[str]:
    """``vllm serve``'s flags for the engine options (``True`` is the bare flag)."""
    flags = []
    for key, value in options.items():
        flags.append("--" + key.replace("_", "-"))
        if value is not True:
            flags.append(str(value))
    return flags


def served_logprobs(args: argparse.Namespace, options: dict, prompts: list[list[int]]) -> dict:
    """Through ``vllm serve`` (its own process group, stopped on the way out) and its OpenAI API."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    module = {"name": ADAPTER_NAME, "path": args.adapter, **adapter_fields(args)}
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", args.model, "--host", "127.0.0.1"]
    cmd += ["--port", str(port), *serve_flags(options), "--lora-modules", json.dumps(module)]
    print("vllm serve:", " ".join(cmd[3:]), flush=True)
    server = subprocess.Popen(cmd, start_new_session=True)  # its output goes where this process's goes
    url = f"http://127.0.0.1:{port}"
    try:
        # within the watchdog, leaving the requests (a minute each at most) and the server's stop
        _wait_healthy(url, server, deadline=START + args.watchdog - 4 * REQUEST_TIMEOUT)
        version = json.loads(urllib.request.urlopen(f"{url}/version", timeout=REQUEST_TIMEOUT).read())[
            "version"
        ]
        return {
            "base": _completion_logprobs(url, args.model, prompts),
            "lora": _completion_logprobs(url, ADAPTER_NAME, prompts),
            "vllm": version,
        }
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=REQUEST_TIMEOUT)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def _wait_healthy(url: str, server: subprocess.Popen, deadline: float) -> None:
    while True:
        if server.poll() is not None:
            raise RuntimeError(
                f"vllm serve exited with {server.returncode} before it was healthy (its log above)"
            )
        try:
            if urllib.request.urlopen(f"{url}/health", timeout=5).status == 200:
                return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"vllm serve not healthy at {url}/health in time (its log above)")
        time.sleep(2)


def _completion_logprobs(url: str, model: str, prompts: list[list[int]]) -> list[list[float]]:
    """``/v1/completions`` on token-id prompts with vLLM's ``prompt_logprobs``: each prompt's log-probability
    of its own next token, position 1 on; ``model`` is the served base model or the adapter's name."""
    body = dict(model=model, prompt=prompts, max_tokens=1, temperature=0.0, prompt_logprobs=0)
    request = urllib.request.Request(
        f"{url}/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        reply = json.loads(urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT).read())
    except urllib.error.HTTPError as err:
        raise RuntimeError(f"/v1/completions for {model}: {err.code} {err.read().decode()[:2000]}") from err
    choices = sorted(reply["choices"], key=lambda c: c["index"])
    return [
        [pos[str(t)]["logprob"] for pos, t in zip(c["prompt_logprobs"][1:], p[1:], strict=True)]
        for c, p in zip(choices, prompts, strict=True)
    ]


if __name__ == "__main__":
    main()
