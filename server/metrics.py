"""Prometheus metrics. The gateway owns the registry; workers send stats over the wire.

Every metric is prefixed `splitserve_` and labelled `model_name`; per-worker gauges also
carry `worker` and `role`. Latency buckets run from 1 ms to ~10 minutes so that both GPU
(milliseconds) and laptop-CPU (seconds) latencies land in informative buckets.
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from scheduler.protocol import WorkerStats

disable_created_metrics()  # no *_created series: dashboards do not use them

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                   1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
               0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000,
                 100000, 200000)

PREFIX = "splitserve_"


class Metrics:
    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.registry = r = CollectorRegistry()
        m = ["model_name"]
        w = ["model_name", "worker", "role"]

        def hist(name, doc, buckets):
            return Histogram(PREFIX + name, doc, m, buckets=buckets, registry=r)

        self.queue_time = hist("request_queue_time_seconds",
                               "Arrival at the gateway to the start of prefill.", LATENCY_BUCKETS)
        self.ttft = hist("time_to_first_token_seconds",
                         "Arrival at the gateway to the first output token.", LATENCY_BUCKETS)
        self.itl = hist("inter_token_latency_seconds",
                        "Time between consecutive output tokens of a request.", ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds",
                        "Arrival at the gateway to the last output token.", LATENCY_BUCKETS)
        self.prefill_time = hist("request_prefill_time_seconds",
                                 "Start of prefill to the first token.", LATENCY_BUCKETS)
        self.decode_time = hist("request_decode_time_seconds",
                                "First token to the last token.", LATENCY_BUCKETS)
        self.prompt_tokens_hist = hist("request_prompt_tokens",
                                       "Prompt length of finished requests.", TOKEN_BUCKETS)
        self.generation_tokens_hist = hist("request_generation_tokens",
                                           "Output length of finished requests.", TOKEN_BUCKETS)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens processed.", m,
                                     registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens",
                                         "Output tokens generated.", m, registry=r)
        self.success = Counter(PREFIX + "request_success", "Finished requests by reason.",
                               m + ["finished_reason"], registry=r)
        self.errors = Counter(PREFIX + "request_errors", "Failed requests by error type.",
                              m + ["type"], registry=r)
        self.preemptions = Counter(PREFIX + "num_preemptions",
                                   "Sequences preempted on workers.", w, registry=r)
        self.running = Gauge(PREFIX + "num_requests_running",
                             "Sequences running on a worker.", w, registry=r)
        self.waiting = Gauge(PREFIX + "num_requests_waiting",
                             "Sequences waiting on a worker.", w, registry=r)
        self.gateway_waiting = Gauge(PREFIX + "num_requests_in_flight",
                                     "Requests admitted by the gateway and not finished.", m,
                                     registry=r)
        self.kv_usage = Gauge(PREFIX + "kv_cache_usage_ratio",
                              "Fraction of KV blocks in use.", w, registry=r)
        self.kv_blocks_total = Gauge(PREFIX + "kv_cache_blocks_total",
                                     "KV cache blocks on the worker.", w, registry=r)
        self.kv_blocks_used = Gauge(PREFIX + "kv_cache_blocks_used",
                                    "KV cache blocks in use on the worker.", w, registry=r)
        self.kv_bytes_per_token = Gauge(PREFIX + "kv_cache_bytes_per_token",
                                        "KV cache bytes per token on the worker.", w, registry=r)
        self.workers = Gauge(PREFIX + "workers", "Registered workers by role.",
                             m + ["role"], registry=r)
        self.dropped_messages = Counter(PREFIX + "dropped_messages",
                                        "Malformed wire messages dropped.", m, registry=r)
        self.kv_transfer_seconds = hist(
            "kv_transfer_seconds", "A request's KV transfer, first layer sent to committed.",
            LATENCY_BUCKETS)
        self.kv_transfer_exposed_seconds = hist(
            "kv_transfer_exposed_seconds",
            "The part of a KV transfer left after the prefill forward ended (not overlapped).",
            LATENCY_BUCKETS)
        self.kv_transfer_bytes = Counter(PREFIX + "kv_transfer_bytes",
                                         "KV bytes received by decode workers.", m, registry=r)
        self.kv_transfer_failures = Counter(
            PREFIX + "kv_transfer_failures",
            "Rejected KV frames, failed sends and expired reservations.", w, registry=r)
        self.kv_transfer_retries = Counter(PREFIX + "kv_transfer_retries",
                                           "Prefills retried after a failed transfer.", m,
                                           registry=r)
        self._preempt_seen: dict[str, int] = {}
        self._failures_seen: dict[str, int] = {}
        self._roles: dict[str, str] = {}

    def worker_labels(self, worker: str, role: str) -> dict:
        return dict(model_name=self.model_name, worker=worker, role=role)

    def add_worker(self, worker: str, role: str, num_blocks: int, bytes_per_token: int) -> None:
        self._roles[worker] = role
        lb = self.worker_labels(worker, role)
        self.kv_blocks_total.labels(**lb).set(num_blocks)
        self.kv_bytes_per_token.labels(**lb).set(bytes_per_token)
        self.preemptions.labels(**lb)  # export 0 from the start
        self.kv_transfer_failures.labels(**lb)
        self.update_worker(worker, role, WorkerStats(num_blocks_total=num_blocks))

    def remove_worker(self, worker: str, role: str) -> None:
        for g in (self.running, self.waiting, self.kv_usage, self.kv_blocks_total,
                  self.kv_blocks_used, self.kv_bytes_per_token):
            try:
                g.remove(self.model_name, worker, role)
            except KeyError:
                pass
        self._preempt_seen.pop(worker, None)
        self._failures_seen.pop(worker, None)

    def update_worker(self, worker: str, role: str, s: WorkerStats) -> None:
        lb = self.worker_labels(worker, role)
        self.running.labels(**lb).set(s.num_running)
        self.waiting.labels(**lb).set(s.num_waiting)
        self.kv_blocks_used.labels(**lb).set(s.num_blocks_used)
        if s.num_blocks_total:
            self.kv_usage.labels(**lb).set(s.num_blocks_used / s.num_blocks_total)
        seen = self._preempt_seen.get(worker, 0)
        if s.num_preemptions > seen:
            self.preemptions.labels(**lb).inc(s.num_preemptions - seen)
            self._preempt_seen[worker] = s.num_preemptions

    def update_transfer_failures(self, worker: str, cumulative: int) -> None:
        seen = self._failures_seen.get(worker, 0)
        if cumulative > seen:
            role = self._roles.get(worker, "")
            self.kv_transfer_failures.labels(**self.worker_labels(worker, role)).inc(
                cumulative - seen)
            self._failures_seen[worker] = cumulative

    def observe_finished(self, *, queue_s, ttft_s, e2e_s, prefill_s, prompt_tokens,
                         output_tokens, finish_reason) -> None:
        m = self.model_name
        if ttft_s is not None:
            self.queue_time.labels(m).observe(max(0.0, queue_s))
            self.ttft.labels(m).observe(ttft_s)
            self.prefill_time.labels(m).observe(prefill_s)
            self.decode_time.labels(m).observe(max(0.0, e2e_s - ttft_s))
        self.e2e.labels(m).observe(e2e_s)
        self.prompt_tokens_hist.labels(m).observe(prompt_tokens)
        self.generation_tokens_hist.labels(m).observe(output_tokens)
        self.success.labels(m, finish_reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
