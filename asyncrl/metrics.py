"""Live Prometheus metrics: one registry and one HTTP endpoint per process (hub, actor, learner).

```
  process main loop ──publish(snapshot dict)──> LiveMetrics (last snapshot, swapped atomically)
  Prometheus / curl ──GET /metrics──> HTTP thread ──collect()──> families from the snapshot
```

The main loop owns its counters; it hands the endpoint a plain snapshot now and then (the hub
once a second, an actor after each generation round, the learner after each step) and the
HTTP thread only ever reads the latest one, so scraping never races the loop. A snapshot is a
flat or nested dict of numbers: nested keys are joined with `_` (`errors: {too_large: 2}` ->
`asyncrl_hub_errors_too_large 2`); keys ending in `_total` or listed as counters are exported as
counters, the rest as gauges; lists of numbers (a staleness histogram) become one sample per
position with a `bucket` label. Every metric carries the process's `role` and `instance` labels.

Ports come from `[metrics]` (0 = off, the default; tests turn it on): the hub serves on
`hub_port`, actor i on `actor_port + i`, learner rank 0 on `learner_port`. prometheus-client is
imported only when an endpoint is started.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator, Mapping
from typing import Any

PREFIX = "asyncrl"
_NAME = re.compile(r"[^a-zA-Z0-9_]")


def flatten(snapshot: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(metric name suffix, number or list of numbers) of every numeric leaf of `snapshot`."""
    for key, value in snapshot.items():
        name = _NAME.sub("_", f"{prefix}{key}")
        if isinstance(value, bool):
            yield name, float(value)
        elif isinstance(value, (int, float)):
            yield name, float(value)
        elif isinstance(value, Mapping):
            yield from flatten(value, name + "_")
        elif isinstance(value, (list, tuple)) and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in value
        ):
            yield name, [float(v) for v in value]


class LiveMetrics:
    """The latest snapshot of one process, served over HTTP by prometheus-client."""

    def __init__(self, role: str, instance: str, counters: tuple[str, ...] = ()) -> None:
        self.role, self.instance, self.counters = role, instance, counters
        self._snapshot: Mapping[str, Any] = {}
        self._lock = threading.Lock()
        self.port = 0

    def publish(self, snapshot: Mapping[str, Any]) -> None:
        """Replace the snapshot (cheap: the HTTP thread reads it when scraped)."""
        with self._lock:
            self._snapshot = snapshot

    def collect(self) -> Iterator[Any]:
        """prometheus-client's collector protocol: metric families from the snapshot."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        with self._lock:
            snapshot = self._snapshot
        labels = ["role", "instance"]
        for suffix, value in flatten(snapshot):
            name = f"{PREFIX}_{self.role}_{suffix}"
            if isinstance(value, list):
                family = GaugeMetricFamily(name, suffix, labels=[*labels, "bucket"])
                for i, v in enumerate(value):
                    family.add_metric([self.role, self.instance, str(i)], v)
            elif suffix.endswith("_total") or suffix in self.counters:
                family = CounterMetricFamily(name, suffix, labels=labels)
                family.add_metric([self.role, self.instance], value)
            else:
                family = GaugeMetricFamily(name, suffix, labels=labels)
                family.add_metric([self.role, self.instance], value)
            yield family

    def serve(self, port: int, host: str = "0.0.0.0") -> int:
        """Start the HTTP endpoint (a daemon thread); return the bound port."""
        from prometheus_client import CollectorRegistry, start_http_server

        registry = CollectorRegistry(auto_describe=False)
        registry.register(self)  # type: ignore[arg-type]
        server, _ = start_http_server(port, addr=host, registry=registry)
        self.port = int(server.server_port)
        return self.port


def start(role: str, instance: str, port: int, counters: tuple[str, ...] = ()) -> LiveMetrics:
    """A LiveMetrics for this process, serving on `port` when it is > 0 (else not serving)."""
    live = LiveMetrics(role, instance, counters)
    if port > 0:
        bound = live.serve(port)
        print(f"{role} {instance}: metrics on http://0.0.0.0:{bound}/metrics", flush=True)
    return live
