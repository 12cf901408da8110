"""The gateway's side of the cluster: submit requests, receive their token streams, cancel.

Two sockets: a DEALER to the scheduler (HELLO, SUBMIT and its reply, CANCEL, cluster status, and
errors for requests the scheduler had to fail) and a PULL bound at the gateway's stream address,
where workers push TOKENS. Each in-flight request has an asyncio queue its HTTP or RPC handler
reads. If the scheduler's status messages stop (it restarted), the gateway says HELLO again.

A request whose worker was lost comes back from the scheduler as a delta with finish reason
"lost" ("preempted" when its decode worker handed it back for recompute). The gateway alone
knows which tokens reached the handler, so it resumes the request: a new attempt (id `<id>~<n>`)
with those tokens prefilled after the prompt, on whatever workers the scheduler picks. The
handler's queue goes on as if nothing happened: no token repeated, none skipped (deltas of an
abandoned attempt are dropped by their id). Within an attempt each delta says where its tokens
sit (`shared.deltas`): the first token comes from the prefill worker and again, ahead of the
rest, from the decode worker, and the handler gets each once, in order. Greedy output is
unchanged by a resumption; a sampled one continues from a fresh generator. After `MAX_RESUMES`
losses (preemptions do not count: each attempt brings a token), or when no worker takes it
within `RESUME_PATIENCE_S`, the handler gets an error delta naming why. A new scheduler epoch
(the scheduler restarted) resumes the requests whose attempt had brought no token yet: the
old scheduler's queue went with it (not one whose first SUBMIT awaits its answer: the answer,
or a 503 when none comes, settles it). Their old attempts are called off: one prefilling, or
holding a decode reservation, would run on for nobody. Until the new scheduler has this
gateway's HELLO it refuses SUBMITs as from a stranger: the gateway says HELLO at once and takes
the refusal as a 503. A resumption's SUBMIT left unanswered is asked again as a new attempt:
the late answer to the first settles nothing.

A stream's last delta can be lost too (its connection cut as it was sent), and no later delta
would show the hole. The scheduler passes on where the worker says the stream ended
(STREAM_ENDED, on the other socket): if the stream's end has not come once its tokens stop
arriving for `STREAM_END_GRACE_S`, the request ends here (every token came: only the finish was
lost) or resumes from the tokens that did come, instead of waiting out its time limit.

A request decoding when the scheduler restarted (its attempt had brought tokens) is orphaned:
its worker goes on streaming, and the new scheduler adopts it from that worker's heartbeats and
says when the worker is lost. Not if the worker died before it could be adopted, nor when the
loss came before this gateway's HELLO reached the new scheduler: so an orphan whose tokens stop
for `ORPHAN_SILENCE_S` is resumed from the tokens that came, its old attempt called off.

A brief cut of the link to the scheduler (a network blip, neither process restarted) loses no
word of the scheduler's. The link's DEALER keeps one routing id for the process's life
(`shared.endpoints.routing_id`), which the scheduler's ROUTER hands over to the new connection,
and what the scheduler sends while the link is down it holds and sends once it is back
(`services/scheduler/service.py`): a request's "lost" word, its stream's end, its SUBMIT's
answer arrive a moment late, not never (the scheduler's status, within its next tick, not after
`status_timeout_s`). What the dying connection swallowed (its bytes in flight when it was cut)
is lost all the same: when the link comes back the gateway says HELLO at once, and watches each
attempt that was decoding as it watches an orphan, resumed once its tokens stop for
`ORPHAN_SILENCE_S` (its "lost" word may have been among those bytes).

A delta holding a negative token id (the wire carries int32s; no tokenizer has one, and decoding
it raised OverflowError in the handler) fails its request with an error naming the id, and its
attempt is called off (no worker sends one: a bug or a foreign peer, whose output is not to be
trusted).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from shared import wire
from shared.binding import bind
from shared.curve import CurveKeys, Security
from shared.deltas import after
from shared.endpoints import connect, set_routing_id
from shared.lifecycle import GatewayEvents
from shared.logs import get_logger

MAX_RESUMES = 3  # attempts after the first, per request
RESUME_PATIENCE_S = 15.0  # how long a resumption waits for a worker to take it (503s)
RESUBMIT_ANSWER_S = 10.0  # how long a resumption's SUBMIT waits for its answer
# Submits sent and not yet answered, at most: past it a request is refused at once (429). A
# flood (10,000 requests at once) otherwise piles up behind the scheduler's replies until they
# time out as 503s; the scheduler's own queue holds 1,024 by default, so a pile larger than that
# would mostly be refused anyway, only later.
MAX_PENDING_SUBMITS = 1024
# How long a stream may be silent, after its worker said it ended, before its end is taken as
# lost. The two messages travel on different connections, and a busy gateway reads its stream
# socket behind a backlog: a stream still bringing tokens is given this much again.
STREAM_END_GRACE_S = 5.0
# How long an orphaned attempt (decoding when the scheduler restarted) may bring no token before
# it is taken as lost: far above any decode step. A sequence its worker swapped out may wait
# longer under load, and is then resumed too; that costs its prefill again, not its output: it
# resumes from its tokens (greedy output unchanged), and the old attempt is called off through
# the new scheduler, which has adopted it by then and cancels it on its worker.
ORPHAN_SILENCE_S = 30.0
MAX_RETRY_AFTER_S = 3600.0  # the longest wait a refusal may ask of a client, seconds
# The scheduler's refusal of a SUBMIT from a gateway it does not know (`_admission_refusal` in
# services/scheduler/core.py): a restarted scheduler before this gateway's HELLO reached it.
# The reply carries no code for it, so its message is matched (a 400 ending with these words).
UNKNOWN_GATEWAY_MARKER = "has not said HELLO"
HELLO_AGAIN_S = 1.0  # the least time between two HELLOs said because of that refusal


def _require_seconds(**settings: float) -> None:
    """Each a length of time: > 0 and finite. A NaN sleep never ends (a chore left for good), and
    a zero one turns a wait into a busy loop or takes every stream end as lost."""
    for name, value in settings.items():
        if not 0 < value < math.inf:  # (NaN fails every comparison)
            raise ValueError(f"{name} must be > 0 and finite (seconds), got {value!r}")


def _negative_token_id(delta: wire.TokenDelta) -> int | None:
    """The lowest token id of the delta (its tokens, their top logprobs', the prompt's), if it
    is negative: the wire carries int32 ids, and no tokenizer has a negative one (decoding it
    raises OverflowError). An id past the vocabulary is one the model's padded embedding may
    well give: that one decodes to no text."""
    lowest = min(delta.token_ids, default=0)
    for tops in (delta.top_logprobs, delta.prompt_top_logprobs):
        for top in tops or ():
            lowest = min(lowest, min((token for token, _ in top), default=0))
    return lowest if lowest < 0 else None


SUBMIT_ANSWER_S = 10.0  # the longest a SUBMIT waits for the scheduler's answer (then a 503)


class SubmitRefused(Exception):
    def __init__(
        self, status_code: int, message: str, retry_after_s: float | None, answered: bool = True
    ):
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.retry_after_s = retry_after_s
        # False: no answer came in time (a 503); the SUBMIT was called off, its answer may come.
        self.answered = answered


def refusal(reply: wire.SubmitReply) -> SubmitRefused:
    """A refused SUBMIT as the gateway answers it. The wire checks types only: a status that
    is not an HTTP error becomes 502, and a retry delay that is not a finite number of seconds
    within `MAX_RETRY_AFTER_S` is dropped (a NaN failed the Retry-After header's rounding, and an
    infinite one put a resumption to sleep for good)."""
    status = reply.status_code if 400 <= reply.status_code <= 599 else 502
    message = reply.message or "refused"
    if status != reply.status_code:
        message = f"the scheduler refused with status {reply.status_code}: {message}"
    retry_after_s = reply.retry_after_s
    if retry_after_s is not None and not 0.0 <= retry_after_s <= MAX_RETRY_AFTER_S:
        retry_after_s = None  # also NaN: every comparison with it is false
    return SubmitRefused(status, message, retry_after_s)


@dataclass
class InFlight:
    """A request as its handler knows it (by its first id), and the attempt now running it."""

    submit: wire.Submit  # the first attempt
    queue: asyncio.Queue
    attempt_id: str
    token_ids: list[int] = field(default_factory=list)  # every token handed to the handler
    num_resumes: int = 0  # after losses: bounded by MAX_RESUMES
    num_attempts: int = 1  # every attempt, preemptions' included (each brings a token)
    num_tokens_before_attempt: int = 0  # of `token_ids`, those the attempt running began with
    ended: bool = False  # the stream's last delta (its finish) is on the queue

    @property
    def attempt_has_tokens(self) -> bool:
        """Whether the attempt running brought a token: it left the scheduler's queue."""
        return len(self.token_ids) > self.num_tokens_before_attempt


