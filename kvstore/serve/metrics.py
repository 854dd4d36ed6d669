"""Prometheus metrics of kvstore serve (GET /metrics).

Two kinds of numbers:
- the server's own, counted as requests are served: requests by where their
  cache came from (ram, disk, remote, none), tokens reused and prefilled,
  the time each request's disk or bucket load took, loads in progress,
  stores skipped (by admission, or with the writer behind), pins asked for by outcome, --warm prompts
  by outcome, requests and tokens reused by prompt_cache_key tag (kvstore.serve.routing);
- the directory's, read from the store when the endpoint is scraped: the
  cumulative counters every process using the directory adds to
  (KVStore.counters(), the same numbers `kvstore stats --json` prints:
  saves, bytes written and read, hits, misses, evictions, corrupt files,
  stores skipped by the write budget, load and save latency histograms),
  entries and bytes against the budget, live pins and the bytes they keep,
  the write budget's level and the remote tier's breaker.

A scrape never fails for the store: a counter the store cannot give now
(the directory being wiped, say) is left out of that scrape.
"""

import logging
import threading

log = logging.getLogger("kvstore")

SOURCES = ("ram", "disk", "remote", "none")
PIN_OUTCOMES = ("pinned", "refused", "not_stored")
WARM_OUTCOMES = ("stored", "skipped", "failed")
# Why the server skipped a store: admission (--admit-after), writer_busy (the
# background writer's queue was full: the generation thread never waits for it).
SKIPPED = ("admission", "writer_busy")
# prompt_cache_key tags given a label of their own, at most: the rest count
# as "other" (a label per client-chosen key would grow without bound).
MAX_KEY_LABELS = 64


def available():
    """True when prometheus_client is installed."""
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        return False
    return True


