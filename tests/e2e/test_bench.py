"""`tandem bench` against the shared cluster for a few seconds: a valid result.json with every
request measured, the PNG plots (batch occupancy included, since the server is tandem), and a
comparison of two results."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from loadtest.workload import WorkloadRequest, write_workload

pytestmark = pytest.mark.slow
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def tandem_bench(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "services.commands.cli", "bench", *argv],
        capture_output=True,
        text=True,
        timeout=300,
    )


def small_workload(path, smollm2) -> None:
    prompts = ["The river ran", "In the morning the baker", "A list of colors:", "Once"]
    write_workload(
        path,
        [
            WorkloadRequest(
                text,
                max_tokens=6,
                arrival_time=0.0,
                prompt_token_ids=smollm2.tokenizer(text).input_ids,
                label="bulk" if i == 3 else "chat",
                stream=i != 3,
            )
            for i, text in enumerate(prompts)
        ],
    )


def test_bench_measures_plots_and_compares(cluster, smollm2, tmp_path):
    workload = tmp_path / "small.jsonl"
    small_workload(workload, smollm2)
    outs = []
    for name, arrivals in (("burst", ["--burst"]), ("rate", ["--rate", "4"])):
        out = tmp_path / name
        done = tandem_bench("--url", cluster.url, "--workload", str(workload), *arrivals,
                            "--slo-ttft", "60", "--slo-tpot", "10", "--out", str(out))  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        outs.append(out)
        result = json.loads((out / "result.json").read_text())
        (run,) = result["runs"]
        summary = run["summary"]
        assert (summary["num_ok"], summary["num_errors"]) == (4, 0)
        assert summary["output_tokens"] == 24 and summary["goodput_rps"] > 0
        assert set(run["classes"]) == {"chat", "bulk"}
        assert run["classes"]["bulk"]["ttft_p50"] is None  # not streamed: no TTFT
        assert 0 < run["classes"]["chat"]["ttft_p50"] <= run["classes"]["chat"]["e2e_p50"]
        assert sum(rate for _, rate in run["throughput"]) > 0
        assert any(max(s["sizes"]) > 0 for s in run["batch"])  # tandem's decode steps seen
        for png in ("latency_cdf.png", "throughput.png", "batch.png"):
            assert (out / png).read_bytes().startswith(PNG_MAGIC), png
        assert "TTFT ms p50" in done.stdout
    compared = tandem_bench("--compare", *(str(o / "result.json") for o in outs),
                            "--out", str(tmp_path / "cmp"))  # fmt: skip
    assert compared.returncode == 0, compared.stderr[-3000:]
    assert "burst" in compared.stdout and "rate" in compared.stdout
    assert (tmp_path / "cmp" / "compare.png").read_bytes().startswith(PNG_MAGIC)
