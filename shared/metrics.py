"""Prometheus plumbing every service shares: buckets, the /metrics HTTP server, and federation.

Metric names follow vLLM's where the concept is the same, with a `tandem:` prefix in place of
`vllm:`, so existing dashboards translate by a rename. Which service records what is decided in
`shared.lifecycle`; this module only serves and merges.

The gateway's /metrics federates the cluster: it scrapes every peer named in the scheduler's
status and merges the texts into one exposition, each sample labelled with the `peer` it came
from, so one scrape target suffices for a local cluster.
"""

from __future__ import annotations

import bisect
import errno
import functools
import socket
import threading
from collections.abc import Callable
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import (
    CollectorRegistry,
    disable_created_metrics,
    generate_latest,
    make_wsgi_app,
)
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from shared.binding import BindError, describe, host_port
from shared.endpoints import host_ip

# `_created` series double the exposition and no dashboard of ours reads them.
disable_created_metrics()

PREFIX = "tandem:"
PEER_LABEL = "peer"
TENANT_LABEL = "tenant"  # fair-share accounts' samples: shown only to callers who may see them
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
METRICS_SETTINGS = ("metrics_host", "metrics_port")  # every service's names for serve_metrics's

# Buckets as vLLM's, so histograms compare bucket for bucket.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
TRANSFER_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip
KV_BYTES_BUCKETS = tuple(float(1 << n) for n in range(16, 34, 2))  # 64 KiB .. 8 GiB
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 512)
STEP_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.125, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5,
    0.6, 0.8, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0,
)  # fmt: skip  # one engine step's seconds: a decode step replayed from a CUDA graph (about
# 2 ms: from 5 ms, every one fell in the first bucket, and step quantiles were guesses), a small
# model's on a CPU, a long prefill chunk


GC_PAUSE_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
)  # fmt: skip  # a collection of the young generation to a full walk of a million objects


@functools.cache  # every engine step asks (and every simulated one): a label, not a new string
def batch_range(num_sequences: int) -> str:
    """The label of the BATCH_SIZE_BUCKETS range a batch size falls in: its upper bound."""
    index = bisect.bisect_left(BATCH_SIZE_BUCKETS, num_sequences)
    return str(BATCH_SIZE_BUCKETS[index]) if index < len(BATCH_SIZE_BUCKETS) else "+Inf"


def name(suffix: str) -> str:
    return PREFIX + suffix


# None when healthy, else why not: what a service's /health answers (200, or 503 with the reason).
HealthCheck = Callable[[], "str | None"]


def serve_metrics(
    registry: CollectorRegistry, host: str, port: int, health: HealthCheck | None = None
) -> str:
    """Serves `registry` at http://host:port/metrics and `health` at /health, from a daemon
    thread; port 0 picks a free one. Returns the address peers should scrape."""
    metrics_app = make_wsgi_app(registry)

    def app(environ, start_response):
        if environ.get("PATH_INFO") == "/health":
            problem = health() if health is not None else None
            status = "200 OK" if problem is None else "503 Service Unavailable"
            start_response(status, [("Content-Type", "text/plain; charset=utf-8")])
            return [(problem or "ok").encode() + b"\n"]
        return metrics_app(environ, start_response)

    server_class = _ThreadingServer6 if ":" in host else _ThreadingServer
    try:
        server = make_server(host, port, app, server_class, handler_class=_QuietHandler)
    except OSError as error:  # in use, not this machine's address, a host that does not resolve
        settings = ("metrics_port",) if error.errno == errno.EADDRINUSE else METRICS_SETTINGS
        raise BindError(
            f"{describe(*settings)}: cannot serve /metrics on "
            f"{host_port(host, port)}: {error.strerror or error}"
        ) from None
    threading.Thread(target=server.serve_forever, daemon=True, name="metrics").start()
    return f"http://{host_port(advertised_host(host), server.server_port)}"


def advertised_host(host: str) -> str:
    """The address others reach a server bound to `host` at: for a wildcard bind, this
    machine's (a container's) own IP address."""
    if host not in ("0.0.0.0", "::", ""):
        return host
    return host_ip(socket.gethostname())  # (an IPv6-only container's IPv6 one)


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _ThreadingServer6(_ThreadingServer):
    """For an IPv6 host (`::1`, or `::`, which takes IPv4 too): wsgiref's server is IPv4 only."""

    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base's name
        """Scrapes every few seconds would flood the service's log."""


def federate(
    expositions: list[tuple[str, str]], tenant_shown: Callable[[str], bool] = lambda _: True
) -> bytes:
    """One exposition from several: (peer, text) pairs, every sample labelled with its peer.
    Families of one name merge; the first peer's type and help win (peers run the same code).
    A sample labelled with a `tenant` that `tenant_shown` refuses is left out (a tenant's name
    is often an end user's email: the gateway's /metrics shows them as its /ready does)."""
    merged: dict[str, Metric] = {}
    for peer, text in expositions:
        for family in text_string_to_metric_families(text):
            target = merged.get(family.name)
            if target is None:
                target = Metric(family.name, family.documentation, family.type)
                merged[family.name] = target
            elif target.type != family.type:
                continue
            for sample in family.samples:
                tenant = sample.labels.get(TENANT_LABEL)
                if tenant is not None and not tenant_shown(tenant):
                    continue
                labels = {**sample.labels, PEER_LABEL: peer}
                target.add_sample(sample.name, labels, sample.value, sample.timestamp)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed(list(merged.values())))
    return generate_latest(registry)


class _Fixed:
    """A collector that yields families built elsewhere."""

    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families
