"""The gateway's /metrics: its own metrics and every peer's, in one exposition.

The scheduler's status names each peer's metrics address; the gateway scrapes them all at once,
each with a short timeout, and merges the texts (`shared.metrics.federate`), every sample labelled
with its `peer`. A peer that does not answer, or cannot be scraped at all (an address that is
not a URL), is left out and shows as `tandem:peer_scrape_up 0`, so a dashboard sees the gap
instead of a silently smaller sum.
"""

from __future__ import annotations

import asyncio

import httpx
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from services.gateway.cluster import ClusterView
from shared.lifecycle import GatewayEvents
from shared.logs import get_logger
from shared.metrics import federate

SCRAPE_TIMEOUT_S = 2.0
log = get_logger()


def scrape_targets(view: ClusterView) -> list[tuple[str, str]]:
    """(peer, metrics URL) for the scheduler and every registered worker that serves metrics."""
    targets = []
    if view.scheduler_metrics_address:
        targets.append(("scheduler", view.scheduler_metrics_address + "/metrics"))
    for worker in view.workers:
        if worker.metrics_address:
            targets.append((worker.peer_id, worker.metrics_address + "/metrics"))
    return targets


async def cluster_metrics(peer_id: str, telemetry: GatewayEvents, view: ClusterView) -> bytes:
    targets = scrape_targets(view)
    async with httpx.AsyncClient(timeout=SCRAPE_TIMEOUT_S, trust_env=False) as client:
        texts = await asyncio.gather(*(_scrape(client, url) for _, url in targets))
    scraped = []
    telemetry.peer_scrape_up.clear()  # peers that left drop out
    for (peer, _), text in zip(targets, texts, strict=True):
        telemetry.peer_scrape_up.labels(peer).set(0 if text is None else 1)
        if text is not None:
            scraped.append((peer, text))
    own = generate_latest(telemetry.registry).decode()
    return federate([(peer_id, own), *scraped])


async def _scrape(client: httpx.AsyncClient, url: str) -> str | None:
    """A peer's exposition, or None when it did not answer with one, for whatever reason (a
    200 that is not Prometheus text, as a proxy's page, made the whole /metrics a 500)."""
    try:
        response = await client.get(url)
        response.raise_for_status()
        text = response.text
        for _ in text_string_to_metric_families(text):
            pass
        return text
    except Exception as error:
        # Whatever it is, one peer must not make the whole /metrics a 500: not only HTTP
        # errors, an address httpx cannot parse (`http://::1:9000`, an IPv6 host unbracketed)
        # raises InvalidURL, which is not one.
        log.warning("peer not scraped", url=url, error=repr(error))
        return None
