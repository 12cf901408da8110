"""The gateway's /metrics: its own metrics and every peer's, in one exposition.

The scheduler's status names each peer's metrics address; the gateway scrapes them all at once,
each with a short timeout, asks the batch service over its link (when it has one) meanwhile, and
merges the texts (`shared.metrics.federate`), every sample labelled with its `peer`. A peer that
does not answer, or cannot be scraped at all (an address that is not a URL), is left out and
shows as `tandem:peer_scrape_up 0`, so a dashboard sees the gap instead of a silently smaller
sum.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import httpx
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from services.gateway.batch_link import BatchLink
from services.gateway.cluster import ClusterView
from shared.lifecycle import GatewayEvents
from shared.logs import get_logger
from shared.metrics import federate

SCRAPE_TIMEOUT_S = 2.0
BATCH_PEER = "batch"
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


async def cluster_metrics(
    peer_id: str,
    telemetry: GatewayEvents,
    view: ClusterView,
    batch: BatchLink | None = None,
    tenant_shown: Callable[[str], bool] = lambda _: True,
) -> bytes:
    """With `batch`, the batch service's too (peer `batch`), asked over the gateway's link to
    it: it is no peer of the scheduler's, and its own --metrics-port is a free one under
    `tandem up`, which nobody was told. Samples of the tenants `tenant_shown` refuses are left
    out, whichever peer's they are."""
    targets = scrape_targets(view)
    # Read as the peers are asked, as theirs are: read once they all answered, up to the scrape
    # timeout later, the gateway's counters made each rate across a slow scrape's edges wrong
    # (threefold at a 1 s interval as a peer began timing out, a third as it stopped).
    own = generate_latest(telemetry.registry).decode()
    async with httpx.AsyncClient(timeout=SCRAPE_TIMEOUT_S, trust_env=False) as client:
        scrapes = [_scrape(client, url) for _, url in targets]
        peers = [peer for peer, _ in targets]
        if batch is not None:
            scrapes.append(_checked(batch.metrics(SCRAPE_TIMEOUT_S), BATCH_PEER))
            peers.append(BATCH_PEER)
        texts = await asyncio.gather(*scrapes)
    scraped = []
    telemetry.peer_scrape_up.clear()  # peers that left drop out
    for peer, text in zip(peers, texts, strict=True):
        telemetry.peer_scrape_up.labels(peer).set(0 if text is None else 1)
        if text is not None:
            scraped.append((peer, text))
    scrape_up = generate_latest(telemetry.scrape_registry).decode()
    # Parsing and merging every peer's text takes a while in a large cluster (over half a
    # second for 64 workers on a 2-core machine): off the event loop, where every stream the
    # gateway serves waited for it, each scrape (each second under `tandem top`).
    expositions = [(peer_id, own), (peer_id, scrape_up), *scraped]
    return await asyncio.to_thread(federate, expositions, tenant_shown)


async def _scrape(client: httpx.AsyncClient, url: str) -> str | None:
    """A peer's exposition, or None when it did not answer with one, for whatever reason (a
    200 that is not Prometheus text, as a proxy's page, made the whole /metrics a 500)."""

    async def fetch() -> str:
        # The whole answer within the timeout: the client's bounds each read only, and a peer
        # sending a byte now and then held the whole /metrics as long as it went on.
        async with asyncio.timeout(SCRAPE_TIMEOUT_S):
            response = await client.get(url)
            response.raise_for_status()
            return response.text

    return await _checked(fetch(), url)


async def _checked(text: Awaitable[str | None], source: str) -> str | None:
    """`text` if it is Prometheus text, else None, and whatever it raised logged."""
    try:
        exposition = await text
        if exposition is not None:
            await asyncio.to_thread(_parse, exposition)  # (off the loop, as the merge)
        return exposition
    except Exception as error:
        # Whatever it is, one peer must not make the whole /metrics a 500: not only HTTP
        # errors, an address httpx cannot parse (`http://::1:9000`, an IPv6 host unbracketed)
        # raises InvalidURL, which is not one.
        log.warning("peer not scraped", url=source, error=repr(error))
        return None


def _parse(exposition: str) -> None:
    """Raises ValueError unless `exposition` is Prometheus text."""
    for _ in text_string_to_metric_families(exposition):
        pass
