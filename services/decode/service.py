"""`tandem decode`: the decode worker.

It owns a paged KV pool. The scheduler asks it to RESERVE blocks for a request before the prompt
is prefilled; the reservation is a lease that lapses if the KV does not arrive in time. When a
prefill worker's KV_TRANSFER arrives on the KV ROUTER socket, the K/V is written into the reserved
blocks, the sequence joins the running batch at the next step, and the prefill worker gets a
KV_ACK. Every step runs one token for every running sequence (iteration-level batching) and sends
each gateway one TOKENS message with its requests' new tokens. Finished sequences leave at once,
their blocks return to the pool, and the scheduler hears REQUEST_DONE.
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
from services.worker.streams import group_by_gateway
from shared import wire, wire_kv
from shared.binding import bind
from shared.config import ConfigError, add_config_arguments, config_from_args, expand_host
from shared.deltas import joined
from shared.engine.block_manager import NoFreeBlocksError
from shared.engine.sampling_params import remaining_params
from shared.engine.sequence import Sequence, SequenceStatus
from shared.errors import InvalidRequestError
from shared.lifecycle import DecodeEvents
from shared.logs import configure_logging
from shared.wire_convert import sampling_params, token_delta

# Characters of a refusal's reason a KV_ACK carries (a decode error can quote a long value).
MAX_REFUSAL_LEN = 1000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, WorkerConfig)


def run(args: argparse.Namespace) -> int:
    configure_logging("decode")
    config = config_from_args(WorkerConfig, args)
    if config.address is None:
        raise ConfigError("a decode worker needs --address / TANDEM_ADDRESS (its KV ROUTER)")
    DecodeWorker(config).serve_forever()
    return 0


@dataclass
class Reservation:
    block_ids: list[int]
    deadline: float
    num_cached_blocks: int = 0  # leading block_ids taken from the prefix cache: not sent
    # The salt the blocks are named by in this worker's cache: the request's (its tenant's, from
    # the scheduler), as the pinned prefix was looked up, never the transfer's. A prefill worker
    # that shares its cache between tenants sends none: its KV named by that would be missed by
    # the tenant's next turn and found by requests of no tenant.
    cache_salt: str | None = None
    # The worker's registration with the scheduler that reserved it: its KV may arrive after
    # the worker registered again, and the request is still the earlier scheduler's.
    registration: int = 0


@dataclass
class Route:
    gateway_address: str
    num_prompt_tokens: int
    num_output_tokens: int  # generated here
    num_output_before: int  # output tokens made before it came here (a prefill's first, ...)
    # Prefilled here (conditional disaggregation): its sequence, until its first token.
    local_sequence: Sequence | None = None
    # Prefilled elsewhere: the prefill worker's delta, streamed again ahead of the first here.
    repeat: wire.TokenDelta | None = None
    registration: int = 0  # the worker's registration with the scheduler it came under


def _first_delta_error(transfer: wire.KvTransfer) -> str | None:
    """The delta streamed again must be the output's last tokens, at their place: the gateway
    takes it as the truth where the prefill worker's copy never arrived."""
    first = transfer.first_delta
    if first is None:
        return None
    output = transfer.output_token_ids
    tail = list(output[len(output) - len(first.token_ids) :])  # a list, as the delta's ids
    if (
        first.request_id != transfer.request_id
        or not first.token_ids
        or first.token_ids != tail
        or first.index != len(transfer.output_token_ids) - len(first.token_ids)
        or first.finish_reason is not None
        or first.error is not None
    ):
        return "first_delta is not the output's last token at its place"
    return None


