"""A tiny llama-architecture GGUF model with random weights, written with the ``gguf`` package:
what a test needs to run llama.cpp's server for real (it loads, tokenizes, embeds and generates
nonsense) without downloading a model. One block, 64-wide, a byte-fallback SentencePiece-style
vocabulary of 280 tokens, float32 throughout (about 310 KB), the same file for the same seed."""

from __future__ import annotations

from pathlib import Path

N_EMBD = 64
N_HEAD = 4
N_FF = 128
N_CTX = 256
WORDS = ["hello", "world", "tiny", "model", "the", "a", "embed", "me", "quick", "fox"]


def write_tiny_llama(path: Path, seed: int = 37) -> Path:
    """Write the model to ``path`` and return it."""
    import gguf
    import numpy as np

    rng = np.random.default_rng(seed)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    types += [gguf.TokenType.BYTE] * 256
    pieces = ["▁"] + [f"▁{w}" for w in WORDS] + WORDS
    tokens += pieces
    types += [gguf.TokenType.NORMAL] * len(pieces)
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    n_vocab = len(tokens)

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny")
    writer.add_context_length(N_CTX)
    writer.add_embedding_length(N_EMBD)
    writer.add_block_count(1)
    writer.add_feed_forward_length(N_FF)
    writer.add_head_count(N_HEAD)
    writer.add_head_count_kv(N_HEAD)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(N_EMBD // N_HEAD)
    writer.add_vocab_size(n_vocab)
    writer.add_pooling_type(gguf.PoolingType.MEAN)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)

    def weights(*shape: int) -> object:
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    ones = np.ones(N_EMBD, dtype=np.float32)
    writer.add_tensor("token_embd.weight", weights(n_vocab, N_EMBD))
    writer.add_tensor("output_norm.weight", ones)
    writer.add_tensor("output.weight", weights(n_vocab, N_EMBD))
    writer.add_tensor("blk.0.attn_norm.weight", ones)
    writer.add_tensor("blk.0.attn_q.weight", weights(N_EMBD, N_EMBD))
    writer.add_tensor("blk.0.attn_k.weight", weights(N_EMBD, N_EMBD))
    writer.add_tensor("blk.0.attn_v.weight", weights(N_EMBD, N_EMBD))
    writer.add_tensor("blk.0.attn_output.weight", weights(N_EMBD, N_EMBD))
    writer.add_tensor("blk.0.ffn_norm.weight", ones)
    writer.add_tensor("blk.0.ffn_gate.weight", weights(N_FF, N_EMBD))
    writer.add_tensor("blk.0.ffn_down.weight", weights(N_EMBD, N_FF))
    writer.add_tensor("blk.0.ffn_up.weight", weights(N_FF, N_EMBD))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
