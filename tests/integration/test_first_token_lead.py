"""The first-token lead benchmark, tiny: a real prefill worker, its peers played by the script."""

from __future__ import annotations

import pytest

from loadtest.first_token_lead import main


def test_a_tiny_run_prints_a_lead_per_round_and_the_median(tiny_model_dir, capsys):
    argv = ["--model", str(tiny_model_dir), "--prompts", "2", "--tokens", "8", "--rounds", "3"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    leads = out.split("last first token minus last transfer, ms:")[1].splitlines()[0]
    assert len(leads.split(",")) == 2  # the warm-up round left out
    assert "median:" in out


@pytest.mark.parametrize("argv", [["--rounds", "1"], ["--prompts", "0"], ["--tokens", "-3"]])
def test_wrong_values_exit_2_naming_them(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2 and "must be" in capsys.readouterr().err
