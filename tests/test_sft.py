"""Supervised fine-tuning on conversations (``--sft``), portable path, fp32 CPU.

The tokenizer side: the loss covers exactly the answers (transformers' own assistant mask is the
reference), with clear errors for data and templates that cannot give one. The model side: several
conversations packed into one row (THD, ``cu_seqlens``) give each conversation the logits it has alone,
and the loss of the packed row with LoRA equals transformers + PEFT's on the conversations unpacked.
"""

from __future__ import annotations

import numpy as np
import peft
import pytest
import torch
from chat_data import answer_loss, assistant_masks, conversations, pack, save_tokenizer
from conftest import cpu_reference, megatron_training_root
from hybrid_models import make_hybrid_checkpoint
from models import make_checkpoint
from test_lora_support import hf_model, randomize_peft

import twinkle_specs as ts
from twinkle_specs import LoraConfig, load_peft_adapter
from twinkle_specs.sft import IGNORE_INDEX, ChatDataError, QwenChatTokenizer

pytestmark = cpu_reference

LOSS_RTOL = 1e-5  # the packed loss against transformers + peft unpacked, relative; measured <= 2.5e-8 (torch 2.13 CPU)
LOGITS_TOL = 2e-5  # max |Δ| of a packed sequence's logits against the sequence alone; measured <= 5.6e-6
ROW = 512  # tokens per packed row: the six test conversations (about 490 tokens) and some padding
STYLE = {"qwen2_5": "qwen2_5"}  # the template shape each kind is tested with; qwen3's otherwise


@pytest.fixture(scope="module")
def chat_checkpoint(tmp_path_factory):
    root, made = tmp_path_factory.mktemp("hf-chat"), {}

    def get(kind: str):
        if kind not in made:
            out = root / kind
            if kind.startswith(("qwen3_next", "qwen3_5")):
                make_hybrid_checkpoint(kind, out)
            else:
                make_checkpoint(kind, out)
            made[kind] = save_tokenizer(out, STYLE.get(kind, "qwen3"))
        return made[kind]

    return get


@pytest.mark.parametrize("style", ["qwen2_5", "qwen3"])
def test_answer_tokens_are_transformers_assistant_mask(style, tmp_path):
    """Default system prompt (Qwen2.5) and the think block of the last answer (Qwen3) included."""
    tok = QwenChatTokenizer(save_tokenizer(tmp_path, style))
    for conv, (ids, mask) in zip(
        conversations(), assistant_masks(tmp_path, style, conversations()), strict=True
    ):
        tokens, target = tok.tokenize_conversation(conv, return_target=True, add_generation_prompt=False)
        # the template's newline after the last <|im_end|> is dropped (it ends on eod, nothing is appended)
        assert tokens[-1] == tok.eod and ids[len(tokens) :].tolist() == [tok.hf.convert_tokens_to_ids("\n")]
        np.testing.assert_array_equal(tokens, ids[: len(tokens)])
        np.testing.assert_array_equal(target != IGNORE_INDEX, mask[: len(tokens)])
        np.testing.assert_array_equal(target[mask[: len(tokens)]], tokens[mask[: len(tokens)]])
        assert mask.sum() > 0 and (~mask).sum() > 0
    assert tok.pad == tok.hf.convert_tokens_to_ids("<|endoftext|>") != tok.eod


def test_conversation_errors_say_what_is_wrong(tmp_path):
    tok = QwenChatTokenizer(save_tokenizer(tmp_path, "qwen3"))
    bad = {
        "no assistant message": [{"role": "user", "content": "alpha"}],
        "an assistant message is empty": [
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": " "},
        ],
        "needs a role out of": [{"role": "robot", "content": "a"}, {"role": "assistant", "content": "b"}],
        "content as a string": [{"role": "user", "content": ["a"]}, {"role": "assistant", "content": "b"}],
        "non-empty list of messages": [],
    }
    for why, conv in bad.items():
        with pytest.raises(ChatDataError, match=why):
            tok.tokenize_conversation(conv, True, False)


def test_template_and_tokenizer_errors_name_the_checkpoint(tmp_path):
    from transformers import AutoTokenizer

    hf = save_tokenizer(tmp_path / "plain", "qwen3")
    raw = AutoTokenizer.from_pretrained(hf)
    raw.chat_template = None
    raw.save_pretrained(tmp_path / "no-template")
    with pytest.raises(
        ChatDataError, match=f"{tmp_path / 'no-template'}: the tokenizer has no chat template"
    ):
        QwenChatTokenizer(tmp_path / "no-template")
    raw.chat_template = "{% for m in messages %}{{ m.role + ': ' + m.content + '\\n' }}{% endfor %}"
    raw.save_pretrained(tmp_path / "not-chatml")
    with pytest.raises(ChatDataError, match="rendered 0 ChatML assistant blocks .* for 1 assistant messages"):
        QwenChatTokenizer(tmp_path / "not-chatml").tokenize_conversation(conversations(1)[0], True, False)


