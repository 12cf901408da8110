"""`tandem batch`: wrong arguments get a clear error before anything is sent."""

from __future__ import annotations

import pytest

from services.commands.cli import main


def test_submit_of_a_missing_file_says_so(tmp_path):
    with pytest.raises(SystemExit, match="no such file"):
        main(["batch", "--url", "http://127.0.0.1:9", "submit", str(tmp_path / "none.jsonl")])


def test_submit_without_an_endpoint_anywhere_asks_for_one(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text('{"custom_id": "a", "url": "/v1/embeddings"}\n')
    with pytest.raises(SystemExit, match="--endpoint"):
        main(["batch", "--url", "http://127.0.0.1:9", "submit", str(path)])


def test_an_unknown_endpoint_or_action_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["batch", "submit", "x.jsonl", "--endpoint", "/v1/embeddings"])
    assert "invalid choice" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["batch", "explode"])


def test_batch_bench_refuses_wrong_values_and_builds_distinct_prompts(capsys):
    from loadtest import batch_bench

    with pytest.raises(SystemExit):
        batch_bench.main(["--num-prompts", "0"])
    assert "must be positive" in capsys.readouterr().err
    assert len(set(batch_bench.prompts(50, "batch"))) == 50
    assert batch_bench.percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert batch_bench.percentile([], 0.99) is None
