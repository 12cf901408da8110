"""The gateway's link to the batch service while the service is down: a call is answered 503 in
its time and never delivered later (queued, a create its client was told to retry ran anyway
once the service came back, and the retry made a second batch)."""

from __future__ import annotations

import asyncio

import pytest
import zmq

from services.gateway.batch_link import BatchLink
from services.gateway.openai_protocol import ApiError


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
