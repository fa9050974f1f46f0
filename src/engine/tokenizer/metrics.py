"""Prometheus metrics of the serving front end, with SGLang's metric names (`sglang:...`).

Two sources feed one registry per TokenizerManager (so several servers, or tests, can live in
one process without clashing in prometheus_client's global registry):

- counters and histograms, observed by the TokenizerManager as outputs arrive
  (`RequestTimer` tracks one request's timestamps; `observe_output` turns them into TTFT,
  inter-token latency, e2e latency and token counts);
- gauges of the scheduler (running/queued requests, token usage, cache hit rate, generation
  throughput), taken from its internal state at scrape time and set with `set_scheduler_states`.
  A scrape that could not reach the scheduler exposes no gauge rather than a stale value.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from dataclasses import dataclass
from typing import Any, Dict, Iterator, Mapping, Optional, Sequence, Tuple

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

logger = logging.getLogger(__name__)

METRIC_PREFIX = "sglang:"
METRICS_CONTENT_TYPE = CONTENT_TYPE_LATEST

# Bucket edges in seconds. They start lower than SGLang's because a small model on a CPU
# answers in milliseconds, and they reach minutes for long generations on big models.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


# Custom labels (--tokenizer-metrics-allowed-custom-labels): names a label may have, the values a
# request may give, and the label sets one server keeps. Every distinct set of values is a series
# of every request metric, held until the server stops: past the cap, new sets count under
# OVERFLOW_LABEL_VALUE, so clients cannot grow the registry without bound.
CUSTOM_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
RESERVED_LABEL_NAMES = ("model_name", "le", "quantile")
MAX_CUSTOM_LABEL_NAMES = 16
MAX_CUSTOM_LABEL_VALUE_LEN = 128
MAX_CUSTOM_LABEL_SETS = 1000
OVERFLOW_LABEL_VALUE = "__overflow__"


def custom_label_names_error(names: Sequence[str]) -> Optional[str]:
    """Why `names` cannot be the allowed custom labels (None: they can)."""
    if len(names) > MAX_CUSTOM_LABEL_NAMES:
        return f"at most {MAX_CUSTOM_LABEL_NAMES} names, got {len(names)}"
    if len(set(names)) != len(names):
        return f"names must be distinct, got {list(names)}"
    for name in names:
        if not CUSTOM_LABEL_NAME.fullmatch(name) or name.startswith("__") or name in RESERVED_LABEL_NAMES:
            return (f"{name!r} is not a label name this server can add (letters, digits and '_', not starting "
                    f"with a digit or '__', none of {', '.join(RESERVED_LABEL_NAMES)})")
    return None


def checked_custom_labels(labels: Any, allowed: Sequence[str]) -> Optional[Dict[str, str]]:
    """A request's custom labels, kept to the allowed names (others are dropped, as SGLang);
    ValueError for a shape or a value out of bounds."""
    if labels is None:
        return None
    if not isinstance(labels, dict):
        raise ValueError("custom_labels must be an object of label name -> string value")
    kept: Dict[str, str] = {}
    for name, value in labels.items():
        if name not in allowed:
            continue
        if not isinstance(value, str) or len(value) > MAX_CUSTOM_LABEL_VALUE_LEN:
            raise ValueError(f"custom_labels[{name!r}] must be a string of at most {MAX_CUSTOM_LABEL_VALUE_LEN} "
                             "characters")
        kept[name] = value
    return kept or None


@dataclass(slots=True)
class RequestTimer:
    """Timestamps of one request, in the clock the caller uses for `now` (seconds), and the values
    of its custom labels (TokenizerMetricsCollector.label_values)."""

    created: float
    first_token_time: Optional[float] = None
    last_output_time: Optional[float] = None
    completion_tokens: int = 0
    labels: Tuple[str, ...] = ()


@dataclass(slots=True)
class _Series:
    """The request metrics of one set of label values."""

    prompt_tokens: Any
    generation_tokens: Any
    num_requests: Any
    time_to_first_token: Any
    inter_token_latency: Any
    e2e_request_latency: Any


class TokenizerMetricsCollector:
    """The metrics of one server: request counters, latency histograms and scheduler gauges.

    `custom_label_names` (--tokenizer-metrics-allowed-custom-labels) label every request metric
    after model_name, as SGLang's; a request without a value for one gets "".
    """

    def __init__(self, model_name: str, registry: Optional[CollectorRegistry] = None,
                 custom_label_names: Sequence[str] = ()) -> None:
        self.model_name = model_name
        self.registry = registry if registry is not None else CollectorRegistry()
        self.custom_label_names = tuple(custom_label_names)
        labels = ("model_name", *self.custom_label_names)

        def counter(name: str, doc: str) -> Any:
            return Counter(METRIC_PREFIX + name, doc, labels, registry=self.registry)

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Any:
            return Histogram(METRIC_PREFIX + name, doc, labels, buckets=buckets, registry=self.registry)

        # prometheus_client appends `_total` to counter names.
        self._metrics = _Series(
            prompt_tokens=counter("prompt_tokens", "Prompt tokens of finished requests."),
            generation_tokens=counter("generation_tokens", "Generated tokens of finished requests."),
            num_requests=counter("num_requests", "Finished requests (any finish reason)."),
            time_to_first_token=histogram(
                "time_to_first_token_seconds", "Time from arrival to the first output token.", TTFT_BUCKETS),
            inter_token_latency=histogram(
                "inter_token_latency_seconds", "Time between consecutive output tokens.", ITL_BUCKETS),
            e2e_request_latency=histogram(
                "e2e_request_latency_seconds", "Time from arrival to the last output token.", E2E_BUCKETS),
        )
        self._series: Dict[Tuple[str, ...], _Series] = {}
        self.label_values(None)  # the unlabelled series shows from the start
        self.scheduler_gauges = SchedulerStateCollector(model_name)
        self.registry.register(self.scheduler_gauges)
        self.registry.register(DisaggregationCollector(self.scheduler_gauges))
        self.registry.register(ExpertCollector(self.scheduler_gauges))

    def label_values(self, custom_labels: Optional[Mapping[str, str]]) -> Tuple[str, ...]:
        """A request's custom label values, in label order; OVERFLOW_LABEL_VALUE for every label
        once MAX_CUSTOM_LABEL_SETS sets are kept and this one is new."""
        values = tuple((custom_labels or {}).get(name, "") for name in self.custom_label_names)
        if values not in self._series and len(self._series) >= MAX_CUSTOM_LABEL_SETS:
            values = (OVERFLOW_LABEL_VALUE,) * len(values)
        self._series_of(values)  # kept from now on: the cap counts it
        return values

    def _series_of(self, values: Tuple[str, ...]) -> _Series:
        series = self._series.get(values)
        if series is None:
            metrics = self._metrics
            label_values = (self.model_name, *values)
            series = self._series[values] = _Series(*(
                getattr(metrics, f.name).labels(*label_values) for f in dataclasses.fields(_Series)))
        return series

    # ------------------------------------------------------------------ observing
    def observe_output(self, timer: RequestTimer, prompt_tokens: int, completion_tokens: int,
                       finished: bool, now: float) -> None:
        """One output of a request arrived with `completion_tokens` tokens generated so far."""
        new_tokens = completion_tokens - timer.completion_tokens
        if new_tokens > 0:
            if timer.first_token_time is None:
                timer.first_token_time = now
                self._series_of(timer.labels).time_to_first_token.observe(max(0.0, now - timer.created))
                new_tokens -= 1  # the first token has no predecessor to measure against
            if new_tokens > 0 and timer.last_output_time is not None:
                self.observe_inter_token_latency(now - timer.last_output_time, new_tokens, timer.labels)
            timer.completion_tokens = completion_tokens
            timer.last_output_time = now
        if finished:
            self.observe_one_finished_request(prompt_tokens, completion_tokens, now - timer.created, timer.labels)

    def observe_inter_token_latency(self, interval: float, num_new_tokens: int,
                                    labels: Tuple[str, ...] = ()) -> None:
        """`num_new_tokens` arrived together after `interval` s: each took interval / n on average."""
        per_token = max(0.0, interval) / num_new_tokens
        histogram = self._series_of(labels or self.label_values(None)).inter_token_latency
        for _ in range(num_new_tokens):
            histogram.observe(per_token)

    def observe_one_finished_request(self, prompt_tokens: int, generation_tokens: int,
                                     e2e_latency: float, labels: Tuple[str, ...] = ()) -> None:
        series = self._series_of(labels or self.label_values(None))
        series.prompt_tokens.inc(max(0, prompt_tokens))
        series.generation_tokens.inc(max(0, generation_tokens))
        series.num_requests.inc()
        series.e2e_request_latency.observe(max(0.0, e2e_latency))

    # ------------------------------------------------------------------ scraping
    def set_scheduler_states(self, states: Optional[Sequence[dict]]) -> None:
        """The schedulers' internal states for this scrape (one per DP replica), or None."""
        self.scheduler_gauges.states = list(states) if states is not None else None

    def render(self) -> bytes:
        """The Prometheus text exposition of everything in this collector's registry."""
        return generate_latest(self.registry)


