"""Settings that each parse but cannot work: refused at start-up, in one line naming them."""

import os
import subprocess
import sys

import pytest

from services.batch.service import BatchServiceConfig
from services.gateway.service import GatewayConfig
from services.worker.config import WorkerConfig
from shared.config import ConfigError, config_from_args

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SOCKET = "ipc:///tmp/tandem-config-review/one.sock"


@pytest.mark.parametrize(
    "cls, environ, needle",
    [
        # The gateway bound its token stream where it sent to the scheduler: "ready", it spoke
        # to itself, and a scheduler started after it could not bind there.
        (
            GatewayConfig,
            {"TANDEM_SCHEDULER_ADDRESS": SOCKET, "TANDEM_STREAM_ADDRESS": SOCKET},
            "stream_address .*TANDEM_STREAM_ADDRESS.* scheduler_address",
        ),
        # Its batch requests went to its own RPC door.
        (
            GatewayConfig,
            {"TANDEM_RPC_ADDRESS": SOCKET, "TANDEM_BATCH_ADDRESS": SOCKET},
            "rpc_address .* batch_address",
        ),
        (
            WorkerConfig,
            {"TANDEM_ADDRESS": SOCKET, "TANDEM_SCHEDULER_ADDRESS": SOCKET},
            "address .*TANDEM_ADDRESS.* scheduler_address",
        ),
        (
            BatchServiceConfig,
            {"TANDEM_ADDRESS": SOCKET, "TANDEM_GATEWAY_RPC_ADDRESS": SOCKET},
            "address .* gateway_rpc_address",
        ),
    ],
)
def test_a_service_bound_where_it_also_connects_is_refused(cls, environ, needle):
    with pytest.raises(ConfigError, match=needle):
        config_from_args(cls, environ=environ)


def test_distinct_addresses_are_taken():
    config = config_from_args(
        GatewayConfig,
        environ={"TANDEM_RPC_ADDRESS": "tcp://127.0.0.1:8001", "TANDEM_BATCH_ADDRESS": SOCKET},
    )
    assert config.batch_address == SOCKET


def test_a_kv_budget_past_the_devices_memory_is_refused_before_loading():
    # 10**23 bytes overflowed torch's storage size: a traceback once the model had loaded.
    config = config_from_args(WorkerConfig, environ={"TANDEM_KV_CACHE_BYTES": str(10**23)})
    with pytest.raises(ConfigError, match=r"kv_cache_bytes .*TANDEM_KV_CACHE_BYTES.* memory"):
        config.check_kv_budget()


def test_a_kv_budget_the_device_holds_is_taken():
    config = config_from_args(WorkerConfig, environ={"TANDEM_KV_CACHE_BYTES": str(64 << 20)})
    config.check_kv_budget()


def test_the_worker_command_says_so_in_one_line_and_exits_2():
    result = subprocess.run(
        [sys.executable, "-m", "services.commands.cli", "prefill", "--kv-cache-bytes", str(10**23)],
        cwd=ROOT,
        env={**os.environ, "TANDEM_SCHEDULER_ADDRESS": SOCKET},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert (
        result.stderr.strip()
        .splitlines()[-1]
        .startswith("tandem prefill: configuration error: kv_cache_bytes")
    )


@pytest.mark.parametrize("name", ["tandem_curve_keys_dir", "Tandem_Curve_Keys_Dir"])
def test_a_setting_in_the_wrong_case_is_refused_not_ignored(name):
    # Environment names are case-sensitive: it was never read, and the worker ran in clear.
    with pytest.raises(ConfigError, match=f"{name} .*TANDEM_CURVE_KEYS_DIR"):
        config_from_args(WorkerConfig, environ={name: "/keys"})


def test_a_wrong_case_name_beside_the_right_one_is_refused_too():
    environ = {"TANDEM_BLOCK_SIZE": "32", "tandem_block_size": "8"}
    with pytest.raises(ConfigError, match="tandem_block_size"):
        config_from_args(WorkerConfig, environ=environ)
