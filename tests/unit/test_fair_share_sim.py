"""The fair-share policy under a randomized simulation, on the Python index and on the C one.

Random runs of what the scheduler does to its queue (requests of every kind queued, choices
with and without length ranges or a worker that refuses some, generated tokens charged, a
dispatched prompt refunded and queued again, cancels, time passing) check after every choice
the promises of `fair_share.py`: work conservation, bulk lines only on what interactive work
leaves, aging (an overdue request waits at most two choices per older overdue one), and the
share between backlogged parties (none banks credit for the time it was away, bulk ones among
themselves too).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable

import pytest

from services.scheduler.fair_share import FairQueue, FairShareConfig, LengthRanges, Party
from services.scheduler.queued import QueuedRequest

INDEXES = ["python", "native"]
_ids = itertools.count()


class Run:
    """One random run against one queue, asserting the policy's promises as it goes."""

    def __init__(self, seed: int, indexes: str):
        self.rng = random.Random(seed)
        self.config = FairShareConfig(
            class_thresholds=(64,),
            max_wait_s=self.rng.choice([2.0, 5.0]),
            bulk_max_wait_s=self.rng.choice([3.0, 8.0, 1e9]),
        )
        self.queue = FairQueue(self.config, indexes)
        self.now = 0.0
        self.running: list[tuple[Party, QueuedRequest]] = []
        self.previous_was_oldest_overdue = False

    def step(self) -> None:
        rng, queue = self.rng, self.queue
        action = rng.random()
        if action < 0.4:
            self.push()
        elif action < 0.8:
            self.choose()
        elif action < 0.85 and self.running:
            party, _ = self.running.pop(rng.randrange(len(self.running)))
            queue.charge(party, num_output_tokens=rng.choice([0, 1, 50]))
        elif action < 0.9 and self.running:  # handed back: its prompt refunded, queued again
            party, item = self.running.pop(rng.randrange(len(self.running)))
            queue.charge(party, num_prompt_tokens=-item.num_prompt_tokens)
            queue.push(item)
        elif action < 0.95 and len(queue):
            queue.remove(rng.choice(list(queue)).request_id)
        else:
            self.now += rng.choice([0.0, 0.5, 1.0, 4.0])

    def push(self) -> None:
        rng = self.rng
        self.queue.push(
            QueuedRequest(
                f"r{next(_ids)}",
                rng.choice("abc"),
                rng.choice([0, 1, 5, 30, 63, 64, 65, 200, 1000]),
                rng.choice([0, 0, 1, -1]),
                self.now - rng.choice([0, 0, 0, 1, 3]),
                bulk=rng.random() < 0.3,
            )
        )

    def admissible_and_lengths(self) -> tuple[Callable[[QueuedRequest], bool], LengthRanges | None]:
        rng, mode = self.rng, self.rng.random()
        if mode < 0.3:
            return (lambda _: True), None
        if mode < 0.6:
            lengths = LengthRanges(
                ((0, rng.choice([0, 10, 64, 300, 2000])),),
                rng.choice([(), ((0, 100),), ((0, 5000),)]),
            )
            return lengths, lengths
        refused = {i.request_id for i in self.queue if rng.random() < 0.3}
        return (lambda item: item.request_id not in refused), None

    def interactive(self, item: QueuedRequest) -> bool:
        return not item.bulk or self.now - item.arrival >= self.config.bulk_max_wait_s

    def choose(self) -> None:
        admissible, lengths = self.admissible_and_lengths()
        placeable = [i for i in self.queue if admissible(i)]
        interactive = [i for i in placeable if self.interactive(i)]
        overdue = [i for i in interactive if self.now - i.arrival >= self.config.max_wait_s]
        oldest = min((i.arrival for i in overdue), default=None)
        chosen = self.queue.pop_next(self.now, admissible, lengths)
        # work conservation, and bulk only on what interactive work leaves
        assert (chosen is None) == (not placeable)
        if interactive:
            assert chosen is not None and self.interactive(chosen)
        if chosen is None:
            return
        # aging (ties in arrival: any of the oldest)
        is_oldest_overdue = chosen in overdue and chosen.arrival == oldest
        if overdue:
            assert is_oldest_overdue or self.previous_was_oldest_overdue
        self.previous_was_oldest_overdue = is_oldest_overdue
        party = self.queue.party_for(chosen.tenant, chosen.num_prompt_tokens, chosen.bulk)
        self.running.append((party, chosen))


@pytest.mark.parametrize("indexes", INDEXES)
@pytest.mark.parametrize("seed", range(40))
def test_random_runs_keep_the_policys_promises(seed, indexes):
    run = Run(seed, indexes)
    for _ in range(300):
        run.step()


@pytest.mark.parametrize("indexes", INDEXES)
@pytest.mark.parametrize("bulk", [False, True])
@pytest.mark.parametrize("seed", range(5))
def test_a_party_joining_late_shares_from_then_on(seed, bulk, indexes):
    """Party a is served alone a while, its queue emptied and filled again; then b joins, and
    while both stay backlogged their service from then on stays within a couple of requests of
    each other (b banks no credit for the time before, whatever the kind)."""
    rng = random.Random(seed)
    queue = FairQueue(FairShareConfig(max_wait_s=1e9, bulk_max_wait_s=1e9), indexes)

    def push(tenant: str) -> None:
        size = rng.randint(1, 1000)
        queue.push(QueuedRequest(f"r{next(_ids)}", tenant, size, 0, 0.0, bulk=bulk))

    for _ in range(rng.randint(20, 60)):
        for _ in range(rng.randint(1, 3)):
            push("a")
        while len(queue):
            queue.pop_next(1.0)
    for _ in range(3):  # both backlogged from now on
        push("a")
        push("b")
    served = {"a": 0, "b": 0}
    for _ in range(100):
        chosen = queue.pop_next(2.0)
        served[chosen.tenant] += chosen.num_prompt_tokens
        push(chosen.tenant)
        assert abs(served["a"] - served["b"]) <= 2 * 1000, served
