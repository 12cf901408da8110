"""The gateway's link to the batch service while the service is down: a call is answered 503 in
its time and never delivered later (queued, a create its client was told to retry ran anyway
once the service came back, and the retry made a second batch)."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest
import zmq
import zmq.asyncio

from services.gateway.batch_link import BatchLink
from services.gateway.openai_protocol import ApiError
from shared import wire_batch
from tests.helpers import wait_for_line


def test_a_call_to_a_service_that_is_down_is_a_503_and_never_runs_later(tmp_path):
    address = f"ipc://{tmp_path}/batch.sock"

    async def call_while_down() -> ApiError:
        link = BatchLink(address, timeout_s=0.5)
        await link.start()
        try:
            with pytest.raises(ApiError) as refused:
                await link.call("batch_create", "t", {"input_file_id": "file-1"})
            service = zmq.Context.instance().socket(zmq.ROUTER)  # the service, back
            service.bind(address)
            try:
                await asyncio.sleep(0.5)  # (the link reconnects within its interval)
                assert not service.poll(1_000), "the refused call was delivered after all"
            finally:
                service.close(linger=0)
        finally:
            await link.close()
        return refused.value

    refused = asyncio.run(call_while_down())
    assert refused.status == 503 and refused.retry_after_s == 5.0


def test_the_gateways_metrics_carry_the_batch_services(tmp_path):
    """The gateway's /metrics federated the scheduler and workers only: the batch service is
    no peer of the scheduler's, and `tandem up` gives it a free metrics port nobody is told.
    The gateway asks it over its link; a service that is down shows as not scraped."""
    from prometheus_client.parser import text_string_to_metric_families

    from services.gateway.cluster import ClusterView
    from services.gateway.federation import cluster_metrics
    from shared.lifecycle import GatewayEvents
    from shared.logs import get_logger

    address = f"ipc://{tmp_path}/batch.sock"
    process = subprocess.Popen(
        [sys.executable, "-m", "services.commands.cli", "batch-service",
         "--address", address, "--data-dir", str(tmp_path / "data"),
         "--gateway-rpc-address", f"ipc://{tmp_path}/nobody.sock"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip

    def samples(text: bytes) -> dict[tuple[str, str], float]:
        """(name, the peer it came from, or for peer_scrape_up the peer it is about): value."""
        return {
            (sample.name, sample.labels.get("target") or sample.labels.get("peer")): sample.value
            for family in text_string_to_metric_families(text.decode())
            for sample in family.samples
        }

    async def federated() -> tuple[str | None, bytes]:
        link = BatchLink(address, timeout_s=5.0)
        await link.start()
        try:
            own = await link.metrics(timeout_s=30.0)
            telemetry = GatewayEvents(get_logger())
            return own, await cluster_metrics("gw", telemetry, ClusterView(), link)
        finally:
            await link.close()

    try:
        wait_for_line(process, b"batch service listening", "the batch service")
        own, text = asyncio.run(federated())
    finally:
        process.terminate()
        process.wait(30)
    assert own is not None and "tandem:batch_queue_depth" in own
    found = samples(text)
    assert found[("tandem:batch_queue_depth", "batch")] == 0.0
    assert found[("tandem:peer_scrape_up", "batch")] == 1.0

    async def federated_while_down() -> bytes:
        link = BatchLink(address, timeout_s=5.0)
        await link.start()
        try:
            return await cluster_metrics("gw", GatewayEvents(get_logger()), ClusterView(), link)
        finally:
            await link.close()

    found = samples(asyncio.run(federated_while_down()))  # within the scrape's 2 s
    assert found[("tandem:peer_scrape_up", "batch")] == 0.0
    assert ("tandem:batch_queue_depth", "batch") not in found


def _reply_frames(call_id: str, status, body) -> list[bytes]:
    """A BatchReply's frames as a misbehaving service may send them: `status` and `body` put in
    the header as given (a str status, a body that is not JSON), past the wire's own checks."""
    import msgpack

    from shared import wire_batch

    header = {"call_id": call_id, "status": status, "body": body}
    return [bytes((wire_batch.BatchMessageType.BATCH_REPLY,)), msgpack.packb(header)]


