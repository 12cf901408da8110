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


class SlowBatchService:
    """A batch link whose answer takes a while, during which the gateway streams tokens."""

    def __init__(self, telemetry: GatewayEvents) -> None:
        self.telemetry = telemetry

    async def metrics(self, timeout_s: float) -> str:
        await asyncio.sleep(0.05)
        self.telemetry.generation_tokens.inc(50)  # streamed while the scrape waited
        return "# TYPE tandem:batch_queue_depth gauge\ntandem:batch_queue_depth 2.0\n"


def test_the_gateways_counters_are_read_with_the_peers_not_after_the_slowest():
    """The gateway's own counters were read after every peer had answered, up to the scrape
    timeout later than the peers' were: the gateway's rates (`tandem top`'s tokens/s
    generated, a Prometheus rate) jumped threefold and back as a peer began or stopped timing
    out. Now they are read as the peers are asked; `peer_scrape_up` is still this scrape's."""
    telemetry = GatewayEvents(get_logger())
    telemetry.generation_tokens.inc(100)
    batch = SlowBatchService(telemetry)
    text = asyncio.run(cluster_metrics("gw", telemetry, ClusterView(), batch)).decode()
    found = {
        (sample.name, sample.labels.get("target")): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    assert found[("tandem:generation_tokens_total", None)] == 100
    assert found[("tandem:peer_scrape_up", "batch")] == 1.0
    assert found[("tandem:batch_queue_depth", None)] == 2.0
    names = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")]
    assert len(names) == len(set(names))  # each family once
