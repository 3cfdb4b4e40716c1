"""Sampling: penalties, temperature, top-k, top-p, min-p, per-request seeds, logprobs.

Every operation is row-wise, so a row's result does not depend on what else is in the batch;
a seeded request draws its noise from its own generator, so the same seed gives the same
tokens alone or in any batch, and across recompute preemption.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from scheduler.sequence import Sequence


@dataclass
class SampleResult:
    token: int
    logprob: float | None = None  # raw-model logprob of the sampled token
    top_logprobs: list[tuple[int, float]] | None = None


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0,
                 vocab_size: int | None = None) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self._seeded: dict[str, torch.Generator] = {}
        self.vocab_size = vocab_size  # needed by skip_first_draw

    def forget(self, seq_id: str) -> None:
        self._seeded.pop(seq_id, None)

    def _generator_for(self, seq: Sequence) -> torch.Generator:
        g = self._seeded.get(seq.seq_id)
        if g is None:
            g = torch.Generator(device=self.device)
            g.manual_seed(seq.params.seed % (1 << 64))
            self._seeded[seq.seq_id] = g
        return g

    def skip_first_draw(self, seq: Sequence) -> None:
        """Advance a seeded sequence's generator past the draw its first token used (taken on
        another worker), so the rest of its tokens are those it would have had here."""
        if seq.params.seed is not None and not seq.params.greedy:
            if self.vocab_size is None:
                raise ValueError("skip_first_draw needs the sampler's vocab_size")
            torch.empty(self.vocab_size, device=self.device).exponential_(
                generator=self._generator_for(seq))

    def _apply_penalties(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        for i, seq in enumerate(seqs):
            p = seq.params
            if p.repetition_penalty != 1.0:
                ids = torch.tensor(sorted(set(seq.prompt_token_ids) | set(seq.output_token_ids)),
                                   dtype=torch.long, device=logits.device)
                row = logits[i, ids]
                logits[i, ids] = torch.where(row > 0, row / p.repetition_penalty,
                                             row * p.repetition_penalty)
            if (p.frequency_penalty or p.presence_penalty) and seq.output_token_ids:
                out = torch.tensor(seq.output_token_ids, dtype=torch.long, device=logits.device)
                counts = torch.bincount(out, minlength=logits.shape[1]).to(logits.dtype)
                logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
            if seq.num_output_tokens < p.min_tokens:
                banned = set(p.stop_token_ids) | (set() if p.ignore_eos else seq.eos_token_ids)
                # ids outside the vocabulary can never be sampled: skip them, rather than
                # index out of range (IndexError) or, for negative ids, from the end
                banned = [t for t in banned if 0 <= t < logits.shape[1]]
                if banned:
                    logits[i, banned] = float("-inf")

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[SampleResult]:
        """logits: float32 [S, V], one row per sequence that samples this step."""
        raw_logprobs = None
        if any(s.params.logprobs is not None for s in seqs):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        if any(s.params.uses_penalties or s.num_output_tokens < s.params.min_tokens
               for s in seqs):
            logits = logits.clone()
            self._apply_penalties(logits, seqs)

        tokens = torch.empty(len(seqs), dtype=torch.long, device=logits.device)
        greedy = [i for i, s in enumerate(seqs) if s.params.greedy]
        sampled = [i for i, s in enumerate(seqs) if not s.params.greedy]
        if greedy:
            g = torch.tensor(greedy, device=logits.device)
            tokens[g] = logits[g].argmax(dim=-1)
        if sampled:
            idx = torch.tensor(sampled, device=logits.device)
            tokens[idx] = self._sample(logits[idx], [seqs[i] for i in sampled])

        token_list = tokens.tolist()
        results = [SampleResult(t) for t in token_list]
        if raw_logprobs is not None:
            for i, seq in enumerate(seqs):
                n = seq.params.logprobs
                if n is None:
                    continue
                results[i].logprob = float(raw_logprobs[i, token_list[i]])
                if n > 0:
                    vals, ids = raw_logprobs[i].topk(n)
                    results[i].top_logprobs = list(zip(ids.tolist(), vals.tolist()))
        return results

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        dev = logits.device
        # floor: a temperature that tiny (or that rounds to 0 in float32) would overflow the
        # scaled logits to inf and the softmax to NaN; it changes nothing above 1e-30
        temps = torch.tensor([s.params.temperature for s in seqs], device=dev).clamp_min(1e-30)
        logits = logits / temps.unsqueeze(1)
        top_k = [s.params.top_k for s in seqs]
        if any(k > 0 for k in top_k):
            vocab = logits.shape[1]
            ks = torch.tensor([k if 0 < k < vocab else vocab for k in top_k], device=dev)
            kth = logits.sort(dim=-1, descending=True).values.gather(1, (ks - 1).unsqueeze(1))
            logits = logits.masked_fill(logits < kth, float("-inf"))
        top_p = [s.params.top_p for s in seqs]
        if any(p < 1.0 for p in top_p):
            sorted_logits, order = logits.sort(dim=-1, descending=False)
            cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
            drop = cum <= (1.0 - torch.tensor(top_p, device=dev)).unsqueeze(1)
            drop[:, -1] = False  # always keep the most likely token
            logits = logits.masked_fill(drop.scatter(1, order, drop), float("-inf"))
        probs = logits.softmax(dim=-1)
        min_p = [s.params.min_p for s in seqs]
        if any(p > 0.0 for p in min_p):
            thresh = torch.tensor(min_p, device=dev).unsqueeze(1) * probs.max(dim=-1,
                                                                           keepdim=True).values
            probs = probs.masked_fill(probs < thresh, 0.0)
        # Exponential-race sampling: argmax(p / E), E ~ Exp(1), is a draw from p.
        noise = torch.empty_like(probs)
        unseeded = [i for i, s in enumerate(seqs) if s.params.seed is None]
        if unseeded:
            noise[unseeded] = torch.empty(len(unseeded), probs.shape[1], device=dev).exponential_(
                generator=self.generator)
        for i, s in enumerate(seqs):
            if s.params.seed is not None:
                noise[i].exponential_(generator=self._generator_for(s))
        return (probs / noise).argmax(dim=-1)
