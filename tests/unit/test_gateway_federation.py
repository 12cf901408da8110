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


async def _trickling_peer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """A peer that answers 200 and then a byte every 50 ms, never finishing (a worker whose
    metrics thread is starved, a proxy in between)."""
    await reader.readuntil(b"\r\n\r\n")
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\n")
    try:
        for _ in range(200):
            writer.write(b"#")
            await writer.drain()
            await asyncio.sleep(0.05)
    except ConnectionError:
        pass
    finally:
        writer.close()


def test_a_peer_that_trickles_its_answer_is_left_out_within_the_scrape_timeout(monkeypatch):
    """httpx's timeout bounds each read, not the whole answer: a peer sending a byte now and
    then held the gateway's /metrics as long as it went on (every peer's metrics lost to the
    Prometheus scrape's own timeout). The scrape timeout now bounds the whole answer."""
    monkeypatch.setattr("services.gateway.federation.SCRAPE_TIMEOUT_S", 0.3)

    async def scrape() -> tuple[str, float]:
        server = await asyncio.start_server(_trickling_peer, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        view = ClusterView(workers=[worker("d0", f"http://127.0.0.1:{port}")])
        started = asyncio.get_running_loop().time()
        async with server:
            text = await asyncio.wait_for(
                cluster_metrics("gw", GatewayEvents(get_logger()), view), 5.0
            )
        return text.decode(), asyncio.get_running_loop().time() - started

    text, seconds = asyncio.run(scrape())
    up = {
        sample.labels["target"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "tandem:peer_scrape_up"
    }
    assert up == {"d0": 0.0}
    assert seconds < 2.0


class LargeBatchService:
    """A batch link answering a large exposition, as a large cluster's peers answer together."""

    def __init__(self, num_series: int) -> None:
        lines = ["# TYPE tandem:batch_lines gauge"]
        lines += [
            f'tandem:batch_lines{{job="batch_{i}",status="done"}} {i}.0' for i in range(num_series)
        ]
        self.text = "\n".join(lines) + "\n"

    async def metrics(self, timeout_s: float) -> str:
        return self.text


def test_merging_a_large_cluster_s_metrics_does_not_stall_the_event_loop(monkeypatch):
    """Every peer's exposition was parsed, twice, and merged on the gateway's event loop: with
    a few dozen workers a scrape (each second under `tandem top`) held every stream on the
    gateway for a large part of a second (0.66 s for 64 workers' real output, this 2-core
    machine). Now parsing and merging run on a thread."""
    import threading

    from services.gateway import federation

    threads: dict[str, threading.Thread] = {}
    merge, parse = federation.federate, federation._parse

    def merging(*args):
        threads["merge"] = threading.current_thread()
        return merge(*args)

    def parsing(*args):
        threads["parse"] = threading.current_thread()
        return parse(*args)

    monkeypatch.setattr(federation, "federate", merging)
    monkeypatch.setattr(federation, "_parse", parsing)

    async def scrape() -> tuple[bytes, threading.Thread]:
        telemetry = GatewayEvents(get_logger())
        text = await cluster_metrics("gw", telemetry, ClusterView(), LargeBatchService(100))
        return text, threading.current_thread()

    text, loop_thread = asyncio.run(scrape())
    assert b'job="batch_99"' in text
    assert set(threads) == {"merge", "parse"} and loop_thread not in threads.values()
