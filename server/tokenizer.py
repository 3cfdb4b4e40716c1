"""The model's own tokenizer and chat template.

For a GGUF file, transformers converts the embedded tokenizer (slow: seconds); the result is
saved under a cache folder keyed by the file's identity, so later starts load it directly.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

log = logging.getLogger("splitserve.tokenizer")


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "splitserve" / "tokenizers"


def _gguf_key(path: Path) -> str:
    st = path.stat()
    h = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def load_tokenizer(model_path: Path, cache_dir: Path | None = None):
    """A transformers fast tokenizer (with chat template) for a .gguf file or an HF folder."""
    from transformers import AutoTokenizer

    if model_path.suffix != ".gguf":
        return AutoTokenizer.from_pretrained(str(model_path))
    cache = (cache_dir or default_cache_dir()) / _gguf_key(model_path)
    if (cache / "tokenizer.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(str(cache))
        except Exception as e:  # a damaged cache is rebuilt, not fatal
            log.warning("tokenizer cache %s unreadable (%s); rebuilding", cache, e)
    tok = AutoTokenizer.from_pretrained(str(model_path.parent), gguf_file=model_path.name)
    try:
        cache.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_name(cache.name + f".tmp{os.getpid()}")
        tok.save_pretrained(str(tmp))
        os.replace(tmp / "tokenizer.json", cache / "tokenizer.json")
        for f in tmp.iterdir():
            os.replace(f, cache / f.name)
        tmp.rmdir()
    except OSError as e:
        log.warning("could not cache the tokenizer in %s: %s", cache, e)
    return tok


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a chat rendered with the model's template, ready for the assistant turn."""
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(out, "keys"):
        out = out["input_ids"]
    return list(out)
