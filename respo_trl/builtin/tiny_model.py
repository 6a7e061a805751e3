"""Tiny Qwen3 models and a character-level tokenizer, built locally with nothing downloaded.

They power the tests, the embedded default of ``recipes/qwen3_respo.py`` and the CPU benchmarks: a random-init
``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM`` of ~100k parameters trains a GRPO step in about a tenth of a second.
"""

from __future__ import annotations

import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

__all__ = ["CHAT_TEMPLATE", "build_char_tokenizer", "tiny_qwen3"]

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Multi-character pieces kept as single tokens so that answers stay short for tiny models.
DEFAULT_EXTRA_TOKENS = ("\\boxed{",)
# Qwen-style chat markup, with one-letter roles to keep prompts short.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'][0] }}:{{ message['content'] }}<|im_end|>"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>a:{% endif %}"
)


def build_char_tokenizer(extra_tokens: tuple[str, ...] = DEFAULT_EXTRA_TOKENS) -> PreTrainedTokenizerFast:
    """A character-level fast tokenizer over printable ASCII, Qwen's special tokens and a chat template."""
    chars = [c for c in string.printable if c not in "\x0b\x0c\r"]
    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, "<unk>", *extra_tokens, *chars])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<unk>",
        additional_special_tokens=["<|im_start|>"],
    )
    tokenizer.add_tokens(list(extra_tokens))
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.padding_side = "left"
    return tokenizer


def tiny_qwen3(
    tokenizer,
    moe: bool = False,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    num_experts: int = 4,
    experts_per_token: int = 2,
    max_position_embeddings: int = 512,
    seed: int = 0,
):
    """A random-init Qwen3 (dense) or Qwen3-MoE causal LM sized for CPU tests, on ``tokenizer``'s vocabulary."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    if moe:
        config = Qwen3MoeConfig(
            **common,
            intermediate_size=intermediate_size,
            moe_intermediate_size=intermediate_size // 2,
            num_experts=num_experts,
            num_experts_per_tok=experts_per_token,
            decoder_sparse_step=1,
            # As Hub Qwen3-MoE configs ship: TRL asks for router logits in its training forward itself. True here is
            # saved with the checkpoint and breaks transformers' cached, left-padded generation (aux loss per step).
            output_router_logits=False,
            router_aux_loss_coef=0.01,
        )
        return Qwen3MoeForCausalLM(config)
    return Qwen3ForCausalLM(Qwen3Config(**common, intermediate_size=intermediate_size))
