"""A tiny llama-architecture GGUF model with random weights, written with the ``gguf`` package:
what a test needs to run llama.cpp's server for real (it loads, tokenizes, embeds, applies its
chat template and generates nonsense) without downloading a model. One block, 64-wide, float32
throughout, the same file for the same seed and words. Its vocabulary: byte fallback, ChatML's
``<|im_start|>`` and ``<|im_end|>`` as control tokens, every ASCII punctuation mark, and the
``words`` given whole (each with and without SentencePiece's ``▁`` for a space before it, and
every prefix of those, so that llama.cpp's SentencePiece merges reach the whole word): a text of
those words is counted about as a real model's English vocabulary counts it, a word per token
(with the default words, 10 of them: 358 tokens, about 360 KB). Its chat template is ChatML's
(``CHATML``, as Qwen's: tools listed in the system turn), which llama-cpp-python's server applies."""

from __future__ import annotations

import string
from collections.abc import Iterable
from pathlib import Path

N_EMBD = 64
N_HEAD = 4
N_FF = 128
N_CTX = 4096
WORDS = ["hello", "world", "tiny", "model", "the", "a", "embed", "me", "quick", "fox"]
SPECIAL = ["<|im_start|>", "<|im_end|>"]
CHATML = (  # its text in {{- '…' }} so that trim_blocks (llama-cpp-python's) keeps every newline
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\n<tools>' }}{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}"
    "{%- endfor %}{{- '\\n</tools><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}{%- if not (loop.first and message.role == 'system') %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _pieces(words: Iterable[str]) -> list[str]:
    """The words' pieces, with and without ``▁``, with every prefix (two characters on), and
    each punctuation mark: sorted, once each."""
    found = {"▁", *string.punctuation}
    for word in words:
        for whole in (word, f"▁{word}"):
            found.update(whole[:n] for n in range(2, len(whole) + 1))
    found -= set(SPECIAL)
    return sorted(found)


def write_tiny_llama(
    path: Path, seed: int = 37, words: Iterable[str] = WORDS, chat_template: str = CHATML
) -> Path:
    """Write the model to ``path`` and return it."""
    import gguf
    import numpy as np

    rng = np.random.default_rng(seed)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + SPECIAL
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    types += [gguf.TokenType.BYTE] * 256 + [gguf.TokenType.CONTROL] * len(SPECIAL)
    pieces = _pieces(words)
    tokens += pieces
    types += [gguf.TokenType.NORMAL] * len(pieces)
    scores = [0.0] * (259 + len(SPECIAL)) + [float(len(p)) for p in pieces]  # the longer first
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
    writer.add_add_space_prefix(False)  # a message's first word is as its template puts it
    writer.add_chat_template(chat_template)

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
