"""Service configuration from flags and environment variables, and its refusals."""

import argparse
import socket

import pytest
import torch

from services.commands import cli
from services.gateway.service import GatewayConfig
from services.prefill import service as prefill_service
from services.scheduler.service import SchedulerConfig
from services.worker.config import WorkerConfig
from services.worker.link import HandshakeError
from shared.config import ConfigError, add_config_arguments, config_from_args, expand_host


def parse(cls, argv, environ=None):
    parser = argparse.ArgumentParser()
    add_config_arguments(parser, cls)
    return config_from_args(cls, parser.parse_args(argv), environ or {})


def test_flag_beats_environment_beats_default():
    assert parse(WorkerConfig, []).block_size == 16
    assert parse(WorkerConfig, [], {"TANDEM_BLOCK_SIZE": "32"}).block_size == 32
    assert parse(WorkerConfig, ["--block-size", "8"], {"TANDEM_BLOCK_SIZE": "32"}).block_size == 8


def test_the_step_time_target_can_be_switched_off():
    assert parse(WorkerConfig, []).step_time_target_s == 0.2
    assert parse(WorkerConfig, [], {"TANDEM_STEP_TIME_TARGET_S": "none"}).step_time_target_s is None


def test_optional_and_bool_values():
    config = parse(
        WorkerConfig, [], {"TANDEM_THREADS": "none", "TANDEM_ADDRESS": "tcp://0.0.0.0:7000"}
    )
    assert config.threads is None and config.address == "tcp://0.0.0.0:7000"


def test_host_tier_and_retention_settings_reach_the_engine():
    config = parse(WorkerConfig, [], {"TANDEM_HOST_CACHE_BYTES": "1024"})
    assert config.engine_config().host_cache_bytes == 1024
    assert parse(WorkerConfig, []).engine_config().host_cache_bytes == 256 << 20
    assert parse(WorkerConfig, ["--host-cache-bytes", "0"]).engine_config().host_cache_bytes == 0
    small_swap = parse(WorkerConfig, ["--swap-bytes", "1024"])  # the tier fits in what is left
    assert small_swap.engine_config().host_cache_bytes == 256 << 20
    retention = parse(WorkerConfig, ["--think-time-retention-s", "12.5"]).think_time_retention_s
    assert retention == 12.5


