"""Per-worker batch policy: which sequences run in the next step, and how many tokens each.

Continuous batching with chunked prefill under a token budget, in the style of vLLM v1:
there is no separate prefill or decode phase. Each step, running sequences get their next
tokens first (one for a decoding sequence, a chunk for a partly prefilled prompt), then
waiting sequences are admitted while the token budget, `max_num_seqs` and free blocks allow.
When a running sequence needs a block and none is free, the least important running
sequence (largest `priority` value, then latest arrival) is preempted by recomputation: its
blocks are freed and it goes back to the front of the queue with the tokens it has so far.

Pure Python: the policy sees block counts through `BlockManager`, never tensors.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from cache.block_pool import BlockManager
from scheduler.sequence import FinishReason, SeqStatus, Sequence


@dataclass(frozen=True)
class BatchPolicyConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be at least 1")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be at least 1")


@dataclass(frozen=True)
class ScheduledChunk:
    seq: Sequence
    start: int  # first token position computed in this step
    num_tokens: int
    samples: bool  # the chunk reaches the sequence's last token, so a new token is sampled

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @classmethod
    def of(cls, seq: Sequence, num_tokens: int) -> ScheduledChunk:
        start = seq.num_computed_tokens
        return cls(seq, start, num_tokens, start + num_tokens == seq.num_tokens)


@dataclass
class StepPlan:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    def __bool__(self) -> bool:
        return bool(self.chunks)


def _importance(seq: Sequence) -> tuple[int, float]:
    # Smaller sorts first = more important: lower priority value, then earlier arrival.
    return (seq.params.priority, seq.arrival_time)


class BatchPolicy:
    def __init__(self, config: BatchPolicyConfig, blocks: BlockManager) -> None:
        self.config = config
        self.blocks = blocks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # -- queue management --
    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def remove(self, seq: Sequence, reason: FinishReason) -> None:
        """Take a sequence out (finished or aborted) and free its blocks."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        self.blocks.free(seq.seq_id)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    # -- the decision --
    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self.config.max_num_batched_tokens
        scheduled: set[str] = set()

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed_tokens, budget)
            if n <= 0:
                i += 1
                continue
            target = seq.num_computed_tokens + n
            while not self.blocks.can_grow(seq.seq_id, target):
                victim = self.running[-1]
                assert victim.seq_id not in scheduled, "victims come from the unscheduled tail"
                self._preempt(victim)
                plan.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING:
                break  # the sequence itself was preempted; everyone after it too
            self.blocks.grow(seq.seq_id, target)
            plan.chunks.append(ScheduledChunk.of(seq, n))
            scheduled.add(seq.seq_id)
            budget -= n
            i += 1

        if plan.preempted:
            return plan  # memory is short: admit nobody new this step

        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            n = min(seq.num_uncomputed_tokens, budget)
            target = seq.num_computed_tokens + n
            if not self.blocks.can_grow(seq.seq_id, target):
                break
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
            self.running.append(seq)
            self.blocks.grow(seq.seq_id, target)
            plan.chunks.append(ScheduledChunk.of(seq, n))
            budget -= n
        self.running.sort(key=_importance)
        return plan

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def commit(self, chunk: ScheduledChunk) -> None:
        """The worker computed this chunk: its KV is now in the cache."""
        chunk.seq.num_computed_tokens = chunk.end
