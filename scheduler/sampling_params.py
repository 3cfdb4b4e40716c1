"""Per-request sampling parameters: a msgspec struct, so it can cross process boundaries."""

from __future__ import annotations

import msgspec


class SamplingParamsError(ValueError):
    """Invalid sampling parameter; `param` names the offending field (OpenAI's `param`)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # top-N logprobs of each sampled token (0 = only the sampled)
    priority: int = 0

    def validate(self) -> SamplingParams:
        def bad(param: str, msg: str) -> None:
            raise SamplingParamsError(param, f"{param}: {msg}")

        if self.max_tokens < 1:
            bad("max_tokens", f"must be at least 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 100.0:
            bad("temperature", f"must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            bad("top_k", f"must be -1, 0 (off) or positive, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", f"must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                bad(name, f"must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= 10.0:
            bad("repetition_penalty", f"must be in (0, 10], got {self.repetition_penalty}")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must be in [0, max_tokens], got {self.min_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            bad("logprobs", f"must be in [0, 20], got {self.logprobs}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            bad("seed", "out of range")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)
