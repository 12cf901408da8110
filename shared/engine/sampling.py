"""Sampling: one step's logits in, one token per sequence out.

Per row, in this order: suppressed tokens (e.g. EOS under `min_tokens`) go to -inf (unless the
row's grammar allows nothing else: a complete structure ends the choice); the repetition
penalty scales logits of tokens seen in the prompt or output; frequency and presence penalties are
subtracted for tokens in the output; the request's `logit_bias` is added to its tokens' logits.
A greedy row then takes the argmax. Any other row is divided
by its temperature and filtered: top-k, then top-p on the renormalized survivors, then min-p; the
token is drawn from what is left.

The draw is an exponential race: with q_i ~ Exp(1) independent, argmax_i p_i / q_i is distributed
as p (q_i / p_i ~ Exp(p_i), and the smallest of independent exponentials is i with probability
p_i). Each row draws exactly `vocab` uniforms (q = -log u) from its own CPU generator per step,
whatever it keeps, and every filter computes each row from that row alone, so a seeded request
yields the same tokens whatever else shares the batch and wherever it sits in it. Filtering runs
batched; only the draws loop over rows. A batch of greedy rows without penalties, bias or
suppression takes one vectorized argmax, the decode loop's hot path.

Top-k and top-p need the best tokens in order. A partial sort of the best 1024 settles almost
every row (its top-k lies within them, or they hold top_p of the mass); only the rest, flat
distributions under a high top_p, pay for a full sort of the vocabulary.

Logprobs describe the model's own distribution, log_softmax of the raw logits before penalties,
temperature and filtering (vLLM's default), and are computed only for the rows that ask.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from shared.engine.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    """What the sampler needs about one sequence in the batch. Token ids may also be given as
    1-D long tensors, which saves a conversion per step for long prompts."""

    params: SamplingParams
    generator: torch.Generator | None  # from make_generator; None only when greedy
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    suppressed_token_ids: Sequence[int] = ()  # logit -> -inf this step (EOS under min_tokens)
    grammar_matcher: Any = None  # an xgrammar matcher (shared.engine.grammar); None: free

    @property
    def is_plain_greedy(self) -> bool:
        """Its token is the argmax of the raw logits."""
        params = self.params
        return (
            params.greedy
            and not params.has_penalties
            and not params.logit_bias
            and len(self.suppressed_token_ids) == 0
        )


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float | None]  # the chosen token's logprob; None where not asked
    # top-n (token id, logprob) best first; [] when logprobs=0, None where not asked
    top_logprobs: list[list[tuple[int, float]] | None]


def _long_tensor(ids: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.as_tensor(ids, dtype=torch.long, device=device).reshape(-1)


def apply_penalties(
    logits: torch.Tensor,
    params: SamplingParams,
    prompt_token_ids: Sequence[int],
    output_token_ids: Sequence[int],
) -> torch.Tensor:
    """A penalized copy of one row's logits [vocab]: repetition (HF/vLLM: a seen token's logit is
    divided by the penalty if positive, else multiplied), then frequency and presence (OpenAI:
    minus frequency * count + presence * (count > 0), counting the output only)."""
    out = logits.clone()
    output_ids = _long_tensor(output_token_ids, logits.device)
    if params.repetition_penalty != 1.0:
        prompt_ids = _long_tensor(prompt_token_ids, logits.device)
        seen = torch.cat([prompt_ids, output_ids]).unique()  # each id penalized once
        values = out[seen]
        penalty = params.repetition_penalty
        # (A logit of 0 stays 0: times an infinite penalty it was NaN.)
        penalized = torch.where(values > 0, values / penalty, values * penalty)
        out[seen] = torch.where(values == 0, values, penalized)
    if (params.frequency_penalty or params.presence_penalty) and output_ids.numel() > 0:
        ids, counts = output_ids.unique(return_counts=True)
        out[ids] -= params.frequency_penalty * counts.to(out.dtype) + params.presence_penalty
    return out


def _keep_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, num_candidates: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Which tokens survive top-k, then top-p of the renormalized survivors, judged among the
    `num_candidates` best of each row. Returns the keep mask [rows, vocab] and, per row, whether
    it is final: the row's top-k lies among the candidates, or it has no top-k and the
    candidates hold at least top_p of the mass, so that no token outside them could be kept.
    Each row's answer depends on that row alone, never on the others in the batch."""
    vocab = logits.shape[-1]
    size = min(num_candidates, vocab)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
    values, ids = logits.topk(size, dim=-1)  # best first
    # Top-k keeps every token as likely as the k-th, ties included (transformers' and vLLM's
    # top-k: with 16-bit logits ties are common, and keeping k of them by the sort's order
    # dropped tied tokens at random). Its survivors lie among the candidates unless the k-th
    # is past them or ties with the last of them (more ties may follow outside; tokens at
    # -inf, masked by a grammar, have no probability to keep).
    kth = values.gather(1, (k.clamp(max=size) - 1).unsqueeze(1)).squeeze(1)
    in_top_k = values >= kth.unsqueeze(1)
    spills = (values[:, -1] >= kth) & (size < vocab) & (kth > -math.inf)
    within = (k <= size) & ~spills
    # Unnormalized probabilities, 1 for the best token; `total` is the softmax denominator in
    # the same units, over the top-k survivors (known when they all lie among the candidates)
    # or over the whole row (no top-k).
    weights = (values - values[:, :1]).exp().masked_fill(~in_top_k, 0.0)
    cumulative = weights.cumsum(dim=-1)
    total = cumulative[:, -1]
    if not bool(within.all()):
        whole_row = (logits.logsumexp(dim=-1) - values[:, 0]).exp()
        total = torch.where(within, total, whole_row)
    # Keep a token while the mass strictly before it is short of top_p: the smallest prefix
    # reaching top_p, never empty (nothing comes before the first). top_p = 1 keeps all,
    # whatever the rounding of the cumulative sum.
    mass_before = torch.nn.functional.pad(cumulative[:, :-1], (1, 0))
    threshold = (top_p * total).unsqueeze(1)
    best = torch.arange(size, device=logits.device) == 0  # (a top_p that rounds to 0 in float32)
    keep = in_top_k & ((mass_before < threshold) | best | (top_p >= 1).unsqueeze(1))
    final = within | ((k == vocab) & (cumulative[:, -1] >= top_p * total))
    keep_all = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, ids, keep)
    return keep_all, final