def _packed_params(cu: torch.Tensor, padded: torch.Tensor | None = None, **fields):
    """megatron's THD PackedSeqParams as its get_batch builds them: the bounds, the padded ones where given."""
    from megatron.core.packed_seq_params import PackedSeqParams

    spans = cu if padded is None else padded
    longest = int((spans[1:] - spans[:-1]).max())
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=padded,
        cu_seqlens_kv_padded=padded,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
        **fields,
    )


def _peft_pair(hf, tmp_path, targets):
    """A random PEFT adapter on ``hf``, and our LoRA model with it loaded."""
    ref = peft.get_peft_model(hf_model(hf), peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    randomize_peft(ref)
    ref.save_pretrained(tmp_path / "adapter")
    model = ts.build_model(hf, lora=LoraConfig.from_peft(tmp_path / "adapter"), parallel_output=False).eval()
    load_peft_adapter(model, tmp_path / "adapter")
    return ref.eval(), model


# every linear (the hybrids' Gated DeltaNet projections by name: "all-linear" would take in Qwen3-Next's
# shared_expert_gate, which LoRA here does not adapt)
_LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TARGETS = {
    "qwen3": "all-linear",
    "qwen2_5": "all-linear",
    "qwen3_moe": "all-linear",
    "qwen3_next": _LINEARS + ["in_proj_qkvz", "in_proj_ba", "out_proj"],
    "qwen3_5": _LINEARS + ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"],
    "qwen3_5_moe": _LINEARS + ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"],
}
KINDS = list(TARGETS)


@pytest.mark.parametrize("kind", KINDS)
def test_packed_row_matches_peft_on_each_conversation(kind, chat_checkpoint, tmp_path, megatron_single):
    hf = chat_checkpoint(kind)
    style = STYLE.get(kind, "qwen3")
    tok, convs = QwenChatTokenizer(hf), conversations()
    row = pack(tok, convs, ROW)
    ref, model = _peft_pair(hf, tmp_path, TARGETS[kind])

    reference, count = answer_loss(ref, hf, style, convs)  # transformers + peft, each conversation alone

    params = _packed_params(row["cu_seqlens"])
    with torch.no_grad():
        losses = model(
            row["tokens"], row["position_ids"], None, labels=row["labels"], packed_seq_params=params
        )
        logits = model(row["tokens"], row["position_ids"], None, packed_seq_params=params)[0]
    ours = ((losses.double() * row["loss_mask"]).sum() / row["loss_mask"].sum()).item()
    assert row["loss_mask"].sum() == count
    print(f"{kind}: packed loss {ours:.8f}, transformers + peft {reference:.8f}")
    assert abs(ours - reference) <= LOSS_RTOL * reference

    worst = 0.0
    bounds = row["cu_seqlens"].tolist()
    for i, conv in enumerate(convs):
        a, b = bounds[i], bounds[i + 1]
        alone = torch.as_tensor(tok.tokenize_conversation(conv, False, False))[None]
        with torch.no_grad():
            own = model(alone, torch.arange(alone.shape[1])[None], None)[0]
        n = alone.shape[1]
        assert row["tokens"][0, a : a + n].tolist() == alone[0].tolist() and b - a >= n
        worst = max(worst, (logits[a : a + n] - own).abs().max().item())
    print(f"{kind}: packed vs alone max|Δ logits| = {worst:.3g}")
    assert worst <= LOGITS_TOL


def test_layers_of_a_micro_batch_share_one_packed_row():
    """The packed sequences every Gated DeltaNet or FlashAttention-4 layer of a micro-batch restarts at are
    read from the bounds once (a host wait on a GPU) and their tensors made once; the padded bounds where
    given; tokens after the last bound are one more span; another micro-batch (new bounds) gets its own; a
    row that is not one THD micro-batch is refused."""
    from twinkle_specs.gdn import packed_row
    from twinkle_specs.packed_sequences import PackedRow

    cu = torch.tensor([0, 5, 6, 12], dtype=torch.int32)
    params, x = _packed_params(cu), torch.zeros(1, 12, 4)
    row = packed_row(params, x)
    assert row.spans == [(0, 5), (5, 6), (6, 12)] and row.longest == 6
    assert PackedRow.of(params, 12, x.device) is row and row.starts is row.starts
    assert row.starts.tolist() == [0] * 5 + [5] + [6] * 6 and row.cu_seqlens.tolist() == [0, 5, 6, 12]
    assert row.cu_seqlens_int32.dtype == torch.int32 and row.cu_seqlens_int32.tolist() == [0, 5, 6, 12]
    assert row.places(2).tolist() == [2, 3, 4, 5, 6, 9, 12, 13, 14, 15, 16, 17]  # 2 zeros before each
    assert PackedRow.of(params, 14, x.device).spans == [(0, 5), (5, 6), (6, 12), (12, 14)]
    padded = _packed_params(cu)
    padded.cu_seqlens_q_padded = torch.tensor([0, 8, 12], dtype=torch.int32)
    other = packed_row(padded, x)
    assert other is not row and other.spans == [(0, 8), (8, 12)] and other.longest == 8
    with pytest.raises(NotImplementedError, match="micro-batch 1"):
        packed_row(params, torch.zeros(2, 12, 4))
    key = id(cu)
    assert key in PackedRow._rows
    del params, padded, cu  # the micro-batch's bounds go: so does what was kept for them
    assert key not in PackedRow._rows


def test_packed_rows_under_te_cuda_graphs_are_refused_with_what_to_do(chat_checkpoint, megatron_single):
    """Plain pretrain_gpt.py (no launcher to refuse the flags): a packed micro-batch reaching a layer's TE
    CUDA graph replay gets a message naming the flags; Megatron's other replay asserts stay its own."""
    from twinkle_specs.spec import QwenTransformerLayer

    layer = ts.build_model(chat_checkpoint("qwen3")).decoder.layers[0]
    assert isinstance(layer, QwenTransformerLayer)
    hidden = torch.zeros(12, 1, layer.config.hidden_size)
    with pytest.raises(
        RuntimeError, match=r"--sft\) under Transformer Engine CUDA graphs .* Drop --cuda-graph-impl"
    ):
        layer._te_cuda_graph_replay(hidden, packed_seq_params=_packed_params(torch.tensor([0, 5, 12])))
    with pytest.raises(AssertionError, match="CUDA graph accepts only Tensor inputs"):
        layer._te_cuda_graph_replay(hidden, inference_context=object())


def test_fused_qk_rope_steps_aside_for_packed_sequences():
    """The fused q/k norm + RoPE kernel rotates by the row's position; packed rows restart RoPE per
    sequence (megatron's own path), so a forward given packed_seq_params never takes it."""
    from twinkle_specs.lora.attention import _UNFUSED_IF_GIVEN

    assert "packed_seq_params" in _UNFUSED_IF_GIVEN


@pytest.mark.skipif(
    megatron_training_root() is None,
    reason="needs megatron.training (megatron-core 0.19 wheel or MEGATRON_LM_ROOT)",
)
def test_megatron_sft_dataset_packs_our_conversations(chat_checkpoint, monkeypatch):
    """Megatron-LM's own SFTDataset, given this tokenizer, makes the row :func:`chat_data.pack` describes
    (so the loss test above sees what pretrain_gpt.py --sft feeds the model), on both template shapes."""
    root = megatron_training_root()
    monkeypatch.syspath_prepend(root)
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
    from megatron.core.datasets.utils import Split
    from megatron.training.datasets.sft_dataset import SFTDataset

    for kind in ("qwen2_5", "qwen3"):
        tok, convs = QwenChatTokenizer(chat_checkpoint(kind)), [_with_system(c) for c in conversations()]
        merged = [[m for c in convs for m in c]]  # one JSONL line; SFTDataset splits it at system messages
        config = GPTDatasetConfig(
            random_seed=1,
            sequence_length=ROW,
            tokenizer=tok,
            reset_position_ids=False,
            reset_attention_mask=False,
            eod_mask_loss=False,
            create_attention_mask=False,
            context_parallel_size=1,
        )
        sample = SFTDataset(merged, None, np.arange(1), 1, Split.train, config)[0]
        expected = pack(tok, convs, ROW)
        for key in ("tokens", "labels", "loss_mask", "position_ids"):
            torch.testing.assert_close(sample[key], expected[key][0], rtol=0, atol=0, msg=key)
        cu = sample["cu_seqlens"][: len(expected["cu_seqlens"])]
        torch.testing.assert_close(cu, expected["cu_seqlens"], rtol=0, atol=0)


def _with_system(conv: list[dict]) -> list[dict]:
    """SFTDataset starts a new conversation at each system message: give every conversation one."""
    return conv if conv[0]["role"] == "system" else [{"role": "system", "content": "alpha"}, *conv]


def test_launcher_refuses_what_sft_cannot_run(chat_checkpoint, tmp_path):
    import importlib.util

    from twinkle_specs.launch import LaunchError, sft_flags

    hf = str(chat_checkpoint("qwen3"))
    with pytest.raises(LaunchError, match="--micro-batch-size 2 must be 1"):
        sft_flags(hf, ["--sft", "--micro-batch-size", "2"])
    for graphs in (["--cuda-graph-impl", "local"], ["--enable-cuda-graph"], ["--external-cuda-graph"]):
        with pytest.raises(LaunchError, match=f"--sft with {graphs[0]}: CUDA graphs"):
            sft_flags(hf, ["--sft", *graphs])
    sft_flags(hf, ["--micro-batch-size", "2", "--enable-cuda-graph"])  # not SFT: not ours to refuse
    assert sft_flags(hf, ["--micro-batch-size", "2"]) == []
    if importlib.util.find_spec("datasets") is None:
        with pytest.raises(
            LaunchError, match=r"datasets library, which is not installed; pip install 'twinkle-specs\[sft\]'"
        ):
            sft_flags(hf, ["--sft", "--cuda-graph-impl", "none"])
    else:
        assert sft_flags(hf, ["--sft"]) == ["--no-create-attention-mask-in-dataloader"]
        assert sft_flags(hf, ["--sft", "--no-create-attention-mask-in-dataloader"]) == []


def test_launcher_refuses_sft_on_a_tokenizer_without_chat_template(checkpoints, tmp_path, capsys):
    """One line, exit code 2, naming the checkpoint, before Megatron starts."""
    from test_launch_errors import SCRIPT, _refused
    from transformers import AutoTokenizer

    hf = checkpoints("qwen3")
    save_tokenizer(tmp_path / "tok", "qwen3")
    raw = AutoTokenizer.from_pretrained(tmp_path / "tok")
    raw.chat_template = None
    out = tmp_path / "hf"
    out.mkdir()
    for f in hf.iterdir():
        (out / f.name).symlink_to(f)
    raw.save_pretrained(out)
    err = _refused(capsys, [SCRIPT, "--hf-model", str(out), "--sft", "--micro-batch-size", "1"])
    assert f"{out}: the tokenizer has no chat template" in err


@pytest.mark.skipif(
    megatron_training_root() is None,
    reason="needs megatron.training (megatron-core 0.19 wheel or MEGATRON_LM_ROOT)",
)
def test_launcher_hands_megatron_the_chat_tokenizer(chat_checkpoint):
    """With --sft, Megatron-LM's own parser and tokenizer builds (its HuggingFaceTokenizer of the
    checkpoint) end in the chat tokenizer: the global one and the one pretrain_gpt.py builds itself for
    its SFT dataset."""
    import subprocess
    import sys

    hf = str(chat_checkpoint("qwen3"))
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); hf = sys.argv[2];"
        "from megatron.training.arguments import parse_args;"
        "import megatron.training.global_vars as gv;"
        "from twinkle_specs import launch;"
        "sys.argv = ['pretrain_gpt.py', *launch.merge_flags(hf, ['--hf-model', hf, '--sft', '--micro-batch-size',"
        " '1', '--seq-length', '512'])];"
        "args = parse_args(extra_args_provider=launch.add_twinkle_args);"
        "launch.install_tokenizer_hook();"
        "gv._build_tokenizer(args); tok = gv.get_tokenizer();"
        "import importlib, importlib.util;"  # where pretrain_gpt.py imports it from: core_v0.19, else core_v0.16.1
        "name = next(m for m in launch.TOKENIZER_BUILDERS[:2] if importlib.util.find_spec(m.rpartition('.')[0]));"
        "build_tokenizer = importlib.import_module(name).build_tokenizer;"
        "own = build_tokenizer(args);"
        "print('TOKENIZER', type(tok).__name__, type(own).__name__, tok.vocab_size, tok.pad, tok.eod)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, megatron_training_root(), hf],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    tok = QwenChatTokenizer(hf)
    expected = f"TOKENIZER QwenChatTokenizer QwenChatTokenizer {len(tok.hf)} {tok.pad} {tok.eod}"
    assert expected in proc.stdout, proc.stdout[-2000:]