@pytest.mark.parametrize(
    "cls,argv,environ,needle",
    [
        (WorkerConfig, ["--block-size", "abc"], {}, "--block-size: expected an integer"),
        (WorkerConfig, [], {"TANDEM_KV_CACHE_BYTES": "-5"}, "kv_cache_bytes"),
        (WorkerConfig, [], {"TANDEM_SWAP_BYTES": "-1"}, "TANDEM_SWAP_BYTES"),
        (WorkerConfig, ["--preemption-mode", "evict"], {}, "--preemption-mode"),
        (WorkerConfig, ["--address", "localhost:5000"], {}, "tcp://, ipc:// or inproc://"),
        (WorkerConfig, ["--metrics-port", "70000"], {}, "must be a port in"),
        (WorkerConfig, ["--device", "gpu"], {}, "device must be cpu, cuda or cuda:N"),
        (WorkerConfig, [], {"TANDEM_DEVICE": "cpu:1"}, "TANDEM_DEVICE"),
        (WorkerConfig, ["--step-time-target-s", "0"], {}, "step_time_target_s"),
        (WorkerConfig, ["--peer-socket-idle-s", "0"], {}, "peer_socket_idle_s"),
        (WorkerConfig, [], {"TANDEM_PEER_SOCKET_IDLE_S": "nan"}, "expected a finite number"),
        (WorkerConfig, [], {"TANDEM_STEP_TIME_TARGET_S": "soon"}, "TANDEM_STEP_TIME_TARGET_S"),
        (WorkerConfig, ["--prefix-cache-max-blocks", "-1"], {}, "TANDEM_PREFIX_CACHE_MAX_BLOCKS"),
        (WorkerConfig, [], {"TANDEM_ENABLE_PREFIX_CACHING": "maybe"}, "expected a boolean"),
        (WorkerConfig, ["--share-prefix-cache", "2"], {}, "expected a boolean"),
        (WorkerConfig, ["--host-cache-bytes", "-1"], {}, "--host-cache-bytes"),
        (WorkerConfig, [], {"TANDEM_HOST_CACHE_BYTES": "1G"}, "TANDEM_HOST_CACHE_BYTES"),
        (WorkerConfig, ["--think-time-retention-s", "-1"], {}, "TANDEM_THINK_TIME_RETENTION_S"),
        (WorkerConfig, [], {"TANDEM_THINK_TIME_RETENTION_S": "long"}, "THINK_TIME_RETENTION"),
        (WorkerConfig, ["--decode-attention", "fast"], {}, "one of auto, native, reference"),
        (WorkerConfig, [], {"TANDEM_DECODE_ATTENTION": "c"}, "--decode-attention "),
        (SchedulerConfig, [], {"TANDEM_METRICS_PORT": "-1"}, "TANDEM_METRICS_PORT"),
        (SchedulerConfig, ["--metrics-port", "http"], {}, "--metrics-port: expected an integer"),
        (SchedulerConfig, ["--heartbeat-timeout-s", "0"], {}, "heartbeat_timeout_s"),
        (SchedulerConfig, [], {"TANDEM_MAX_QUEUED_REQUESTS": "1.5"}, "TANDEM_MAX_QUEUED_REQUESTS"),
        (GatewayConfig, ["--port", "-1"], {}, "port"),
        (GatewayConfig, ["--first-token-timeout-s", "0"], {}, "first_token_timeout_s"),
        (GatewayConfig, [], {"TANDEM_REQUEST_TIMEOUT_S": "soon"}, "TANDEM_REQUEST_TIMEOUT_S"),
        (GatewayConfig, [], {"TANDEM_RPC_CLIENT_TIMEOUT_S": "0"}, "rpc_client_timeout_s"),
        (SchedulerConfig, ["--max-queue-time-s", "-1"], {}, "max_queue_time_s"),
        (SchedulerConfig, ["--route-queued-weight", "-1"], {}, "--route-queued-weight"),
        (SchedulerConfig, ["--local-prefill-max-tokens", "-1"], {}, "local_prefill_max_tokens"),
        (SchedulerConfig, ["--speculative-prefill", "sometimes"], {}, "expected a boolean"),
        (SchedulerConfig, ["--deadline-share", "0"], {}, "TANDEM_DEADLINE_SHARE"),
        (SchedulerConfig, [], {"TANDEM_DEADLINE_SHARE": "1.2"}, "--deadline-share"),
        (SchedulerConfig, [], {"TANDEM_DEADLINE_SHARE": "most"}, "TANDEM_DEADLINE_SHARE"),
        (SchedulerConfig, ["--bulk-window-share", "0"], {}, "TANDEM_BULK_WINDOW_SHARE"),
        (SchedulerConfig, [], {"TANDEM_BULK_WINDOW_SHARE": "2"}, "--bulk-window-share"),
        (SchedulerConfig, ["--bulk-seat-share", "-0.5"], {}, "TANDEM_BULK_SEAT_SHARE"),
        (SchedulerConfig, [], {"TANDEM_SPECULATIVE_PREFILL": "2"}, "expected a boolean"),
        (SchedulerConfig, [], {"TANDEM_ROUTE_UNCACHED_WEIGHT": "x"}, "TANDEM_ROUTE_UNCACHED"),
        (SchedulerConfig, ["--gc-thaw-every-s", "-1"], {}, "TANDEM_GC_THAW_EVERY_S"),
        (SchedulerConfig, ["--indexes", "rust"], {}, "TANDEM_INDEXES"),
        (SchedulerConfig, [], {"TANDEM_INDEXES": "C"}, "one of auto, native, python"),
        (SchedulerConfig, [], {"TANDEM_GC_THAW_EVERY_S": "nan"}, "THAW_EVERY_S: expected a finite"),
        (
            SchedulerConfig,
            ["--heartbeat-interval-s", "nan"],
            {},
            "--heartbeat-interval-s: expected",
        ),
        (SchedulerConfig, [], {"TANDEM_HEARTBEAT_INTERVAL_S": "inf"}, "a finite number, got 'inf'"),
        (GatewayConfig, ["--request-timeout-s=-inf"], {}, "--request-timeout-s: expected a fin"),
        (WorkerConfig, [], {"TANDEM_STEP_TIME_TARGET_S": "NaN"}, "TANDEM_STEP_TIME_TARGET_S: exp"),
        (SchedulerConfig, [], {"TANDEM_GC_THAW_EVERY_S": "hourly"}, "TANDEM_GC_THAW_EVERY_S"),
        (GatewayConfig, ["--scheduler-address", "http://x"], {}, "scheduler_address"),
        # Each would drop every worker (or take it for stuck) between two of its heartbeats.
        (SchedulerConfig, ["--heartbeat-timeout-s", "0.3"], {}, "must exceed heartbeat_interval"),
        (SchedulerConfig, ["--heartbeat-interval-s", "20"], {}, "heartbeat_timeout_s"),
        (SchedulerConfig, ["--progress-timeout-s", "0.5"], {}, "progress_timeout_s"),
        (GatewayConfig, ["--port", "70000"], {}, "must be a port in"),
        # libzmq connects to each of these without a word: the service ran "ready", every
        # request waiting on a scheduler (or gateway) it could never reach.
        (GatewayConfig, ["--scheduler-address", "tcp://127.0.0.1:65536"], {}, "port from 0 to"),
        (WorkerConfig, [], {"TANDEM_SCHEDULER_ADDRESS": "tcp://:5555"}, "TANDEM_SCHEDULER_ADDR"),
        (GatewayConfig, [], {"TANDEM_BATCH_ADDRESS": "tcp://batch:99999"}, "--batch-address"),
        (WorkerConfig, ["--scheduler-address", "tcp://sched:-1"], {}, "tcp://host:port"),
        (WorkerConfig, ["--scheduler-address", "tcp://scheduler"], {}, "tcp://host:port"),
        # A service run as its own process that binds or connects at inproc:// is reached by no
        # peer, and reaches none: it said it was ready and waited for good.
        (SchedulerConfig, ["--address", "inproc://scheduler"], {}, "--address: 'inproc://sched"),
        (WorkerConfig, [], {"TANDEM_SCHEDULER_ADDRESS": "INPROC://s"}, "only threads of this"),
        (GatewayConfig, ["--rpc-address", "inproc://rpc"], {}, "tcp:// or ipc:// address"),
    ],
)
def test_bad_values_name_the_setting(cls, argv, environ, needle):
    with pytest.raises(ConfigError, match=needle.replace("*", r"\*")):
        parse(cls, argv, environ)


