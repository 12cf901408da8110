"""SUBMITs held while a scheduler that just started waits for its workers.

A scheduler restarted under a running cluster knows no worker until each says HELLO again, at
its next heartbeat (told it is unknown): half a second, by default. Every SUBMIT meanwhile was
refused "no prefill or no decode worker is registered" (503), the gateways' resumptions of the
requests the old scheduler held among them, while the workers were there all along. Now the
core holds them for the rejoin grace (`SchedulerLimits.disconnect_grace_s`, three heartbeat
intervals) and admits them, in order, once a prefill and a decode worker are back; those still
held when the grace ends are refused as before. A cancel of a held one takes it out.
"""

from __future__ import annotations

import math

from shared import wire


class SubmitsAwaitingWorkers:
    def __init__(self) -> None:
        self.until = -math.inf  # (a core no service started holds nothing: the simulator's)
        self._held: dict[str, tuple[bytes, wire.Submit]] = {}

    def open_until(self, until: float) -> None:
        self.until = until

    def open(self, now: float) -> bool:
        return now < self.until

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, identity: bytes, submit: wire.Submit) -> None:
        self._held[submit.request_id] = (identity, submit)

    def holds(self, request_id: str) -> bool:
        return request_id in self._held

    def cancel(self, request_id: str) -> bool:
        return self._held.pop(request_id, None) is not None

    def take_all(self) -> list[tuple[bytes, wire.Submit]]:
        """Every held SUBMIT, in the order they came, and none held after."""
        held = list(self._held.values())
        self._held.clear()
        return held
