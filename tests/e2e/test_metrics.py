"""Every service's /metrics on the shared cluster: it parses, and one request moves exactly the
counters it should; one grep on the request id follows it through every service's log."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.slow


def parse(text: str) -> dict[tuple[str, frozenset], float]:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def total(metrics: dict, name: str, **labels) -> float:
    """Sum over peers (and any label not given) of one sample name."""
    wanted = set(labels.items())
    return sum(v for (n, lbls), v in metrics.items() if n == name and wanted <= lbls)


def scrape(url: str) -> dict:
    response = httpx.get(url + "/metrics", timeout=10)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return parse(response.text)


def test_every_service_serves_metrics_that_parse(cluster):
    info = cluster.ready_info()
    addresses = {w["peer_id"]: w["metrics_address"] for w in info["workers"]}
    addresses["scheduler"] = info["scheduler"]["metrics_address"]
    assert len(addresses) == 4 and all(addresses.values()), addresses  # 1 prefill, 2 decode
    for peer, address in addresses.items():
        names = {name for name, _ in scrape(address)}
        assert any(name.startswith("tandem:") for name in names), peer
        # Every service times its garbage collections (a sample once one has run: an idle
        # worker may not have collected yet; the busy gateway has, below).
        service = "scheduler" if peer == "scheduler" else "worker"
        text = httpx.get(address + "/metrics", timeout=10).text
        assert f"# TYPE tandem:{service}_gc_pause_seconds histogram" in text, peer
    merged = scrape(cluster.url)
    for _ in range(20):  # each scrape parses every peer's metrics: the gateway soon collects
        if total(merged, "tandem:gateway_gc_pause_seconds_count") > 0:
            break
        merged = scrape(cluster.url)
    assert total(merged, "tandem:gateway_gc_pause_seconds_count") > 0
    peers = {dict(labels).get("peer") for _, labels in merged}
    # The gateway's one scrape target covers every service, the batch service too (asked over
    # the gateway's link to it: no peer of the scheduler's, its metrics port one nobody knew).
    assert {*addresses, "batch"} <= peers
    assert ("tandem:batch_queue_depth", frozenset({("peer", "batch")})) in merged
    assert total(merged, "tandem:peer_scrape_up") == len(addresses) + 1


def test_one_request_moves_exactly_its_counters(cluster):
    cluster.wait_blocks_free()
    before = scrape(cluster.url)
    started = time.monotonic()
    response = httpx.post(
        cluster.url + "/v1/completions",
        json={
            "model": "smollm2",
            "prompt": "Counting the counters:",
            "max_tokens": 6,
            "temperature": 0,
            "ignore_eos": True,
        },
        timeout=120,
    )
    assert response.status_code == 200
    usage = response.json()["usage"]
    prompt_tokens = usage["prompt_tokens"]
    time.sleep(1.5)  # worker gauges and counters ride on heartbeats (0.5 s)
    after = scrape(cluster.url)
    wall_s = time.monotonic() - started

    def delta(name: str, **labels) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    assert usage["completion_tokens"] == 6
    # The gateway: what the client saw.
    assert delta("tandem:request_success_total", finished_reason="length") == 1
    assert delta("tandem:prompt_tokens_total") == prompt_tokens
    assert delta("tandem:generation_tokens_total") == 6
    assert delta("tandem:time_to_first_token_seconds_count") == 1
    assert delta("tandem:inter_token_latency_seconds_count") == 5  # one per decode step
    assert delta("tandem:e2e_request_latency_seconds_count") == 1
    assert delta("tandem:request_errors_total") == 0
    # The scheduler queued and dispatched it once.
    assert delta("tandem:request_queue_time_seconds_count") == 1
    assert delta("tandem:party_served_tokens", tenant="default") == prompt_tokens + 6
    # The prefill worker computed the prompt once and handed its KV over.
    assert delta("tandem:request_prefill_time_seconds_count") == 1
    assert delta("tandem:prefill_tokens_total") == prompt_tokens
    assert delta("tandem:kv_transfer_seconds_count") == 1
    kv_bytes = delta("tandem:kv_transfer_bytes_total")
    assert kv_bytes > 0 and delta("tandem:kv_received_bytes_total") == kv_bytes
    # The decode worker generated the other five tokens in five steps of one sequence.
    assert delta("tandem:decode_generated_tokens_total") == 5
    assert delta("tandem:decode_batch_size_count") == 5
    assert delta("tandem:decode_batch_size_sum") == 5
    # Busy time: the six steps took some, and no more than the two workers' wall time.
    assert 0 < delta("tandem:engine_busy_seconds_total") <= 2 * wall_s
    assert total(after, "tandem:gateway_requests_in_flight") == 0


def test_one_grep_follows_a_request_through_every_service(cluster):
    response = httpx.post(
        cluster.url + "/v1/completions",
        json={"model": "smollm2", "prompt": "Follow me", "max_tokens": 4, "ignore_eos": True},
        timeout=120,
    )
    request_id = response.json()["id"]
    time.sleep(1.0)
    events: dict[str, set[str]] = {}
    for line in cluster.log().splitlines():
        if request_id not in line:
            continue
        record = json.loads(line[line.index("{") :])  # after `tandem up`'s "[name]" prefix
        assert record["request_id"].startswith(request_id)
        events.setdefault(record["service"], set()).add(record["event"])
    assert events == {
        "gateway": {"request arrived", "first token", "request finished"},
        "scheduler": {"request queued", "request dispatched", "request phase done"},
        "prefill": {"prefill started", "prefill finished", "kv sent", "kv acknowledged"},
        "decode": {"kv received", "decode finished"},
    }
