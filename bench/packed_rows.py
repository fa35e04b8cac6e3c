"""Packed SFT rows for the ``twinkle_lora_sft`` variant: synthetic conversations in one row of ``seq_len``
tokens, laid out as Megatron-LM's ``--sft`` data is (megatron/training/datasets/sft_dataset.py,
``SFTDataset``) and fed to the model as its ``get_batch`` does (THD ``PackedSeqParams``).

Conversation lengths are log-normal, median ``LENGTH_MEDIAN`` tokens, sigma ``LENGTH_SIGMA`` (mean ~596,
90 % between ~131 and ~1545 tokens: chat SFT data is heavy-tailed), at least ``MIN_LENGTH``; each is a
prompt (``PROMPT_SHARE`` of it, uniform) and an answer (the rest, ending on ``EOD``). They are packed in
the order drawn until the next one does not fit; one longer than the row alone is cut at the row's end
(SFTDataset truncates on the right). As in SFTDataset the row then holds ``seq_len + 1`` tokens (the +1
for the shifted labels), the tail padded with ``PAD``: the padding belongs to the last sequence
(``cu_seqlens`` ends at ``seq_len``, its positions go on counting), the labels are the next tokens with
prompts as ``IGNORE_INDEX``, and the loss mask is off where a label is pad or ignored, i.e. on answers
only. The loss is the masked mean over the answer tokens.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass

import torch

LENGTH_MEDIAN = 450
LENGTH_SIGMA = 0.75
MIN_LENGTH = 16
PROMPT_SHARE = (0.2, 0.5)
IGNORE_INDEX = -100  # Megatron-LM's SFT targets of prompt tokens
PAD, EOD = 0, 1  # content tokens are drawn from the rest of the vocabulary


def conversation_lengths(seed: int) -> Iterator[tuple[int, int]]:
    """(prompt, answer) token counts of a seeded, endless stream of synthetic conversations."""
    rng = random.Random(seed)
    while True:
        n = max(MIN_LENGTH, round(rng.lognormvariate(math.log(LENGTH_MEDIAN), LENGTH_SIGMA)))
        prompt = min(n - 1, max(1, round(n * rng.uniform(*PROMPT_SHARE))))
        yield prompt, n - prompt


def pack_lengths(seq_len: int, seed: int) -> list[tuple[int, int]]:
    """The (prompt, answer) lengths of one row: conversations in the order drawn while the next still fits,
    the first cut to ``seq_len`` where it alone is longer."""
    row: list[tuple[int, int]] = []
    used = 0
    for prompt, answer in conversation_lengths(seed):
        if used + prompt + answer > seq_len:
            if not row:
                prompt = min(prompt, seq_len - 1)
                row.append((prompt, seq_len - prompt))
            return row
        row.append((prompt, answer))
        used += prompt + answer
    raise AssertionError("unreachable: the stream is endless")


@dataclass(frozen=True)
class PackedRow:
    """One packed row (micro-batch 1, the batch dimension included) and what it holds."""

    tokens: torch.Tensor  # [1, seq_len]
    labels: torch.Tensor  # [1, seq_len]: the next token; IGNORE_INDEX after a prompt token, PAD in padding
    loss_mask: torch.Tensor  # [1, seq_len] float: 1 where the label is an answer token
    position_ids: torch.Tensor  # [1, seq_len]: from 0 in each conversation, counting on into the padding
    cu_seqlens: torch.Tensor  # int32 [conversations + 1]; the last bound is seq_len (padding joins the last)
    sequence_lengths: list[int]  # each conversation's tokens (no padding)

    @property
    def useful_tokens(self) -> int:
        return sum(self.sequence_lengths)

    @property
    def answer_tokens(self) -> int:
        return int(self.loss_mask.sum())

    @property
    def max_seqlen(self) -> int:
        return int((self.cu_seqlens[1:] - self.cu_seqlens[:-1]).max())


def packed_row(seq_len: int, vocab_size: int, seed: int) -> PackedRow:
    """A row of :func:`pack_lengths` conversations with random content tokens, as SFTDataset builds it."""
    gen = torch.Generator().manual_seed(seed)
    tokens: list[int] = []
    targets: list[int] = []
    positions: list[int] = []
    bounds = [0]
    convs = pack_lengths(seq_len, seed)
    for prompt, answer in convs:
        ids = torch.randint(EOD + 1, vocab_size, (prompt + answer,), generator=gen).tolist()
        ids[-1] = EOD
        tokens += ids
        targets += [IGNORE_INDEX] * prompt + ids[prompt:]
        positions += range(len(ids))
        bounds.append(len(tokens))
    pad = seq_len + 1 - len(tokens)
    tokens += [PAD] * pad
    targets += [PAD] * pad
    positions += range(positions[-1] + 1, positions[-1] + 1 + pad)
    bounds[-1] = seq_len
    labels = torch.tensor(targets[1:])
    loss_mask = ((labels != PAD) & (labels != IGNORE_INDEX)).float()
    return PackedRow(
        tokens=torch.tensor(tokens[:-1])[None],
        labels=labels[None],
        loss_mask=loss_mask[None],
        position_ids=torch.tensor(positions[:-1])[None],
        cu_seqlens=torch.tensor(bounds, dtype=torch.int32),
        sequence_lengths=[p + a for p, a in convs],
    )