# (status, body) of a reply a sound link cannot relay: each is its call's 502 at once.
NONSENSE_REPLIES = {
    "status past 599": (999, "{}"),
    "negative status": (-1, "{}"),
    "informational status": (101, "{}"),
    "redirect status": (302, "{}"),
    "status not an int": ("200", "{}"),
    "body not JSON": (200, "not json"),
    "error body not JSON": (404, "<html>nope</html>"),
    "body not an object": (200, "[1, 2]"),
    "body nested past the stack": (200, "[" * 100_000 + "]" * 100_000),
    "body with a 5,000-digit int": (200, '{"n": ' + "9" * 5000 + "}"),
}


@pytest.mark.parametrize("status, body", NONSENSE_REPLIES.values(), ids=NONSENSE_REPLIES.keys())
def test_a_nonsense_reply_is_its_calls_502_and_the_link_goes_on(tmp_path, status, body):
    """A reply the link could not read (a status no HTTP answer has, a body not a JSON object)
    raised in the call (the gateway's 500, or an ApiError no HTTP status can carry) or was
    dropped by the wire while its call waited out the timeout (a 503 that says retry). Each is a
    502 at once; a reply for no call is dropped; and the next call is answered as usual."""
    import zmq.asyncio

    address = f"ipc://{tmp_path}/batch.sock"

    async def scenario() -> tuple[ApiError, tuple, float]:
        service = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
        service.setsockopt(zmq.LINGER, 0)
        service.bind(address)
        link = BatchLink(address, timeout_s=10.0)
        await link.start()

        async def serve() -> None:
            from shared import wire_batch

            identity, *frames = await service.recv_multipart()
            call, _ = wire_batch.decode(frames)
            await service.send_multipart([identity, *_reply_frames("nobody's", 200, "{}")])
            await service.send_multipart([identity, *_reply_frames(call.call_id, status, body)])
            identity, *frames = await service.recv_multipart()
            call, _ = wire_batch.decode(frames)
            reply = wire_batch.BatchReply(call_id=call.call_id, status=200, body='{"id": "b"}')
            await service.send_multipart([identity, *wire_batch.encode(reply)])

        serving = asyncio.create_task(serve())
        try:
            started = asyncio.get_running_loop().time()
            with pytest.raises(ApiError) as refused:
                await link.call("batch_get", "t", {"batch_id": "b"})
            took_s = asyncio.get_running_loop().time() - started
            answered = await link.call("batch_get", "t", {"batch_id": "b"})
            await serving
        finally:
            serving.cancel()
            await link.close()
            service.close()
        return refused.value, answered, took_s

    refused, answered, took_s = asyncio.run(scenario())
    assert refused.status == 502, (refused.status, refused.message)
    assert refused.type == "server_error"
    assert "the batch service answered" in refused.message
    assert took_s < 5.0  # not the link's timeout
    assert answered == (200, {"id": "b"}, None)


def test_a_call_in_flight_when_the_service_goes_is_a_503_at_once(tmp_path):
    """The service took the call and died (killed, its container stopped): its answer will never
    come, and the call waited out the link's whole timeout (30 s) for a 503 while the service,
    restarted, was back within a second. The link sees the connection go and answers the calls
    it had sent over it at once; a call sent after the service is back is answered by it."""
    address = f"ipc://{tmp_path}/batch.sock"

    async def call_as_the_service_dies() -> tuple[ApiError, float, int]:
        link = BatchLink(address, timeout_s=30.0)
        service = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
        service.bind(address)
        await link.start()
        try:
            call = asyncio.create_task(link.call("batch_create", "t", {"input_file_id": "f"}))
            await service.recv_multipart()  # taken, never answered
            started = asyncio.get_running_loop().time()
            service.close(linger=0)
            with pytest.raises(ApiError) as refused:
                await call
            waited = asyncio.get_running_loop().time() - started
            back = zmq.asyncio.Context.instance().socket(zmq.ROUTER)  # the service, restarted
            back.bind(address)
            try:
                answered = asyncio.create_task(link.call("file_list", "t", {}))
                identity, *frames = await back.recv_multipart()
                request, _ = wire_batch.decode(frames)
                reply = wire_batch.BatchReply(call_id=request.call_id, status=200, body="{}")
                await wire_batch.async_send_to(back, identity, reply)
                status, _, _ = await answered
            finally:
                back.close(linger=0)
        finally:
            await link.close()
        return refused.value, waited, status

    refused, waited, status = asyncio.run(call_as_the_service_dies())
    assert refused.status == 503 and "went away" in refused.message, refused.message
    assert waited < 5.0, f"waited {waited:.1f} s for an answer that could not come"
    assert refused.retry_after_s == 1.0
    assert status == 200