@pytest.mark.parametrize(
    "address", ["tcp://*:*", "tcp://[::1]:*", "tcp://0.0.0.0:0", "tcp://[fe80::1%eth0]:5555"]
)
def test_tcp_addresses_with_any_port_or_an_ipv6_host_are_taken(address):
    assert parse(WorkerConfig, ["--address", address]).address == address


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_a_cuda_device_without_a_gpu_is_refused_before_loading():
    with pytest.raises(ConfigError, match="sees no CUDA GPU.*--device / TANDEM_DEVICE"):
        parse(WorkerConfig, ["--device", "cuda"])


def test_an_ip_this_host_has_none_of_is_a_config_error(monkeypatch):
    """`{ip}` in an advertised address, on a host whose name resolves to nothing: a
    socket.gaierror traceback at start-up."""

    def unresolvable(name):
        raise socket.gaierror(-2, "Name or service not known")

    monkeypatch.setattr(socket, "gethostbyname", unresolvable)
    monkeypatch.setattr(socket, "getaddrinfo", lambda *args: unresolvable(args[0]))
    with pytest.raises(ConfigError, match="no IP address for this host"):
        expand_host("tcp://{ip}:5601")
    assert expand_host("tcp://{hostname}:1") == f"tcp://{socket.gethostname()}:1"  # no IP asked


def test_an_ipv6_only_hosts_ip_is_its_ipv6_address_in_brackets(monkeypatch):
    """`{ip}` read the host's IPv4 address alone: in an IPv6-only container or pod a worker
    stopped at start with "no IP address for this host", and so did a wildcard metrics bind's
    advertised address."""
    from shared.metrics import advertised_host

    def no_ipv4(name):
        raise socket.gaierror(-5, "No address associated with hostname")

    def ipv6_only(name, port, family=0, kind=0, *rest):
        assert family == socket.AF_INET6
        return [(socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("fd00::7", 0, 0, 0))]

    monkeypatch.setattr(socket, "gethostbyname", no_ipv4)
    monkeypatch.setattr(socket, "getaddrinfo", ipv6_only)
    assert expand_host("tcp://{ip}:5601") == "tcp://[fd00::7]:5601"
    assert advertised_host("::") == "fd00::7"


def test_a_worker_the_scheduler_refuses_says_so_in_one_line(monkeypatch, capsys):
    """A worker the scheduler refused (another model, KV layout, schema) or never answered
    ended on a HandshakeError traceback."""

    def refused(args):
        raise HandshakeError("the scheduler refused this worker: model mismatch")

    monkeypatch.setattr(prefill_service, "run", refused)
    assert cli.main(["prefill"]) == 1
    assert capsys.readouterr().err == (
        "tandem prefill: the scheduler refused this worker: model mismatch\n"
    )
