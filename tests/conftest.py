"""Shared fixtures: tiny random Llama folders, the real SmolLM2 engine, and the rule that
every engine a test used ends with zero blocks in use."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

torch.set_num_threads(min(2, os.cpu_count() or 1))

_ENGINES: list = []


def track(engine):
    _ENGINES.append(engine)
    return engine


@pytest.fixture(autouse=True)
def _blocks_back_to_zero():
    yield
    for eng in _ENGINES:
        if not eng.has_unfinished():
            assert eng.blocks.num_used_blocks == 0, "blocks leaked after the test"


def make_tiny_llama(folder: Path, *, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=None,
                    intermediate=96, vocab=211, tie=True, theta=10000.0, seed=0,
                    max_pos=512) -> Path:
    """Save a random LlamaForCausalLM (safetensors) to `folder` and return it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=head_dim or hidden // heads, rope_theta=theta, tie_word_embeddings=tie,
        max_position_embeddings=max_pos, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
    )
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # random init has tiny weights; widen them so logits differ clearly
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.15)
    model.save_pretrained(str(folder), safe_serialization=True)
    assert json.loads((folder / "config.json").read_text())["model_type"] == "llama"
    return folder


@pytest.fixture(scope="session")
def smollm2_path():
    from workers.loaders.resolve import default_gguf_path

    return default_gguf_path()


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_path):
    from server.tokenizer import load_tokenizer

    return load_tokenizer(smollm2_path)


@pytest.fixture(scope="session")
def smollm2_engine():
    from workers.engine import EngineConfig, LLMEngine

    return track(LLMEngine(EngineConfig(dtype="float32", kv_cache_memory="256MiB",
                                        max_num_batched_tokens=512)))


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(smollm2_path.parent), gguf_file=smollm2_path.name, dtype=torch.float32).eval()


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Reference greedy decoding with transformers: plain argmax loop, EOS not special."""
    ids = torch.tensor([prompt])
    out = model(ids, use_cache=True)
    past, tokens = out.past_key_values, []
    for _ in range(n):
        nxt = int(out.logits[0, -1].argmax())
        tokens.append(nxt)
        out = model(torch.tensor([[nxt]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
    return tokens
