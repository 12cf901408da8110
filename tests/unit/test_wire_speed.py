"""The wire speed benchmark, tiny: every message it times decodes to itself, and it prints a
decode and an encode time for each."""

from __future__ import annotations

import pytest

from loadtest.wire_speed import MESSAGES, main


def test_the_command_prints_a_time_per_message(capsys):
    assert main(["--number", "3", "--repeats", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0].strip() for line in lines] == list(MESSAGES)
    for line in lines:
        decode, encode = line.split(":")[1].split(",")
        assert decode.split()[0] == "decode" and float(decode.split()[1]) > 0
        assert encode.split()[0] == "encode" and float(encode.split()[1]) > 0


@pytest.mark.parametrize("argv", [["--number", "0"], ["--repeats", "-1"], ["--number", "x"]])
def test_wrong_values_exit_2_naming_them(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2 and argv[0] in capsys.readouterr().err
