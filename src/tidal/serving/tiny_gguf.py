"""A tiny random-weight LLaMA model in GGUF, written locally (nothing is downloaded), for a real engine
(llama.cpp's ``llama-server``) to serve in tests, benchmarks and demos: 4 layers, 256 wide, a byte-level
GPT-2 BPE vocabulary (every byte a token, a few merges, ``<|endoftext|>`` as BOS/EOS), f32, ~11 MB.

    write_tiny_gguf("tiny.gguf")   # needs the `gguf` package (the `engine` extra)

Random weights sample end-of-text early: ask with ``"ignore_eos": true`` for exact token counts.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tidal.files import atomic_path

MERGES = ("Ġ t", "t h", "h e", "i n", "e r", "a n", "Ġ a", "o n")


def _byte_tokens() -> list[str]:
    """GPT-2's byte-to-unicode mapping: the 256 byte tokens, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b], extra = chr(256 + extra), extra + 1
    return [out[b] for b in range(256)]


def write_tiny_gguf(path: str | Path, *, layers: int = 4, width: int = 256, context: int = 2048,
                    seed: int = 0) -> Path:
    """Write the model to ``path`` (atomically) and return it. ``ImportError`` naming the package when
    ``gguf`` is not installed."""
    try:
        import gguf
    except ImportError:
        raise ImportError("writing a GGUF model needs the gguf package: pip install gguf") from None
    tokens = [*_byte_tokens(), *(m.replace(" ", "") for m in MERGES), "<|endoftext|>"]
    vocab, ff, heads = len(tokens), 2 * width, max(1, width // 64)
    rng = np.random.default_rng(seed)

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    path = Path(path)
    with atomic_path(path, mode=0o644) as tmp:
        g = gguf.GGUFWriter(str(tmp), "llama")
        g.add_name("tidal-tiny")
        g.add_context_length(context)
        g.add_embedding_length(width)
        g.add_block_count(layers)
        g.add_feed_forward_length(ff)
        g.add_head_count(heads)
        g.add_head_count_kv(heads)
        g.add_rope_dimension_count(width // heads)
        g.add_layer_norm_rms_eps(1e-5)
        g.add_file_type(0)  # all f32
        g.add_vocab_size(vocab)
        g.add_tokenizer_model("gpt2")
        g.add_tokenizer_pre("default")
        g.add_token_list(tokens)
        g.add_token_types([1] * (vocab - 1) + [3])  # normal, ..., control
        g.add_token_merges(list(MERGES))
        g.add_bos_token_id(vocab - 1)
        g.add_eos_token_id(vocab - 1)
        g.add_add_bos_token(False)
        g.add_tensor("token_embd.weight", w(vocab, width))
        for i in range(layers):
            b = f"blk.{i}."
            for name, t in (("attn_norm", np.ones(width, np.float32)), ("attn_q", w(width, width)),
                            ("attn_k", w(width, width)), ("attn_v", w(width, width)),
                            ("attn_output", w(width, width)), ("ffn_norm", np.ones(width, np.float32)),
                            ("ffn_gate", w(ff, width)), ("ffn_up", w(ff, width)), ("ffn_down", w(width, ff))):
                g.add_tensor(f"{b}{name}.weight", t)
        g.add_tensor("output_norm.weight", np.ones(width, np.float32))
        g.add_tensor("output.weight", w(vocab, width))
        g.write_header_to_file()
        g.write_kv_data_to_file()
        g.write_tensors_to_file()
        g.close()
    return path
