"""A tiny random-weight target of any supported architecture, as a complete HF checkpoint folder
(config, safetensors, a small byte-level BPE tokenizer with a ChatML chat template): what
``make train-smoke`` and ``python_tests/model/test_any_target.py`` run the whole pipeline on
(gen-data -> train -> export -> reference engine -> sglang DLITE) in seconds per stage.

    from dlite_lab.training.tiny_target import save_tiny_target
    save_tiny_target("artifacts/tiny/qwen3", arch="qwen3")

The weights are random, so the text is gibberish: greedy decoding falls into cycles of ~10-20
tokens, which a drafter learns in a few dozen steps (it is accepted part of the time). The
end-of-turn token's LM-head row is zero, so every turn runs to its token budget.
"""

from __future__ import annotations

import argparse
import os

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from sglang_dlite.model.config import SUPPORTED_TARGET_ARCHITECTURES
from sglang_dlite.errors import DLiteInputError

# arch name -> (transformers config class, model class, extra config fields)
ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"use_sliding_window": False}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),  # head_dim: hidden / heads (its config's default is 128)
}
assert {v[1] for v in ARCHS.values()} == set(SUPPORTED_TARGET_ARCHITECTURES)

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_CORPUS = [
    "def add(a, b):\n    return a + b\n", "import os\nimport sys\n\nclass Parser:\n    pass\n",
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain the difference between a list and a tuple in Python.", "The quick brown fox jumps over the lazy dog.",
    "for i in range(10):\n    print(i)\n", "Summarize the following text in one sentence.",
]


def build_tokenizer(vocab_size: int = 384):
    """A byte-level BPE tokenizer (every text encodes) with ChatML special tokens, trained on a
    few fixed lines: deterministic, offline, ~``vocab_size`` tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", unk_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_tiny_target(path, arch: str = "llama", seed: int = 0, hidden: int = 64, layers: int = 6,
                     heads: int = 4, kv_heads: int = 2, vocab_size: int = 384, sticky: float = 0.0) -> str:
    """Write a tiny random ``arch`` target (see ARCHS) with its tokenizer into ``path``."""
    if arch not in ARCHS:
        raise DLiteInputError(f"unknown tiny target architecture {arch!r}; choose one of {sorted(ARCHS)}.")
    cfg_name, model_name, extra = ARCHS[arch]
    extra = dict(extra, head_dim=hidden // heads) if arch == "qwen3" else extra
    tok = build_tokenizer(vocab_size)
    V = len(tok)
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL}
    torch.manual_seed(seed)
    cfg = getattr(transformers, cfg_name)(
        vocab_size=V, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=4096,
        tie_word_embeddings=False, bos_token_id=ids["<|im_start|>"], eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"], **extra,
    )
    model = getattr(transformers, model_name)(cfg).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0, 1.0)
        model.lm_head.weight.copy_(sticky * model.model.embed_tokens.weight + torch.randn_like(model.lm_head.weight))
        # the end-of-turn token never wins: every turn runs to its token budget
        model.lm_head.weight[ids["<|im_end|>"]].zero_()
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def main(argv=None) -> int:
    """``python -m dlite_lab.training.tiny_target OUT [--arch qwen3]``"""
    ap = argparse.ArgumentParser(description="write a tiny random-weight target checkpoint (with tokenizer)")
    ap.add_argument("out")
    ap.add_argument("--arch", default="llama", choices=sorted(ARCHS))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    print(save_tiny_target(args.out, args.arch, seed=args.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
