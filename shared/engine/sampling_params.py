"""A request's sampling parameters, validated where they are built, and its random generator.

Every refusal raises `InvalidRequestError` naming the field, so the HTTP API, the RPC front door and
the engine all answer a bad value the same way.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shared.engine.constraint import Constraint
from shared.errors import InvalidRequestError

if TYPE_CHECKING:  # imported where a generator is made: a gateway validates without torch
    import torch

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 4096  # tokens biased per request (the wire's longest list, `MAX_LIST_LEN`)
MAX_STOP_TOKEN_IDS = 4096  # the wire's longest list too: a longer one failed the SUBMIT's encoding
MAX_ABS_LOGIT_BIAS = 100.0  # OpenAI's range: -100 bans a token, 100 all but forces it
# Past any vocabulary; the sampler builds its top-k column as int64, which 2**63 overflowed in
# the middle of a step (the whole batch's).
GREEDY_BELOW_TEMPERATURE = 1e-5  # a lower temperature samples greedily (vLLM's bound)
MAX_TOP_K = 2**31 - 1
_MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed accepts no larger value
_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)


def _as_int(name: str, value: object) -> int:
    # bool is an int subclass, but `max_tokens: true` is a client bug, not a 1.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InvalidRequestError(name, f"must be an integer, got {value!r}")
    return int(value)


def _as_float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidRequestError(name, f"must be a number, got {value!r}")
    try:
        number = float(value)
    except OverflowError:  # an int past the largest float (JSON allows 300 digits and more)
        raise InvalidRequestError(name, "must be a number a float can hold") from None
    if not math.isfinite(number):
        raise InvalidRequestError(name, f"must be finite, got {value!r}")
    return number


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise InvalidRequestError(name, message)


@dataclass(frozen=True)
class SamplingParams:
    """How one request turns logits into tokens. Validated when built; numbers are normalized
    (ints given for floats become floats, `stop_token_ids` becomes a tuple)."""

    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 or -1: off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # None: none; 0: the chosen token's; n: also the top n
    # The prompt's tokens too (each but the first, as the model predicted it from those before:
    # what `echo` shows and perplexity needs), with the top n; None: not asked. A prompt asking
    # is computed whole (its prefix is never taken from the cache) and not cached.
    prompt_logprobs: int | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    constraint: Constraint | None = None  # structured output: what the output must match
    # Added to the logits of these tokens before sampling (after penalties), as (token id,
    # bias) pairs sorted by id; a dict {id: bias} is taken too. Logprobs stay the model's own.
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        self._normalize_types()
        self._check_ranges()

    def _set(self, name: str, value: object) -> None:
        object.__setattr__(self, name, value)

    def _normalize_types(self) -> None:
        for name in ("max_tokens", "top_k", "min_tokens"):
            self._set(name, _as_int(name, getattr(self, name)))
        for name in _FLOAT_FIELDS:
            self._set(name, _as_float(name, getattr(self, name)))
        for name in ("seed", "logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                self._set(name, _as_int(name, getattr(self, name)))
        _check(isinstance(self.ignore_eos, bool), "ignore_eos", "must be a boolean")
        ids = self.stop_token_ids
        _check(isinstance(ids, (list, tuple)), "stop_token_ids", "must be a list of token ids")
        self._set("stop_token_ids", tuple(_as_int("stop_token_ids", i) for i in ids))
        self._set("logit_bias", _logit_bias_pairs(self.logit_bias))
        _check(
            self.constraint is None or isinstance(self.constraint, Constraint),
            "constraint",
            "must be a Constraint (shared.engine.constraint)",
        )

    def _check_ranges(self) -> None:
        _check(self.max_tokens >= 1, "max_tokens", f"must be >= 1, got {self.max_tokens}")
        _check(
            0 <= self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}",
        )
        _check(self.temperature >= 0, "temperature", f"must be >= 0, got {self.temperature}")
        _check(
            self.top_k in (-1, 0) or 1 <= self.top_k <= MAX_TOP_K,
            "top_k",
            f"must be in [1, {MAX_TOP_K}], or 0 or -1 for no limit, got {self.top_k}",
        )
        _check(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(0 <= self.min_p <= 1, "min_p", f"must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(-2 <= value <= 2, name, f"must be in [-2, 2], got {value}")
        penalty = self.repetition_penalty
        _check(penalty > 0, "repetition_penalty", f"must be > 0, got {penalty}")
        seed = self.seed
        _check(seed is None or 0 <= seed <= _MAX_SEED, "seed", f"must be in [0, 2**64), got {seed}")
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(self, name)
            within = n is None or 0 <= n <= MAX_LOGPROBS
            _check(within, name, f"must be in [0, {MAX_LOGPROBS}], got {n}")
        ids = self.stop_token_ids
        _check(
            len(ids) <= MAX_STOP_TOKEN_IDS,
            "stop_token_ids",
            f"at most {MAX_STOP_TOKEN_IDS} ids, got {len(ids)}",
        )
        _check(all(i >= 0 for i in ids), "stop_token_ids", f"ids must be >= 0, got {list(ids)}")
        self._check_logit_bias()

    def _check_logit_bias(self) -> None:
        pairs = self.logit_bias
        _check(
            len(pairs) <= MAX_LOGIT_BIAS,
            "logit_bias",
            f"at most {MAX_LOGIT_BIAS} tokens, got {len(pairs)}",
        )
        for token_id, bias in pairs:
            _check(token_id >= 0, "logit_bias", f"token ids must be >= 0, got {token_id}")
            _check(
                -MAX_ABS_LOGIT_BIAS <= bias <= MAX_ABS_LOGIT_BIAS,
                "logit_bias",
                f"biases must be in [-100, 100], got {bias} for token {token_id}",
            )
        ids = [token_id for token_id, _ in pairs]
        _check(len(set(ids)) == len(ids), "logit_bias", "each token id at most once")

    @property
    def greedy(self) -> bool:
        """Temperature 0 (or below `GREEDY_BELOW_TEMPERATURE`, as vLLM: dividing by it
        overflows float32), or top_k 1."""
        return self.temperature < GREEDY_BELOW_TEMPERATURE or self.top_k == 1

    @property
    def logit_bias_ids(self) -> tuple[int, ...]:
        return tuple(token_id for token_id, _ in self.logit_bias)

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


def remaining_params(params: SamplingParams, num_output: int) -> SamplingParams:
    """The sampling of what is left of a request that has `num_output` tokens already (resumed,
    its earlier tokens computed as the prompt's end): max_tokens and min_tokens count them.
    Only for `num_output < params.max_tokens` (a request at max_tokens has ended)."""
    if num_output == 0:
        return params
    return dataclasses.replace(
        params,
        max_tokens=params.max_tokens - num_output,
        min_tokens=max(params.min_tokens - num_output, 0),
    )


def _logit_bias_pairs(value: object) -> tuple[tuple[int, float], ...]:
    """(token id, bias) pairs sorted by id, from pairs or a dict; types checked, not ranges."""
    if isinstance(value, dict):
        value = list(value.items())
    _check(
        isinstance(value, (list, tuple)),
        "logit_bias",
        "must map token ids to biases (a dict, or (id, bias) pairs)",
    )
    pairs = []
    for pair in value:
        _check(
            isinstance(pair, (list, tuple)) and len(pair) == 2,
            "logit_bias",
            f"must map token ids to biases, got the item {pair!r}",
        )
        pairs.append((_as_int("logit_bias", pair[0]), _as_float("logit_bias", pair[1])))
    return tuple(sorted(pairs))


def token_seed(seed: int, index: int) -> int:
    """The seed of the draw of a seeded request's output token `index` (splitmix64 of the two):
    a draw that depends on the request's seed and the token's place alone, not on how many
    draws its generator made before (a request preempted and resumed elsewhere from its
    tokens starts a fresh generator; its next token must be the one it would have drawn)."""
    mask = (1 << 64) - 1
    x = (seed + (index + 1) * 0x9E3779B97F4A7C15) & mask
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
    return x ^ (x >> 31)


def make_generator(params: SamplingParams) -> torch.Generator | None:
    """The request's own RNG: a CPU generator seeded with `params.seed`, or freshly from the OS
    when there is none; None for a greedy request, which draws nothing."""
    if params.greedy:
        return None
    import torch

    generator = torch.Generator(device="cpu")
    if params.seed is None:
        generator.seed()  # non-deterministic, and leaves torch's global RNG alone
    else:
        generator.manual_seed(params.seed)
    return generator
