"""Every TANDEM_ environment variable tandem reads, so that one it does not read is named.

A setting misspelled in the environment (`TANDEM_HEARTBEAT_TIMOUT_S`) was ignored without a word,
and the service ran on the default. The names are listed here, not gathered from the services'
config classes at start-up: the scheduler must not import the workers' (torch) to know theirs.
`tests/unit/test_env_names.py` holds the list to the config classes and to every name the code,
the compose files and the scripts read, so it cannot go stale.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping

PREFIX = "TANDEM_"
# Names the test suite reads (devices, models for its own runs): never a service's setting.
TEST_PREFIX = "TANDEM_TEST_"

# One per field of the services' config classes (`shared/config.py`: `--some-field` is
# `TANDEM_SOME_FIELD`), the gateway's, the workers', the scheduler's and the batch service's.
SETTINGS = frozenset(
    {
        "TANDEM_ADDRESS",
        "TANDEM_ADVERTISE_ADDRESS",
        "TANDEM_ADVERTISE_STREAM_ADDRESS",
        "TANDEM_API_KEY",
        "TANDEM_API_KEYS",
        "TANDEM_API_KEYS_FILE",
        "TANDEM_BATCH_ADDRESS",
        "TANDEM_BLOCK_SIZE",
        "TANDEM_BULK_SEAT_SHARE",
        "TANDEM_BULK_STEP_SLACK",
        "TANDEM_BULK_WINDOW_SHARE",
        "TANDEM_CHAT_TEMPLATE",
        "TANDEM_CLASS_THRESHOLDS",
        "TANDEM_CLASS_WEIGHTS",
        "TANDEM_CUDA_GRAPHS",
        "TANDEM_CURVE_CLIENT_KEYS",
        "TANDEM_CURVE_KEYS_DIR",
        "TANDEM_CURVE_SECRET_KEY",
        "TANDEM_DATA_DIR",
        "TANDEM_DEADLINE_SHARE",
        "TANDEM_DECODE_ATTENTION",
        "TANDEM_DEFAULT_SAMPLING",
        "TANDEM_DEVICE",
        "TANDEM_DTYPE",
        "TANDEM_ENABLE_PREFIX_CACHING",
        "TANDEM_FIRST_TOKEN_TIMEOUT_S",
        "TANDEM_GATEWAY_RPC_ADDRESS",
        "TANDEM_GC_THAW_EVERY_S",
        "TANDEM_GENERATION_CONFIG",
        "TANDEM_HEARTBEAT_INTERVAL_S",
        "TANDEM_HEARTBEAT_TIMEOUT_S",
        "TANDEM_HOST",
        "TANDEM_HOST_CACHE_BYTES",
        "TANDEM_INDEXES",
        "TANDEM_KV_CACHE_BYTES",
        "TANDEM_LINE_TIMEOUT_S",
        "TANDEM_LOCAL_PREFILL_MAX_TOKENS",
        "TANDEM_MAX_ATTEMPTS",
        "TANDEM_MAX_BODY_BYTES",
        "TANDEM_MAX_FILE_BYTES",
        "TANDEM_MAX_IN_FLIGHT",
        "TANDEM_MAX_LINES",
        "TANDEM_MAX_MODEL_LEN",
        "TANDEM_MAX_NUM_BATCHED_TOKENS",
        "TANDEM_MAX_NUM_SEQS",
        "TANDEM_MAX_QUEUED_REQUESTS",
        "TANDEM_MAX_QUEUED_TOKENS",
        "TANDEM_MAX_QUEUE_TIME_S",
        "TANDEM_MAX_QUEUE_WAIT_S",
        "TANDEM_METRICS_HOST",
        "TANDEM_METRICS_PORT",
        "TANDEM_MODEL",
        "TANDEM_PEER_ID",
        "TANDEM_PEER_SOCKET_IDLE_S",
        "TANDEM_POLICY",
        "TANDEM_PORT",
        "TANDEM_PREEMPTION_MODE",
        "TANDEM_PREFILL_TIMEOUT_S",
        "TANDEM_PREFILL_WINDOW_TOKENS",
        "TANDEM_PREFIX_CACHE_MAX_BLOCKS",
        "TANDEM_PROGRESS_TIMEOUT_S",
        "TANDEM_QUANTIZATION",
        "TANDEM_REFUSE_PAST_DEADLINE",
        "TANDEM_REQUEST_TIMEOUT_S",
        "TANDEM_RESERVE_TIMEOUT_S",
        "TANDEM_RESPONSE_STORE_BYTES",
        "TANDEM_ROUTE_QUEUED_WEIGHT",
        "TANDEM_ROUTE_UNCACHED_WEIGHT",
        "TANDEM_RPC_ADDRESS",
        "TANDEM_RPC_CLIENT_TIMEOUT_S",
        "TANDEM_SCHEDULER_ADDRESS",
        "TANDEM_SHARE_PREFIX_CACHE",
        "TANDEM_SHUTDOWN_GRACE_S",
        "TANDEM_SPECULATIVE_PREFILL",
        "TANDEM_STEP_TIME_TARGET_S",
        "TANDEM_STREAM_ADDRESS",
        "TANDEM_SWAP_BYTES",
        "TANDEM_TENANT_WEIGHTS",
        "TANDEM_THINK_TIME_RETENTION_S",
        "TANDEM_THREADS",
        "TANDEM_TRANSFER_TIMEOUT_S",
    }
)

# Read where they are used, outside the config classes.
OTHERS = frozenset(
    {
        "TANDEM_CACHE_DIR",  # shared/config.py: converted models, compiled C
        "TANDEM_COMPILED",  # services/compiled.py: the scheduler and simulator built by mypyc
        "TANDEM_NATIVE_CFLAGS",  # kernels/native_build.py: extra C compiler flags
        "TANDEM_LOG_LEVEL",  # shared/logs.py
        "TANDEM_LOG_FORMAT",  # shared/logs.py
        "TANDEM_CURVE_CLIENT",  # loadtest/locustfile.py: Locust's RPC users' CurveZMQ key
        "TANDEM_CURVE_CLIENT_DIR",  # loadtest/locustfile.py
        "TANDEM_BATCH_API_KEY",  # docker-compose.yml: the batch service's key, on the host
        "TANDEM_DOCKER_DIR",  # compose/docker-engine.sh: the engine's own directory
        "TANDEM_DOCKER_KEEP",  # compose/docker-engine.sh, the compose tests: keep it running
    }
)

KNOWN = SETTINGS | OTHERS


def unread_names(environ: Mapping[str, str]) -> list[str]:
    """The TANDEM_ names in `environ` no tandem process reads, sorted."""
    return sorted(
        name
        for name in environ
        if name.startswith(PREFIX) and name not in KNOWN and not name.startswith(TEST_PREFIX)
    )


def unread_warning(name: str) -> str:
    """What to tell the person who set `name`: that it is ignored, and the setting it resembles."""
    close = difflib.get_close_matches(name, KNOWN, n=1, cutoff=0.8)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return f"environment variable {name} is not a tandem setting and is ignored{hint}"
