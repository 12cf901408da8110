"""The scheduler: admission, worker registry, choice of prefill and decode worker, re-routing."""
