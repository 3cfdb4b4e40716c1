"""The in-process engine: add requests, step, collect outputs, abort.

One step is three calls, as in nano-vllm: the batch policy schedules (pure Python), the
model runner executes (torch), and the engine updates sequence state from the results.
The worker process, the tests and the benchmarks all drive this same class.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from cache.block_pool import BlockManager
from cache.kv_storage import KVCacheStorage
from cache.layout import KVLayout, parse_bytes
from scheduler.batch_policy import BatchPolicy, BatchPolicyConfig
from scheduler.protocol import LogprobEntry, TokenDelta
from scheduler.sampling_params import SamplingParams
from scheduler.sequence import FinishReason, Sequence
from workers.device import dtype_name, pick_device, pick_dtype
from workers.loaders import load_model_files
from workers.loaders.resolve import resolve_model_path
from workers.model_config import ModelConfig
from workers.model_runner import ModelRunner
from workers.models.llama import LlamaModel
from workers.sampler import Sampler

log = logging.getLogger("splitserve.engine")

DEFAULT_KV_CACHE_MEMORY = "512MiB"


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # None / "smollm2": the default GGUF
    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    kv_cache_memory: str | int | None = None  # e.g. "512MiB"; default 512MiB
    num_kv_blocks: int | None = None  # overrides kv_cache_memory
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_model_len: int | None = None  # default: the model's context window
    seed: int = 0
    num_threads: int | None = None  # torch CPU threads; None: torch's default

    def __post_init__(self) -> None:
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be a power of two <= 128, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError("num_kv_blocks must be at least 1")
        if self.kv_cache_memory is not None:
            parse_bytes(self.kv_cache_memory)
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError("max_model_len must be at least 1")
        BatchPolicyConfig(self.max_num_batched_tokens, self.max_num_seqs)


class LLMEngine:
    def __init__(self, config: EngineConfig, *, model_config: ModelConfig | None = None,
                 weights: dict[str, torch.Tensor] | None = None) -> None:
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.device = pick_device(config.device)
        self.dtype = pick_dtype(config.dtype, self.device)
        t0 = time.perf_counter()
        if weights is None:
            self.model_path = resolve_model_path(config.model)
            model_config, weights = load_model_files(self.model_path)
        else:
            self.model_path = None
        assert model_config is not None
        self.model_config = model_config
        self.model = LlamaModel(model_config, weights, self.dtype, self.device)
        del weights
        self.load_seconds = time.perf_counter() - t0
        self.max_model_len = min(config.max_model_len or model_config.max_position_embeddings,
                                 model_config.max_position_embeddings)

        self.kv_layout = KVLayout(
            num_layers=model_config.num_layers,
            num_kv_heads=model_config.num_kv_heads,
            head_dim=model_config.head_dim,
            dtype=dtype_name(self.dtype),
            block_size=config.block_size,
        )
        num_blocks = config.num_kv_blocks or self.kv_layout.num_blocks_for_budget(
            parse_bytes(config.kv_cache_memory or DEFAULT_KV_CACHE_MEMORY))
        pool_tokens = num_blocks * config.block_size
        if pool_tokens < self.max_model_len:
            # A sequence that cannot fit the whole pool could never finish (it would preempt
            # itself forever), so the context window shrinks to what the pool holds.
            log.warning("KV cache holds %d tokens, fewer than the context window %d: "
                        "max_model_len is now %d", pool_tokens, self.max_model_len, pool_tokens)
            self.max_model_len = pool_tokens
        self.blocks = BlockManager(num_blocks, config.block_size)
        self.kv = KVCacheStorage(self.kv_layout, num_blocks, self.device)
        self.policy = BatchPolicy(
            BatchPolicyConfig(config.max_num_batched_tokens, config.max_num_seqs), self.blocks)
        self.sampler = Sampler(self.device, config.seed, model_config.vocab_size)
        self.runner = ModelRunner(self.model, self.kv, self.blocks, self.sampler)
        self._seqs: dict[str, Sequence] = {}
        self.num_steps = 0
        # Prefill role: called after each layer's attention with [(request id, block table,
        # num tokens)] of the prompts that finish prefill in this step, so their KV can be
        # sent while later layers compute.
        self.on_kv_layer = None
        self._eos = frozenset(model_config.eos_token_ids)
        log.info(
            "model %s: %s on %s, %d layers, weights %.1f MiB, loaded in %.1fs; KV cache %d blocks "
            "x %d tokens, %d bytes/token, %d bytes",
            model_config.name, dtype_name(self.dtype), self.device, model_config.num_layers,
            self.model.weight_bytes() / 2**20, self.load_seconds, num_blocks, config.block_size,
            self.kv_layout.bytes_per_token, self.kv.nbytes,
        )

    # -- requests --
    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams, arrival_time: float | None = None,
                    prefill_only: bool = False) -> None:
        if request_id in self._seqs:
            raise ValueError(f"request id {request_id!r} is already in use")
        params.validate()
        if not prompt_token_ids:
            raise ValueError("prompt must contain at least one token")
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        n = len(prompt_token_ids)
        if n >= self.max_model_len:
            raise ValueError(f"prompt has {n} tokens; the context window is {self.max_model_len}")
        if self.blocks.blocks_for(n + 1) > self.blocks.num_total_blocks:
            raise ValueError(
                f"prompt of {n} tokens cannot fit the KV cache "
                f"({self.blocks.num_total_blocks} blocks of {self.blocks.block_size})")
        seq = Sequence(request_id, list(prompt_token_ids), params, eos_token_ids=self._eos,
                       max_model_len=self.max_model_len, prefill_only=prefill_only)
        if arrival_time is not None:
            seq.arrival_time = arrival_time  # time.monotonic() of this process
        self._seqs[request_id] = seq
        self.policy.add(seq)

    def add_prefilled(self, request_id: str, prompt_token_ids: list[int], first_token: int,
                      params: SamplingParams) -> None:
        """Join a request whose prompt KV is already in this worker's blocks (held under
        `request_id`, written by a KV transfer) and whose first token was sampled elsewhere."""
        if request_id in self._seqs:
            raise ValueError(f"request id {request_id!r} is already in use")
        n = len(prompt_token_ids)
        if self.blocks.num_blocks_held(request_id) < self.blocks.blocks_for(n):
            raise ValueError(f"{request_id}: the prompt's KV blocks are not held here")
        seq = Sequence(request_id, list(prompt_token_ids), params, eos_token_ids=self._eos,
                       max_model_len=self.max_model_len)
        seq.output_token_ids.append(first_token)
        seq.num_computed_tokens = n
        seq.first_scheduled_time = time.monotonic()
        self.sampler.skip_first_draw(seq)  # seeded streams continue as if sampled here
        self._seqs[request_id] = seq
        self.policy.add(seq)

    def abort(self, request_id: str) -> bool:
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return False
        self.policy.remove(seq, FinishReason.ABORT)
        self.sampler.forget(request_id)
        return True

    def num_uncomputed_prompt_tokens(self) -> int:
        """Prompt tokens still to prefill (waiting or mid-prefill): a prefill queue length."""
        return sum(max(0, s.num_prompt_tokens - s.num_computed_tokens)
                   for s in self._seqs.values())

    def has_unfinished(self) -> bool:
        return self.policy.has_work()

    @property
    def num_running(self) -> int:
        return self.policy.num_running

    @property
    def num_waiting(self) -> int:
        return self.policy.num_waiting

    # -- the step loop --
    def step(self) -> list[TokenDelta]:
        """One step; what it reports per request is the wire struct itself (one shape from
        engine to client)."""
        plan = self.policy.schedule()
        if not plan:
            return []
        self.num_steps += 1
        exports = [(c.seq.seq_id, list(self.blocks.table(c.seq.seq_id)), c.end)
                   for c in plan.chunks if c.samples and c.seq.prefill_only]
        hook = None
        if exports and self.on_kv_layer is not None:
            def hook(layer: int) -> None:
                self.on_kv_layer(exports, layer)
        results = self.runner.execute(plan, hook)
        now = time.monotonic()
        outputs: list[TokenDelta] = []
        for i, chunk in enumerate(plan.chunks):
            self.policy.commit(chunk)
            res = results.get(i)
            if res is None:
                continue
            seq = chunk.seq
            reason = seq.append_token(res.token)
            lp = None
            if res.logprob is not None:
                lp = [LogprobEntry(res.token, res.logprob, res.top_logprobs or [])]
            if reason is not None:
                self.policy.remove(seq, reason)
                self._seqs.pop(seq.seq_id, None)
                self.sampler.forget(seq.seq_id)
            out = TokenDelta(
                request_id=seq.seq_id, token_ids=[res.token], logprobs=lp,
                finished=reason is not None,
                finish_reason=reason.value if reason is not None else None,
                num_prompt_tokens=seq.num_prompt_tokens,
                num_output_tokens=seq.num_output_tokens,
            )
            if seq.num_output_tokens == 1 and seq.first_scheduled_time is not None:
                out.queue_s = seq.first_scheduled_time - seq.arrival_time
                out.prefill_s = now - seq.first_scheduled_time
            outputs.append(out)
        return outputs

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 ) -> list[list[int]]:
        """Run prompts to completion; returns the generated token ids for each."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"gen-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
        for rid, p, sp in zip(ids, prompts, plist):
            self.add_request(rid, p, sp)
        out: dict[str, list[int]] = {rid: [] for rid in ids}
        while self.has_unfinished():
            for o in self.step():
                if o.request_id in out:
                    out[o.request_id].extend(o.token_ids)
        return [out[rid] for rid in ids]
