"""How long a request just queued will wait for a worker, so that one which would outwait its
gateway's first-token deadline is refused at once (429, Retry-After) instead of queued and timed
out minutes later (504) after holding a queue slot that a request with a chance could have had.

The forecast is the request's place in line over the rate at which the cluster has been
bringing requests to their first token while it had a backlog:

* **Rate.** Only time the queue spent backlogged counts (after a dispatch pass some request
  was left waiting): then the workers are the limit, while in an idle cluster the arrivals are,
  and say nothing of capacity. Each first token (any request's, the prefill's or a decode
  worker's local one) during a backlog is a sample: the time since the previous one (or since
  the backlog began). First tokens, not dispatches: a dispatch only moves a request into a
  prefill worker's window, where it may wait (or be cancelled) long after, and cancels free
  windows fast, so dispatches counted optimistic exactly when requests were timing out. The
  rate is one more than the last `max_samples` samples (none older than `horizon_s`) over
  their time plus the time the current backlog has gone without a first token: one more, so
  that it leans optimistic however few were seen (a slow start refuses little), and still
  falls the longer nothing comes. That matters most when it looks worst: when every request
  waits until it times out, none reaches its first token, and only the silence tells that the
  cluster is not keeping up. Until the backlogs seen have lasted `min_span_s` there is no
  forecast and nothing is refused on it.
* **Place.** Interactive requests go before bulk lines, so only interactive requests are ahead
  of one: those dispatched and still awaiting their first token (in a prefill window or
  reserving), and those queued before it in the policy's order. Under fair share a request
  waits for its own party's queue and, for each of them and itself, one turn of every other
  backlogged party: `(own queued + 1) x backlogged parties - 1` queued ahead, never more than
  the whole interactive queue (FCFS: the whole queue). Fair share charges tokens, not
  requests, and aging turns every other choice to the oldest overdue request; the forecast
  ignores both, which is close for a flood of similar prompts, the case it is for. A request
  with nothing ahead is never refused: it goes at the next chance.
* **Refusal.** The wait is `(ahead + 1) / rate` (its own turn counted); past `DEADLINE_SHARE`
  of the deadline the request is refused, with Retry-After the excess (1-60 s).

Only interactive requests whose gateway sends a deadline are refused this way: a batch line has
its own pacing (the batch service keeps its window) and waits for spare capacity by design.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

# The forecast is an average and the deadline a hard cut: a request is refused once its forecast
# passes this share of its deadline. The queue kept is still some seconds of work (the workers
# never idle for it); what is cut is the tail that would time out.
DEADLINE_SHARE = 0.5
MIN_RETRY_AFTER_S = 1.0
MAX_RETRY_AFTER_S = 60.0


@dataclass
class ServiceRate:
    """First tokens per second while the queue is backlogged (see the module doc)."""

    max_samples: int = 128
    horizon_s: float = 3600.0
    min_span_s: float = 1.0
    _samples: deque[tuple[float, float]] = field(default_factory=deque)  # (when, seconds)
    _total_s: float = 0.0
    _since: float | None = None  # the last first token (or the start) of the current backlog

    def __post_init__(self) -> None:
        if self.max_samples < 1 or not self.min_span_s > 0:
            raise ValueError(
                f"need max_samples >= 1 and min_span_s > 0, got {self.max_samples}, "
                f"{self.min_span_s}"
            )

    def served(self, now: float) -> None:
        """A request got its first token; it counts if the queue is backlogged."""
        if self._since is None:
            return
        self._samples.append((now, now - self._since))
        self._total_s += now - self._since
        self._since = now
        if len(self._samples) > self.max_samples:
            self._total_s -= self._samples.popleft()[1]

    def pass_ended(self, now: float, backlogged: bool) -> None:
        """A dispatch pass ended with requests still waiting (a backlog goes on or begins) or
        with the queue empty (the backlog, if any, ended)."""
        if not backlogged:
            self._since = None
        elif self._since is None:
            self._since = now

    def per_second(self, now: float) -> float | None:
        """The rate, or None while the backlogs seen are too short to tell."""
        while self._samples and self._samples[0][0] < now - self.horizon_s:
            self._total_s -= self._samples.popleft()[1]
        stalled_s = now - self._since if self._since is not None else 0.0
        span = self._total_s + stalled_s
        if span < self.min_span_s:
            return None
        return (len(self._samples) + 1) / span


def queued_ahead(
    num_interactive_queued: int, num_party_queued: int, num_backlogged_parties: int, fair: bool
) -> int:
    """Queued interactive requests the policy serves before one more of a party that has
    `num_party_queued` queued (its party counted in `num_backlogged_parties` or not)."""
    if not fair:
        return num_interactive_queued
    parties = num_backlogged_parties + (1 if num_party_queued == 0 else 0)
    return min(num_interactive_queued, (num_party_queued + 1) * parties - 1)


def refusal_for_deadline(
    deadline_s: float, num_ahead: int, rate_per_s: float | None
) -> tuple[str, float] | None:
    """(message, Retry-After seconds) if `num_ahead` requests and this one at `rate_per_s` take
    longer than `DEADLINE_SHARE` of `deadline_s`; None when they do not, when no rate is known
    or nothing is ahead. (Its own turn counts: where the pace is the prefill's, its first token
    comes about one turn after its dispatch.)"""
    if rate_per_s is None or num_ahead == 0:  # nothing ahead: it goes at the next chance
        return None
    wait_s = (num_ahead + 1) / rate_per_s
    if wait_s <= DEADLINE_SHARE * deadline_s:
        return None
    message = (
        f"the cluster is overloaded: about {num_ahead} requests are ahead of this one, which "
        f"would wait about {wait_s:.0f} s for a worker at the {rate_per_s:.2g} requests/s "
        f"being served, too close to its {deadline_s:.0f} s deadline for a first token; "
        "retry later"
    )
    excess_s = wait_s - DEADLINE_SHARE * deadline_s
    retry_after = min(MAX_RETRY_AFTER_S, max(MIN_RETRY_AFTER_S, excess_s))
    return message, retry_after