def _mask_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, num_candidates: int
) -> torch.Tensor:
    """-inf outside each row's top-k, then outside the top-p of the renormalized survivors.
    The best `num_candidates` tokens (a partial sort) usually decide; rows whose kept set may
    reach beyond them are judged again over the whole vocabulary (a full sort)."""
    keep, final = _keep_top_k_top_p(logits, top_k, top_p, num_candidates)
    if not bool(final.all()):
        redo = (~final).nonzero().squeeze(1)
        vocab = logits.shape[-1]
        redo_keep, _ = _keep_top_k_top_p(logits[redo], top_k[redo], top_p[redo], vocab)
        keep[redo] = redo_keep
    return logits.masked_fill(~keep, -math.inf)


def filter_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    num_candidates: int = 1024,
) -> torch.Tensor:
    """The distribution a row samples from: softmax(logits / temperature) restricted to the
    top-k, then to the top-p of what is left, then to tokens with prob >= min_p * max prob;
    renormalized. `logits` is [rows, vocab]; the others are per-row [rows] tensors, top_k <= 0
    meaning no limit. Temperatures must be > 0 (greedy rows never come here).
    `num_candidates` tunes speed only: top-p first looks among that many best tokens."""
    # A logit past float32's range (a seen token's divided by a tiny repetition penalty, or a
    # large one by a low temperature) is taken as the largest float: infinities made the
    # distribution NaN. Tokens tied there share the draw; -inf (masked) stays as it is.
    scaled = (logits.float() / temperature.unsqueeze(1)).clamp_(max=torch.finfo(torch.float32).max)
    vocab = logits.shape[-1]
    filtered = ((top_k > 0) & (top_k < vocab)) | (top_p < 1)
    if bool(filtered.all()):
        scaled = _mask_top_k_top_p(scaled, top_k, top_p, num_candidates)
    elif bool(filtered.any()):
        rows = filtered.nonzero().squeeze(1)
        scaled[rows] = _mask_top_k_top_p(scaled[rows], top_k[rows], top_p[rows], num_candidates)
    probs = scaled.softmax(dim=-1)
    if bool((min_p > 0).any()):
        # Ratios to the max are unchanged by renormalization, so min-p may come last. Only the
        # rows with a floor are renormalized: a row's draw never depends on its batch mates.
        floor = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
        floored = probs.masked_fill(probs < floor, 0.0)
        floored = floored / floored.sum(dim=-1, keepdim=True)
        probs = torch.where((min_p > 0).unsqueeze(1), floored, probs)
    return probs


def _race(probs: torch.Tensor, generators: Sequence[torch.Generator]) -> torch.Tensor:
    """One token per row drawn from `probs` [rows, vocab], row i's randomness from generators[i]
    alone: exactly `vocab` uniform draws per row, on the CPU, whatever the device."""
    noise = torch.empty(probs.shape, dtype=torch.float32)
    for row_noise, generator in zip(noise, generators, strict=True):
        row_noise.uniform_(generator=generator)
    # -log(u) is Exp(1) (cheaper here than exponential_). The floor keeps it finite, so a kept
    # token (p > 0) always beats a dropped one (p / q = 0).
    noise.clamp_(min=torch.finfo(torch.float32).tiny).log_().neg_()
    return (probs / noise.to(probs.device)).argmax(dim=-1)


