"""The Files and Batches APIs end to end, through the official `openai` client against `tandem up`
(gateway -> batch service -> the gateway's RPC door -> the cluster): a job that completes with
the same greedy answers as direct calls, malformed lines failing in `validating`, a line failing
at run time, cancel, expiry, the size and line limits, and tenancy between API keys."""

from __future__ import annotations

import io
import json
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.conftest import start_cluster, stop_cluster

ALPHA = "alpha-batch-key-0123456789"
BETA = "beta-batch-key-0123456789"
SERVICE = "batch-service-key-0123456789"  # the batch service's own (bare) key for the RPC door
MAX_FILE_BYTES = 40_000
MAX_LINES = 120
ENDED = ("completed", "failed", "cancelled", "expired")


@pytest.fixture(scope="module")
def batch_cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("batch")
    running = start_cluster(
        root,
        "--batch-dir",
        str(root / "batch"),
        env={
            "TANDEM_API_KEYS": f"{ALPHA}=alpha,{BETA}=beta,{SERVICE}",
            "TANDEM_API_KEY": SERVICE,
            "TANDEM_MAX_FILE_BYTES": str(MAX_FILE_BYTES),
            "TANDEM_MAX_LINES": str(MAX_LINES),
            "TANDEM_MAX_IN_FLIGHT": "8",
        },
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # the batch service answers once it is up
        headers = {"Authorization": f"Bearer {ALPHA}"}
        if httpx.get(running.url + "/v1/batches", headers=headers).status_code == 200:
            break
        time.sleep(0.5)
    yield running
    stop_cluster(running)


def client(cluster, key: str = ALPHA) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.url + "/v1", api_key=key, max_retries=0, timeout=60)


def line(custom_id: str, prompt: str, max_tokens: int = 6, **extra) -> dict:
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
            "body": {**body, **extra}}  # fmt: skip


def upload(api: openai.OpenAI, lines: list) -> str:
    text = "\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n"
    return api.files.create(file=("in.jsonl", io.BytesIO(text.encode())), purpose="batch").id


def submit(api: openai.OpenAI, lines: list, window: str = "24h"):
    file_id = upload(api, lines)
    return api.batches.create(
        input_file_id=file_id, endpoint="/v1/completions", completion_window=window,
        metadata={"test": "yes"},
    )  # fmt: skip


def wait(api: openai.OpenAI, batch_id: str, timeout_s: float = 120.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        batch = api.batches.retrieve(batch_id)
        if batch.status in ENDED:
            return batch
        time.sleep(0.3)
    raise TimeoutError(f"batch {batch_id} still {batch.status}")


def jsonl(api: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(x) for x in api.files.content(file_id).text.splitlines()]


def test_a_job_completes_with_the_answers_of_direct_calls(batch_cluster):
    api = client(batch_cluster)
    prompts = [f"The number {i} is" for i in range(5)]
    batch = submit(api, [line(f"id-{i}", p) for i, p in enumerate(prompts)])
    assert batch.status == "validating" and batch.metadata == {"test": "yes"}
    assert batch.model == "smollm2"  # (the openai client's Batch has it; it was null)
    batch = wait(api, batch.id)
    assert batch.status == "completed", batch
    assert (batch.request_counts.total, batch.request_counts.completed) == (5, 5)
    assert batch.error_file_id is None and batch.in_progress_at and batch.completed_at
    outputs = {o["custom_id"]: o for o in jsonl(api, batch.output_file_id)}
    assert sorted(outputs) == [f"id-{i}" for i in range(5)]
    for i, prompt in enumerate(prompts):
        direct = api.completions.create(model="smollm2", prompt=prompt, max_tokens=6,
                                        temperature=0)  # fmt: skip
        answer = outputs[f"id-{i}"]
        assert answer["error"] is None and answer["response"]["status_code"] == 200
        assert answer["response"]["body"]["choices"][0]["text"] == direct.choices[0].text
        assert answer["response"]["request_id"] == answer["response"]["body"]["id"]
    listed = api.batches.list(limit=100)
    assert batch.id in [b.id for b in listed.data]
    file_ids = [f.id for f in api.files.list()]
    assert batch.input_file_id in file_ids and batch.output_file_id in file_ids


def readme_example(heading: str) -> str:
    """The first Python block of the README section under `heading`."""
    text = (Path(__file__).parents[2] / "README.md").read_text()
    section = text[text.index(heading) :]
    start = section.index("```python\n") + len("```python\n")
    return section[start : section.index("```", start)]


def test_the_readmes_python_example_runs_as_written(batch_cluster, tmp_path, monkeypatch, capsys):
    """What a new user copies first: it read the output file straight after the create, while
    the job was still in progress (`files.content(None)` raised)."""
    chat = {"model": "smollm2", "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": "Say hi"}]}  # fmt: skip
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions", "body": chat}
             for i in range(3)]  # fmt: skip
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    monkeypatch.chdir(tmp_path)
    exec(readme_example("### Bulk jobs"), {"client": client(batch_cluster)})
    answers = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.strip()]
    assert sorted(a["custom_id"] for a in answers) == ["c0", "c1", "c2"]
    assert all(a["response"]["status_code"] == 200 for a in answers)


