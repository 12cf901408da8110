"""`tandem gateway`: the OpenAI HTTP API (uvicorn on uvloop) and its link to the cluster."""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
from dataclasses import dataclass
from typing import Any

import jinja2
import uvicorn

from services.gateway.app import build_app
from services.gateway.auth import ApiKeys, KeyConfigError
from services.gateway.batch_link import BatchLink
from services.gateway.batch_routes import add_batch_routes
from services.gateway.chat_prompt import read_chat_template
from services.gateway.cluster import ClusterClient
from services.gateway.drain import Drain
from services.gateway.generation import Generator, Timeouts
from services.gateway.response_store import DEFAULT_MAX_BYTES, ResponseStore
from services.gateway.rpc import RpcServer
from shared.binding import check_address, check_tcp_port, describe
from shared.config import (
    ConfigError,
    CurveSettings,
    add_config_arguments,
    config_from_args,
    expand_host,
    require_address,
    require_distinct_addresses,
    require_port,
    require_positive,
    setting,
)
from shared.engine.model_config import served_context_len
from shared.engine.model_files import DEFAULT_MODEL, resolve_model_dir
from shared.engine.sampling_defaults import parse_default_sampling, sampling_defaults
from shared.gc_policy import CollectionTimer
from shared.lifecycle import GatewayEvents
from shared.logs import configure_logging, get_logger


@dataclass(frozen=True)
class GatewayConfig(CurveSettings):
    host: str = setting("127.0.0.1", "HTTP host to bind")
    port: int = setting(8000, "HTTP port")
    scheduler_address: str = setting("ipc:///tmp/tandem/scheduler.sock", "the scheduler's ROUTER")
    stream_address: str = setting(
        "ipc:///tmp/tandem/gateway-stream.sock", "token-stream PULL to bind"
    )
    advertise_stream_address: str | None = setting(
        None,
        "the stream address workers connect to, when it differs from the bound one "
        "({ip} and {hostname} expand to this machine's)",
    )
    model: str = setting(
        "smollm2", "a HF directory, a .gguf file, or 'smollm2' (for its tokenizer)"
    )
    peer_id: str | None = setting(None, "unique name of this gateway (default: gateway-host-pid)")
    max_body_bytes: int = setting(8 << 20, "largest accepted HTTP request body")
    max_model_len: int | None = setting(None, "context length (default: the model's)")
    rpc_address: str | None = setting(None, "ZeroMQ RPC ROUTER to bind (default: no RPC door)")
    rpc_client_timeout_s: float = setting(
        30.0,
        "an RPC client connection that answers no heartbeat this long is closed, its calls "
        "cancelled (a host gone, a process stopped)",
    )
    api_keys: tuple[str, ...] = setting(
        (), "API keys clients must present, each key or key=tenant (none: no authentication)"
    )
    api_keys_file: str | None = setting(None, "a file of API keys, one key or key=tenant a line")
    first_token_timeout_s: float = setting(
        300.0, "a request with no token this long after arriving is cancelled (504)"
    )
    request_timeout_s: float = setting(3600.0, "a request unfinished this long is cancelled (504)")
    generation_config: str = setting(
        "auto",
        "where unset sampling fields take their defaults: auto (the model's "
        "generation_config.json), none, or the path of another one",
    )
    default_sampling: str | None = setting(
        None,
        "defaults for unset sampling fields, over the model's, e.g. temperature=0.7,top_p=0.9",
    )
    batch_address: str | None = setting(
        None, "the batch service's ROUTER, for /v1/files and /v1/batches (default: none, 404)"
    )
    chat_template: str | None = setting(
        None, "a Jinja chat template file used instead of the model's (e.g. one that renders tools)"
    )
    response_store_bytes: int = setting(
        DEFAULT_MAX_BYTES,
        "memory for the Responses API's stored responses (previous_response_id); 0: none kept",
    )
    shutdown_grace_s: float = setting(
        5.0,
        "on SIGTERM, how long requests under way may still run; then each ends with a 503 "
        "(a stream's error event and [DONE]) and the gateway exits, about 1 s later. Keep it "
        "under the orchestrator's kill (`tandem up` waits the grace plus 4 s, 10 s at least), "
        "the shipped compose file's stop_grace_period (15 s), the k8s pod's "
        "terminationGracePeriodSeconds (20 s, its preStop sleep of 5 s included)",
    )

    def __post_init__(self) -> None:
        self.curve_keys()
        try:
            parse_default_sampling(self.default_sampling)
        except ValueError as error:
            raise ConfigError(f"default_sampling (--default-sampling): {error}") from None
        require_address(
            self,
            "scheduler_address",
            "stream_address",
            "advertise_stream_address",
            "rpc_address",
            "batch_address",
        )
        require_distinct_addresses(
            self, "stream_address", "rpc_address", "scheduler_address", "batch_address"
        )
        require_positive(
            self,
            "port",
            "max_body_bytes",
            "max_model_len",
            "first_token_timeout_s",
            "request_timeout_s",
            "rpc_client_timeout_s",
            "shutdown_grace_s",
        )
        require_port(self, "port")
        if self.response_store_bytes < 0:
            raise ConfigError(
                f"response_store_bytes (--response-store-bytes) must be >= 0, got "
                f"{self.response_store_bytes}"
            )
        self.keys()  # refuses bad keys at start-up
        if self.chat_template is not None:
            read_chat_template(self.chat_template)

    def keys(self) -> ApiKeys:
        try:
            return ApiKeys.load(self.api_keys, self.api_keys_file)
        except KeyConfigError as error:
            raise ConfigError(f"api_keys (--api-keys / TANDEM_API_KEYS): {error}") from None