class Metrics:
    """The metrics of one server and its store.

    Args:
        store: a callable that gives the server's KVStore, or None while the
            store is not open yet (it opens once the model has loaded).
    """

    def __init__(self, store):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
        self.registry = CollectorRegistry(auto_describe=True)
        self._requests = Counter("kvstore_requests", "Requests by where their prompt cache came from",
                                 ["source"], registry=self.registry)
        self._reused = Counter("kvstore_tokens_reused", "Prompt tokens taken from a cache, by source",
                               ["source"], registry=self.registry)
        self._prefilled = Counter("kvstore_tokens_prefilled", "Prompt tokens the model computed",
                                  registry=self.registry)
        self._load = Histogram("kvstore_request_load_seconds",
                               "Time to load a request's cache from disk or the bucket, by source",
                               ["source"], registry=self.registry)
        self._loading = Gauge("kvstore_loads_in_progress", "Disk or bucket loads running now",
                              registry=self.registry)
        self._skipped = Counter("kvstore_stores_skipped", "Stores this server skipped, by why",
                                ["why"], registry=self.registry)
        for s in SOURCES:
            self._requests.labels(s)
            self._reused.labels(s)
        for why in SKIPPED:
            self._skipped.labels(why)
        self._pins = Counter("kvstore_pin_requests", "cache_control pins asked for, by outcome (pinned, refused, "
                             "not_stored)", ["outcome"], registry=self.registry)
        for outcome in PIN_OUTCOMES:
            self._pins.labels(outcome)
        self._warm = Counter("kvstore_warm_prompts", "Prompts of the --warm file, by outcome (stored, skipped: "
                             "stored already, failed)", ["outcome"], registry=self.registry)
        for outcome in WARM_OUTCOMES:
            self._warm.labels(outcome)
        self._keyed_requests = Counter("kvstore_cache_key_requests", "Requests by prompt_cache_key tag (its first "
                                       "digits; past MAX_KEY_LABELS tags: other) and source",
                                       ["cache_key", "source"], registry=self.registry)
        self._keyed_reused = Counter("kvstore_cache_key_tokens_reused", "Prompt tokens taken from a cache, by "
                                     "prompt_cache_key tag and source", ["cache_key", "source"], registry=self.registry)
        self._key_labels = set()
        self.registry.register(_StoreCollector(store))
        self._lock = threading.Lock()

    # -- counted by the server ------------------------------------------------

    def request(self, source, reused, prefilled, load_s=None):
        """One request served: where its cache came from, tokens reused and prefilled, its load time."""
        self._requests.labels(source).inc()
        self._reused.labels(source).inc(reused)
        self._prefilled.inc(prefilled)
        if load_s is not None:
            self._load.labels(source).observe(load_s)

    def keyed(self, tag, source, reused):
        """One request under a prompt_cache_key tag: its source and tokens reused."""
        with self._lock:
            if tag not in self._key_labels and len(self._key_labels) >= MAX_KEY_LABELS:
                tag = "other"
            self._key_labels.add(tag)
        self._keyed_requests.labels(tag, source).inc()
        self._keyed_reused.labels(tag, source).inc(reused)

    def loading(self, delta):
        self._loading.inc(delta)

    def skipped(self, why):
        self._skipped.labels(why).inc()

    def pin(self, outcome):
        """One pin asked for, by outcome (PIN_OUTCOMES)."""
        self._pins.labels(outcome).inc()

    def warm(self, outcome):
        """One warm prompt done, by outcome (WARM_OUTCOMES)."""
        self._warm.labels(outcome).inc()

    # -- the endpoint -----------------------------------------------------------

    def exposition(self):
        """(body bytes, content type) of a scrape."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
        with self._lock:
            return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _StoreCollector:
    """The store's numbers, read at scrape time."""

    def __init__(self, store):
        self.store = store

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
        store = self.store()
        if store is None:
            return
        try:
            stats = store.stats()
            counters = store.counters()
        except Exception as e:              # noqa: BLE001 - a scrape never fails for the store
            log.warning("kvstore: metrics_unavailable error=%s", type(e).__name__)
            return
        g = GaugeMetricFamily
        yield g("kvstore_entries", "Checkpoint files in the directory", value=stats["entries"])
        yield g("kvstore_bytes", "Bytes of checkpoint files in the directory", value=stats["bytes"])
        yield g("kvstore_budget_bytes", "The directory's disk budget", value=stats["budget_bytes"])
        yield CounterMetricFamily("kvstore_chains_over_half_budget",
                                  "Saves that took one session's chain past half the disk budget (this process)",
                                  value=stats["chains_over_half_budget"])
        if "pinned_bytes" in stats:
            yield g("kvstore_pinned_bytes", "Bytes live pins keep in the directory", value=stats["pinned_bytes"])
            yield g("kvstore_live_pins", "Live pins in the directory", value=stats["pins"])
        for name, key, doc in (
                ("saves", "saves", "Checkpoints saved"),
                ("written_bytes", "bytes_written", "Bytes written to checkpoint files"),
                ("loads", "loads", "Checkpoints loaded"),
                ("read_bytes", "bytes_read", "Bytes of checkpoint files loaded"),
                ("hits", "hits", "Lookups that loaded a checkpoint"),
                ("misses", "misses", "Lookups or loads that ended without a checkpoint"),
                ("evictions", "evictions", "Checkpoints evicted to keep the budget"),
                ("evicted_bytes", "bytes_evicted", "Bytes evicted to keep the budget"),
                ("corrupt_files", "corrupt", "Files found corrupt and removed"),
                ("stores_skipped_write_budget", "stores_skipped_write_budget",
                 "Stores skipped because the write budget ran low"),
                ("canary_checks", "canary_checks", "Restored states the canary checked against the live model"),
                ("canary_failures", "canary_failures",
                 "Restored states the live model would not have produced (quarantined)")):
            if key in counters:
                yield CounterMetricFamily(f"kvstore_directory_{name}", f"{doc} (every process, cumulative)",
                                          value=counters[key])
        for name, doc in (("load_seconds", "Checkpoint load latency"), ("save_seconds", "Checkpoint save latency")):
            h = counters.get(name)
            if h:
                buckets = [("+Inf" if le == float("inf") else repr(float(le)), n) for le, n in h["buckets"]]
                yield HistogramMetricFamily(f"kvstore_directory_{name}", f"{doc} (every process, cumulative)",
                                            buckets=buckets, sum_value=h["sum_s"])
        budget = counters.get("write_budget") or stats.get("write_budget")
        if budget:
            yield g("kvstore_write_budget_available_bytes", "Bytes the write budget allows now",
                    value=budget["available_bytes"])
            yield g("kvstore_write_budget_capacity_bytes", "The write budget's size (one hour's bytes)",
                    value=budget["capacity_bytes"])
        state = stats.get("remote_breaker")
        if state is not None:
            breaker = g("kvstore_remote_breaker", "The remote tier's circuit breaker: 1 for its state",
                        labels=["state"])
            for s in ("closed", "open", "half_open"):
                breaker.add_metric([s], 1.0 if state == s else 0.0)
            yield breaker