class DecodeWorker(WorkerLoop):
    role = "decode"
    events_class = DecodeEvents
    peer_messages = (wire.KvTransfer,)  # from prefill workers, on its KV socket
    binds_address = True  # that KV socket
    events: DecodeEvents

    def __init__(self, config: WorkerConfig, context: zmq.Context | None = None):
        advertised = expand_host(config.advertise_address) or config.address
        super().__init__(
            config,
            context,
            address=advertised,
            hand_back_recomputed=True,
            # A finished turn's blocks are the prefix of its conversation's next turn.
            finished_retention_s=config.think_time_retention_s,
        )
        self.blocks = self.engine.block_manager
        self.kv_socket = self.security.server(self.context.socket(zmq.ROUTER))
        self.kv_socket.setsockopt(zmq.MAXMSGSIZE, wire.MAX_MESSAGE_BYTES)
        self.kv_socket.setsockopt(zmq.LINGER, 0)
        bind(self.kv_socket, config.address, "address")
        self.add_socket(self.kv_socket, router=True)
        self.reservations: dict[str, Reservation] = {}
        self.routes: dict[str, Route] = {}

    # -- messages -----------------------------------------------------------------------------

    def _handle(self, message: wire.Message, identity: bytes | None) -> None:
        match message:
            case wire.Reserve():
                self._reserve(message)
            case wire.KvTransfer() if identity is not None:
                ack = self._admit(message)
                wire.send_to(self.kv_socket, identity, ack)
            case wire.PrefillJob():
                self._prefill_here(message)
            case wire.Cancel():
                self._cancel(message.request_id, message.reason)
            case _:
                self.log.warning("dropped unexpected message", type=type(message).__name__)

    def _reserve(self, reserve: wire.Reserve) -> None:
        ok = reserve.request_id not in self.reservations and reserve.request_id not in self.routes
        # A lease that is not a positive, finite time would never lapse (NaN compares false
        # with every clock reading): its blocks would be held for good.
        ok = ok and 0 < reserve.lease_s < math.inf
        # Preempted sequences resume before new ones are admitted: their blocks are not for hire.
        ok = ok and self.blocks.num_blocks_for(reserve.num_tokens) <= self.num_available_blocks()
        cached: list[int] = []
        if ok:
            # The full blocks of the KV about to arrive that this worker has cached (a previous
            # turn of the conversation) are pinned now: the prefill worker skips sending them.
            # Only blocks within the reservation's tokens: pinned past them, they were more than
            # the reservation holds, and leaked when allocating the rest raised.
            size = self.blocks.block_size
            num_known = min(len(reserve.token_ids), reserve.num_tokens)
            full = reserve.token_ids[: num_known // size * size]
            salt = self._salt(reserve.cache_salt)
            cached = self.engine.pin_cached_prefix(full, salt)
            try:
                num_new = self.blocks.num_blocks_for(reserve.num_tokens) - len(cached)
                block_ids = cached + self.blocks.allocate(num_new)
                self.reservations[reserve.request_id] = Reservation(
                    block_ids,
                    time.monotonic() + reserve.lease_s,
                    len(cached),
                    salt,
                    self._registration,
                )
            except NoFreeBlocksError:
                self.blocks.free(cached)
                cached, ok = [], False
        self.link.send(
            wire.ReserveReply(
                request_id=reserve.request_id,
                peer_id=self.peer_id,
                ok=ok,
                num_free_blocks=self.num_available_blocks(),
                num_cached_blocks=len(cached),
                attempt=reserve.attempt,
            )
        )

    def _prefill_here(self, job: wire.PrefillJob) -> None:
        """Conditional disaggregation: this worker holds the prompt's prefix (it pinned it at
        RESERVE) and computes the short rest itself, so no KV crosses the wire. The reservation
        is let go just before the engine takes the same cached blocks again by hash."""
        reservation = self.reservations.pop(job.request_id, None)
        if reservation is None:
            self._report(job.request_id, "prefill", "error", len(job.prompt_token_ids), 0)
            return
        # Its cached prefix stays protected as a finished turn's is (plain LRU, a reservation
        # taken before the engine admits the sequence evicted the very blocks it came for), and
        # the blocks stay its own in what this worker offers (`num_available_blocks`).
        retention = self.engine.config.finished_retention_s
        retain_until = self.engine.clock() + retention if retention > 0 else None
        self.blocks.free(reservation.block_ids, retain_until=retain_until)
        refusal = self.streams.check(job.gateway_address)
        num_output = len(job.output_token_ids)
        if refusal is None:
            # A resumed request's earlier tokens are computed with its prompt, as a prefill
            # worker computes them: the stream and max_tokens go on after them.
            try:
                params = sampling_params(job.sampling)  # (checked before max_tokens is read)
                if num_output >= params.max_tokens:
                    self._end_here_at_max_tokens(job)
                    return
                self.engine.add_request(
                    list(job.prompt_token_ids) + list(job.output_token_ids),
                    remaining_params(params, num_output),
                    job.request_id,
                    priority=job.priority,
                    cache_salt=self._salt(job.cache_salt),
                    num_generated=num_output,  # a constraint replays them, penalties count them
                    bulk=job.bulk,
                )
            except InvalidRequestError as error:
                refusal = str(error)
        if refusal is not None:
            self._refuse_here(job, refusal)
            return
        self.routes[job.request_id] = Route(
            job.gateway_address,
            len(job.prompt_token_ids),
            0,
            num_output_before=len(job.output_token_ids),
            local_sequence=self.engine.sequence(job.request_id),
            registration=self._registration,
        )
        self.events.local_prefill(job.request_id, len(job.prompt_token_ids))

    def _end_here_at_max_tokens(self, job: wire.PrefillJob) -> None:
        """A job whose earlier output already holds max_tokens tokens ends at once, "length",
        as a transfer at max_tokens does (`_end_at_max_tokens`): no token more."""
        num_prompt, output_length = len(job.prompt_token_ids), len(job.output_token_ids)
        self._end_at_length(job.request_id, job.gateway_address, num_prompt, output_length)

    def _refuse_here(self, job: wire.PrefillJob, refusal: str) -> None:
        """A prefill job this worker cannot run ends for good: an error to its gateway, and
        "rejected" to the scheduler."""
        delta = wire.TokenDelta(
            request_id=job.request_id, token_ids=[], finish_reason="error", error=refusal
        )
        self.streams.send({job.gateway_address: [delta]})
        num_prompt, output_length = len(job.prompt_token_ids), len(job.output_token_ids)
        self._report(job.request_id, "prefill", "rejected", num_prompt, 0, 0, output_length)

    def _report(
        self,
        request_id: str,
        phase: str,
        reason: str | None,
        num_prompt: int,
        num_output: int,
        num_cached: int = 0,
        output_length: int | None = None,
    ) -> None:
        """`output_length`: where the request's stream ended, when it ended here."""
        self.link.send(
            wire.RequestDone(
                request_id=request_id,
                peer_id=self.peer_id,
                phase=phase,
                finish_reason=reason,
                num_prompt_tokens=num_prompt,
                num_output_tokens=num_output,
                num_cached_tokens=num_cached,
                output_length=output_length,
            )
        )

    def _admit(self, transfer: wire.KvTransfer) -> wire.KvAck:
        request_id = transfer.request_id
        # Held in `reservations` until the engine owns its blocks: a failure in between
        # (`WorkerLoop._handle_guarded`) must find them to free them.
        reservation = self.reservations.get(request_id)
        error = self._transfer_error(transfer, reservation)
        if error is None and len(transfer.output_token_ids) >= transfer.sampling.max_tokens:
            return self._end_at_max_tokens(transfer)
        if error is None:
            first, num_blocks = transfer.first_block, transfer.keys.shape[1]
            # Blocks before `first` came from this worker's cache; blocks beyond the transferred
            # ones stay with the sequence for its next tokens.
            self.engine.kv_cache.write_blocks(
                reservation.block_ids[first : first + num_blocks], transfer.keys, transfer.values
            )
            try:
                self.engine.add_prefilled(
                    request_id,
                    list(transfer.prompt_token_ids),
                    list(transfer.output_token_ids),
                    sampling_params(transfer.sampling),
                    reservation.block_ids,
                    transfer.generator_state,
                    priority=transfer.priority,
                    cache_salt=reservation.cache_salt,
                    bulk=transfer.bulk,
                )
            except (InvalidRequestError, ValueError) as exc:
                error = str(exc)
            else:
                del self.reservations[request_id]  # its blocks are the sequence's now
        if error is not None:
            self.reservations.pop(request_id, None)
            if reservation is not None and request_id not in self.routes:
                self.blocks.free(reservation.block_ids)
            # No reservation is the usual end of a request cancelled while it prefilled (a stop
            # string in its first token, a client gone): no fault anywhere, so no warning.
            log = self.log.warning if reservation is not None else self.log.info
            log("kv refused", request_id=request_id, error=error)
            return wire.KvAck(request_id=request_id, ok=False, error=error)
        self.routes[request_id] = Route(
            transfer.gateway_address,
            len(transfer.prompt_token_ids),
            0,
            num_output_before=len(transfer.output_token_ids),
            repeat=transfer.first_delta,
            registration=reservation.registration,
        )
        num_bytes = transfer.keys.numel() * transfer.keys.element_size() * 2
        self.events.kv_received(request_id, transfer.num_tokens, num_bytes)
        return wire.KvAck(request_id=request_id, ok=True, error=None)

    def _end_at_max_tokens(self, transfer: wire.KvTransfer) -> wire.KvAck:
        """A transfer whose output already holds max_tokens tokens (its prefill worker should
        have ended it at its first token) ends here at once, "length", as the engine ends a
        sequence at max_tokens: decoded, it would get one token more than its client asked
        for. (Refused, its gateway would resume it from those tokens, and the next prefill
        would add that token.) Its first delta is streamed again, ending the stream."""
        request_id = transfer.request_id
        reservation = self.reservations.pop(request_id)
        self.blocks.free(reservation.block_ids)
        num_prompt, output_length = len(transfer.prompt_token_ids), len(transfer.output_token_ids)
        self._end_at_length(
            request_id, transfer.gateway_address, num_prompt, output_length, transfer.first_delta
        )
        return wire.KvAck(request_id=request_id, ok=True, error=None)

    def _end_at_length(
        self,
        request_id: str,
        gateway_address: str,
        num_prompt: int,
        output_length: int,
        first: wire.TokenDelta | None = None,
    ) -> None:
        """Ends a request whose output already holds max_tokens tokens, "length", with no
        token more: its gateway told (after `first`, the delta streamed again, if any) and the
        scheduler."""
        end = wire.TokenDelta(request_id=request_id, token_ids=[], finish_reason="length",
                              index=output_length)  # fmt: skip
        self.streams.send({gateway_address: [end if first is None else joined(first, end)]})
        self.events.decode_finished(request_id, "length", 0)
        self._report(request_id, "decode", "length", num_prompt, 0, 0, output_length)

    def _salt(self, cache_salt: str | None) -> str | None:
        return None if self.config.share_prefix_cache else cache_salt

    def _transfer_error(
        self, transfer: wire.KvTransfer, reservation: Reservation | None
    ) -> str | None:
        if reservation is None:
            return "no reservation (it lapsed or was cancelled)"
        unreachable = self.streams.check(transfer.gateway_address)
        if unreachable is not None:
            return unreachable
        if transfer.block_size != self.config.block_size:
            return f"block size {transfer.block_size} != this worker's {self.config.block_size}"
        if transfer.first_block != reservation.num_cached_blocks:
            return (
                f"first block {transfer.first_block} != the {reservation.num_cached_blocks} "
                "blocks this worker holds for it"
            )
        cache = self.engine.kv_cache
        expected = (
            len(cache.key_caches),
            self.blocks.num_blocks_for(transfer.num_tokens) - transfer.first_block,
            *cache.key_caches[0].shape[1:],
        )
        if tuple(transfer.keys.shape) != expected or tuple(transfer.values.shape) != expected:
            return f"KV shape {tuple(transfer.keys.shape)} != expected {expected}"
        if transfer.keys.dtype != cache.dtype or transfer.values.dtype != cache.dtype:
            return f"KV dtype {transfer.keys.dtype} != cache dtype {cache.dtype}"
        if transfer.first_block + expected[1] > len(reservation.block_ids):
            return "the KV is larger than the reservation"
        if (
            transfer.num_tokens
            != len(transfer.prompt_token_ids) + len(transfer.output_token_ids) - 1
        ):
            return "num_tokens does not match the prompt and output"
        # Before `_admit` reads max_tokens: under 1, it took the request for one at its end,
        # acknowledged it as admitted, and ended its stream "length" as if served.
        try:
            sampling_params(transfer.sampling)
        except InvalidRequestError as error:
            return str(error)
        return _first_delta_error(transfer)

    def _answer_undecodable(self, frames: list, error: str) -> wire.Message | None:
        """A KV transfer that failed to decode (cut, corrupt, out of bounds) is refused by the
        request its header names, as `_admit` refuses one: its reservation freed (unless the
        request runs here already: a faulty peer's duplicate), and its prefill worker told at
        once, which reports the attempt failed, and the request is resumed. Dropped unanswered,
        it waited out the transfer timeout (30 s), its blocks held meanwhile."""
        request_id = wire_kv.undecodable_transfer_id(frames)
        if request_id is None:
            return None
        reservation = self.reservations.pop(request_id, None)
        if reservation is not None and request_id not in self.routes:
            self.blocks.free(reservation.block_ids)
        reason = f"the KV transfer failed to decode: {error}"[:MAX_REFUSAL_LEN]
        self.log.warning("kv refused", request_id=request_id, error=reason)
        return wire.KvAck(request_id=request_id, ok=False, error=reason)

    def _cancel(self, request_id: str, reason: str) -> None:
        reservation = self.reservations.pop(request_id, None)
        if reservation is not None:
            self.blocks.free(reservation.block_ids)
        if self.routes.pop(request_id, None) is not None:
            self.engine.abort(request_id)
        self.log.info("decode cancelled", request_id=request_id, reason=reason)

    def _abandon(self, message: wire.Message, identity: bytes | None, reason: str) -> None:
        """Frees what the request holds here, the engine's sequence included, and answers the
        message as a refusal: a KV transfer's sender hears the KV refused (it reports the
        attempt failed: the request is resumed elsewhere, a bounded number of times), a
        reservation is refused, a local prefill ends for good."""
        request_id = message.request_id  # type: ignore[attr-defined]
        self._cancel(request_id, reason)
        self.engine.abort(request_id)  # one the engine took before its route was set
        match message:
            case wire.KvTransfer() if identity is not None:
                ack = wire.KvAck(request_id=request_id, ok=False, error=reason)
                wire.send_to(self.kv_socket, identity, ack)
            case wire.Reserve():
                free = self.num_available_blocks()
                reply = wire.ReserveReply(
                    request_id=request_id,
                    peer_id=self.peer_id,
                    ok=False,
                    num_free_blocks=free,
                    attempt=message.attempt,
                )
                self.link.send(reply)
            case wire.PrefillJob():
                self._refuse_here(message, reason)

    def held_request_ids(self) -> list[str]:
        return [*self.reservations, *self.routes]

    def num_available_blocks(self) -> int:
        """What the pool offers new reservations, less the blocks of local prefills the engine
        has not admitted yet: their reservations went back to the pool for the engine to take
        again, and until it does they are theirs (a reservation in between took them, and the
        prefill waited behind it)."""
        waiting = [
            route.local_sequence
            for route in self.routes.values()
            if route.local_sequence is not None
            and route.local_sequence.status == SequenceStatus.WAITING
        ]
        claimed = sum(self.blocks.num_blocks_for(seq.num_tokens + 1) for seq in waiting)
        return max(0, super().num_available_blocks() - claimed)

    def _on_timers(self, now: float) -> None:
        """Reservations whose KV did not arrive within the lease return to the pool."""
        for request_id, reservation in list(self.reservations.items()):
            if now > reservation.deadline:
                del self.reservations[request_id]
                self.blocks.free(reservation.block_ids)
                self.log.warning("reservation lapsed", request_id=request_id)

    # -- the step -----------------------------------------------------------------------------

    def _step(self) -> None:
        outputs = self.engine.step()
        for seq in self.engine.take_evicted():
            self._hand_back(seq.request_id)
        self.events.decode_step(
            self.engine.last_step_num_seqs, sum(len(o.new_token_ids) for o in outputs)
        )
        streamed = []
        for output in outputs:
            route = self.routes.get(output.request_id)
            if route is None:
                continue
            index = route.num_output_before + route.num_output_tokens
            delta = token_delta(output, index, output.finish_reason)
            if route.local_sequence is not None:
                delta = self._first_local_token(output.request_id, route, delta, output.finished)
            if route.repeat is not None:
                delta, route.repeat = joined(route.repeat, delta), None
            route.num_output_tokens += len(output.new_token_ids)
            streamed.append((route.gateway_address, delta))
            if output.finished:
                del self.routes[output.request_id]
                self.events.decode_finished(
                    output.request_id, output.finish_reason, route.num_output_tokens
                )
                self.link.send(
                    wire.RequestDone(
                        request_id=output.request_id,
                        peer_id=self.peer_id,
                        phase="decode",
                        finish_reason=output.finish_reason,
                        num_prompt_tokens=route.num_prompt_tokens,
                        num_output_tokens=route.num_output_tokens,
                        output_length=route.num_output_before + route.num_output_tokens,
                    )
                )
        self.streams.send(group_by_gateway(streamed))

    def _first_local_token(
        self, request_id: str, route: Route, delta: wire.TokenDelta, finished: bool
    ) -> wire.TokenDelta:
        """A local prefill's first token: its prefill phase is over (unless the request is, too)
        and its delta says how many prompt tokens the cache spared."""
        num_cached = route.local_sequence.num_cached_tokens if route.local_sequence else 0
        route.local_sequence = None
        if not finished:
            self._report(request_id, "prefill", None, route.num_prompt_tokens, 0, num_cached)
        return dataclasses.replace(delta, num_cached_tokens=num_cached)

    def _hand_back(self, request_id: str) -> None:
        """A sequence preempted for recompute goes back for prefill on a prefill worker (its
        gateway resumes it from the tokens its client has), not recomputed here. One of an
        earlier registration's (a scheduler restarted meanwhile) is told its gateway directly
        too: the new scheduler drops the report on an id this worker has not listed to it yet,
        and the gateway waited for its orphan watch (30-60 s). Told twice, the gateway resumes
        it once (the second word is on an attempt it dropped)."""
        route = self.routes.pop(request_id, None)
        if route is None:
            return
        self.log.info("handed back for recompute", request_id=request_id)
        if route.registration != self._registration:
            reason = f"preempted for recompute on {self.peer_id} (held across a scheduler restart)"
            handed_back = wire.TokenDelta(request_id=request_id, token_ids=[],
                                          finish_reason="preempted", error=reason)  # fmt: skip
            self.streams.send({route.gateway_address: [handed_back]})
        self.link.send(
            wire.RequestDone(
                request_id=request_id,
                peer_id=self.peer_id,
                phase="decode",
                finish_reason="preempted",
                num_prompt_tokens=route.num_prompt_tokens,
                num_output_tokens=route.num_output_tokens,
            )
        )

    def _close(self) -> None:
        self.kv_socket.close(linger=0)
