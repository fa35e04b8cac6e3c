"""Conversations, a small Qwen-style (ChatML) tokenizer and two chat templates for the SFT tests.

The templates follow the two shapes of Qwen's own that matter for loss masking: Qwen2.5's (a default
system prompt when the conversation has none) and Qwen3's (an empty think block opening the last answer
after the last user message). ``tagged=True`` adds transformers' ``{% generation %}`` markers around each
answer, so that transformers itself computes the assistant mask the tests compare against.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import torch

from twinkle_specs.sft import IGNORE_INDEX

_WORDS = "alpha beta gamma delta qwen megatron tensor pipeline expert adapter token answer question".split()
_QWEN2_5 = (
    "{%- if messages[0].role != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}{%- if m.role == 'assistant' %}{{- '<|im_start|>assistant\\n' }}"
    "OPEN{{- m.content + '<|im_end|>' }}CLOSE{{- '\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
_QWEN3 = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- for m in messages %}{%- if m.role == 'assistant' %}{{- '<|im_start|>assistant\\n' }}OPEN"
    "{%- if loop.last and loop.index0 > ns.last_user %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{{- m.content + '<|im_end|>' }}CLOSE{{- '\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
)
TEMPLATES = {"qwen2_5": _QWEN2_5, "qwen3": _QWEN3}
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def template(style: str, tagged: bool = False) -> str:
    open_, close = ("{% generation %}", "{% endgeneration %}") if tagged else ("", "")
    return TEMPLATES[style].replace("OPEN", open_).replace("CLOSE", close)


def conversations(n: int = 6, seed: int = 0) -> list[list[dict]]:
    """Short conversations of random words: with and without a system message, one to three turns."""
    rng = random.Random(seed)

    def words(k: int) -> str:
        return " ".join(rng.choice(_WORDS) for _ in range(k))

    out = []
    for i in range(n):
        conv = [{"role": "system", "content": words(4)}] if i % 2 else []
        for _ in range(1 + i % 3):
            conv += [{"role": "user", "content": words(rng.randint(3, 8))}]
            conv += [{"role": "assistant", "content": words(rng.randint(2, 9))}]
        out.append(conv)
    return out


def save_tokenizer(out: Path, style: str, vocab_size: int = 200) -> Path:
    """A BPE tokenizer over the characters of rendered conversations (under ``vocab_size`` ids, so that
    it fits the tiny models' embeddings), Qwen's special tokens, and the ``style`` chat template."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"\s+|\w+|[^\w\s]+"), behavior="isolated")
    render = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE()))
    render.chat_template = template(style)
    corpus = [render.apply_chat_template(c, tokenize=False) for c in conversations(40, seed=1)]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token=None
    )
    fast.chat_template = template(style)
    fast.save_pretrained(out)
    return out


def write_jsonl(path: Path, convs: list[list[dict]]) -> Path:
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in convs))
    return path


def pack(tokenizer, convs: list[list[dict]], length: int) -> dict[str, torch.Tensor]:
    """One packed row as Megatron-LM's SFTDataset makes it (eod after a conversation unless it ends on
    it, positions restarting per conversation, pad to ``length`` + 1 in the last one, labels shifted by
    one, loss mask off on pad and prompt labels); micro-batch 1, the batch dimension included."""
    tokens, targets, positions, bounds = [], [], [], [0]
    for conv in convs:
        t, g = (x.tolist() for x in tokenizer.tokenize_conversation(conv, True, False))
        if t[-1] != tokenizer.eod:
            t, g = t + [tokenizer.eod], g + [tokenizer.eod]
        tokens += t
        targets += g
        positions += range(len(t))
        bounds.append(len(tokens))
    assert len(tokens) <= length, "the test conversations must fit the row"
    pad = length + 1 - len(tokens)
    tokens += [tokenizer.pad] * pad
    targets += [tokenizer.pad] * pad
    positions += range(positions[-1] + 1, positions[-1] + 1 + pad)
    bounds[-1] = length
    labels = torch.tensor(targets[1:])
    loss_mask = ((labels != tokenizer.pad) & (labels != -100)).float()
    return {
        "tokens": torch.tensor(tokens[:-1])[None],
        "labels": labels[None],
        "loss_mask": loss_mask[None],
        "position_ids": torch.tensor(positions[:-1])[None],
        "cu_seqlens": torch.tensor(bounds, dtype=torch.int32),
    }


def assistant_masks(hf_dir: Path, style: str, convs: list[list[dict]]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each conversation's token ids and transformers' own assistant mask (the tagged template)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf_dir)
    out = []
    for conv in convs:
        enc = tok.apply_chat_template(
            conv,
            chat_template=template(style, tagged=True),
            return_dict=True,
            return_assistant_tokens_mask=True,
        )
        out.append((np.asarray(enc["input_ids"]), np.asarray(enc["assistant_masks"], dtype=bool)))
    return out


def answer_loss(model, hf_dir: Path, style: str, convs: list[list[dict]]) -> tuple[float, int]:
    """A transformers (or PEFT) ``model``'s mean loss on the answers of each conversation run alone, by
    transformers' own assistant mask, on the model's device; and the number of answer targets."""
    device = next(model.parameters()).device
    total, count = 0.0, 0
    with torch.no_grad():
        for ids, mask in assistant_masks(hf_dir, style, convs):
            logits = model(torch.from_numpy(ids)[None].to(device)).logits[0].double()
            labels = torch.from_numpy(np.where(mask, ids, IGNORE_INDEX)).to(device)
            total += torch.nn.functional.cross_entropy(logits[:-1], labels[1:], reduction="sum").item()
            count += int(mask[1:].sum())
    return total / count, count
