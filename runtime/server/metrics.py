"""Prometheus metrics of the served runtime (`GET /metrics`).

Latencies and token counts are observed from each request's final output (the
tokenizer process stamps `time_to_first_token` and `e2e_latency` into its
meta_info); gauges of the scheduler's state are read from it at scrape time.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from radixlm.runtime.messages import ClientOutput

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
_TIER_GAUGES = {  # --kv-tier-path: kv_tier.FileTier.info()'s fields
    "bytes": "Bytes the KV tier's folder holds", "blocks": "Blocks the KV tier holds",
    "hits": "Requests that read KV from the tier, since start",
    "tokens_loaded": "Prompt tokens whose KV was read from the tier instead of prefilled, since start",
    "bytes_read": "Bytes read from the KV tier, since start", "bytes_written": "Bytes written to the KV tier, since start",
    "load_seconds": "Seconds spent reading KV from the tier into the pool, since start",
    "corrupt_skipped": "Tier files that failed their checks when read (deleted, never used), since start",
    "writes_failed": "Blocks whose write to the KV tier failed, since start",
    "writes_dropped": "Blocks not saved to the KV tier because its write queue was full, since start",
    "queued_bytes": "Bytes of blocks waiting to be written to the KV tier",
    "other_identity_blocks": "Blocks in the KV tier's folder written under other configurations (never read here)",
}


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("radixlm_time_to_first_token_seconds", "Time to first token", buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("radixlm_inter_token_latency_seconds", "Mean time per output token after the first",
                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("radixlm_e2e_request_latency_seconds", "End-to-end request latency",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("radixlm_prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter("radixlm_generation_tokens", "Tokens generated", registry=r)
        self.cached_tokens = Counter("radixlm_cached_tokens", "Prompt tokens served from the prefix cache", registry=r)
        self.requests = Counter("radixlm_requests", "Finished requests", ["finish_reason"], registry=r)
        self.running = Gauge("radixlm_num_running_requests", "Requests decoding", registry=r)
        self.queued = Gauge("radixlm_num_queued_requests", "Requests waiting", registry=r)
        self.token_usage = Gauge("radixlm_token_usage", "Share of the KV pool in use by running requests", registry=r)
        self.cache_hit_rate = Gauge("radixlm_cache_hit_rate", "Cached prompt tokens / prompt tokens, since start",
                                    registry=r)
        self.spec_verify = Counter("radixlm_spec_verify_passes", "Speculative verify rows run (one per request and step)",
                                   registry=r)
        self.spec_proposed = Counter("radixlm_spec_proposed_tokens", "Draft tokens checked by speculative decoding",
                                     registry=r)
        self.spec_accepted = Counter("radixlm_spec_accepted_tokens", "Draft tokens kept", registry=r)
        self.spec_accept_rate = Gauge("radixlm_spec_accept_rate", "Draft tokens kept / checked, since start", registry=r)
        self.spec_tokens_per_verify = Gauge("radixlm_spec_tokens_per_verify",
                                            "Tokens a verify row produces on average (kept drafts + 1), since start",
                                            registry=r)
        # the KV tier's totals since start, read from the scheduler at scrape time
        self.tier = {name: Gauge(f"radixlm_kv_tier_{name}", text, registry=r) for name, text in _TIER_GAUGES.items()}
        self._prompt_total = self._cached_total = 0  # for the hit rate (counters cannot be read back publicly)
        self._spec_totals = [0, 0, 0]  # verify rows, drafts checked, drafts kept

    def observe(self, out: ClientOutput) -> None:
        """Record a finished request."""
        meta = out.meta_info
        reason = (meta.get("finish_reason") or {}).get("type", "error" if out.error else "unknown")
        self.requests.labels(reason).inc()
        if out.error:
            return
        prompt, completion = meta.get("prompt_tokens", 0), meta.get("completion_tokens", 0)
        self.prompt_tokens.inc(prompt)
        self.generation_tokens.inc(completion)
        self.cached_tokens.inc(meta.get("cached_tokens", 0))
        self._prompt_total += prompt
        self._cached_total += meta.get("cached_tokens", 0)
        if meta.get("spec_verify_ct"):
            self._observe_speculation(meta["spec_verify_ct"], meta["spec_proposed_tokens"], meta["spec_accepted_tokens"])
        if "e2e_latency" in meta:
            self.e2e.observe(meta["e2e_latency"])
        if "time_to_first_token" in meta:
            self.ttft.observe(meta["time_to_first_token"])
            if completion > 1:
                self.itl.observe((meta["e2e_latency"] - meta["time_to_first_token"]) / (completion - 1))

    def _observe_speculation(self, verify: int, proposed: int, accepted: int) -> None:
        self.spec_verify.inc(verify)
        self.spec_proposed.inc(proposed)
        self.spec_accepted.inc(accepted)
        totals = self._spec_totals
        totals[0] += verify
        totals[1] += proposed
        totals[2] += accepted
        self.spec_accept_rate.set(totals[2] / totals[1] if totals[1] else 0.0)
        self.spec_tokens_per_verify.set((totals[2] + totals[0]) / totals[0])

    @property
    def hit_rate(self) -> float:
        """Cached prompt tokens / prompt tokens of the requests finished since start."""
        return self._cached_total / self._prompt_total if self._prompt_total else 0.0

    def latency_histograms(self) -> dict[str, dict[str, list]]:
        """TTFT's and inter-token latency's histograms as the dashboard draws them: each bucket's
        upper bound (`le`, the last one infinite: null) and the requests in it (not cumulative)."""
        out = {}
        for name, histogram in (("ttft", self.ttft), ("itl", self.itl)):
            (metric,) = histogram.collect()
            cumulative = [(float(s.labels["le"]), s.value) for s in metric.samples if s.name.endswith("_bucket")]
            counts = [int(c - b) for (_, c), (_, b) in zip(cumulative, [(0, 0.0)] + cumulative)]
            out[name] = {"le": [le if le != float("inf") else None for le, _ in cumulative], "counts": counts}
        return out

    def render(self, scheduler_info: dict[str, Any]) -> bytes:
        self.running.set(scheduler_info.get("running_requests", 0))
        self.queued.set(scheduler_info.get("waiting_requests", 0))
        pool = scheduler_info.get("kv_pool_tokens") or 1
        used = pool - scheduler_info.get("free_tokens", pool) - scheduler_info.get("cached_tokens", 0)
        self.token_usage.set(max(used, 0) / pool)
        self.cache_hit_rate.set(self.hit_rate)
        tier = scheduler_info.get("kv_tier") or {}
        for name, gauge in self.tier.items():
            gauge.set(tier.get(name, 0))
        return generate_latest(self.registry)
