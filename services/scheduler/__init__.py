"""The scheduler: admission, worker registry, choice of prefill and decode worker, re-routing."""

from services.compiled import activate

# Before any of the package's modules is imported: `TANDEM_COMPILED=on` puts their compiled
# twins first (`services/compiled.py`).
activate("scheduler", __path__)
