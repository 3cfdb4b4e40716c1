"""Incremental detokenization and stop strings.

Text is released only when it is final: a token sequence whose decoded text ends in an
incomplete UTF-8 character (U+FFFD) is held until the next token completes it, and the last
`len(longest stop string) - 1` characters are held back so a stop string split across
tokens is never emitted before it is recognised.
"""

from __future__ import annotations


class IncrementalDetokenizer:
    """Decodes a growing token list with a sliding window (as vLLM does): decode
    tokens[prefix:] and keep what extends the decode of tokens[prefix:read]."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.tokens: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

    def push(self, token_ids: list[int], final: bool = False) -> str:
        self.tokens.extend(token_ids)
        prefix = self._decode(self.tokens[self.prefix_offset:self.read_offset])
        full = self._decode(self.tokens[self.prefix_offset:])
        if len(full) > len(prefix) and (final or not full.endswith("\ufffd")):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.tokens)
            return full[len(prefix):]
        return ""


class StopStringMatcher:
    """Accumulates text; returns what is safe to emit and whether a stop string was hit."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""  # everything decoded so far
        self.emitted = 0  # characters of self.text already released
        self.stopped = False

    def feed(self, new_text: str, final: bool = False) -> str:
        if self.stopped:
            return ""
        start = max(0, self.emitted - self.hold)
        self.text += new_text
        if self.stops:
            hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
            if hits:
                self.stopped = True
                self.text = self.text[:min(hits)]
                return self._release(len(self.text))
        return self._release(len(self.text) if final else len(self.text) - self.hold)

    def _release(self, upto: int) -> str:
        if upto <= self.emitted:
            return ""
        out = self.text[self.emitted:upto]
        self.emitted = upto
        return out
