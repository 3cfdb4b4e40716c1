"""Llama-family decoder (Llama, Mistral, SmolLM, Qwen2-style biases): GQA, RoPE, RMSNorm,
SwiGLU, tied or untied embeddings. One forward runs a flat variable-length batch against
the paged KV cache; the engine owns attention (no transformers model classes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from cache.kv_storage import KVCacheStorage
from workers.attention import AttentionMetadata, paged_attention
from workers.model_config import ModelConfig
from workers.models.linear import pick_kernel


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: torch.Tensor  # [(H + 2 Hkv) D, hidden], Q/K/V fused
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor  # [2 I, hidden], gate and up fused
    down: torch.Tensor


def rope_cache(cfg: ModelConfig, max_pos: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [max_pos, D/2] in float32 (half-split RoPE, as HF Llama)."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
    return freqs.cos().to(device), freqs.sin().to(device)


class LlamaModel:
    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor],
                 dtype: torch.dtype, device: torch.device) -> None:
        self.cfg = cfg
        self.dtype = dtype
        self.device = device

        self.linear = kernel = pick_kernel(dtype, device)

        def w(name: str) -> torch.Tensor:
            return weights[name].to(device=device, dtype=dtype).contiguous()

        # the embedding stays a plain [vocab, hidden] table for lookups; the LM head is in
        # the kernel's layout (a second copy when the two are tied and that layout differs)
        self.embed = w("model.embed_tokens.weight")
        self.norm = w("model.norm.weight")
        tied = cfg.tie_word_embeddings or "lm_head.weight" not in weights
        self.lm_head = kernel.prepare(self.embed if tied else w("lm_head.weight"))
        self.layers: list[LayerWeights] = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            a, m = p + "self_attn.", p + "mlp."
            bias = None
            if cfg.attention_bias:
                bias = torch.cat([w(a + "q_proj.bias"), w(a + "k_proj.bias"),
                                  w(a + "v_proj.bias")])
            self.layers.append(LayerWeights(
                input_norm=w(p + "input_layernorm.weight"),
                qkv=kernel.prepare(torch.cat([w(a + "q_proj.weight"), w(a + "k_proj.weight"),
                                              w(a + "v_proj.weight")])),
                qkv_bias=bias,
                o=kernel.prepare(w(a + "o_proj.weight")),
                post_norm=w(p + "post_attention_layernorm.weight"),
                gate_up=kernel.prepare(torch.cat([w(m + "gate_proj.weight"),
                                                  w(m + "up_proj.weight")])),
                down=kernel.prepare(w(m + "down_proj.weight")),
            ))
        self.cos, self.sin = rope_cache(cfg, cfg.max_position_embeddings, device)
        self.scale = cfg.head_dim ** -0.5
        self.attn_dtype = kernel.compute_dtype or dtype

    def weight_bytes(self) -> int:
        """Bytes of weights held (a tied LM head stored in another layout counts twice)."""
        tensors = {id(t): t for t in (self.embed, self.norm, self.lm_head)}
        for layer in self.layers:
            tensors.update((id(t), t) for t in vars(layer).values() if t is not None)
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # One fused kernel (float32 accumulation), instead of HF's seven ops.
        return F.rms_norm(x, weight.shape, weight, self.cfg.rms_norm_eps)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata, kv: KVCacheStorage, layer_hook=None) -> torch.Tensor:
        """layer_hook(i), if given, runs once layer i's K/V are in the cache."""
        cfg = self.cfg
        t = input_ids.shape[0]
        nh, nkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        cos = self.cos[positions].to(self.dtype).unsqueeze(1)
        sin = self.sin[positions].to(self.dtype).unsqueeze(1)
        h = F.embedding(input_ids, self.embed)
        for i, layer in enumerate(self.layers):
            x = self._rms_norm(h, layer.input_norm)
            qkv = self.linear(x, layer.qkv, layer.qkv_bias)
            qk = self._rope(qkv[:, : (nh + nkv) * d].view(t, nh + nkv, d), cos, sin)
            q, k = qk[:, :nh], qk[:, nh:]
            v = qkv[:, (nh + nkv) * d:].view(t, nkv, d)
            k_cache, v_cache = kv.layer(i)
            attn = paged_attention(q, k, v, k_cache, v_cache, kv.layout.block_size, meta,
                                   self.scale, self.attn_dtype)
            if layer_hook is not None:
                layer_hook(i)
            h = h + self.linear(attn.reshape(t, nh * d), layer.o)
            x = self._rms_norm(h, layer.post_norm)
            gate, up = self.linear(x, layer.gate_up).chunk(2, dim=-1)
            h = h + self.linear(F.silu(gate) * up, layer.down)
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head for the selected positions; float32 logits."""
        return self.linear(self._rms_norm(hidden, self.norm), self.lm_head).float()
