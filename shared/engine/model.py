"""A Llama-family decoder written against the paged KV cache.

One forward runs a `StepBatch` (prompt chunks and decode tokens flattened together): each layer
projects q, k and v in one matmul, rotates q and k, writes the new k and v into the cache at the
batch's slots, attends through the block tables (`kernels.paged_attention`), and runs the SwiGLU
MLP with gate and up fused into one matmul. Only each sequence's last token reaches the LM head
(and a prompt's every token when its prompt logprobs are asked: `logits`).

Weights are held as plain tensors and `shared.engine.linear` layers (no autograd, no nn.Module),
loaded from transformers' names by `load_hf_weights`, which fuses q/k/v and gate/up as it goes and
packs the matrices for the device's fastest matmul (oneDNN's layout on the CPU).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.attention_plan import AttentionPlan, plan_attention
from kernels.cpu_decode_attention import CpuDecodeAttention, NewTokens
from kernels.kv_write import write_kv
from kernels.paged_attention import paged_attention, triton_decodes
from shared.engine.kv_cache import KVCache
from shared.engine.linear import Linear, make_linear
from shared.engine.model_config import ModelConfig
from shared.engine.rope import RotaryEmbedding, apply_rotary
from shared.engine.step_batch import StepBatch


@dataclass
class DecoderLayerWeights:
    input_norm: torch.Tensor  # [hidden]
    qkv: Linear  # hidden -> (heads + 2 * kv_heads) * head_dim
    o: Linear  # heads * head_dim -> hidden
    post_attention_norm: torch.Tensor  # [hidden]
    gate_up: Linear  # hidden -> 2 * intermediate
    down: Linear  # intermediate -> hidden


@dataclass(frozen=True)
class StepContext:
    """What every layer of one step shares, computed once per step rather than per layer."""

    batch: StepBatch
    cos: torch.Tensor  # [tokens, 1, head_dim]
    sin: torch.Tensor
    attention_plan: AttentionPlan | None  # the CPU reference's gather indices and masks
    # A pure decode step on the C decode kernel: it rotates, writes the new K/V and attends in one
    # call per layer (torch's dozen calls for rotary and the KV write made decode steps of 1-16
    # sequences 8-9% longer).
    fused_decode: bool = False


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:  # one fused op; identical to the float32 path below
        return F.rms_norm(x, weight.shape, weight, eps)
    # Normalize in float32 whatever the activation dtype, round, then scale, as transformers
    # does (the fused op without a weight gives the same bits as the formula, in fewer kernels).
    return weight * F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)


class LlamaModel:
    def __init__(
        self,
        config: ModelConfig,
        layers: list[DecoderLayerWeights],
        embed_tokens: torch.Tensor,
        final_norm: torch.Tensor,
        lm_head: Linear,
        max_positions: int | None = None,
        decode_kernel: CpuDecodeAttention | None = None,
    ):
        self.config = config
        self.layers = layers
        self.embed_tokens = embed_tokens
        self.final_norm = final_norm
        self.lm_head = lm_head
        # Decode rows' attention on the CPU, read straight from the cache (bfloat16; None: the
        # torch reference's groups).
        self.decode_kernel = decode_kernel
        self.dtype = embed_tokens.dtype
        self.device = embed_tokens.device
        self.max_positions = max_positions or config.context_len
        self.rotary = RotaryEmbedding(
            config.rope_parameters,
            config.head_dim,
            self.max_positions,
            dtype=self.dtype,
            device=self.device,
            max_position_embeddings=config.max_position_embeddings,
        )
        self._q_size = config.num_heads * config.head_dim
        self._kv_size = config.num_kv_heads * config.head_dim
        self._scale = config.head_dim**-0.5

    @torch.inference_mode()
    def step(self, batch: StepBatch, kv_cache: KVCache) -> torch.Tensor:
        """Runs one step; returns float32 logits [num_seqs, vocab] of each sequence's last token."""
        hidden = self.forward(batch, kv_cache)
        return self.logits(hidden.index_select(0, batch.last_token_indices))

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [rows, vocab] of `forward`'s hidden states [rows, hidden]."""
        return self.lm_head(rms_norm(hidden, self.final_norm, self.config.rms_norm_eps)).float()

    @torch.inference_mode()
    def forward(self, batch: StepBatch, kv_cache: KVCache) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] after the last layer, before the final norm."""
        hidden = F.embedding(batch.token_ids, self.embed_tokens)
        context = self._step_context(batch, kv_cache)
        for index, layer in enumerate(self.layers):
            key_cache, value_cache = kv_cache.layer(index)
            hidden = hidden + self._attention(layer, hidden, context, key_cache, value_cache)
            hidden = hidden + self._mlp(layer, hidden)
        return hidden

    def _step_context(self, batch: StepBatch, kv_cache: KVCache) -> StepContext:
        cos, sin = self.rotary.lookup(batch.positions)
        plan = None
        # Exactly the batches `paged_attention` sends to the reference get a plan, once per step
        # (without it the reference would plan again in every layer); Triton decode plans nothing.
        head_dim = self.config.head_dim
        if not triton_decodes(batch.token_ids.is_cuda, batch.max_query_len, head_dim):
            plan = plan_attention(
                batch.block_tables,
                batch.context_lens,
                batch.query_start_loc,
                block_size=kv_cache.block_size,
                max_query_len=batch.max_query_len,
                max_context_len=batch.max_context_len,
                paged_decode=self.decode_kernel is not None,
            )
        fused = plan is not None and plan.decode_rows is not None and not plan.prefill
        return StepContext(batch, cos, sin, plan, fused)

    def _attention(
        self,
        layer: DecoderLayerWeights,
        hidden: torch.Tensor,
        context: StepContext,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
    ) -> torch.Tensor:
        c = self.config
        batch = context.batch
        x = rms_norm(hidden, layer.input_norm, c.rms_norm_eps)
        qkv = layer.qkv(x)
        q, k, v = qkv.split([self._q_size, self._kv_size, self._kv_size], dim=-1)
        num_tokens = hidden.shape[0]
        q = q.view(num_tokens, c.num_heads, c.head_dim)
        k = k.view(num_tokens, c.num_kv_heads, c.head_dim)
        v = v.reshape(num_tokens, c.num_kv_heads, c.head_dim)
        if context.fused_decode:
            return layer.o(self._fused_decode(q, k, v, context, key_cache, value_cache))
        q, k = apply_rotary(q, k, context.cos, context.sin)
        write_kv(k, v, key_cache, value_cache, batch.slot_mapping)
        out = paged_attention(
            q,
            key_cache,
            value_cache,
            batch.block_tables,
            batch.context_lens,
            batch.query_start_loc,
            scale=self._scale,
            max_query_len=batch.max_query_len,
            max_context_len=batch.max_context_len,
            plan=context.attention_plan,
            decode_kernel=self.decode_kernel,
        )
        return layer.o(out.reshape(num_tokens, self._q_size))

    def _fused_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        context: StepContext,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
    ) -> torch.Tensor:
        """Rotary, KV write and attention of a pure decode step in the C kernel's one call."""
        batch = context.batch
        out = q.new_empty(q.shape)
        self.decode_kernel(
            q,
            key_cache,
            value_cache,
            batch.block_tables,
            batch.context_lens,
            context.attention_plan.decode_rows,
            out,
            scale=self._scale,
            new_tokens=NewTokens(k, v, context.cos, context.sin, batch.slot_mapping),
        )
        return out.view(q.shape[0], self._q_size)

    def _mlp(self, layer: DecoderLayerWeights, hidden: torch.Tensor) -> torch.Tensor:
        x = rms_norm(hidden, layer.post_attention_norm, self.config.rms_norm_eps)
        gate, up = layer.gate_up(x).chunk(2, dim=-1)
        return layer.down(F.silu(gate) * up)


