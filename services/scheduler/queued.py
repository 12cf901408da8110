"""What the fair queue holds: parties (a tenant's requests of one prompt class) and the queued
requests themselves. The policy (`fair_share.py`) and its indexes (`queue_index.py`) both use
them; they live apart so that neither of the two imports the other back."""

from __future__ import annotations

from typing import NamedTuple

# The class of every bulk request (a batch job's line), whatever its length.
BULK_CLASS = "bulk"


class Party(NamedTuple):
    """A fair-share account. A tuple: a decision looks parties up some twenty-five times, and a
    tuple hashes and compares in C (a frozen dataclass's hash is a Python call)."""

    tenant: str
    class_name: str


QUEUED_FIELDS = (
    "request_id",
    "tenant",
    "num_prompt_tokens",
    "priority",
    "arrival",
    "resumed",
    "bulk",
    "num_cached_tokens",
)


class QueuedRequest:
    """A request as the fair queue holds it. A class with its own `__init__`, not a dataclass:
    mypyc compiles this one to C, where it runs a dataclass's generated `__init__` as Python,
    and the core makes one per request. Treated as frozen: nothing assigns its fields."""

    __slots__ = QUEUED_FIELDS

    def __init__(
        self,
        request_id: str,
        tenant: str,
        num_prompt_tokens: int,
        priority: int,
        arrival: float,
        resumed: bool = False,
        bulk: bool = False,
        num_cached_tokens: int = 0,
    ) -> None:
        self.request_id = request_id
        self.tenant = tenant
        self.num_prompt_tokens = num_prompt_tokens
        self.priority = priority  # larger is more urgent, within the tenant's party
        self.arrival = arrival  # the policy's clock, seconds
        # Work resuming (its worker was lost, or it was handed back for recompute): its client
        # is mid-stream, so it goes before anything new, oldest first, under either policy.
        self.resumed = resumed
        self.bulk = bulk  # a batch job's line: spare capacity only (see the module doc)
        # Of its prompt, the tokens a worker holds cached (as the scheduler's index predicts):
        # not computed, so not charged. Its class still goes by the whole prompt.
        self.num_cached_tokens = num_cached_tokens

    def __repr__(self) -> str:
        fields = ", ".join([f"{name}={getattr(self, name)!r}" for name in QUEUED_FIELDS])
        return f"QueuedRequest({fields})"
