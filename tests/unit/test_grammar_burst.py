"""`loadtest/grammar_burst.py` runs end to end (its figures are README's) and refuses settings
that measure nothing."""

from __future__ import annotations

import pytest

from loadtest import grammar_burst


@pytest.mark.slow
def test_the_burst_bench_runs_and_skips_what_nobody_waits_for(capsys):
    grammar_burst.main(["--burst", "3", "--fresh", "1", "--limit-s", "0.5"])
    lines = capsys.readouterr().out.strip().splitlines()
    shown = {key.strip(): value for key, value in (line.split(":") for line in lines)}
    assert float(shown["fresh_waited_s"]) > 0
    # The pool's two threads begin two of the three; the third was given up on by then.
    assert int(shown["skipped"]) >= 1


@pytest.mark.parametrize(
    "argv", [["--burst", "0"], ["--fresh", "0"], ["--limit-s", "nan"], ["--limit-s", "0"]]
)
def test_settings_that_measure_nothing_are_refused(argv, capsys):
    with pytest.raises(SystemExit):
        grammar_burst.main(argv)
    assert "--burst and --fresh" in capsys.readouterr().err