def use_chat_template(tokenizer, path: str) -> None:
    """The template at `path` replaces the tokenizer's; refused at start-up if it cannot render
    a one-message chat."""
    tokenizer.chat_template = read_chat_template(path)
    try:
        tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
    except jinja2.TemplateError as error:
        raise ConfigError(f"chat_template (--chat-template): {path}: {error}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, GatewayConfig)


def build_gateway(config: GatewayConfig, drain: Drain | None = None):
    from transformers import AutoConfig, AutoTokenizer

    directory, name = resolve_model_dir(config.model)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    if config.chat_template is not None:
        use_chat_template(tokenizer, config.chat_template)
    max_model_len = served_context_len(AutoConfig.from_pretrained(directory), config.max_model_len)
    peer_id = config.peer_id or f"gateway-{socket.gethostname()}-{os.getpid()}"
    logger = get_logger(peer_id=peer_id)
    try:
        defaults = sampling_defaults(
            directory, name == DEFAULT_MODEL, config.generation_config, config.default_sampling
        )
    except ValueError as error:
        raise ConfigError(f"generation_config (--generation-config): {error}") from None
    logger.info("sampling defaults", **defaults)
    telemetry = GatewayEvents(logger)
    cluster = ClusterClient(
        config.scheduler_address,
        config.stream_address,
        expand_host(config.advertise_stream_address) or config.stream_address,
        peer_id,
        config.model,
        telemetry,
        config.curve_keys(),
    )
    timeouts = Timeouts(config.first_token_timeout_s, config.request_timeout_s)
    generator = Generator(
        cluster, tokenizer, name, max_model_len, telemetry, timeouts, sampling_defaults=defaults
    )
    tool_format = generator.template_tool_format
    logger.info("tool calls", format=tool_format.name if tool_format else "fallback (tagged)")
    keys = config.keys()
    rpc = None
    if config.rpc_address is not None:
        rpc = RpcServer(
            generator,
            config.rpc_address,
            config.max_body_bytes,
            keys,
            config.curve_keys(),
            client_timeout_s=config.rpc_client_timeout_s,
        )

    batch = None
    if config.batch_address is not None:
        batch = BatchLink(config.batch_address, curve=config.curve_keys())

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        # Every collection timed into /metrics while the app runs (gateway_gc_pause_seconds).
        with contextlib.closing(CollectionTimer(telemetry.gc_paused)):
            await cluster.start()
            if rpc is not None:
                await rpc.start()
            if batch is not None:
                await batch.start()
            get_logger().info("gateway ready", port=config.port, model=name, rpc=config.rpc_address)
            yield
            if batch is not None:
                await batch.close()
            if rpc is not None:
                await rpc.close()  # first: its calls cancel theirs through the cluster link
            await cluster.close()

    responses = ResponseStore(config.response_store_bytes)
    app = build_app(generator, config.max_body_bytes, keys, lifespan, batch, responses, drain)
    if batch is not None:
        add_batch_routes(app, batch, keys, name)
    return app


# uvicorn's own logging set-up (`log_config=None`: none) would print its lines as plain text
# among the JSON ones; its loggers go through Python's root to structlog (`shared.logs`).
UVICORN_SETTINGS: dict[str, Any] = {"loop": "uvloop", "log_level": "warning", "log_config": None}
# After the grace, what the drain's 503s take to reach their clients; a task still running then
# is cancelled by uvicorn (its connection torn), so the exit is bounded whatever a handler does.
STREAM_END_S = 1.0
# uvicorn's exit status when it could not start (its `run` exits with it: a taken port).
STARTUP_FAILURE = 3


class DrainingServer(uvicorn.Server):
    """uvicorn's server, its shutdown bounded. On SIGTERM uvicorn closes its listening socket
    (new connections are refused) and idle keep-alive connections, then waited for every
    request under way, without end for a stream that never ends, until the orchestrator's
    SIGKILL tore them all. Here the drain begins with the shutdown: requests have
    `grace_s` to finish, then the app ends them itself (`Drain`)."""

    def __init__(self, config: uvicorn.Config, drain: Drain, grace_s: float):
        super().__init__(config)
        self.drain = drain
        self.grace_s = grace_s

    async def shutdown(self, sockets=None) -> None:
        self.drain.begin(self.grace_s)
        await super().shutdown(sockets)


def serve(app, config: GatewayConfig, drain: Drain) -> int:
    """Serves `app` until SIGTERM or Ctrl-C, then drains it (`DrainingServer`)."""
    server_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        timeout_graceful_shutdown=config.shutdown_grace_s + STREAM_END_S,
        **UVICORN_SETTINGS,
    )
    server = DrainingServer(server_config, drain, config.shutdown_grace_s)
    with contextlib.suppress(KeyboardInterrupt):  # (Ctrl-C, drained: as `uvicorn.run`, exit 0)
        server.run()
    return 0 if server.started else STARTUP_FAILURE


def run(args: argparse.Namespace) -> int:
    configure_logging("gateway")
    config = config_from_args(GatewayConfig, args)
    # Refused here in one line, before the model's tokenizer loads: bound in the web server's
    # start-up, a taken address was a traceback (or, for the HTTP port, came after "ready").
    check_tcp_port(config.host, config.port, describe("host", "port"))
    check_address(config.stream_address, "stream_address")
    if config.rpc_address is not None:
        check_address(config.rpc_address, "rpc_address")
    drain = Drain()
    return serve(build_gateway(config, drain), config, drain)
