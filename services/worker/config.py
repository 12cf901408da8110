"""The worker configuration, one dataclass for both roles (the role is the command)."""

from __future__ import annotations

import math
import os
import socket
from dataclasses import dataclass

from shared.config import (
    ConfigError,
    CurveSettings,
    require_address,
    require_distinct_addresses,
    require_port,
    require_positive,
    setting,
)
from shared.engine.engine import EngineConfig
from shared.engine.kv_cache import num_blocks_for_budget
from shared.engine.loader import (
    DECODE_ATTENTION_CHOICES,
    DECODE_ATTENTION_HELP,
    DEVICE_HELP,
    DTYPE_CHOICES,
    DTYPE_HELP,
    QUANTIZATION_HELP,
    linear_backend_for,
    parse_device,
    parse_dtype,
)
from shared.engine.model_config import ModelConfig
from shared.engine.model_files import resolve_model_dir
from shared.engine.swap import PREEMPTION_MODES


@dataclass(frozen=True)
class WorkerConfig(CurveSettings):
    scheduler_address: str = setting("ipc:///tmp/tandem/scheduler.sock", "the scheduler's ROUTER")
    address: str | None = setting(None, "decode: the KV ROUTER address to bind")
    advertise_address: str | None = setting(
        None,
        "decode: the KV address peers connect to, when it differs from the bound one "
        "({ip} and {hostname} expand to this machine's)",
    )
    peer_id: str | None = setting(None, "unique name of this worker (default: role-host-pid)")
    model: str = setting("smollm2", "a HF directory, a .gguf file, or 'smollm2'")
    dtype: str = setting("auto", DTYPE_HELP)
    quantization: str = setting("none", QUANTIZATION_HELP)
    decode_attention: str = setting("auto", DECODE_ATTENTION_HELP)
    device: str = setting("cpu", DEVICE_HELP)
    kv_cache_bytes: int = setting(512 << 20, "bytes of KV cache")
    block_size: int = setting(16, "tokens per KV block")
    max_num_seqs: int = setting(64, "most sequences in one step")
    max_num_batched_tokens: int = setting(512, "most tokens in one step (chunked-prefill budget)")
    step_time_target_s: float | None = setting(
        0.2,
        "prefill: how long a step with prompt chunks may take (a short prompt's wait for the step "
        "in progress); none: the token budget alone",
    )
    bulk_step_slack: float = setting(
        0.25,
        "how much slower bulk (batch job) decode rows may make a step beside interactive rows, "
        "from the measured decode step times (0: none beside them; a large number: no bound)",
    )
    cuda_graphs: bool = setting(
        False,
        "decode, CUDA only: replay decode steps from CUDA graphs, one per batch-size bucket "
        "(prompt chunks stay eager)",
    )
    threads: int | None = setting(None, "torch threads (default: torch's choice)")
    transfer_timeout_s: float = setting(
        30.0, "prefill: how long a KV transfer may wait for its ack"
    )
    peer_socket_idle_s: float = setting(
        300.0,
        "close a socket to a gateway or decode worker unused this long (a peer that restarted "
        "elsewhere left its old address behind)",
    )
    swap_bytes: int = setting(
        512 << 20, "decode: host memory for preempted sequences' KV (0: recompute only)"
    )
    preemption_mode: str = setting(
        "auto", "decode: swap or recompute a preempted sequence: auto (by cost), swap, recompute"
    )
    enable_prefix_caching: bool = setting(
        True, "keep computed KV blocks for later prompts that start with the same tokens"
    )
    prefix_cache_max_blocks: int | None = setting(
        None, "most unreferenced blocks the prefix cache keeps (unset: the whole pool)"
    )
    host_cache_bytes: int = setting(
        256 << 20,
        "host memory for cached blocks evicted from the KV pool, found again on a hit: up to this "
        "much of --swap-bytes, which swapped sequences take back first (0: no host tier)",
    )
    think_time_retention_s: float = setting(
        30.0,
        "decode: for how long a finished turn's cached blocks are evicted only after all other "
        "cached blocks (its conversation's next turn comes after a tool call); 0: plain LRU",
    )
    share_prefix_cache: bool = setting(
        False, "share cached prefixes between tenants (off: a tenant only hits its own)"
    )
    metrics_port: int | None = setting(
        None, "HTTP port of the Prometheus /metrics (0: any free port; unset: not served)"
    )
    metrics_host: str = setting("127.0.0.1", "host the /metrics server binds")

    def __post_init__(self) -> None:
        self.curve_keys()
        if self.dtype not in DTYPE_CHOICES:
            raise ConfigError(
                f"dtype (--dtype / TANDEM_DTYPE) must be one of {', '.join(DTYPE_CHOICES)}"
            )
        if self.decode_attention not in DECODE_ATTENTION_CHOICES:
            choices = ", ".join(DECODE_ATTENTION_CHOICES)
            raise ConfigError(
                f"decode_attention (--decode-attention / TANDEM_DECODE_ATTENTION) must be one of "
                f"{choices}, got {self.decode_attention!r}"
            )
        try:
            parse_device(self.device)
        except ValueError as error:
            raise ConfigError(f"{error} (--device / TANDEM_DEVICE)") from None
        try:
            _ = self.linear_backend  # a quantization this dtype and device can run
        except ValueError as error:
            raise ConfigError(f"{error} (--quantization / TANDEM_QUANTIZATION)") from None
        if self.cuda_graphs and self.torch_device.type != "cuda":
            raise ConfigError(
                f"cuda_graphs (--cuda-graphs / TANDEM_CUDA_GRAPHS) needs --device cuda, "
                f"got {self.device}"
            )
        require_address(self, "scheduler_address", "address", "advertise_address")
        require_distinct_addresses(self, "address", "scheduler_address")
        require_port(self, "metrics_port")
        require_positive(
            self,
            "kv_cache_bytes",
            "block_size",
            "max_num_seqs",
            "max_num_batched_tokens",
            "threads",
            "transfer_timeout_s",
            "peer_socket_idle_s",
            "step_time_target_s",
        )
        if self.prefix_cache_max_blocks is not None and self.prefix_cache_max_blocks < 0:
            raise ConfigError(
                "prefix_cache_max_blocks (--prefix-cache-max-blocks / "
                "TANDEM_PREFIX_CACHE_MAX_BLOCKS) must be >= 0"
            )
        if self.swap_bytes < 0:
            raise ConfigError("swap_bytes (--swap-bytes / TANDEM_SWAP_BYTES) must be >= 0")
        if self.host_cache_bytes < 0:
            raise ConfigError(
                "host_cache_bytes (--host-cache-bytes / TANDEM_HOST_CACHE_BYTES) must be >= 0"
            )
        if not 0 <= self.bulk_step_slack < math.inf:
            raise ConfigError(
                "bulk_step_slack (--bulk-step-slack / TANDEM_BULK_STEP_SLACK) must be >= 0 and "
                f"finite, got {self.bulk_step_slack}"
            )
        if not self.think_time_retention_s >= 0:
            raise ConfigError(
                "think_time_retention_s (--think-time-retention-s / "
                "TANDEM_THINK_TIME_RETENTION_S) must be >= 0"
            )
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ConfigError(
                "preemption_mode (--preemption-mode / TANDEM_PREEMPTION_MODE) must be one of "
                f"{', '.join(PREEMPTION_MODES)}, got {self.preemption_mode!r}"
            )

    def check_kv_budget(self) -> None:
        """ConfigError unless kv_cache_bytes holds one block of the model's: read from its
        config file alone, so that a worker (and `tandem up`) refuses it before any weight
        loads, where the engine found it after (a minute and more for a big model)."""
        from transformers import AutoConfig  # (as load_model: a heavy import, when needed)

        directory, _ = resolve_model_dir(self.model)
        try:  # (a checkpoint the forward does not serve: quantized, not SiLU; it was a traceback)
            model_config = ModelConfig.from_hf(AutoConfig.from_pretrained(directory))
        except (ValueError, OSError) as error:
            raise ConfigError(f"--model {self.model}: {error}") from None
        num_blocks_for_budget(model_config, self.block_size, self.torch_dtype, self.kv_cache_bytes)
        self._check_kv_budget_fits_device()

    def _check_kv_budget_fits_device(self) -> None:
        """A budget past all the device's memory cannot be allocated: it was a traceback once the
        model had loaded (torch's storage size overflowed, or its allocator ran out)."""
        memory_bytes = device_memory_bytes(self.torch_device)
        if memory_bytes is not None and self.kv_cache_bytes > memory_bytes:
            raise ConfigError(
                f"kv_cache_bytes (--kv-cache-bytes / TANDEM_KV_CACHE_BYTES) is "
                f"{self.kv_cache_bytes} bytes, past the {memory_bytes} bytes of memory the "
                f"{self.device} device has"
            )

    def engine_config(self, **overrides) -> EngineConfig:
        return EngineConfig(
            block_size=self.block_size,
            kv_cache_bytes=self.kv_cache_bytes,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            swap_bytes=self.swap_bytes,
            preemption_mode=self.preemption_mode,
            enable_prefix_caching=self.enable_prefix_caching,
            prefix_cache_max_blocks=self.prefix_cache_max_blocks,
            host_cache_bytes=self.host_cache_bytes,
            cache_model_id=self.model,
            cuda_graphs=self.cuda_graphs,
            bulk_step_slack=self.bulk_step_slack,
            **overrides,
        )

    @property
    def torch_dtype(self):
        """The dtype the worker runs in, `auto` resolved for its device."""
        return parse_dtype(self.dtype, self.torch_device)

    @property
    def torch_device(self):
        return parse_device(self.device)

    @property
    def linear_backend(self) -> str:
        """The model's linear layers (`shared.engine.linear`), as `quantization` says."""
        return linear_backend_for(self.quantization, self.torch_dtype, self.torch_device)

    def resolved_peer_id(self, role: str) -> str:
        return self.peer_id or f"{role}-{socket.gethostname()}-{os.getpid()}"


def device_memory_bytes(device) -> int | None:
    """This machine's RAM for the CPU; None for another device. (A GPU's would be asked of the
    CUDA runtime, which `tandem up`, checking its workers' settings, would then hold for the
    cluster's life: its worker's allocation refuses a budget past it.)"""
    if device.type != "cpu":
        return None
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