def load_hf_weights(
    config: ModelConfig,
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    max_positions: int | None = None,
    linear_backend: str = "auto",
    decode_kernel: CpuDecodeAttention | None = None,
) -> LlamaModel:
    """Builds the model from transformers' parameter names (`model.layers.0.self_attn...`);
    `linear_backend` is `shared.engine.linear`'s (`auto`: oneDNN-packed where the CPU can);
    `decode_kernel` attends decode rows on the CPU (see `LlamaModel`)."""
    w = {name: t for name, t in named_tensors}
    embed_name, head_name = "model.embed_tokens.weight", "lm_head.weight"
    if config.tie_word_embeddings and embed_name not in w and head_name in w:
        # A tied checkpoint's one tensor, stored under the head's name: transformers ties the
        # embedding to it as readily as the other way round.
        w[embed_name] = w.pop(head_name)
    missing: list[str] = []
    # Tensors shaped unlike the config says (transformers' "size mismatch"): loaded anyway, they
    # failed at the first step, or ran with token ids past the embedding or the vocabulary.
    misshapen: list[str] = []
    c = config
    q_rows, kv_rows = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    hidden, intermediate = c.hidden_size, c.intermediate_size

    def take(name: str, shape: tuple[int, ...], required: bool = True) -> torch.Tensor | None:
        tensor = w.pop(name, None)
        if tensor is None:
            if required:
                missing.append(name)
            return None
        if tuple(tensor.shape) != shape:
            misshapen.append(f"{name} is {list(tensor.shape)}, not {list(shape)}")
            return None
        return tensor.to(dtype=dtype, device=device).contiguous()

    def fused(*parts: tuple[str, tuple[int, ...]], required: bool = True) -> torch.Tensor | None:
        tensors = [take(name, shape, required) for name, shape in parts]
        return None if any(t is None for t in tensors) else torch.cat(tensors, dim=0).contiguous()

    def linear(prefix: str, rows: dict[str, int], in_features: int, bias: bool) -> Linear | None:
        """The projections `prefix + part` (of `rows[part]` outputs each) fused into one layer
        (None if a weight is missing or misshapen)."""
        weight = fused(*((f"{prefix}{part}.weight", (n, in_features)) for part, n in rows.items()))
        bias_tensor = fused(
            *((f"{prefix}{part}.bias", (n,)) for part, n in rows.items()), required=bias
        )
        return None if weight is None else make_linear(weight, bias_tensor, linear_backend)

    layers = []
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        attn, mlp = p + "self_attn.", p + "mlp."
        qkv_rows = {"q_proj": q_rows, "k_proj": kv_rows, "v_proj": kv_rows}
        layers.append(
            DecoderLayerWeights(
                input_norm=take(p + "input_layernorm.weight", (hidden,)),
                qkv=linear(attn, qkv_rows, hidden, bias=c.qkv_bias),
                o=linear(attn, {"o_proj": hidden}, q_rows, bias=c.o_bias),
                post_attention_norm=take(p + "post_attention_layernorm.weight", (hidden,)),
                gate_up=linear(
                    mlp, {"gate_proj": intermediate, "up_proj": intermediate}, hidden, c.mlp_bias
                ),
                down=linear(mlp, {"down_proj": hidden}, intermediate, bias=c.mlp_bias),
            )
        )
    embed = take(embed_name, (c.vocab_size, hidden))
    final_norm = take("model.norm.weight", (hidden,))
    lm_head = take(head_name, (c.vocab_size, hidden), required=not c.tie_word_embeddings)
    if lm_head is None:
        lm_head = embed
    # Rotary inverse frequencies are recomputed from the config, never loaded.
    leftovers = [n for n in w if not n.endswith("rotary_emb.inv_freq")]
    if missing or leftovers or misshapen:
        raise ValueError(
            f"weights do not match the config: missing {missing}, unused {leftovers}, "
            f"shaped otherwise {misshapen}"
        )
    head = make_linear(lm_head, None, linear_backend)
    return LlamaModel(config, layers, embed, final_norm, head, max_positions, decode_kernel)
