"""Model loaders. `load_model_files` dispatches on the path: a .gguf file or an HF folder."""

from __future__ import annotations

from pathlib import Path


def load_model_files(path: Path):
    """Return (ModelConfig, {hf_name: float tensor}) for a resolved model path."""
    if path.suffix == ".gguf":
        from workers.loaders.gguf_loader import load_gguf

        return load_gguf(path)
    from workers.loaders.hf_loader import load_hf

    return load_hf(path)


def read_model_config(path: Path):
    if path.suffix == ".gguf":
        from workers.loaders.gguf_loader import read_gguf_config

        return read_gguf_config(path)[1]
    from workers.loaders.hf_loader import read_hf_config

    return read_hf_config(path)
