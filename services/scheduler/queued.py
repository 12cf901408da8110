"""What the fair queue holds: parties (a tenant's requests of one prompt class) and the queued
requests themselves. The policy (`fair_share.py`) and its indexes (`queue_index.py`) both use
them; they live apart so that neither of the two imports the other back."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

# The class of every bulk request (a batch job's line), whatever its length.
BULK_CLASS = "bulk"


class Party(NamedTuple):
    """A fair-share account. A tuple: a decision looks parties up some twenty-five times, and a
    tuple hashes and compares in C (a frozen dataclass's hash is a Python call)."""

    tenant: str
    class_name: str


@dataclass(frozen=True)
class QueuedRequest:
    request_id: str
    tenant: str
    num_prompt_tokens: int
    priority: int  # larger is more urgent, within the tenant's party
    arrival: float  # the policy's clock, seconds
    # Work resuming (its worker was lost, or it was handed back for recompute): its client is
    # mid-stream, so it goes before anything new, oldest first, under either policy.
    resumed: bool = False
    bulk: bool = False  # a batch job's line: spare capacity only (see the module doc)
    # Of its prompt, the tokens a worker holds cached (as the scheduler's index predicts): not
    # computed, so not charged. Its class still goes by the whole prompt.
    num_cached_tokens: int = 0
