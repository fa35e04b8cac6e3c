"""Conversations → tokens with the loss on the assistant's answers only, for Megatron-LM's ``--sft`` data.

Megatron-LM's SFT dataset (``SFTDataset``: JSONL ``{"messages": [...]}``, several conversations packed per
row with ``cu_seqlens``) asks its tokenizer for ``tokenize_conversation(...) -> (tokens, target)``, ``pad``
and ``eod``. Its own SFT tokenizer knows no Qwen format on megatron-core 0.16.1; on 0.19 its ``default``
format renders each turn alone and asserts that the turns add up to the conversation, which Qwen's
templates break (Qwen2.5 adds a default system prompt, Qwen3 an empty think block in the last answer).

:class:`QwenChatTokenizer` renders the whole conversation with the checkpoint's own chat template (no
hand-written prompt format), tokenizes it once with offsets and trains on exactly the characters of each
assistant message's ChatML block after its ``<|im_start|>assistant\\n`` header, through ``<|im_end|>``:
what the model generates when answering, think block included, the header and everything else masked.

Qwen's pad id is the pitfall: Megatron masks every label equal to ``pad``, and megatron-core 0.16.1
appends ``eod`` after each conversation unless it ends with it, as a target. Here ``pad`` is
``<|endoftext|>`` (never in chat text) and ``eod`` is ``<|im_end|>``, each conversation ending on it (the
template's newline after the last ``<|im_end|>`` is dropped: nothing would learn from it), so nothing
is appended, and the ``<|im_end|>`` that ends each answer is always a target.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from pathlib import Path
from typing import Any

import numpy as np

IGNORE_INDEX = -100  # Megatron's SFT dataset masks targets equal to this
ROLES = ("system", "user", "assistant", "tool")
IM_START, IM_END, END_OF_TEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
_ANSWER = re.compile(re.escape(IM_START) + r"assistant\n(.*?" + re.escape(IM_END) + ")", re.DOTALL)


class ChatDataError(ValueError):
    """A conversation (or the checkpoint's template) cannot give an SFT sample; the message says why."""


class QwenChatTokenizer:
    """Megatron's SFT tokenizer interface over a Qwen checkpoint's own tokenizer and chat template.

    ``base`` (Megatron's tokenizer of the same checkpoint) answers everything else (``vocab_size``,
    ``tokenize``, ...), so the rest of the run sees the tokenizer it built.
    """

    def __init__(self, hf_dir: str | Path, base: Any = None) -> None:
        self.hf_dir = Path(hf_dir)
        self.hf = _hf_tokenizer(str(hf_dir))
        self._base = base
        if not self.hf.chat_template:
            raise ChatDataError(
                f"{self.hf_dir}: the tokenizer has no chat template (tokenizer_config.json chat_template or "
                "chat_template.jinja); --sft trains on the checkpoint's own template, use an instruct "
                "checkpoint's tokenizer files"
            )
        ids = {t: self.hf.convert_tokens_to_ids(t) for t in (IM_START, IM_END, END_OF_TEXT)}
        missing = [t for t, i in ids.items() if i is None or i == self.hf.unk_token_id]
        if missing:
            raise ChatDataError(f"{self.hf_dir}: the tokenizer lacks Qwen's special tokens {missing}")
        self._pad, self._eod = ids[END_OF_TEXT], ids[IM_END]

    @property
    def pad(self) -> int:
        return self._pad

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def eos(self) -> int:
        return self._eod

    @property
    def unique_identifiers(self) -> dict[str, str]:
        """What Megatron's datasets hash into their description: this class, the checkpoint, the template."""
        template = hashlib.sha256(self.hf.chat_template.encode()).hexdigest()
        return {
            "class": type(self).__name__,
            "tokenizer_path": str(self.hf_dir),
            "chat_template_sha256": template,
        }

    @property
    def vocab_size(self) -> int:
        return self._base.vocab_size if self._base is not None else len(self.hf)

    def __getattr__(self, name: str) -> Any:
        base = self.__dict__.get("_base")
        if base is None:
            raise AttributeError(name)
        return getattr(base, name)

    def tokenize_conversation(
        self, conversation: list[dict], return_target: bool, add_generation_prompt: bool
    ) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
        """Token ids of ``conversation`` as its template renders it, and (``return_target``) the targets:
        the token where it belongs to an assistant answer, ``IGNORE_INDEX`` elsewhere."""
        _check(conversation)
        text = self.hf.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        if not add_generation_prompt and text.endswith(IM_END + "\n"):
            text = text[:-1]
        enc = self.hf(text, add_special_tokens=False, return_offsets_mapping=True)
        tokens = np.asarray(enc["input_ids"], dtype=np.int64)
        if not return_target:
            return tokens
        spans = [m.span(1) for m in _ANSWER.finditer(text)]
        answers = sum(m["role"] == "assistant" for m in conversation)
        if len(spans) != answers:
            raise ChatDataError(
                f"the chat template of {self.hf_dir} rendered {len(spans)} ChatML assistant blocks "
                f"({IM_START}assistant ... {IM_END}) for {answers} assistant messages; --sft needs a Qwen "
                "(ChatML) template"
            )
        starts = np.asarray([a for a, _ in enc["offset_mapping"]])
        answer = np.zeros(len(tokens), dtype=bool)
        for a, b in spans:
            answer |= (starts >= a) & (starts < b)
        return tokens, np.where(answer, tokens, IGNORE_INDEX)


@functools.cache
def _hf_tokenizer(hf_dir: str) -> Any:
    """The checkpoint's tokenizer, read once per process: the launcher checks it before Megatron starts,
    and Megatron builds a tokenizer twice (the global one, and pretrain_gpt.py's for its dataset)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(hf_dir)


def _check(conversation: Any) -> None:
    """A conversation is a list of {role, content} messages with at least one non-empty answer."""

    def refuse(why: str) -> None:
        raise ChatDataError(f"{why}; in conversation {json.dumps(conversation)[:300]}")

    if not isinstance(conversation, list) or not conversation:
        refuse("a conversation is a non-empty list of messages")
    for message in conversation:
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            refuse(f"each message needs a role out of {ROLES}")
        if not isinstance(message.get("content"), str):
            refuse(f"a {message['role']} message needs its content as a string")
        if message["role"] == "assistant" and not message["content"].strip():
            refuse("an assistant message is empty (nothing to train on)")
    if not any(m["role"] == "assistant" for m in conversation):
        refuse("no assistant message (nothing to train on)")
