"""`tandem prefill`: the prefill worker.

It takes PREFILL_JOBs from the scheduler into its engine, which batches and chunks prompts under
the step's token budget. When a prompt completes, the engine samples the first token, which goes
to the gateway at once (the time to first token), and the sequence's blocks are retained: their
K/V is copied out, the blocks freed, and the copy sent to the decode worker the scheduler named.
The copy is kept alive until the decode worker acknowledges; then the scheduler is told the
prefill phase is over. A transfer not acknowledged in time is abandoned and reported, so the
scheduler re-routes the request. A request that finishes at its first token (end of sequence, or
max_tokens of 1) ends here.

A speculative job (`await_grant`: sent while the decode worker's reservation was in flight) runs
and streams its first token the same way, but its KV stays here until the scheduler's
PREFILL_GRANT (which says how many leading blocks the decode worker holds) or a CANCEL.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
from dataclasses import dataclass

import zmq

from services.worker.config import WorkerConfig
from services.worker.loop import WorkerLoop
from services.worker.peer_sockets import PeerSockets
from services.worker.streams import group_by_gateway
from shared import wire
from shared.config import add_config_arguments, config_from_args
from shared.engine.engine import RequestOutput
from shared.engine.sampling_params import SamplingParams
from shared.errors import InvalidRequestError
from shared.lifecycle import PrefillEvents
from shared.logs import configure_logging
from shared.wire_convert import sampling_params, token_delta

# KV messages queued for one decode worker before a send fails at once (each holds a prompt's
# whole KV): one that cannot be reached must not gather them without bound, nor, past the
# queue's bound, block this worker's loop in a send.
KV_SEND_QUEUE = 16


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, WorkerConfig)


def run(args: argparse.Namespace) -> int:
    configure_logging("prefill")
    config = config_from_args(WorkerConfig, args)
    PrefillWorker(config).serve_forever()
    return 0


def _encoded(message: wire.KvTransfer) -> tuple[wire.KvTransfer, list]:
    """The transfer as sent, and its frames. Its first delta repeated with its prompt's logprobs
    (megabytes) may pass a header's bound that the delta alone kept (`_stream_first_tokens`),
    with the prompt's ids beside it: then the KV goes without the repeat, and a gateway the first
    copy missed, or reached after the decode worker's tokens, resumes the request (a gap in its
    tokens). Without a repeat it stays whole or is resumed; with one stripped of the scores it
    could lose them unsaid; failing the transfer ended a request served a little shorter."""
    try:
        return message, wire.encode(message)
    except wire.WireError:
        first = message.first_delta
        if first is None or first.prompt_logprobs is None:
            raise
    message = dataclasses.replace(message, first_delta=None)
    return message, wire.encode(message)


def first_token_params(params: SamplingParams, num_output: int) -> SamplingParams:
    """The request's sampling for the one token sampled here (the decode worker generates the
    rest); a resumed request's `num_output` earlier tokens count toward its min_tokens."""
    unmet = max(params.min_tokens - num_output, 0)
    return dataclasses.replace(params, max_tokens=1, min_tokens=min(unmet, 1))


# A prompt's job, its step output and its first token's delta, between prefill and hand-on.
FirstToken = tuple[wire.PrefillJob, RequestOutput, wire.TokenDelta]


@dataclass
class RunningJob:
    job: wire.PrefillJob
    started_at: float  # monotonic
    registration: int = 0  # the worker's registration with the scheduler it was accepted under


@dataclass
class PendingTransfer:
    job: wire.PrefillJob
    message: wire.KvTransfer  # holds the K/V copy alive until the ack
    deadline: float
    num_output_tokens: int
    sent_at: float  # monotonic
    registration: int = 0  # the worker's registration with the scheduler its job came under


