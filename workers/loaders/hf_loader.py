"""Load a Hugging Face model folder: config.json plus *.safetensors (never pickle)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from workers.model_config import ModelConfig

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


def _eos_ids(folder: Path, config: dict) -> tuple[int, ...]:
    ids: list[int] = []
    sources = [config]
    gen = folder / "generation_config.json"
    if gen.is_file():
        sources.append(json.loads(gen.read_text()))
    for src in sources:
        e = src.get("eos_token_id")
        for x in (e if isinstance(e, list) else [e]):
            if x is not None and int(x) not in ids:
                ids.append(int(x))
    return tuple(ids)


def read_hf_config(folder: Path) -> ModelConfig:
    c = json.loads((folder / "config.json").read_text())
    mt = c.get("model_type")
    if mt not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"{folder}: model_type {mt!r} not supported ({SUPPORTED_MODEL_TYPES})")
    scaling = c.get("rope_scaling")
    if scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
        raise ValueError(f"{folder}: rope_scaling {scaling} is not supported yet")
    if mt == "mistral" and c.get("sliding_window"):
        raise ValueError(f"{folder}: sliding-window attention is not supported yet")
    heads = c["num_attention_heads"]
    rope = c.get("rope_parameters") or {}
    return ModelConfig(
        architecture="llama",
        vocab_size=c["vocab_size"],
        hidden_size=c["hidden_size"],
        intermediate_size=c["intermediate_size"],
        num_layers=c["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=c.get("num_key_value_heads") or heads,
        head_dim=c.get("head_dim") or c["hidden_size"] // heads,
        rms_norm_eps=c.get("rms_norm_eps", 1e-6),
        rope_theta=float(c.get("rope_theta", rope.get("rope_theta", 10000.0))),
        max_position_embeddings=c.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        attention_bias=bool(c.get("attention_bias", mt == "qwen2")),
        bos_token_id=c.get("bos_token_id"),
        eos_token_ids=_eos_ids(folder, c),
        name=folder.name,
    )


def load_hf(folder: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    cfg = read_hf_config(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no .safetensors files (pickled weights are refused)")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights.update(load_file(str(f)))
    return cfg, weights