@dataclass
class ClusterView:
    num_prefill: int = 0
    num_decode: int = 0
    num_queued: int = 0
    num_in_flight: int = 0
    num_decode_free_blocks: int = 0
    num_decode_total_blocks: int = 0
    max_decode_pool_tokens: int = 0  # (0: not known)
    num_swap_preemptions: int = 0
    num_recompute_preemptions: int = 0
    policy: str = ""
    max_queue_wait_s: float = 0.0
    service: list[wire.PartyService] = field(default_factory=list)
    workers: list[wire.WorkerStatus] = field(default_factory=list)
    scheduler_metrics_address: str | None = None
    scheduler_epoch: str = ""
    received_at: float = 0.0


class ClusterClient:
    def __init__(
        self,
        scheduler_address: str,
        stream_bind: str,
        stream_address: str,
        peer_id: str,
        model: str,
        telemetry: GatewayEvents,
        keys: CurveKeys | None = None,
        status_timeout_s: float = 3.0,
        max_pending_submits: int = MAX_PENDING_SUBMITS,
        stream_end_grace_s: float = STREAM_END_GRACE_S,
        orphan_silence_s: float = ORPHAN_SILENCE_S,
    ):
        _require_seconds(
            status_timeout_s=status_timeout_s,
            stream_end_grace_s=stream_end_grace_s,
            orphan_silence_s=orphan_silence_s,
        )
        if type(max_pending_submits) is not int or max_pending_submits < 1:  # (bool neither)
            raise ValueError(
                f"max_pending_submits must be an int >= 1, got {max_pending_submits!r}"
            )
        self.scheduler_address = scheduler_address
        self.max_pending_submits = max_pending_submits
        self.stream_bind = stream_bind
        self.stream_address = stream_address
        self.peer_id = peer_id
        self.model = model
        self.status_timeout_s = status_timeout_s
        self.stream_end_grace_s = stream_end_grace_s
        self.orphan_silence_s = orphan_silence_s
        self.view = ClusterView()
        self.log = get_logger(peer_id=peer_id)
        self.telemetry = telemetry
        self.security = Security(keys, self.log)
        self._requests: dict[str, InFlight] = {}  # by first id
        self._attempts: dict[str, str] = {}  # attempt id -> first id
        self._replies: dict[str, asyncio.Future[wire.SubmitReply]] = {}
        self._hello_again_at = -HELLO_AGAIN_S  # the last HELLO said for a refusal (monotonic)
        self._tasks: list[asyncio.Task] = []
        self._chores: set[asyncio.Task] = set()  # held so they are not collected mid-flight
        self._watched_orphans: set[str] = set()  # attempt ids: one watchdog each

    async def start(self) -> None:
        self.context = zmq.asyncio.Context()
        self.security.start(self.context)
        self.scheduler = self.security.client(self.context.socket(zmq.DEALER))
        self.scheduler.setsockopt(zmq.LINGER, 0)
        self.scheduler.setsockopt(zmq.MAXMSGSIZE, wire.MAX_MESSAGE_BYTES)
        set_routing_id(self.scheduler, self.peer_id)  # the same across reconnects (docstring)
        # (Before the connect: its first connection's events are of no interest, but must not
        # be missed either.)
        self._monitor = self.scheduler.get_monitor_socket(
            zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
        )
        connect(self.scheduler, self.scheduler_address)
        self.stream = self.security.server(self.context.socket(zmq.PULL))
        self.stream.setsockopt(zmq.LINGER, 0)
        self.stream.setsockopt(zmq.MAXMSGSIZE, wire.MAX_MESSAGE_BYTES)
        self.stream.setsockopt(zmq.RCVHWM, 100_000)
        bind(self.stream, self.stream_bind, "stream_address")
        await self._hello()
        self._tasks = [
            asyncio.create_task(self._read_scheduler()),
            asyncio.create_task(self._read_stream()),
            asyncio.create_task(self._watch_scheduler()),
            asyncio.create_task(self._watch_link()),
        ]

    async def close(self) -> None:
        """Stops the readers, and the chores (resumptions, stream ends awaited, orphans
        watched) before the sockets close: one left running failed later on a closed socket,
        an exception never retrieved. (Chores start only from the readers and from chores, and
        a cancelled one starts none.)"""
        tasks = [*self._tasks, *self._chores]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._monitor.close(linger=0)
        self.scheduler.close(linger=0)
        self.stream.close(linger=0)
        self.security.stop()
        self.context.term()

    @property
    def ready(self) -> bool:
        fresh = time.monotonic() - self.view.received_at < self.status_timeout_s
        return fresh and self.view.num_prefill > 0 and self.view.num_decode > 0

    async def _hello(self) -> None:
        await wire.async_send(
            self.scheduler,
            wire.Hello(
                schema_version=wire.SCHEMA_VERSION,
                role="gateway",
                peer_id=self.peer_id,
                model=self.model,
                address=self.stream_address,
                num_kv_blocks=0,
                block_size=0,
                max_num_seqs=0,
            ),
        )

    # -- requests -----------------------------------------------------------------------------

    async def submit(
        self, submit: wire.Submit, timeout_s: float = SUBMIT_ANSWER_S
    ) -> asyncio.Queue:
        """Queues a request; returns the queue its TokenDeltas arrive on. Raises SubmitRefused."""
        request_id = submit.request_id
        inflight = InFlight(submit, asyncio.Queue(), request_id)
        self._requests[request_id] = inflight
        self._attempts[request_id] = request_id
        try:
            await self._send_submit(submit, timeout_s)
        except BaseException:
            self._drop(request_id, "submit failed")  # (`_send_submit` called off the first)
            raise
        return inflight.queue

    async def _send_submit(self, submit: wire.Submit, timeout_s: float) -> None:
        """Sends a SUBMIT and waits for its answer. A resumption is not held to the pending
        submits' bound: the scheduler never refuses one for load either (its request was
        admitted once), and a refusal here would fail a stream its client is reading."""
        if submit.resumed_from is None and len(self._replies) >= self.max_pending_submits:
            raise SubmitRefused(
                429, f"{len(self._replies)} requests are awaiting admission; retry shortly", 1.0
            )
        reply_future = asyncio.get_running_loop().create_future()
        self._replies[submit.request_id] = reply_future
        try:
            async with asyncio.timeout(timeout_s):  # (wait_for could swallow a cancel)
                await wire.async_send(self.scheduler, submit)
                reply = await reply_future
        except TimeoutError:
            # The scheduler may have queued it and be late answering (a flood of submits): a
            # request its client was told failed must not run, nor run twice when retried.
            self._send_cancel(submit.request_id, "submit not answered")
            raise SubmitRefused(503, "the scheduler did not answer", 1.0, answered=False) from None
        except asyncio.CancelledError:
            # The caller left (its client gone) with the SUBMIT sent, or perhaps sent: once
            # admitted it must not run for nobody (a cancel of a request unknown is ignored).
            self._send_cancel(submit.request_id, "caller gone")
            raise
        finally:
            self._replies.pop(submit.request_id, None)
        if not reply.accepted:
            if reply.status_code == 400 and UNKNOWN_GATEWAY_MARKER in (reply.message or ""):
                # A restarted scheduler that has not heard this gateway's HELLO yet (it is
                # said after `status_timeout_s` of silence): say it now, once for the crowd
                # of submits sent before it; the refusal is one of the moment, as when no
                # worker is registered.
                if time.monotonic() - self._hello_again_at > HELLO_AGAIN_S:
                    self._hello_again_at = time.monotonic()
                    await self._hello()
                raise SubmitRefused(503, "the scheduler restarted; retry shortly", 1.0)
            raise refusal(reply)

    async def cancel(self, request_id: str, reason: str) -> None:
        inflight = self._drop(request_id, reason)
        if inflight is not None and inflight.attempt_id == request_id:
            self._send_cancel(request_id, reason)  # (a later attempt's, `_drop` called off)

    def _send_cancel(self, request_id: str, reason: str) -> None:
        """A CANCEL sent without waiting. With the scheduler unreachable long enough the
        socket's queue (SNDHWM, 1,000 messages) fills, and a send that waited would hang its
        handler until the scheduler returned; so it is dropped then, and logged (a SUBMIT
        queued before it may then run for nobody once the scheduler is back)."""
        if not wire.send_or_drop(self.scheduler, wire.Cancel(request_id=request_id, reason=reason)):
            self.log.warning("cancel dropped: the scheduler's queue is full", request_id=request_id)

    def finished(self, request_id: str) -> None:
        """The handler saw the last delta; later deltas (none expected) are dropped."""
        self._drop(request_id)

    def _drop(self, request_id: str, reason: str = "finished") -> InFlight | None:
        """Forgets a request. An attempt a resumption started for it, unless its stream has
        ended, is called off: nothing else would stop it running for nobody (a cancel of a
        request the scheduler does not hold is ignored)."""
        inflight = self._requests.pop(request_id, None)
        if inflight is not None:
            self._attempts.pop(inflight.attempt_id, None)
            if inflight.attempt_id != request_id and not inflight.ended:
                self._send_cancel(inflight.attempt_id, reason)
        return inflight

    # -- resuming a request whose worker was lost -----------------------------------------------

    def _resume(
        self, inflight: InFlight, reason: str, counted: bool = True, abandon: str | None = None
    ) -> None:
        """A new attempt from the tokens the handler has. Only losses count toward the bound:
        a preempted request comes back with at least one more token each time. `abandon`: an
        attempt still running that must stop first (its stream lost tokens). The new attempt
        is the request's from this moment (no await before): a resumption still submitting an
        older one sees it has been taken over."""
        if abandon is not None:
            self._send_cancel(abandon, reason)
        if counted and inflight.num_resumes >= MAX_RESUMES:
            self._fail(inflight, f"{reason}; given up after {MAX_RESUMES} resumptions")
            return
        inflight.num_resumes += counted
        submit = self._next_attempt(inflight)
        self.telemetry.resumed(
            inflight.submit.request_id, submit.request_id, len(inflight.token_ids), reason
        )
        self._start_chore(self._submit_attempt(inflight, submit, reason))

    def _next_attempt(self, inflight: InFlight) -> wire.Submit:
        """The SUBMIT of a new attempt from the tokens the handler has, made the request's. Its
        id (`<first id>~<n>`) is one the request never used: an earlier attempt's late deltas,
        or late answer, cannot be taken for its."""
        first_id = inflight.submit.request_id
        previous, attempt_id = inflight.attempt_id, f"{first_id}~{inflight.num_attempts}"
        inflight.num_attempts += 1
        inflight.attempt_id = attempt_id
        inflight.num_tokens_before_attempt = len(inflight.token_ids)
        self._attempts[attempt_id] = first_id
        sampling = inflight.submit.sampling
        if inflight.token_ids and sampling.prompt_logprobs is not None:
            # They came with the first token: the new attempt need not compute them again.
            sampling = dataclasses.replace(sampling, prompt_logprobs=None)
        return dataclasses.replace(
            inflight.submit,
            request_id=attempt_id,
            sampling=sampling,
            output_token_ids=list(inflight.token_ids),
            resumed_from=previous,
            arrival_time=time.time(),
        )

    async def _submit_attempt(self, inflight: InFlight, submit: wire.Submit, reason: str) -> None:
        """Submits a resumed attempt, asking again while no worker can take it (503s) within
        `RESUME_PATIENCE_S`. Each wait may end with the attempt no longer the request's: its
        client left (cancelled), or a newer resumption took over (the scheduler restarted
        meanwhile). Then this one stops, and calls off what it submitted. A SUBMIT left
        unanswered was called off, and its answer may come late, while the next one waits for
        its own: that one is a new attempt, whose answer the late one cannot be taken for (the
        same id, a late acceptance settled a refused SUBMIT, and the request waited for an
        attempt nobody ran; a token of the first could mix into the second's stream)."""
        attempt_id = submit.request_id
        deadline = time.monotonic() + RESUME_PATIENCE_S
        while self._is_current(inflight, attempt_id):
            try:
                await self._send_submit(submit, RESUBMIT_ANSWER_S)
            except SubmitRefused as refused:
                if not self._is_current(inflight, attempt_id):
                    return  # (a 503 for no answer: `_send_submit` called it off)
                # 503: no worker registered just now (a restarted one may be on its way back).
                if refused.status_code != 503 or time.monotonic() > deadline:
                    self._fail(inflight, f"{reason}; could not resume it: {refused.message}")
                    return
                if not refused.answered:
                    self._attempts.pop(attempt_id, None)  # its late deltas are dropped from now on
                    submit = self._next_attempt(inflight)
                    self.log.warning("resumption unanswered", request_id=attempt_id,
                                     next_attempt=submit.request_id)  # fmt: skip
                    attempt_id = submit.request_id
                # (No later than the patience's end: a 503 may ask for up to an hour.)
                left_s = max(0.0, deadline - time.monotonic())
                await asyncio.sleep(min(refused.retry_after_s or 1.0, left_s))
                continue
            if not self._is_current(inflight, attempt_id):
                self._send_cancel(attempt_id, "superseded")
            return

    def _is_current(self, inflight: InFlight, attempt_id: str) -> bool:
        """Whether the request is still in flight and this attempt is the one running it."""
        in_flight = self._requests.get(inflight.submit.request_id) is inflight
        return in_flight and inflight.attempt_id == attempt_id

    def _on_scheduler_restart(self) -> None:
        """A new scheduler knows nothing of the requests the old one held. Those whose attempt
        brought tokens are decoding on a worker, which goes on streaming them; the others (a
        resumed attempt too, whatever tokens came before it) may have been in its queue, lost
        with it: they are resumed, their old attempts called off. One still prefilling, or
        holding a decode reservation, ran on for nobody (its tokens dropped): the new scheduler
        keeps a cancel of an id it does not know for a heartbeat timeout, and tells the worker
        that then lists it to let it go (`services/scheduler/adopted.py`). Not those whose
        stream ended (a failure without tokens the handler has yet to read: nothing would call
        off their new attempt), nor those whose first SUBMIT is still unanswered: its answer
        (or its timeout, a 503 that calls it off) tells their handlers what became of them,
        and an attempt of theirs running meanwhile would be one the handlers never hear of.
        Those decoding are watched, in case their worker dies unseen (`_watch_orphan`)."""
        waiting: list[InFlight] = []
        orphans: list[InFlight] = []
        for inflight in self._requests.values():
            if not (inflight.ended or self._awaits_answer(inflight.submit.request_id)):
                (orphans if inflight.attempt_has_tokens else waiting).append(inflight)
        self.log.warning("scheduler restarted", resuming=len(waiting), orphans=len(orphans))
        for inflight in waiting:
            self._attempts.pop(inflight.attempt_id, None)
            self._resume(inflight, "the scheduler restarted", abandon=inflight.attempt_id)
        self._watch_orphans(orphans, "the scheduler restarted")

    def _watch_orphans(self, orphans: list[InFlight], after: str) -> None:
        """Watches each attempt for silence (`_watch_orphan`), unless it is watched already (an
        earlier restart's, or cut's)."""
        for inflight in orphans:
            if inflight.attempt_id not in self._watched_orphans:
                self._watched_orphans.add(inflight.attempt_id)
                self._start_chore(self._watch_orphan(inflight, inflight.attempt_id, after))

    def _awaits_answer(self, request_id: str) -> bool:
        """Whether the SUBMIT's answer is for its handler to take: it has yet to come, or was
        a refusal. An answer read in the same go as what follows it has not reached its
        handler yet (it is in `_replies` still): an acceptance was by a scheduler whose queue
        went with it, and the request is resumed as any other queued there."""
        reply = self._replies.get(request_id)
        if reply is None:
            return False
        return not reply.done() or reply.cancelled() or not reply.result().accepted

    async def _watch_orphan(self, inflight: InFlight, attempt_id: str, after: str) -> None:
        """Resumes an orphaned attempt once its tokens stop for `orphan_silence_s`: its worker
        died before the new scheduler could adopt it, or the loss was told before this
        gateway's HELLO reached it (or, `after` a cut of the link, while the link was dying).
        Ends with the attempt (ended, resumed, cancelled)."""
        try:
            num_seen = await self._await_silence(inflight, attempt_id, self.orphan_silence_s)
        finally:
            self._watched_orphans.discard(attempt_id)
        if num_seen is None:
            return
        del self._attempts[attempt_id]  # its late deltas are dropped from now on
        self.log.warning("orphaned stream silent", request_id=attempt_id, num_tokens=num_seen)
        reason = f"no token for {self.orphan_silence_s:g} s after {after}"
        self._resume(inflight, reason, abandon=attempt_id)

    def _start_chore(self, coroutine: Coroutine) -> None:
        task = asyncio.create_task(coroutine)
        self._chores.add(task)
        task.add_done_callback(self._chores.discard)

    def _fail(self, inflight: InFlight, error: str) -> None:
        if self._requests.get(inflight.submit.request_id) is inflight:
            delta = wire.TokenDelta(
                request_id=inflight.attempt_id, token_ids=[], finish_reason="error", error=error
            )
            inflight.queue.put_nowait(delta)

    # -- a stream whose end was lost ------------------------------------------------------------

    def _on_stream_ended(self, ended: wire.StreamEnded) -> None:
        if ended.output_length < 0:
            length = ended.output_length
            self.log.warning("dropped a negative stream end", request_id=ended.request_id,
                             output_length=length)  # fmt: skip
            return
        inflight = self._current(ended.request_id)
        if inflight is not None and not inflight.ended:
            self._start_chore(self._await_stream_end(inflight, ended))

    async def _await_stream_end(self, inflight: InFlight, ended: wire.StreamEnded) -> None:
        """Waits for the stream's end while its tokens still come; then takes it as lost."""
        num_seen = await self._await_silence(inflight, ended.request_id, self.stream_end_grace_s)
        if num_seen is None:
            return
        del self._attempts[ended.request_id]  # its late deltas are dropped from now on
        self.log.warning("stream end lost", request_id=ended.request_id, num_tokens=num_seen,
                         output_length=ended.output_length)  # fmt: skip
        if num_seen < ended.output_length:
            reason = f"the stream's last tokens were lost ({num_seen} of {ended.output_length})"
            self._resume(inflight, reason)
        elif ended.finish_reason in ("stop", "length"):  # only the finish was lost
            inflight.ended = True
            logprobs = inflight.submit.sampling.logprobs
            finish = wire.TokenDelta(
                request_id=ended.request_id,
                token_ids=[],
                logprobs=None if logprobs is None else [],
                top_logprobs=[] if logprobs else None,
                finish_reason=ended.finish_reason,
                index=num_seen,
            )
            inflight.queue.put_nowait(finish)
        else:
            self._fail(inflight, f"its worker ended it ({ended.finish_reason}); why was lost")

    async def _await_silence(
        self, inflight: InFlight, attempt_id: str, silence_s: float
    ) -> int | None:
        """Waits until the attempt brings no token for `silence_s` (looked at every `silence_s`:
        from one to two of them pass); then the number of tokens the handler has. None if it
        ended first, or moved on (resumed, cancelled)."""
        num_seen = -1
        while len(inflight.token_ids) != num_seen:
            num_seen = len(inflight.token_ids)
            await asyncio.sleep(silence_s)
            if inflight.ended or self._current(attempt_id) is not inflight:
                return None
        return num_seen

    def _current(self, attempt_id: str) -> InFlight | None:
        """The request this attempt runs, if it is the attempt now running it."""
        first_id = self._attempts.get(attempt_id)
        inflight = self._requests.get(first_id) if first_id is not None else None
        return inflight if inflight is not None and inflight.attempt_id == attempt_id else None

    # -- readers ------------------------------------------------------------------------------

    async def _read_scheduler(self) -> None:
        while True:
            frames = await self.scheduler.recv_multipart(copy=False)
            try:
                message = wire.decode(frames)
            except wire.WireError as error:
                self.log.warning("dropped malformed message", error=str(error))
                continue
            match message:
                case wire.SubmitReply():
                    future = self._replies.get(message.request_id)
                    if future is not None and not future.done():
                        future.set_result(message)
                case wire.ClusterStatus():
                    if self.view.scheduler_epoch not in ("", message.scheduler_epoch):
                        self._on_scheduler_restart()
                    self.view = ClusterView(
                        num_prefill=message.num_prefill,
                        num_decode=message.num_decode,
                        num_queued=message.num_queued,
                        num_in_flight=message.num_in_flight,
                        num_decode_free_blocks=message.num_decode_free_blocks,
                        num_decode_total_blocks=message.num_decode_total_blocks,
                        max_decode_pool_tokens=message.max_decode_pool_tokens,
                        num_swap_preemptions=message.num_swap_preemptions,
                        num_recompute_preemptions=message.num_recompute_preemptions,
                        policy=message.policy,
                        max_queue_wait_s=message.max_queue_wait_s,
                        service=message.service,
                        workers=message.workers,
                        scheduler_metrics_address=message.scheduler_metrics_address,
                        scheduler_epoch=message.scheduler_epoch,
                        received_at=time.monotonic(),
                    )
                case wire.Tokens():
                    self._route(message)
                case wire.StreamEnded():
                    self._on_stream_ended(message)
                case wire.HelloAck():
                    if not message.accepted:
                        self.log.error("scheduler refused this gateway", error=message.error)
                case _:
                    self.log.warning("dropped unexpected message", type=type(message).__name__)

    async def _read_stream(self) -> None:
        while True:
            frames = await self.stream.recv_multipart(copy=False)
            try:
                message = wire.decode(frames)
            except wire.WireError as error:
                self.log.warning("dropped malformed stream message", error=str(error))
                continue
            if isinstance(message, wire.Tokens):
                self._route(message)
            else:
                self.log.warning("dropped unexpected stream message", type=type(message).__name__)

    def _route(self, tokens: wire.Tokens) -> None:
        for delta in tokens.deltas:
            inflight = self._current(delta.request_id)
            if inflight is None:
                continue  # finished, cancelled, or an abandoned attempt
            if inflight.ended:
                # Its finish came before: nothing follows it (a loss leaves nothing to resume),
                # and an attempt this started (a hole, a bad id) ran for nobody: its handler,
                # done, has `finished` call nothing off.
                continue
            if delta.finish_reason in ("lost", "preempted"):
                del self._attempts[delta.request_id]  # its late deltas are dropped from now on
                reason = delta.error or delta.finish_reason
                self._resume(inflight, reason, counted=delta.finish_reason == "lost")
                continue
            bad_id = _negative_token_id(delta)
            if bad_id is not None:  # a bug or a foreign peer: no text, no logprob holds it
                self.log.error("negative token id", request_id=delta.request_id, token_id=bad_id)
                del self._attempts[delta.request_id]  # its late deltas are dropped from now on
                self._send_cancel(delta.request_id, "negative token id")
                self._fail(inflight, f"a worker sent token id {bad_id}, which is no token")
                continue
            try:
                fresh = after(delta, len(inflight.token_ids))
            except ValueError as gap:  # a bug or a foreign peer: this attempt cannot be trusted
                self.log.error("tokens missing", request_id=delta.request_id, error=str(gap))
                del self._attempts[delta.request_id]
                self._resume(inflight, f"tokens missing: {gap}", abandon=delta.request_id)
                continue
            if fresh is not None:
                inflight.token_ids.extend(fresh.token_ids)
                inflight.ended = fresh.finish_reason is not None
                inflight.queue.put_nowait(fresh)

    async def _watch_link(self) -> None:
        """Takes the link back to the scheduler after a cut (`_on_link_back`): a handshake on
        a new connection after the last one was lost. (A scheduler that restarted is one too:
        it hears this gateway's HELLO at once, not after the status' silence.)"""
        was_cut = False
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())["event"]
            if event == zmq.EVENT_DISCONNECTED:
                was_cut = True
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED and was_cut:
                was_cut = False
                await self._on_link_back()

    async def _on_link_back(self) -> None:
        """What the scheduler sent while the link was down comes now (it held it), but not
        what the dying connection swallowed: an attempt decoding may have lost its "lost" word
        there, and is watched as an orphan. Says HELLO at once (to a scheduler that restarted
        meanwhile: its refusals of SUBMITs from a stranger would come until then)."""
        decoding = [i for i in self._requests.values() if not i.ended and i.attempt_has_tokens]
        self.log.warning("scheduler link back after a cut", watched=len(decoding))
        await self._hello()
        self._watch_orphans(decoding, "the link to the scheduler was cut")

    async def _watch_scheduler(self) -> None:
        """Says HELLO again whenever the scheduler's status goes quiet (it may have restarted)."""
        while True:
            await asyncio.sleep(self.status_timeout_s / 2)
            if time.monotonic() - self.view.received_at > self.status_timeout_s:
                await self._hello()