class PrefillWorker(WorkerLoop):
    role = "prefill"
    events_class = PrefillEvents
    peer_messages = (wire.KvAck,)  # from the decode workers it sends KV to
    events: PrefillEvents

    def __init__(self, config: WorkerConfig, context: zmq.Context | None = None):
        super().__init__(
            config,
            context,
            address=None,
            retain_finished=True,
            step_time_target_s=config.step_time_target_s,
        )
        self.jobs: dict[str, RunningJob] = {}
        self.transfers: dict[str, PendingTransfer] = {}
        # Speculative jobs: grants that came while the prefill ran (leading blocks to skip),
        # and finished prefills whose KV waits for its grant.
        self.grants: dict[str, int] = {}
        self.awaiting_grant: dict[str, tuple[wire.PrefillJob, RequestOutput, wire.TokenDelta]] = {}
        # Closed idle only while no job of this worker's names the address (`_close_idle`).
        self.decode_sockets = PeerSockets(
            self._open_decode_socket,
            config.peer_socket_idle_s,
            self.poller,  # for KV_ACKs
        )
        self._num_cached: dict[str, int] = {}  # prompt tokens the cache spared, until reported
        # Per decode address with a socket (monotonic): when it was opened, and last acked.
        self._opened_at: dict[str, float] = {}
        self._last_ack_at: dict[str, float] = {}
        self._reading: zmq.Socket | None = None  # the socket `_drain` reads

    # -- messages -----------------------------------------------------------------------------

    def _handle(self, message: wire.Message, identity: bytes | None) -> None:
        match message:
            case wire.PrefillJob():
                self._accept_job(message)
            case wire.Cancel():
                self._cancel(message.request_id, message.reason)
            case wire.KvAck():
                self._on_ack(message)
            case wire.PrefillGrant():
                self._on_grant(message)
            case _:
                self.log.warning("dropped unexpected message", type=type(message).__name__)

    def _accept_job(self, job: wire.PrefillJob) -> None:
        if job.request_id in self.held_request_ids():
            self._cancel(job.request_id, "dispatched again")  # the new attempt replaces the old
        unreachable = self.streams.check(job.gateway_address) or self._check_decode(
            job.decode_address
        )
        if unreachable is not None:
            self.log.warning("prefill job refused", request_id=job.request_id, error=unreachable)
            self._fail(job, unreachable)
            return
        try:
            params = sampling_params(job.sampling)
            if len(job.output_token_ids) >= params.max_tokens:
                self._end_at_max_tokens(job)
                return
            self.engine.add_request(
                list(job.prompt_token_ids) + list(job.output_token_ids),
                first_token_params(params, len(job.output_token_ids)),
                job.request_id,
                priority=job.priority,
                cache_salt=None if self.config.share_prefix_cache else job.cache_salt,
                num_generated=len(job.output_token_ids),  # a constraint replays them
                bulk=job.bulk,
            )
        except InvalidRequestError as error:
            self.log.warning("prefill job refused", request_id=job.request_id, error=str(error))
            self._fail(job, str(error))
            return
        started_at = self.events.prefill_started(job.request_id, len(job.prompt_token_ids))
        self.jobs[job.request_id] = RunningJob(job, started_at, self._registration)

    def _end_at_max_tokens(self, job: wire.PrefillJob) -> None:
        """A resumed job whose earlier output already holds max_tokens tokens (its stream's
        end was lost) ends at once, "length", where its output ends: prefilled, it would get
        one token more than its client asked for."""
        output_length = len(job.output_token_ids)
        end = wire.TokenDelta(request_id=job.request_id, token_ids=[], finish_reason="length",
                              index=output_length)  # fmt: skip
        self.streams.send({job.gateway_address: [end]})
        self._report(job, "length", 0, output_length)

    def _cancel(self, request_id: str, reason: str) -> None:
        self.engine.abort(request_id)  # its retained KV too, if it was waiting for a grant
        self._num_cached.pop(request_id, None)
        self.jobs.pop(request_id, None)
        self.transfers.pop(request_id, None)
        self.grants.pop(request_id, None)
        self.awaiting_grant.pop(request_id, None)
        self.log.info("prefill cancelled", request_id=request_id, reason=reason)

    def _on_registered_again(self) -> None:
        """No grant will come for a job of the old registration: its KV (parked, or still being
        computed) is let go, and its gateway told the attempt is lost, which resumes it from
        the tokens it has (under a new id), and the scheduler cancels its decode worker's
        reservation (`_cancel_at_scheduler`). Jobs whose room was confirmed go on: their
        decode worker expects their KV, and streams on."""
        super()._on_registered_again()
        orphans = [parked[0] for parked in self.awaiting_grant.values()]
        orphans += [
            running.job
            for running in self.jobs.values()
            if running.job.await_grant and running.job.request_id not in self.grants
        ]
        reason = "the prefill worker registered again: no grant for its KV would come"
        for job in orphans:
            self._cancel(job.request_id, reason)
            self._lost_at_gateway(job, reason)
            self._cancel_at_scheduler(job, reason)

    def _lost_at_gateway(self, job: wire.PrefillJob, reason: str) -> None:
        """Tells the job's gateway the attempt is lost: it resumes the request from the tokens
        it has (the scheduler, which would have told it, does not know the request)."""
        lost = wire.TokenDelta(request_id=job.request_id, token_ids=[],
                               finish_reason="lost", error=reason)  # fmt: skip
        self.streams.send({job.gateway_address: [lost]})

    def _cancel_at_scheduler(self, job: wire.PrefillJob, reason: str) -> None:
        """Asks the scheduler to cancel an attempt of an earlier registration that ended here:
        its decode worker still holds its reservation, which that worker lists to the scheduler
        (a restarted one adopts it), and would hold it for nobody until its lease ran out
        (minutes). A report does not do: the decode worker lists the id a heartbeat after it
        registers again, mostly after this worker's word, and a report on an id not listed is
        dropped, where a cancel waits for the listing (`adopted.py`). (A scheduler that
        dropped this worker gave the attempt up already, and ignores the cancel.)"""
        self.link.send(wire.Cancel(request_id=job.request_id, reason=reason))

    # -- the step -----------------------------------------------------------------------------

    def _step(self) -> None:
        outputs = self.engine.step()
        firsts: list[FirstToken] = []
        registrations: dict[str, int] = {}  # each first's job's (`RunningJob.registration`)
        for output in outputs:
            running = self.jobs.pop(output.request_id, None)
            if running is None:  # cancelled while its step ran
                self.engine.release(output.request_id)
                continue
            job = running.job
            registrations[job.request_id] = running.registration
            if output.error is not None:  # its grammar failed to compile, or its sampling
                self.engine.release(job.request_id)
                self.grants.pop(job.request_id, None)
                self._fail(job, output.error, running.registration)
                continue
            num_tokens = len(job.prompt_token_ids) + len(job.output_token_ids)
            self.events.prefill_finished(job.request_id, running.started_at, num_tokens)
            firsts.append((job, output, self._first_delta(job, output)))
        for job, output, delta in self._stream_first_tokens(firsts, registrations):
            self._hand_on(job, output, delta, registrations[job.request_id])

    def _stream_first_tokens(
        self, firsts: list[FirstToken], registrations: dict[str, int]
    ) -> list[FirstToken]:
        """Every first token goes out before any KV is copied out for its transfer: the step's
        last prompt does not wait for the copies of the others'. One carrying its prompt's
        logprobs (up to megabytes) goes in a message of its own, which a header bounds; past
        the bound its request ends here. The firsts that went out."""
        plain = [(job.gateway_address, d) for job, _, d in firsts if d.prompt_logprobs is None]
        self.streams.send(group_by_gateway(plain))
        sent = []
        for job, output, delta in firsts:
            try:
                if delta.prompt_logprobs is not None:
                    self.streams.send({job.gateway_address: [delta]})
            except wire.WireError as error:  # a huge prompt's scores
                self.engine.release(job.request_id)
                self.grants.pop(job.request_id, None)
                reason = f"its prompt logprobs cannot be sent: {error}"
                self._fail(job, reason, registrations[job.request_id])
                continue
            sent.append((job, output, delta))
        return sent

    def _first_delta(self, job: wire.PrefillJob, output: RequestOutput) -> wire.TokenDelta:
        """The first token's delta, with the prompt tokens the cache spared."""
        num_cached = self.engine.retained(job.request_id).num_cached_tokens
        self._num_cached[job.request_id] = num_cached
        reason = None
        if output.finish_reason == "stop":
            reason = "stop"
        elif len(job.output_token_ids) + 1 >= job.sampling.max_tokens:
            reason = "length"
        delta = token_delta(output, len(job.output_token_ids), reason)
        return dataclasses.replace(delta, num_cached_tokens=num_cached)

    def _hand_on(
        self,
        job: wire.PrefillJob,
        output: RequestOutput,
        delta: wire.TokenDelta,
        registration: int,
    ) -> None:
        """The KV goes to the decode worker (or waits for its grant), unless the request ended
        at its first token. `registration`: the one the job came under."""
        granted = self.grants.pop(job.request_id, None)  # (kept past its job, kept for good)
        if delta.finish_reason is not None:
            self.engine.release(job.request_id)
            num_made = len(delta.token_ids)
            output_length = len(job.output_token_ids) + num_made
            self._report(job, delta.finish_reason, num_made, output_length)
            if registration != self._registration:
                self._cancel_at_scheduler(job, "finished in prefill")
        elif job.await_grant and granted is None:
            self.awaiting_grant[job.request_id] = (job, output, delta)  # the KV awaits its grant
        else:
            if granted is not None:
                job = dataclasses.replace(job, num_skip_blocks=granted)
            self._send_kv(job, output, delta, registration)

    def _send_kv(
        self,
        job: wire.PrefillJob,
        output: RequestOutput,
        delta: wire.TokenDelta,
        registration: int,
    ) -> None:
        """`registration`: the one the job came under (a job accepted before the worker
        registered again may be prefilled after)."""
        seq = self.engine.retained(job.request_id)
        # The decode worker holds the leading blocks already (pinned when it reserved).
        # (A negative count from a faulty peer skips nothing: the whole KV goes.)
        first_block = min(
            max(0, job.num_skip_blocks), seq.num_computed_tokens // self.config.block_size
        )
        keys, values = self.engine.export_kv(job.request_id, first_block)
        generator = seq.generator.get_state() if seq.generator is not None else None
        self.engine.release(job.request_id)
        message = wire.KvTransfer(
            request_id=job.request_id,
            prompt_token_ids=job.prompt_token_ids,
            output_token_ids=list(job.output_token_ids) + list(output.new_token_ids),
            sampling=job.sampling,
            gateway_address=job.gateway_address,
            num_tokens=seq.num_computed_tokens,
            block_size=self.config.block_size,
            first_block=first_block,
            keys=keys,
            values=values,
            generator_state=generator,
            priority=job.priority,
            cache_salt=None if self.config.share_prefix_cache else job.cache_salt,
            bulk=job.bulk,
            first_delta=delta,
        )
        try:
            message, frames = _encoded(message)
        except wire.WireError as error:  # KV over a frame's bound (big models, long prompts)
            # Ended for good: any other worker would fail the same way (`_abandon`).
            self._fail(job, f"its KV cannot be sent: {error}", registration)
            return
        if not self._send_to_decode(job, frames):
            self.events.kv_failed(job.request_id, "unreachable", f"{KV_SEND_QUEUE} queued")
            reason = f"its decode worker is unreachable ({KV_SEND_QUEUE} KV messages queued)"
            self._handoff_failed(job, len(output.new_token_ids), registration, reason)
            return
        num_bytes = keys.numel() * keys.element_size() * 2
        sent_at = self.events.kv_sent(job.request_id, job.decode_peer_id, num_bytes)
        self.transfers[job.request_id] = PendingTransfer(
            job,
            message,
            time.monotonic() + self.config.transfer_timeout_s,
            len(output.new_token_ids),  # made here: a resumed attempt's given ones were not
            sent_at,
            registration,
        )

    def _send_to_decode(self, job: wire.PrefillJob, frames: list) -> bool:
        """Queues a KV message for the job's decode worker; False if its queue is full (the
        worker is unreachable or far behind: waiting would stop this worker's loop)."""
        if self._check_decode(job.decode_address) is not None:  # (reopens a socket dropped)
            return False
        try:
            self.decode_sockets[job.decode_address].send_multipart(
                frames, copy=False, flags=zmq.NOBLOCK
            )
        except zmq.Again:
            return False
        return True

    def _check_decode(self, address: str) -> str | None:
        """Why KV cannot be shipped to the decode worker at `address`, or None; connects to it
        if not connected."""
        opening = address not in self.decode_sockets
        refusal = self.decode_sockets.check(address)
        if refusal is not None:
            return f"the decode {refusal}"
        if opening:
            self._opened_at[address] = time.monotonic()
        return None

    def _open_decode_socket(self) -> zmq.Socket:
        sock = self.security.client(self.context.socket(zmq.DEALER))
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, wire.MAX_MESSAGE_BYTES)
        sock.setsockopt(zmq.SNDHWM, KV_SEND_QUEUE)
        return sock

    def _on_grant(self, grant: wire.PrefillGrant) -> None:
        """The decode worker's room is confirmed: the KV goes now, or when the prefill ends."""
        parked = self.awaiting_grant.get(grant.request_id)
        if parked is not None:
            job, output, delta = parked
            job = dataclasses.replace(job, num_skip_blocks=grant.num_skip_blocks)
            # Parked until shipped: were the shipping to raise, `_abandon` finds the job and
            # ends it at its gateway and the scheduler, which would otherwise never hear.
            # (Of this registration: those parked under an earlier one were let go.)
            self._send_kv(job, output, delta, self._registration)
            self.awaiting_grant.pop(grant.request_id, None)  # (a failed send may have let it go)
        elif grant.request_id in self.jobs:
            self.grants[grant.request_id] = grant.num_skip_blocks
        else:  # cancelled meanwhile, or finished at its first token
            self.log.debug("grant for a job not held", request_id=grant.request_id)

    def _drain(self, sock: zmq.Socket) -> None:
        """Notes the socket read: an ack heard on a decode worker's says the worker is alive
        even when its transfer was given up on already (`_on_ack`)."""
        self._reading = sock
        try:
            super()._drain(sock)
        finally:
            self._reading = None

    def _on_ack(self, ack: wire.KvAck) -> None:
        # Any ack, late or for an id never sent, is a sign of life of the worker it came from:
        # one whose acks all come past their deadlines is slow, not silent (`_silent_since`).
        address = self.decode_sockets.address_of(self._reading) if self._reading else None
        if address is not None:
            self._last_ack_at[address] = time.monotonic()
        transfer = self.transfers.pop(ack.request_id, None)
        if transfer is None:  # given up on (late: the scheduler re-routed it), or cancelled
            self.log.debug("ack for a transfer not held", request_id=ack.request_id)
            return
        if ack.ok:
            self.events.kv_acknowledged(ack.request_id, transfer.sent_at)
            self._report(transfer.job, None, transfer.num_output_tokens)
        else:
            self.events.kv_failed(ack.request_id, "refused", ack.error)
            self._transfer_failed(transfer, f"its decode worker refused the KV: {ack.error}")

    def held_request_ids(self) -> list[str]:
        return [*self.jobs, *self.awaiting_grant, *self.transfers]

    def _on_timers(self, now: float) -> None:
        """A transfer never acknowledged in time is abandoned: the scheduler re-routes it. If
        its decode worker acknowledged nothing since, its socket goes too, with what is queued
        in it (KV that socket would otherwise hold, and deliver stale should the worker come
        back); the next job naming the address opens a new one."""
        self._read_acks_of_transfers_due(now)
        for request_id, transfer in list(self.transfers.items()):
            if now > transfer.deadline:
                del self.transfers[request_id]
                self.events.kv_failed(request_id, "timeout", None)
                if self._silent_since(transfer):
                    self._drop_decode_socket(transfer.job.decode_address)
                self._transfer_failed(transfer, "its KV transfer was not acknowledged in time")

    def _read_acks_of_transfers_due(self, now: float) -> None:
        """Reads the acks waiting on the sockets of transfers past their deadline before they
        are given up on: the loop runs its timers after its step, and an ack that came in
        while the step ran (mostly before the deadline) was left unread, its request taken
        from the decode worker that had admitted it and resumed elsewhere."""
        due = {t.job.decode_address for t in self.transfers.values() if now > t.deadline}
        for address in due:
            if address in self.decode_sockets and self.decode_sockets[address].poll(0):
                self._drain(self.decode_sockets[address])

    def _transfer_failed(self, transfer: PendingTransfer, reason: str) -> None:
        self._handoff_failed(
            transfer.job, transfer.num_output_tokens, transfer.registration, reason
        )

    def _handoff_failed(
        self, job: wire.PrefillJob, num_output: int, registration: int, reason: str
    ) -> None:
        """Reported to the scheduler, which re-routes the request (its gateway resumes it).
        A job of an earlier registration (the scheduler restarted, or dropped this worker),
        whether its KV went before or after this worker registered again, is one the
        scheduler may not know, and whose report it may ignore: its gateway is told directly
        (or it waited for its watch of the streams the restart orphaned, a minute; the
        request timeout, an hour, before that watch), and its decode worker's reservation
        cancelled."""
        self._report(job, "error", num_output)
        if registration != self._registration:
            self._lost_at_gateway(job, reason)
            self._cancel_at_scheduler(job, reason)

    def _silent_since(self, transfer: PendingTransfer) -> bool:
        """The transfer went on its address's current socket, and nothing was acknowledged on
        it since (a transfer sent on a socket dropped since says nothing of the new one)."""
        address = transfer.job.decode_address
        opened = self._opened_at.get(address, math.inf)
        heard = self._last_ack_at.get(address, -math.inf)
        return opened <= transfer.sent_at and heard < transfer.sent_at

    def _drop_decode_socket(self, address: str) -> None:
        if address in self.decode_sockets:
            self.decode_sockets.discard(address)
            self.log.warning("dropped the socket of a silent decode worker", decode=address)
        self._opened_at.pop(address, None)
        self._last_ack_at.pop(address, None)

    def _report(
        self,
        job: wire.PrefillJob,
        finish_reason: str | None,
        num_output: int,
        output_length: int | None = None,
    ) -> None:
        """`output_length`: where the request's stream ended, when it ended here."""
        self.link.send(
            wire.RequestDone(
                request_id=job.request_id,
                peer_id=self.peer_id,
                phase="prefill",
                finish_reason=finish_reason,
                num_prompt_tokens=len(job.prompt_token_ids),
                num_output_tokens=num_output,
                num_cached_tokens=self._num_cached.pop(job.request_id, 0),
                output_length=output_length,
            )
        )

    def _fail(self, job: wire.PrefillJob, error: str, registration: int | None = None) -> None:
        """`registration`: the one the job came under, if not the current one's (a job of
        an earlier one has its decode reservation cancelled, as `_handoff_failed` has)."""
        delta = wire.TokenDelta(
            request_id=job.request_id, token_ids=[], finish_reason="error", error=error
        )
        self.streams.send({job.gateway_address: [delta]})
        # Not "error", which asks the scheduler to re-route: this request can never run.
        self._report(job, "rejected", 0, len(job.output_token_ids))
        if registration is not None and registration != self._registration:
            self._cancel_at_scheduler(job, error)

    def _abandon(self, message: wire.Message, identity: bytes | None, reason: str) -> None:
        """Ends the request for good, as a job that can never run (`_fail`): no other worker
        would fare better with the message that broke this one."""
        request_id = message.request_id  # type: ignore[attr-defined]
        held = self._held_job(request_id)
        if held is None and isinstance(message, wire.PrefillJob):
            held = message, self._registration
        self._cancel(request_id, reason)
        if held is not None:
            job, registration = held
            self._fail(job, reason, registration)

    def _held_job(self, request_id: str) -> tuple[wire.PrefillJob, int] | None:
        """The job this worker holds of the request, and the registration it came under."""
        if (running := self.jobs.get(request_id)) is not None:
            return running.job, running.registration
        if (parked := self.awaiting_grant.get(request_id)) is not None:
            return parked[0], self._registration  # (an earlier one's were let go)
        if (transfer := self.transfers.get(request_id)) is not None:
            return transfer.job, transfer.registration
        return None

    def _close_idle(self) -> None:
        super()._close_idle()
        in_use = {job.decode_address for job in self._jobs_held()}
        for address in self.decode_sockets.close_idle(in_use):
            self._opened_at.pop(address, None)
            self._last_ack_at.pop(address, None)
            self.log.info("closed an idle decode socket", decode=address)

    def _jobs_held(self) -> list[wire.PrefillJob]:
        """Every job whose KV is yet to ship or be acknowledged."""
        return [
            *(running.job for running in self.jobs.values()),
            *(parked[0] for parked in self.awaiting_grant.values()),
            *(transfer.job for transfer in self.transfers.values()),
        ]

    def _close(self) -> None:
        self.decode_sockets.close()
