"""Turns a batch policy's StepPlan into tensors, runs the model, samples."""

from __future__ import annotations

import torch

from cache.block_pool import BlockManager
from cache.kv_storage import KVCacheStorage
from scheduler.batch_policy import StepPlan
from workers.attention import build_metadata
from workers.models.llama import LlamaModel
from workers.sampler import Sampler, SampleResult


class ModelRunner:
    def __init__(self, model: LlamaModel, kv: KVCacheStorage, blocks: BlockManager,
                 sampler: Sampler) -> None:
        self.model = model
        self.kv = kv
        self.blocks = blocks
        self.sampler = sampler
        self.device = model.device

    @torch.inference_mode()
    def execute(self, plan: StepPlan, layer_hook=None) -> dict[int, SampleResult]:
        """Run one step; returns the sampled token for every chunk (by index) that samples."""
        # Single-token chunks (decodes) first: attention batches them together.
        order = sorted(range(len(plan.chunks)), key=lambda i: plan.chunks[i].num_tokens != 1)
        input_ids: list[int] = []
        positions: list[int] = []
        spans = []
        sample_rows: list[int] = []
        sample_chunks: list[int] = []
        for i in order:
            c = plan.chunks[i]
            input_ids.extend(c.seq.token_ids(c.start, c.end))
            positions.extend(range(c.start, c.end))
            spans.append((self.blocks.table(c.seq.seq_id), c.start, c.num_tokens))
            if c.samples:
                sample_rows.append(len(input_ids) - 1)
                sample_chunks.append(i)
        dev = self.device
        meta = build_metadata(spans, self.blocks.block_size, dev)
        hidden = self.model.forward(
            torch.tensor(input_ids, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            meta, self.kv, layer_hook,
        )
        if not sample_rows:
            return {}
        logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=dev)])
        results = self.sampler(logits, [plan.chunks[i].seq for i in sample_chunks])
        return dict(zip(sample_chunks, results))
