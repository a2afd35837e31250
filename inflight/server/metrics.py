"""Prometheus metrics of the server, and of the engine and KV cache behind it."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from inflight.api import LLM

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_ENGINE_COUNTERS = (
    "submitted",
    "refused",
    "stalls_incompatible",
    "stalls_no_capacity",
    "admitted_mid_flight",
    "steps",
    "completed",
    "cancelled",
    "failed",
)


class ServerMetrics:
    def __init__(self, llm: LLM) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("inflight_requests", "Requests by outcome", ["outcome"], registry=r)
        self.queue_time = Histogram(
            "inflight_request_queue_seconds",
            "Time from arrival until the request is being served",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.time_to_first_token = Histogram(
            "inflight_time_to_first_token_seconds",
            "Time from admission to the first output token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.inter_token_latency = Histogram(
            "inflight_inter_token_latency_seconds",
            "Time between consecutive output tokens",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.request_latency = Histogram(
            "inflight_e2e_request_latency_seconds",
            "Time from admission to the end of the request",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        r.register(_EngineCollector(llm))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector(Collector):
    """Reads the engine's counters and the KV cache's occupancy at scrape time."""

    def __init__(self, llm: LLM) -> None:
        self._llm = llm

    def collect(self) -> Iterator[Metric]:
        used, total = self._llm.kv_cache_usage()
        yield GaugeMetricFamily("inflight_kv_blocks_used", "KV cache blocks in use", value=used)
        yield GaugeMetricFamily("inflight_kv_blocks_total", "KV cache blocks in all", value=total)
        yield GaugeMetricFamily(
            "inflight_kv_cache_usage_ratio", "Share of KV blocks in use", value=used / total
        )
        used, total = self._llm.resident_slot_usage()
        yield GaugeMetricFamily("inflight_resident_slots_used", "Resident slots in use", value=used)
        yield GaugeMetricFamily(
            "inflight_resident_slots_total", "Resident slots in all", value=total
        )
        cache = self._llm.get_context_cache_metrics()
        if cache is not None:
            for name in ("lookups", "lookup_tokens", "hit_tokens", "skipped_lookups", "evictions"):
                yield CounterMetricFamily(
                    f"inflight_context_cache_{name}", f"Context cache {name}", value=cache[name]
                )
            yield GaugeMetricFamily(
                "inflight_context_cache_hit_ratio",
                "Share of looked-up prompt tokens found in the context cache",
                value=cache["hit_ratio"],
            )
            for name, doc in (
                ("pinned_prefixes", "Prefixes pinned in the context cache"),
                ("pinned_blocks", "KV blocks pinned prefixes hold"),
            ):
                yield GaugeMetricFamily(f"inflight_context_cache_{name}", doc, value=cache[name])
            yield CounterMetricFamily(
                "inflight_context_cache_pinned_hit_tokens",
                "Prompt tokens found in pinned prefixes",
                value=cache["pinned_hit_tokens"],
            )
        spec = self._llm.get_speculative_metrics()
        if spec is not None:
            for name in (
                "drafted_tokens",
                "accepted_tokens",
                "verifications",
                "voided_rows",
                "fallback_rows",
            ):
                yield CounterMetricFamily(
                    f"inflight_spec_decode_{name}", f"Speculative decoding {name}", value=spec[name]
                )
            for name, doc in (
                ("acceptance_rate", "Share of draft tokens accepted"),
                ("mean_accepted_length", "Tokens a verified row emits per step"),
            ):
                yield GaugeMetricFamily(f"inflight_spec_decode_{name}", doc, value=spec[name])
        encoder = self._llm.get_encoder_metrics()
        if encoder is not None:
            for name, doc in (
                ("encoder_runs", "Media items encoded"),
                ("encoder_cache_hits", "Media items found in the encoder cache"),
            ):
                yield CounterMetricFamily(f"inflight_{name}", doc, value=encoder[name])
        values = self._llm.get_scheduling_metrics()
        if values is None:
            return
        for name in _ENGINE_COUNTERS:
            yield CounterMetricFamily(
                f"inflight_engine_{name}", f"Engine counter {name}", value=values[name]
            )
        for name in ("queued", "resident"):
            yield GaugeMetricFamily(
                f"inflight_engine_{name}", f"Engine gauge {name}", value=values[name]
            )
        yield GaugeMetricFamily(
            "inflight_engine_queue_latency_avg_seconds",
            "Mean time from submit to admission",
            value=values["queue_latency_avg_us"] / 1e6,
        )
        yield GaugeMetricFamily(
            "inflight_engine_queue_latency_max_seconds",
            "Longest time from submit to admission",
            value=values["queue_latency_max_us"] / 1e6,
        )
