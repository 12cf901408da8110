"""Conversions between wire types and engine types, in one place for every service."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from shared import wire
from shared.engine.constraint import Constraint
from shared.engine.sampling_params import SamplingParams

if TYPE_CHECKING:  # a worker's engine output; the gateway converts requests without torch
    from shared.engine.engine import RequestOutput

_FIELDS = [f.name for f in dataclasses.fields(wire.SamplingSpec)]


def sampling_params(spec: wire.SamplingSpec) -> SamplingParams:
    """Raises InvalidRequestError (naming the field) for values the engine refuses."""
    values = {name: getattr(spec, name) for name in _FIELDS}
    values["stop_token_ids"] = tuple(values["stop_token_ids"])
    values["logit_bias"] = tuple(values["logit_bias"])
    if spec.constraint is not None:
        values["constraint"] = Constraint(spec.constraint.kind, spec.constraint.spec)
    return SamplingParams(**values)


def sampling_spec(params: SamplingParams) -> wire.SamplingSpec:
    values = {name: getattr(params, name) for name in _FIELDS}
    values["stop_token_ids"] = list(values["stop_token_ids"])
    values["logit_bias"] = list(values["logit_bias"])
    if params.constraint is not None:
        constraint = params.constraint
        values["constraint"] = wire.ConstraintSpec(kind=constraint.kind, spec=constraint.spec)
    return wire.SamplingSpec(**values)


def token_delta(
    output: RequestOutput, index: int, finish_reason: str | None = None
) -> wire.TokenDelta:
    """`output`'s new tokens as a delta whose first token is the output's `index`th."""
    has_logprobs = bool(output.new_logprobs)
    prompt = output.prompt_logprobs
    return wire.TokenDelta(
        request_id=output.request_id,
        token_ids=list(output.new_token_ids),
        logprobs=[lp.logprob for lp in output.new_logprobs] if has_logprobs else None,
        top_logprobs=[list(lp.top or []) for lp in output.new_logprobs] if has_logprobs else None,
        prompt_logprobs=None if prompt is None else [lp.logprob for lp in prompt],
        prompt_top_logprobs=None if prompt is None else [list(lp.top or []) for lp in prompt],
        finish_reason=finish_reason,
        error=output.error,
        index=index,
    )
