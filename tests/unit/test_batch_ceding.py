"""`ceding`: a worker thread's long loop yields the GIL now and then (the loop-gap tests of
test_batch_runner measure what it is for)."""

from __future__ import annotations

import time

from services.batch import ceding


def test_ceding_passes_every_item_in_order_and_yields_after_each_every(monkeypatch):
    sleeps: list[tuple[int, float]] = []
    seen: list[int] = []
    monkeypatch.setattr(time, "sleep", lambda seconds: sleeps.append((len(seen), seconds)))
    for item in ceding.ceding(iter(range(10)), every=4):
        seen.append(item)
    assert seen == list(range(10))
    assert sleeps == [(4, 0), (8, 0)]  # after the 4th and the 8th, none at the end


def test_ceding_an_empty_loop_yields_nothing(monkeypatch):
    monkeypatch.setattr(time, "sleep", lambda seconds: (_ for _ in ()).throw(AssertionError))
    assert list(ceding.ceding([], every=1)) == []
