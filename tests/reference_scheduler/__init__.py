"""The scheduler core as it was before its indexes (commit 0ba9bb3): scans over the queue and the
workers, kept as the oracle that tests/unit/test_scheduler_indexes.py compares the indexed core
with, decision by decision. Not imported by anything but that test."""
