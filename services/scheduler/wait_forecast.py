"""How long a request just queued will wait for a worker, so that one which would outwait its
gateway's first-token deadline is refused at once (429, Retry-After) instead of queued and timed
out minutes later (504) after holding a queue slot that a request with a chance could have had.

The forecast is the prompt tokens the cluster must bring to their first token before this
request's, over the pace at which it has been doing so while it had a backlog. Tokens, not
requests: requests differ in size, and a pace learned from long prompts (a few requests a
second) would forecast a burst of short ones minutes away that is served in seconds.

* **Pace.** Only time the queue spent backlogged counts (after a dispatch pass some request
  was left waiting): then the workers are the limit, while in an idle cluster the arrivals are,
  and say nothing of capacity. Each first token (any request's, the prefill's or a decode
  worker's local one) during a backlog is a sample: the request's prompt tokens and the time
  since the previous first token (or since the backlog began). First tokens, not dispatches: a
  dispatch only moves a request into a prefill worker's window, where it may wait (or be
  cancelled) long after, and cancels free windows fast, so dispatches counted optimistic
  exactly when requests were timing out. The pace is the tokens of the last `max_samples`
  samples (none older than `horizon_s`) plus those of one more first token, over their time
  plus the time the current backlog has gone without a first token: one more (the caller
  says how big: the mean of the requests in hand), so that it leans optimistic however few
  were seen (a slow start refuses little), and still falls the longer nothing comes. That
  matters most when it looks worst: when every request waits until it times out, none
  reaches its first token, and only the silence tells that the cluster is not keeping up.
  Until the backlogs seen have lasted `min_span_s` there is no forecast and nothing is
  refused on it. And a backlog's first seconds say little: a prefill step brings a whole
  batch of first tokens at its end, so a burst's first step reads as silence (a burst of 300
  short prompts, served in 51 s, had 21 refused 1.4 s in, paced at 45 tokens/s where 150 were
  served). So the prefill workers' own measured rates count as `PRIOR_S` seconds of samples,
  which the backlog's own soon outweigh (and a silence of a minute still reads as slowness).
  Half a second, no more: a worker's rate is its steps' compute, and under a flood the first
  tokens come at the decode seats' turnover, slower (weighed as two seconds, a prefill rate of
  ~500 tokens/s let a 1,500-request flood at a 60 s limit in to 16 time-outs).
* **Work ahead.** Interactive requests go before bulk lines, so only interactive work is ahead
  of one: the prompts dispatched and still awaiting their first token (in a prefill window or
  reserving), and those queued before it in the policy's order, its own included. Fair share
  (VTC) serves every backlogged party tokens in proportion to its weight: before a party's
  queue and the new request are through (`own` tokens), every other backlogged party gets up
  to as much times its weight over the party's (`--tenant-weights`, the class weights), so
  with equal weights `own x backlogged parties` (its own counted), never more than the whole
  interactive queue and the request (FCFS: that whole). Parties with less queued than `own`
  make it an upper bound, and aging turns every other choice to the oldest overdue request;
  the forecast ignores both. A request with nothing ahead is never refused: it goes at the next
  chance.
* **Refusal.** The wait is the work over the pace; past a share of the deadline (the
  scheduler's `deadline_share`, `DEADLINE_SHARE` by default) the request is refused, with
  Retry-After the excess (1-60 s).

Only interactive requests whose gateway sends a deadline are refused this way: a batch line has
its own pacing (the batch service keeps its window) and waits for spare capacity by design.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

# The forecast is an average and the deadline a hard cut: a request is refused once its forecast
# passes this share of its deadline. The queue kept is still some seconds of work (the workers
# never idle for it); what is cut is the tail that would time out.
DEADLINE_SHARE = 0.75
# The prefill workers' measured rates count as this many seconds of first tokens (see above).
PRIOR_S = 0.5
MIN_RETRY_AFTER_S = 1.0
MAX_RETRY_AFTER_S = 60.0


@dataclass
class ServiceRate:
    """First tokens, and their prompt tokens, per second while the queue is backlogged (see
    the module doc)."""

    max_samples: int = 128
    horizon_s: float = 3600.0
    min_span_s: float = 1.0
    _samples: deque[tuple[float, float, int]] = field(default_factory=deque)  # when, s, tokens
    _total_s: float = 0.0
    _total_tokens: int = 0
    _since: float | None = None  # the last first token (or the start) of the current backlog

    def __post_init__(self) -> None:
        if self.max_samples < 1 or not self.min_span_s > 0:
            raise ValueError(
                f"need max_samples >= 1 and min_span_s > 0, got {self.max_samples}, "
                f"{self.min_span_s}"
            )

    def served(self, now: float, num_prompt_tokens: int) -> None:
        """A request of `num_prompt_tokens` got its first token; it counts if the queue is
        backlogged."""
        if self._since is None:
            return
        self._samples.append((now, now - self._since, num_prompt_tokens))
        self._total_s += now - self._since
        self._total_tokens += num_prompt_tokens
        self._since = now
        if len(self._samples) > self.max_samples:
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        _, seconds, num_tokens = self._samples.popleft()
        self._total_s -= seconds
        self._total_tokens -= num_tokens

    def pass_ended(self, now: float, backlogged: bool) -> None:
        """A dispatch pass ended with requests still waiting (a backlog goes on or begins) or
        with the queue empty (the backlog, if any, ended)."""
        if not backlogged:
            self._since = None
        elif self._since is None:
            self._since = now

    def per_second(self, now: float) -> float | None:
        """First tokens a second (one more than seen), or None while the backlogs seen are too
        short to tell."""
        span = self._span(now)
        return None if span is None else (len(self._samples) + 1) / span

    def tokens_per_second(
        self, now: float, next_num_tokens: int, prior_tokens_per_s: float = 0.0
    ) -> float | None:
        """Prompt tokens brought to their first token a second, counting one more first token
        of `next_num_tokens` and `PRIOR_S` seconds at `prior_tokens_per_s` (the workers' own
        measure; 0: none); None while the backlogs seen are too short to tell."""
        span = self._span(now)
        if span is None:
            return None
        prior_s = PRIOR_S if prior_tokens_per_s > 0 else 0.0
        tokens = self._total_tokens + next_num_tokens + prior_tokens_per_s * prior_s
        return tokens / (span + prior_s)

    def _span(self, now: float) -> float | None:
        while self._samples and self._samples[0][0] < now - self.horizon_s:
            self._drop_oldest()
        stalled_s = now - self._since if self._since is not None else 0.0
        span = self._total_s + stalled_s
        return None if span < self.min_span_s else span


class InHand:
    """The interactive requests dispatched and still awaiting their first token, with their
    prompt tokens: work ahead of every request queued."""

    def __init__(self) -> None:
        self._tokens: dict[str, int] = {}
        self.num_tokens = 0

    def __len__(self) -> int:
        return len(self._tokens)

    def __iter__(self) -> Iterator[str]:
        return iter(self._tokens)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._tokens

    def add(self, request_id: str, num_prompt_tokens: int) -> None:
        self.discard(request_id)
        self._tokens[request_id] = num_prompt_tokens
        self.num_tokens += num_prompt_tokens

    def discard(self, request_id: str) -> None:
        self.num_tokens -= self._tokens.pop(request_id, 0)

    def mean_tokens(self) -> float | None:
        return self.num_tokens / len(self._tokens) if self._tokens else None


def queued_work(
    num_tokens: int,
    num_party_queued_tokens: int,
    num_interactive_queued_tokens: int,
    num_backlogged_parties: int,
    fair: bool,
    weights: tuple[float, float] | None = None,
) -> int:
    """Prompt tokens of the queued interactive requests the policy serves before one more of
    `num_tokens` whose party has `num_party_queued_tokens` queued (the party counted in
    `num_backlogged_parties` or not), that one's own included. `weights`: the backlogged
    interactive parties' weights summed (its party's included if backlogged) and its party's
    weight; fair share serves each party tokens in proportion to its weight, so while its
    party is served its own, the others are served theirs times their weight over its. None:
    every weight is 1 (each other party as much as its own)."""
    whole = num_interactive_queued_tokens + num_tokens
    if not fair:
        return whole
    own = num_party_queued_tokens + num_tokens
    if weights is None:
        parties = num_backlogged_parties + (1 if num_party_queued_tokens == 0 else 0)
        return min(whole, own * parties)
    backlogged_weight, own_weight = weights
    others_weight = backlogged_weight - (own_weight if num_party_queued_tokens else 0.0)
    turns = 1.0 + max(0.0, others_weight) / own_weight
    return min(whole, round(own * turns))


def refusal_for_deadline(
    deadline_s: float,
    num_tokens: int,
    work_tokens: int,
    tokens_per_s: float | None,
    share: float = DEADLINE_SHARE,
) -> tuple[str, float] | None:
    """(message, Retry-After seconds) if `work_tokens` of prompt (a request of `num_tokens` and
    the work ahead of it) at `tokens_per_s` take longer than `share` of `deadline_s`; None when
    they do not, when no pace is known or nothing is ahead. (Its own prompt counts: where the
    pace is the prefill's, its first token comes when its prompt is through.)"""
    if tokens_per_s is None or work_tokens <= num_tokens:  # nothing ahead: goes at once
        return None
    if not tokens_per_s > 0:  # no pace seen (no prompt tokens): no forecast, as with None
        return None
    wait_s = work_tokens / tokens_per_s
    if wait_s <= share * deadline_s:
        return None
    message = (
        f"the cluster is overloaded: the requests ahead of this one hold about "
        f"{work_tokens - num_tokens} prompt tokens; at the {tokens_per_s:.0f} prompt tokens/s "
        f"being served it would wait about {wait_s:.0f} s for a worker, too close to its "
        f"{deadline_s:.0f} s deadline for a first token; retry later"
    )
    excess_s = wait_s - share * deadline_s
    retry_after = min(MAX_RETRY_AFTER_S, max(MIN_RETRY_AFTER_S, excess_s))
    return message, retry_after
