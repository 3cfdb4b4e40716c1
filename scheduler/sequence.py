"""A sequence's state inside one worker: tokens, progress, and when it is finished."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from scheduler.sampling_params import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS or a stop token
    LENGTH = "length"  # max_tokens or the context window
    ABORT = "abort"
    TRANSFERRED = "transferred"  # prefill role: first token sampled, KV sent to a decode worker


@dataclass
class Sequence:
    seq_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    max_model_len: int = 1 << 30
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    first_scheduled_time: float | None = None  # time.monotonic() when first scheduled
    prefill_only: bool = False  # prefill role: stop after the first token

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - p]

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    def append_token(self, token: int) -> FinishReason | None:
        """Record a sampled token and return why the sequence stops, if it does."""
        self.output_token_ids.append(token)
        reason = self._stop_reason(token)
        if reason is None and self.prefill_only:
            return FinishReason.TRANSFERRED
        return reason

    def _stop_reason(self, token: int) -> FinishReason | None:
        p = self.params
        n = len(self.output_token_ids)
        if n >= p.min_tokens:
            if not p.ignore_eos and token in self.eos_token_ids:
                return FinishReason.STOP
            if token in p.stop_token_ids:
                return FinishReason.STOP
        if n >= p.max_tokens or self.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None
