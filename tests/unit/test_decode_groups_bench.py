"""`loadtest.decode_groups_bench`: its arguments and the groups it reports (the timing itself
runs by hand)."""

from __future__ import annotations

import argparse

import pytest

from loadtest.decode_groups_bench import _lengths, groups_of, main


def test_lengths_parse_and_refuse_nonsense():
    assert _lengths("30,45,800") == [30, 45, 800]
    for bad in ("", "a,b", "0,4", "-3"):
        with pytest.raises(argparse.ArgumentTypeError):
            _lengths(bad)


def test_groups_follow_the_bound():
    contexts = [200] + [40] * 10
    assert groups_of(contexts, 4096) == [11]
    assert groups_of(contexts, 256) == [2, 9]


def test_contexts_are_required(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--dtype", "float32"])
    assert exit_info.value.code == 2
    assert "--contexts" in capsys.readouterr().err