def _processed_logits(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Logits after suppression, penalties and the request's logit bias; a copy, the caller's
    tensor stays untouched."""
    work = logits.clone()
    for i, row in enumerate(rows):
        if len(row.suppressed_token_ids) > 0:
            _suppress(work[i], row)
        if row.params.has_penalties:
            work[i] = apply_penalties(
                work[i], row.params, row.prompt_token_ids, row.output_token_ids
            )
        if row.params.logit_bias:
            _add_logit_bias(work[i], row.params)
    return work


def _add_logit_bias(logits: torch.Tensor, params: SamplingParams) -> None:
    """OpenAI's `logit_bias`: each listed token's logit moved by its bias (a token at -inf,
    suppressed or out of the grammar, stays there)."""
    token_ids = _long_tensor(params.logit_bias_ids, logits.device)
    biases = torch.tensor([bias for _, bias in params.logit_bias], dtype=logits.dtype)
    logits[token_ids] += biases.to(logits.device)


def _suppress(logits: torch.Tensor, row: SamplingRow) -> None:
    """Sends the row's suppressed tokens to -inf, unless that leaves nothing to draw: a grammar
    that allows only EOS (its structure is complete) wins over `min_tokens`."""
    token_ids = _long_tensor(row.suppressed_token_ids, logits.device)
    kept = logits[token_ids].clone() if row.grammar_matcher is not None else None
    logits[token_ids] = -math.inf
    if kept is not None and not torch.isfinite(logits).any():
        logits[token_ids] = kept


def _filter_params(rows: Sequence[SamplingRow], device: torch.device) -> tuple[torch.Tensor, ...]:
    """Per-row (temperature, top_k, top_p, min_p) tensors, as filter_probs takes them."""
    params = [row.params for row in rows]

    def column(name: str, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor([getattr(p, name) for p in params], dtype=dtype, device=device)

    return (
        column("temperature", torch.float32),
        column("top_k", torch.long),
        column("top_p", torch.float32),
        column("min_p", torch.float32),
    )


def _sample(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    work = _processed_logits(logits, rows)
    token_ids = work.argmax(dim=-1)  # the answer for greedy rows; the others are overwritten
    random_rows = [i for i, row in enumerate(rows) if not row.params.greedy]
    if random_rows:
        chosen = [rows[i] for i in random_rows]
        if any(row.generator is None for row in chosen):
            raise ValueError("a non-greedy SamplingRow needs a generator (make_generator)")
        index = torch.tensor(random_rows, device=logits.device)
        probs = filter_probs(work[index], *_filter_params(chosen, logits.device))
        token_ids[index] = _race(probs, [row.generator for row in chosen])
    return token_ids


def _with_logprobs(
    logits: torch.Tensor, rows: Sequence[SamplingRow], token_ids: torch.Tensor
) -> SamplerOutput:
    num_rows = len(rows)
    logprobs: list[float | None] = [None] * num_rows
    top_logprobs: list[list[tuple[int, float]] | None] = [None] * num_rows
    asked = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    if asked:
        index = torch.tensor(asked, device=logits.device)
        all_logprobs = torch.log_softmax(logits[index].float(), dim=-1)  # raw: the model's own
        chosen = all_logprobs.gather(1, token_ids[index].unsqueeze(1)).squeeze(1).tolist()
        max_n = min(max(rows[i].params.logprobs for i in asked), logits.shape[-1])
        top_values, top_ids = all_logprobs.topk(max_n, dim=-1)  # sorted, best first
        top_values, top_ids = top_values.tolist(), top_ids.tolist()
        for j, i in enumerate(asked):
            n = rows[i].params.logprobs
            logprobs[i] = chosen[j]
            top_logprobs[i] = list(zip(top_ids[j][:n], top_values[j][:n], strict=True))
    return SamplerOutput(token_ids.tolist(), logprobs, top_logprobs)


class Sampler:
    """Chooses the next token of every row of a batch; see the module docstring."""

    def __init__(self) -> None:
        self._masks: Any = None  # a grammar MaskBuffer, made at the first constrained batch

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        """`logits` is [len(rows), vocab], read only. Logprobs are of the raw logits."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(rows)} rows")
        work = self._grammar_masked(logits, rows)
        if all(row.is_plain_greedy for row in rows):
            token_ids = work.argmax(dim=-1)  # the decode hot path: no per-row work
        else:
            token_ids = _sample(work, rows)
        return _with_logprobs(logits, rows, token_ids)

    def fill_masks_ahead(self, matchers: Sequence[Any], vocab_size: int) -> None:
        """Starts filling the grammar masks of these built matchers, to overlap the forward
        pass; the next call takes them. None given: nothing to start (and no xgrammar load)."""
        if matchers:
            self._mask_buffer(vocab_size).fill_ahead(matchers)

    def settle_masks(self) -> None:
        """Waits for a fill ahead that no call took (a step that sampled no constrained row)."""
        if self._masks is not None:
            self._masks.settle()

    def _grammar_masked(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """The logits themselves when no row is constrained (free batches pay one scan);
        otherwise one copy whose constrained rows are masked in place (rows filled ahead are
        copied, the rest filled in one call)."""
        matchers = [row.grammar_matcher for row in rows]
        if all(matcher is None for matcher in matchers):
            self.settle_masks()
            return logits
        work = logits.clone()
        self._mask_buffer(logits.shape[-1]).apply(work, matchers)
        return work

    def _mask_buffer(self, vocab_size: int) -> Any:
        if self._masks is None:
            from shared.engine.grammar import MaskBuffer  # xgrammar loads only when used

            self._masks = MaskBuffer(vocab_size)
        return self._masks
