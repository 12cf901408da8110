"""Federation of expositions and the lifecycle events' metrics, without a cluster."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from shared import wire
from shared.lifecycle import DecodeEvents, GatewayEvents, SchedulerEvents
from shared.logs import get_logger
from shared.metrics import federate


def samples(text: bytes | str) -> dict[tuple[str, frozenset], float]:
    text = text.decode() if isinstance(text, bytes) else text
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def exposition(value: float, kind: str = "counter") -> str:
    registry = CollectorRegistry()
    if kind == "counter":
        Counter("tandem:things", "things", ["k"], registry=registry).labels("a").inc(value)
    else:
        Gauge("tandem:things", "things", ["k"], registry=registry).labels("a").set(value)
    return generate_latest(registry).decode()


def test_federation_labels_every_sample_with_its_peer():
    merged = samples(federate([("gw", exposition(2)), ("decode-0", exposition(5))]))
    assert merged == {
        ("tandem:things_total", frozenset({("k", "a"), ("peer", "gw")})): 2.0,
        ("tandem:things_total", frozenset({("k", "a"), ("peer", "decode-0")})): 5.0,
    }


def test_federation_keeps_the_first_type_of_a_name():
    merged = samples(federate([("a", exposition(1)), ("b", exposition(7, kind="gauge"))]))
    assert list(merged.values()) == [1.0]


def test_federation_refuses_nothing_when_a_peer_is_empty():
    assert samples(federate([("a", ""), ("b", exposition(3))])) == {
        ("tandem:things_total", frozenset({("k", "a"), ("peer", "b")})): 3.0
    }


def value(events, name: str, **labels) -> float:
    return samples(generate_latest(events.registry)).get((name, frozenset(labels.items())), 0.0)


def test_gateway_events_count_one_choice_exactly():
    events = GatewayEvents(get_logger())
    trace = events.submitted("r-0", arrived_at=0.0, num_prompt_tokens=7)
    assert value(events, "tandem:gateway_requests_in_flight") == 1
    for _ in range(3):
        events.tokens(trace, 1)
    events.tokens(trace, 0)  # an empty delta is no token and no gap
    events.finished(trace, "length")
    events.finished(trace, "abort")  # a second end is ignored
    assert value(events, "tandem:time_to_first_token_seconds_count") == 1
    assert value(events, "tandem:inter_token_latency_seconds_count") == 2
    assert value(events, "tandem:e2e_request_latency_seconds_count") == 1
    assert value(events, "tandem:generation_tokens_total") == 3
    assert value(events, "tandem:prompt_tokens_total") == 7
    assert value(events, "tandem:request_success_total", finished_reason="length") == 1
    assert value(events, "tandem:request_success_total", finished_reason="abort") == 0
    assert value(events, "tandem:gateway_requests_in_flight") == 0


def test_gateway_failure_after_tokens_counts_as_error_not_success():
    events = GatewayEvents(get_logger())
    trace = events.submitted("r-0", arrived_at=0.0, num_prompt_tokens=3)
    events.tokens(trace, 1)
    events.failed(trace, "r-0", 500, "worker died")
    events.finished(trace, "abort")
    events.failed(None, "r-1", 429, "queue full")
    assert value(events, "tandem:request_errors_total", status="500") == 1
    assert value(events, "tandem:request_errors_total", status="429") == 1
    assert value(events, "tandem:request_success_total", finished_reason="abort") == 0
    assert value(events, "tandem:gateway_requests_in_flight") == 0


def worker(peer_id: str, role: str = "decode") -> wire.WorkerStatus:
    return wire.WorkerStatus(
        peer_id=peer_id,
        role=role,
        healthy=True,
        heartbeat_age_s=0.2,
        num_running=1,
        num_waiting=0,
        num_swapped=0,
        num_free_blocks=10,
        num_total_blocks=16,
        steps_completed=5,
    )


def test_scheduler_gauges_drop_workers_that_left():
    events = SchedulerEvents(get_logger())
    status = wire.ClusterStatus(
        num_prefill=0, num_decode=2, num_queued=3, num_in_flight=4,
        workers=[worker("decode-0"), worker("decode-1")],
    )  # fmt: skip
    events.refresh(status)
    age = "tandem:worker_heartbeat_age_seconds"
    assert value(events, age, worker="decode-1", role="decode") == pytest.approx(0.2)
    assert value(events, "tandem:workers", role="decode", state="healthy") == 2
    assert value(events, "tandem:num_requests_waiting") == 3
    events.refresh(wire.ClusterStatus(
        num_prefill=0, num_decode=1, num_queued=0, num_in_flight=0, workers=[worker("decode-0")]
    ))  # fmt: skip
    names = {name for name, _ in samples(generate_latest(events.registry))}
    assert age in names
    assert value(events, age, worker="decode-1", role="decode") == 0  # gone, not stale
    assert value(events, "tandem:workers", role="decode", state="healthy") == 1


def test_preemption_counters_follow_the_heartbeats_totals():
    events = DecodeEvents(get_logger())
    for swaps, recomputes in ((0, 0), (2, 1), (2, 1), (5, 1)):
        events.refresh(
            wire.Heartbeat(
                peer_id="d", num_waiting=0, num_running=2, num_free_blocks=4,
                num_total_blocks=16, steps_completed=1, sent_at=0.0,
                num_swap_preemptions=swaps, num_recompute_preemptions=recomputes,
            )
        )  # fmt: skip
    assert value(events, "tandem:num_preemptions_total", kind="swap") == 5
    assert value(events, "tandem:num_preemptions_total", kind="recompute") == 1
    assert value(events, "tandem:kv_cache_usage_perc") == pytest.approx(12 / 16)


def test_busy_seconds_add_up_the_steps_durations():
    events = DecodeEvents(get_logger())
    for duration_s in (0.25, 0.5, 0.125):
        events.step(duration_s)
    assert value(events, "tandem:engine_steps_total") == 3
    assert value(events, "tandem:engine_busy_seconds_total") == pytest.approx(0.875)
    # Each step's time in the histogram: the 0.125 s step at or under 0.125, all three under 0.5.
    assert value(events, "tandem:engine_step_seconds_bucket", le="0.125") == 1
    assert value(events, "tandem:engine_step_seconds_bucket", le="0.5") == 3


def test_decode_steps_are_counted_by_batch_size_range():
    events = DecodeEvents(get_logger())
    steps = ((0.25, 3, 300), (0.5, 4, 1000), (0.125, 1, 9), (1.0, 600, 0))
    for duration_s, batch, context in steps:  # seconds, sequences, tokens of context
        events.step(duration_s, batch, context)
    events.step(0.5)  # batch not told: only the totals
    assert value(events, "tandem:engine_steps_total") == 5
    # 3 and 4 fall in (2, 4]; 1 in [1, 1]; 600 beyond the last bound (512).
    assert value(events, "tandem:decode_steps_by_batch_total", batch="4") == 2
    assert value(events, "tandem:decode_step_seconds_by_batch_total", batch="4") == 0.75
    assert value(events, "tandem:decode_step_sequences_by_batch_total", batch="4") == 7
    assert value(events, "tandem:decode_step_context_tokens_by_batch_total", batch="4") == 1300
    assert value(events, "tandem:decode_steps_by_batch_total", batch="1") == 1
    assert value(events, "tandem:decode_step_sequences_by_batch_total", batch="+Inf") == 600


def test_host_tier_metrics_follow_the_engines_counters():
    import torch

    from shared.engine.host_tier import HostTier
    from shared.engine.kv_cache import KVCache, bytes_per_block
    from shared.engine.prefix_cache import Eviction, PrefixCache
    from tests.helpers import TINY_KV_CONFIG

    events = DecodeEvents(get_logger())
    cache = PrefixCache()
    bpb = bytes_per_block(TINY_KV_CONFIG, 4, torch.float32)
    tier = HostTier(4 * bpb, bpb, KVCache(TINY_KV_CONFIG, 4, 4))
    tier.demote([Eviction(0, 11), Eviction(1, 12)])
    cache.record_query(64, 48, 32)
    events.refresh_host_tier(cache, tier)
    cache.record_query(16, 16, 16)
    cache.insert(5, 2)
    cache.release(2, retain_until=float("inf"))  # a finished turn in its think time
    events.refresh_host_tier(cache, tier)
    assert value(events, "tandem:prefix_cache_host_hits_total") == 48
    assert value(events, "tandem:prefix_cache_host_bytes") == 2 * bpb
    assert value(events, "tandem:prefix_cache_retained_blocks") == 1
    assert value(events, "tandem:prefix_cache_host_blocks_total", event="demoted") == 2
    assert tier.promote(11, 3)
    no_room = HostTier(0, bpb, KVCache(TINY_KV_CONFIG, 4, 4))
    no_room.demote([Eviction(2, 13)])
    events.refresh_host_tier(cache, tier)
    assert value(events, "tandem:prefix_cache_host_blocks_total", event="promoted") == 1
    events.refresh_host_tier(cache, no_room)  # a tier made anew: its counts from nothing
    assert value(events, "tandem:prefix_cache_host_blocks_total", event="dropped") == 1
    assert value(events, "tandem:prefix_cache_host_blocks_total", event="demoted") == 2
    events.refresh_host_tier(cache, None)  # the tier switched off
    assert value(events, "tandem:prefix_cache_host_bytes") == 0


def test_the_metrics_server_answers_health_honestly():
    import urllib.error
    import urllib.request

    from shared.metrics import serve_metrics

    problem: list[str | None] = [None]
    events = GatewayEvents(get_logger())
    address = serve_metrics(events.registry, "127.0.0.1", 0, lambda: problem[0])
    assert address.startswith("http://127.0.0.1:")
    with urllib.request.urlopen(address + "/health", timeout=5) as response:
        assert response.status == 200 and response.read() == b"ok\n"
    with urllib.request.urlopen(address + "/metrics", timeout=5) as response:
        assert "tandem:gateway_requests_in_flight" in response.read().decode()
    problem[0] = "the worker loop has not turned for 61 s"
    with pytest.raises(urllib.error.HTTPError) as raised:
        urllib.request.urlopen(address + "/health", timeout=5)
    assert raised.value.code == 503 and b"61 s" in raised.value.read()


def test_advertised_addresses_expand_to_this_machine():
    import socket

    from shared.config import expand_host
    from shared.metrics import advertised_host

    ip = socket.gethostbyname(socket.gethostname())
    assert expand_host("tcp://{ip}:5601") == f"tcp://{ip}:5601"
    assert expand_host("tcp://{hostname}:1") == f"tcp://{socket.gethostname()}:1"
    assert expand_host("tcp://10.0.0.1:1") == "tcp://10.0.0.1:1" and expand_host(None) is None
    assert advertised_host("0.0.0.0") == ip and advertised_host("127.0.0.1") == "127.0.0.1"


def test_a_peer_answering_what_is_not_an_exposition_is_left_out():
    """A 200 that is not Prometheus text (a proxy's page, a wrong port) made the gateway's whole
    /metrics a 500; now that peer is down in `peer_scrape_up` and the rest are served."""
    import asyncio

    import httpx

    from services.gateway.federation import _scrape

    def answer(request: httpx.Request) -> httpx.Response:
        body = exposition(1) if request.url.path == "/good" else "<html>502 Bad Gateway</html>"
        return httpx.Response(200, text=body)

    async def scrape_both() -> list[str | None]:
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
            return [await _scrape(client, f"http://peer/{path}") for path in ("good", "bad")]

    good, bad = asyncio.run(scrape_both())
    assert good == exposition(1) and bad is None


def _binds_ipv6_loopback() -> bool:
    import socket

    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _binds_ipv6_loopback(), reason="no IPv6 loopback on this machine")
def test_the_metrics_server_serves_on_an_ipv6_host():
    """`--metrics-host ::1` crashed (wsgiref's server is IPv4 only); the URL peers scrape
    needs the host in brackets (`http://::1:9000` is no URL)."""
    import urllib.request

    from shared.metrics import serve_metrics

    address = serve_metrics(GatewayEvents(get_logger()).registry, "::1", 0)
    assert address.startswith("http://[::1]:")
    with urllib.request.urlopen(address + "/metrics", timeout=5) as response:
        assert "tandem:gateway_requests_in_flight" in response.read().decode()


def test_an_ipv6_host_is_bracketed_in_the_advertised_url(monkeypatch):
    """Without an IPv6 loopback to bind, the URL's shape alone (a server stands in)."""
    from shared import metrics

    class Bound:
        server_port = 9100

        def __init__(self, *_, **__):
            pass

        def serve_forever(self):
            pass

    monkeypatch.setattr(metrics, "make_server", lambda *_, **__: Bound())
    registry = CollectorRegistry()
    assert metrics.serve_metrics(registry, "::1", 0) == "http://[::1]:9100"
    assert metrics.serve_metrics(registry, "fe80::1", 0) == "http://[fe80::1]:9100"
    assert metrics.serve_metrics(registry, "127.0.0.1", 0) == "http://127.0.0.1:9100"


def test_a_taken_metrics_port_is_refused_naming_the_setting():
    """An OSError traceback naming no setting, at start-up."""
    import socket

    from shared.config import ConfigError
    from shared.metrics import serve_metrics

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(ConfigError) as refused:
            serve_metrics(CollectorRegistry(), "127.0.0.1", port)
    assert str(refused.value) == (
        f"metrics_port (--metrics-port / TANDEM_METRICS_PORT): cannot serve /metrics on "
        f"127.0.0.1:{port}: Address already in use"
    )


def test_a_gpu_decode_step_of_2_ms_falls_in_a_bucket_of_its_own_size():
    """Steps replayed from CUDA graphs take about 2 ms: with 5 ms the smallest bucket, every
    one fell in it, and the step quantiles `plan_validate` reads were guesses."""
    events = DecodeEvents(get_logger())
    for duration_s in (0.0008, 0.002, 0.002, 0.004):
        events.step(duration_s, num_sequences=1)
    assert value(events, "tandem:engine_step_seconds_bucket", le="0.001") == 1
    assert value(events, "tandem:engine_step_seconds_bucket", le="0.0025") == 3
    assert value(events, "tandem:engine_step_seconds_bucket", le="0.005") == 4