class SchedulerStateCollector:
    """Custom collector: gauges computed from the last internal states handed to it.

    Counts (requests, throughput) are summed over DP replicas; ratios are averaged.
    """

    # (metric name, internal state key, documentation, how replicas combine)
    GAUGES = (
        ("num_running_reqs", "num_running_reqs", "Requests running in the scheduler.", "sum"),
        ("num_queue_reqs", "num_waiting_reqs", "Requests waiting in the scheduler's queue.", "sum"),
        ("num_grammar_queue_reqs", "num_grammar_queue_reqs", "Requests waiting for their grammar to compile.",
         "sum"),
        ("token_usage", "token_usage", "Fraction of the KV cache pool in use.", "mean"),
        ("cache_hit_rate", "cache_hit_rate", "Fraction of prompt tokens served from the prefix cache.", "mean"),
        ("gen_throughput", "gen_throughput", "Generation throughput (tokens/s) of recent decode batches.", "sum"),
        # Speculative decoding only (absent from the states otherwise).
        ("spec_accept_length", "avg_spec_accept_length", "Mean tokens per request per speculative verify step.",
         "mean"),
    )

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.states: Optional[list[dict]] = None

    def describe(self) -> Iterator[Metric]:
        # Lets the registry check names at registration without touching the scheduler.
        for name, _, doc, _ in self.GAUGES:
            yield GaugeMetricFamily(METRIC_PREFIX + name, doc, labels=["model_name"])

    def collect(self) -> Iterator[Metric]:
        states = self.states
        if not states:
            return
        for name, key, doc, combine in self.GAUGES:
            values = [float(s[key]) for s in states if isinstance(s.get(key), (int, float))]
            if not values:
                continue
            value = sum(values) if combine == "sum" else sum(values) / len(values)
            family = GaugeMetricFamily(METRIC_PREFIX + name, doc, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family


class ExpertCollector:
    """Tokens routed to each expert of a mixture-of-experts model, from the schedulers' internal states
    ("moe": routed_tokens): one counter series per expert id, summed over the layers and the DP
    replicas (a (layer, expert) series would be layers x experts of them; the per-layer counts are what
    /dump_expert_distribution_record gives). A token counts once per expert of its top-k, in every
    forward (prefill and decode). Nothing is exposed for a dense model."""

    def __init__(self, source: SchedulerStateCollector) -> None:
        self.source = source

    def describe(self) -> Iterator[Metric]:
        return iter(())  # present only for MoE models

    def collect(self) -> Iterator[Metric]:
        routed = [s["moe"]["routed_tokens"] for s in self.source.states or [] if isinstance(s.get("moe"), dict)]
        if not routed:
            return
        family = CounterMetricFamily(METRIC_PREFIX + "moe_routed_tokens",
                                     "Tokens routed to each expert (top-k slots), summed over the MoE layers.",
                                     labels=["model_name", "expert_id"])
        for expert_id, counts in enumerate(zip(*routed)):
            family.add_metric([self.source.model_name, str(expert_id)], sum(counts))
        yield family


class DisaggregationCollector:
    """PD disaggregation metrics (SGLang's names) from the schedulers' internal states.

    The scheduler keeps the counters and histograms (engine/disaggregation/metrics.py); a scrape
    renders the snapshot it reported. Nothing is exposed by a server without --disaggregation-mode.
    """

    GAUGES = (
        ("num_prefill_prealloc_queue_reqs", "Requests waiting for the decode side's destination (prefill)."),
        ("num_prefill_inflight_queue_reqs", "Requests whose KV is being sent (prefill)."),
        ("num_decode_prealloc_queue_reqs", "Requests waiting for their prefill or for decode memory (decode)."),
        ("num_decode_transfer_queue_reqs", "Requests whose KV is being received (decode)."),
        ("num_decode_retracted_queue_reqs", "Retracted requests waiting to resume (decode)."),
    )
    COUNTERS = (
        ("num_bootstrap_failed_reqs", "Requests that failed before their KV started to move."),
        ("num_transfer_failed_reqs", "Requests that failed while or after their KV moved."),
        ("num_transferred_prompt_tokens", "Prompt tokens whose KV arrived by transfer (decode)."),
    )
    HISTOGRAMS = (
        ("kv_transfer_bootstrap_ms", "Request arrival until the other side was found (ms)."),
        ("kv_transfer_alloc_ms", "Decode: other side found until memory was reserved (ms)."),
        ("kv_transfer_latency_ms", "KV transfer time of one request (ms)."),
        ("kv_transfer_total_mb", "KV transferred per request (MB)."),
        ("kv_transfer_speed_gb_s", "KV transfer speed per request (GB/s)."),
    )

    def __init__(self, source: SchedulerStateCollector) -> None:
        self.source = source

    def describe(self) -> Iterator[Metric]:
        return iter(())  # names vary with the mode; nothing to check at registration

    def collect(self) -> Iterator[Metric]:
        states = self.source.states or []
        labels = ["model_name"]
        model = [self.source.model_name]
        computed = [s["num_extend_tokens_computed"] for s in states if "num_extend_tokens_computed" in s]
        if computed:
            family = CounterMetricFamily(METRIC_PREFIX + "num_prefill_computed_tokens",
                                         "Tokens this server computed in prefill (extend) forwards.", labels=labels)
            family.add_metric(model, sum(computed))
            yield family
        pd = [s["disaggregation"] for s in states if isinstance(s.get("disaggregation"), dict)]
        if not pd:
            return
        for name, doc in self.GAUGES:
            values = [d[name] for d in pd if name in d]
            if values:
                gauge = GaugeMetricFamily(METRIC_PREFIX + name, doc, labels=labels)
                gauge.add_metric(model, sum(values))
                yield gauge
        snapshots = [d["metrics"] for d in pd]
        for name, doc in self.COUNTERS:
            family = CounterMetricFamily(METRIC_PREFIX + name, doc, labels=labels)
            family.add_metric(model, sum(m[name] for m in snapshots))
            yield family
        by_cause = CounterMetricFamily(METRIC_PREFIX + "kv_transfer_failed_reqs",
                                       "Failed PD requests by cause.", labels=labels + ["cause"])
        causes: dict = {}
        for m in snapshots:
            for cause, count in m["kv_transfer_failed_reqs_by_cause"].items():
                causes[cause] = causes.get(cause, 0) + count
        for cause, count in sorted(causes.items()):
            by_cause.add_metric(model + [cause], count)
        yield by_cause
        for name, doc in self.HISTOGRAMS:
            hists = [m["histograms"][name] for m in snapshots]
            edges = hists[0]["buckets"]
            cumulative = [sum(h["cumulative_counts"][i] for h in hists) for i in range(len(edges) + 1)]
            buckets = [(repr(float(e)), c) for e, c in zip(edges, cumulative)] + [("+Inf", cumulative[-1])]
            histogram = HistogramMetricFamily(METRIC_PREFIX + name, doc, labels=labels)
            histogram.add_metric(model, buckets, sum(h["sum"] for h in hists))
            yield histogram
