"""The batch memory benchmark's job runs every line once through the service's own runner."""

from __future__ import annotations

import asyncio

import pytest

from loadtest.batch_memory import main, run_job


def test_a_job_of_instant_answers_completes_every_line_once(tmp_path):
    result = asyncio.run(run_job(tmp_path, num_lines=300, max_in_flight=8))
    assert result["status"] == "completed"
    assert result["completed"] == result["calls"] == 300
    assert result["rss_end_mib"] >= result["rss_start_mib"] > 0


@pytest.mark.parametrize("argv", [["--sizes", "0"], ["--max-in-flight", "0"]])
def test_wrong_arguments_exit_2(argv):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