def test_malformed_lines_fail_the_batch_in_validating_with_every_line_number(batch_cluster):
    api = client(batch_cluster)
    lines = [
        line("ok-1", "Hello"),
        "{not json",
        line("ok-1", "Hello again"),  # duplicate custom_id
        {**line("wrong-url", "Hi"), "url": "/v1/chat/completions"},
        line("no-model", "Hi") | {"body": {"model": "gpt-4o", "prompt": "Hi"}},
        line("ok-2", "Fine"),
    ]
    batch = wait(api, submit(api, lines).id)
    assert batch.status == "failed" and batch.failed_at
    codes = {(e.line, e.code) for e in batch.errors.data}
    assert codes == {(2, "invalid_json"), (3, "duplicate_custom_id"), (4, "mismatched_url"),
                     (5, "model_not_found")}  # fmt: skip
    assert batch.request_counts.completed == 0 and batch.output_file_id is None


def test_a_line_failing_at_run_time_goes_to_the_error_file_and_the_rest_runs(batch_cluster):
    api = client(batch_cluster)
    lines = [line("good", "Paris is"), line("bad", "Rome is", temperature=-1.0)]
    batch = wait(api, submit(api, lines).id)
    assert batch.status == "completed"
    assert (batch.request_counts.completed, batch.request_counts.failed) == (1, 1)
    [good] = jsonl(api, batch.output_file_id)
    [bad] = jsonl(api, batch.error_file_id)
    assert good["custom_id"] == "good"
    assert bad["custom_id"] == "bad" and bad["response"]["status_code"] == 400
    assert bad["response"]["body"]["error"]["param"] == "temperature"


def test_cancel_stops_the_job_and_keeps_what_was_done(batch_cluster):
    api = client(batch_cluster)
    lines = [line(f"c{i}", f"Story number {i}:", max_tokens=48) for i in range(60)]
    batch = submit(api, lines)
    deadline = time.monotonic() + 60
    while api.batches.retrieve(batch.id).request_counts.completed < 1:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    cancelling = api.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    batch = wait(api, batch.id)
    assert batch.status == "cancelled" and batch.cancelled_at
    done = jsonl(api, batch.output_file_id)
    assert 1 <= len(done) < 60 == batch.request_counts.total
    assert len({d["custom_id"] for d in done}) == len(done) == batch.request_counts.completed
    with pytest.raises(openai.ConflictError):
        api.batches.cancel(batch.id)


def test_lines_unstarted_at_the_deadline_expire(batch_cluster):
    api = client(batch_cluster)
    lines = [line(f"e{i}", f"Item {i} of a long list:", max_tokens=32) for i in range(40)]
    batch = wait(api, submit(api, lines, window="3s").id)
    assert batch.status == "expired" and batch.expired_at
    done, failed = jsonl(api, batch.output_file_id), jsonl(api, batch.error_file_id)
    expired = [f for f in failed if f["error"] and f["error"]["code"] == "batch_expired"]
    assert expired and all(f["response"] is None for f in expired)
    ids = [x["custom_id"] for x in done + failed]
    assert sorted(ids) == sorted(f"e{i}" for i in range(40))  # each exactly once
    assert batch.request_counts.completed == len(done)


def test_limits_and_wrong_values_get_clear_errors(batch_cluster):
    api = client(batch_cluster)
    big = [line(f"b{i}", "x" * 400) for i in range(100)]  # over MAX_FILE_BYTES
    with pytest.raises(openai.APIStatusError) as error:
        upload(api, big)
    assert error.value.status_code == 413
    many = upload(api, [line(f"m{i}", "x") for i in range(MAX_LINES + 1)])
    with pytest.raises(openai.BadRequestError, match="limit"):
        api.batches.create(input_file_id=many, endpoint="/v1/completions", completion_window="24h")
    small = upload(api, [line("s", "x")])
    for wrong in (
        {"endpoint": "/v1/embeddings"},
        {"endpoint": []},
        {"completion_window": "tomorrow"},
        {"completion_window": "1" * 5_000 + "h"},
        {"input_file_id": "file-nope"},
        {"metadata": {"k": 5}},
    ):
        args = {"input_file_id": small, "endpoint": "/v1/completions", "completion_window": "24h"}
        with pytest.raises((openai.BadRequestError, openai.NotFoundError)):
            api.batches.create(**{**args, **wrong})
    with pytest.raises(openai.BadRequestError, match="purpose"):
        api.files.create(file=("x.jsonl", io.BytesIO(b"{}")), purpose="fine-tune")
    with pytest.raises(openai.NotFoundError):
        api.batches.retrieve("batch_nope")


