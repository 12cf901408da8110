"""Capacity planning: a discrete-event simulator driving the real scheduler core."""

from services.compiled import activate

# As the scheduler's: `TANDEM_COMPILED=on` puts the simulator's compiled modules first.
activate("planner", __path__)
