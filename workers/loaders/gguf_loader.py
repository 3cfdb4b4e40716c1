"""Load a Llama-family GGUF file: config from metadata, weights dequantized to float32.

Tensors come back under Hugging Face names (model.layers.N.self_attn.q_proj.weight, ...), so
both loaders feed the same model code. llama.cpp's converter permutes the rows of Q and K
for its interleaved RoPE; we undo that so the weights match the HF (half-split) layout.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from workers.model_config import ModelConfig

# Quantization types this loader is tested on (others gguf can dequantize also work).
SUPPORTED_QTYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    return None


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of llama.cpp's convert-time permutation of Q/K rows (per head: halves <-> pairs)."""
    rows = w.shape[0]
    return (w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:])
            .transpose(1, 2).reshape(w.shape))


def read_gguf_config(path: Path):
    import gguf

    reader = gguf.GGUFReader(str(path))
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"{path.name}: GGUF architecture {arch!r} is not supported (llama only)")
    a = "llama"
    n_embd = int(_field(reader, f"{a}.embedding_length"))
    n_head = int(_field(reader, f"{a}.attention.head_count"))
    n_kv = int(_field(reader, f"{a}.attention.head_count_kv", n_head))
    head_dim = int(_field(reader, f"{a}.attention.key_length", n_embd // n_head))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = int(_field(reader, f"{a}.vocab_size", len(tokens.data) if tokens else 0))
    names = {t.name for t in reader.tensors}
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    scaling = _field(reader, f"{a}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise ValueError(f"{path.name}: RoPE scaling {scaling!r} is not supported yet")
    cfg = ModelConfig(
        architecture="llama",
        vocab_size=vocab,
        hidden_size=n_embd,
        intermediate_size=int(_field(reader, f"{a}.feed_forward_length")),
        num_layers=int(_field(reader, f"{a}.block_count")),
        num_heads=n_head,
        num_kv_heads=n_kv,
        head_dim=head_dim,
        rms_norm_eps=float(_field(reader, f"{a}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(_field(reader, f"{a}.rope.freq_base", 10000.0)),
        max_position_embeddings=int(_field(reader, f"{a}.context_length", 2048)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=() if eos is None else (int(eos),),
        name=path.stem,
    )
    return reader, cfg


def dequantize_tensor(t) -> torch.Tensor:
    """One GGUF tensor as float32 in torch layout ([out, in] for matrices)."""
    from gguf import GGMLQuantizationType, quants

    qtype = GGMLQuantizationType(t.tensor_type)
    data = quants.dequantize(t.data, qtype)
    shape = tuple(int(x) for x in reversed(t.shape))
    return torch.from_numpy(np.array(data, dtype=np.float32, copy=True).reshape(shape))


def load_gguf(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    reader, cfg = read_gguf_config(path)
    weights: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            continue  # e.g. rope_freqs (derived from rope_theta here)
        w = dequantize_tensor(t)
        if ".q_proj." in name:
            w = unpermute_qk(w, cfg.num_heads)
        elif ".k_proj." in name:
            w = unpermute_qk(w, cfg.num_kv_heads)
        weights[name] = w
    return cfg, weights