def test_expiry_policies_date_the_upload_and_the_answers(batch_cluster):
    """`expires_after` and `output_expires_after` were ignored (every file's `expires_at` was
    null); the deletion when they come is `tests/unit/test_batch_parts.py`'s to see."""
    api = client(batch_cluster)
    text = (json.dumps(line("e", "Paris is")) + "\n").encode()
    hour = {"anchor": "created_at", "seconds": 3600}
    uploaded = api.files.create(file=("in.jsonl", io.BytesIO(text)), purpose="batch",
                                expires_after=hour)  # fmt: skip
    assert uploaded.expires_at == uploaded.created_at + 3600
    assert api.files.retrieve(uploaded.id).expires_at == uploaded.expires_at
    with pytest.raises(openai.BadRequestError, match="anchor"):
        api.files.create(file=("in.jsonl", io.BytesIO(text)), purpose="batch",
                         expires_after={"anchor": "last_active_at", "seconds": 3600})  # fmt: skip
    args = {"input_file_id": uploaded.id, "endpoint": "/v1/completions", "completion_window": "24h"}
    with pytest.raises(openai.BadRequestError, match="seconds"):
        api.batches.create(**args, output_expires_after={"anchor": "created_at", "seconds": 60})
    two_hours = {"anchor": "created_at", "seconds": 7200}
    batch = wait(api, api.batches.create(**args, output_expires_after=two_hours).id)
    assert batch.status == "completed", batch
    output = api.files.retrieve(batch.output_file_id)
    assert output.expires_at == output.created_at + 7200


def served_bulk_tokens(cluster) -> dict[str, float]:
    """Tokens the scheduler charged to each tenant's bulk account (the gateway's federation;
    scraped with a bare key, as /metrics shows tenants only to a key that may see them all)."""
    headers = {"Authorization": f"Bearer {SERVICE}"}
    text = httpx.get(cluster.url + "/metrics", headers=headers, timeout=10).text
    return {
        sample.labels["tenant"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "tandem:party_served_tokens" and sample.labels["class"] == "bulk"
    }


def test_api_keys_see_only_their_own_files_and_batches(batch_cluster):
    alpha, beta = client(batch_cluster, ALPHA), client(batch_cluster, BETA)
    served_before = served_bulk_tokens(batch_cluster)
    file_id = upload(alpha, [line("t", "Hi")])
    batch = alpha.batches.create(input_file_id=file_id, endpoint="/v1/completions",
                                 completion_window="24h")  # fmt: skip
    with pytest.raises(openai.NotFoundError):
        beta.files.retrieve(file_id)
    with pytest.raises(openai.NotFoundError):
        beta.files.content(file_id)
    with pytest.raises(openai.NotFoundError):
        beta.batches.retrieve(batch.id)
    with pytest.raises(openai.NotFoundError):
        beta.batches.create(input_file_id=file_id, endpoint="/v1/completions",
                            completion_window="24h")  # fmt: skip
    assert file_id not in [f.id for f in beta.files.list()]
    assert batch.id not in [b.id for b in beta.batches.list()]
    with pytest.raises(openai.AuthenticationError):
        client(batch_cluster, "wrong-key-0123456789abcdef").files.list()
    done = wait(alpha, batch.id)
    assert done.status == "completed", done
    # The line was charged to its owner's bulk account, not to the service key's: that key is
    # bare, so the `user` the service sends (the owner's tenant) decides.
    deadline = time.monotonic() + 10  # the gauges follow the scheduler's status (each second)
    while (grown := _grown(served_before, served_bulk_tokens(batch_cluster))) != {"alpha"}:
        assert time.monotonic() < deadline, grown
        time.sleep(0.5)
    assert alpha.files.delete(file_id).deleted
    with pytest.raises(openai.NotFoundError):
        alpha.files.retrieve(file_id)


def _grown(before: dict[str, float], after: dict[str, float]) -> set[str]:
    return {tenant for tenant, value in after.items() if value > before.get(tenant, 0)}
