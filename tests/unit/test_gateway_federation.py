"""The gateway's federated /metrics with a peer that cannot be scraped at all."""

from __future__ import annotations

import asyncio

from prometheus_client.parser import text_string_to_metric_families

from services.gateway.cluster import ClusterView
from services.gateway.federation import cluster_metrics
from shared import wire
from shared.lifecycle import GatewayEvents
from shared.logs import get_logger


def worker(peer_id: str, metrics_address: str) -> wire.WorkerStatus:
    return wire.WorkerStatus(
        peer_id=peer_id, role="decode", healthy=True, heartbeat_age_s=0.0, num_running=0,
        num_waiting=0, num_swapped=0, num_free_blocks=0, num_total_blocks=0, steps_completed=0,
        metrics_address=metrics_address,
    )  # fmt: skip


def test_a_peer_whose_address_is_not_a_url_is_left_out_not_a_500():
    """`http://::1:9000` (an IPv6 host unbracketed) raised httpx.InvalidURL, which is not an
    HTTPError: it escaped the scrape and made the whole cluster's /metrics a 500."""
    view = ClusterView(workers=[worker("d0", "http://::1:9000")])
    telemetry = GatewayEvents(get_logger())
    text = asyncio.run(cluster_metrics("gw", telemetry, view)).decode()
    up = {
        sample.labels["target"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "tandem:peer_scrape_up"
    }
    assert up == {"d0": 0.0}
