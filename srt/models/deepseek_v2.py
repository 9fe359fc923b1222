"""DeepSeek-V2 (`DeepseekV2ForCausalLM`: V2, V2-Lite, and the V2.5 / Coder-V2 checkpoints of
that architecture) and DeepSeek-V3 (`DeepseekV3ForCausalLM`: V3, R1): multi-head latent
attention and DeepSeek's mixture of experts.

Multi-head latent attention (MLA). Each token's keys and values come from one latent vector:
c = norm(kv_a(x))[:kv_lora_rank] and a rotary part k_pe (shared by all heads). The pool stores
[c, rope(k_pe)] (kv_lora_rank + qk_rope_head_dim values a token and layer, one "KV head",
`kv_shared`: keys and values are the same buffer). Attention runs in the latent space with the
up-projections absorbed: a head's query q_nope is multiplied into the latent by that head's
key up-projection (W_UK^T q_nope), concatenated with its rotated q_pe, and scored against
the stored vectors: the same scores as q . k with k = [W_UK c, k_pe]. The output, a weighted
sum of stored vectors, keeps its first kv_lora_rank values (the c part) and goes through the
head's value up-projection W_UV. So every attention backend computes MLA as multi-query
attention with one head of kv_lora_rank + qk_rope_head_dim (576 on the real models); no
decompressed K/V are ever materialized, in prefill as in decode.

Rotary: interleaved pairs on the qk_rope_head_dim part, YaRN scaling with its mscale on cos
and sin, and the softmax scale qk_head_dim^-0.5 times mscale(factor, mscale_all_dim)^2.

Mixture of experts: a float32 router, softmax scores, the top k (greedy, or
`group_limited_greedy`: only within the `topk_group` groups of best expert) times
`routed_scaling_factor` (renormalized first with `norm_topk_prob`); V3: sigmoid scores and
its bias-corrected group choice (`DeepseekMoE._route_v3`); the experts in FusedMoE,
plus the shared experts as one dense MLP; the first `first_k_dense_replace` layers are dense.

Tensor parallelism splits the heads (q / q_b, kv_b, o) and the experts as elsewhere; the
latent projections (q_a, kv_a) and the router are replicated.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from srt.layers import parallel_state as ps
from srt.layers.attention.fresh_prefill import expanded_extend_attention, fresh_prefill_attention
from srt.layers.embedding import VocabParallelEmbedding
from srt.layers.forward_batch import ForwardMode, get_forward_batch
from srt.layers.fused import use_fused
from srt.layers.kv_cache_dtype import store_kv
from srt.layers.layernorm import RMSNorm
from srt.layers.linear import ColumnParallelLinear, RowParallelLinear
from srt.layers.moe import FusedMoE, ReplicatedLinear
from srt.layers.radix_attention import RadixAttention
from srt.layers.rotary import RotaryEmbedding, yarn_mscale
from srt.model_config import rope_params
from srt.models.llama import LlamaForCausalLM, LlamaMLP, LlamaModel


class MLAttention(nn.Module):
    def __init__(self, config: Any, layer_id: int, max_position: int) -> None:
        super().__init__()
        h = config.hidden_size
        heads = config.num_attention_heads
        self.nope, self.rope = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_dim, self.rank = config.v_head_dim, config.kv_lora_rank
        qk = self.nope + self.rope
        self.q_lora = config.q_lora_rank is not None
        if self.q_lora:
            self.q_a_proj = ReplicatedLinear(h, config.q_lora_rank)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, config.rms_norm_eps)
            self.q_b_proj = ColumnParallelLinear(config.q_lora_rank, heads * qk)
            self.num_heads = self.q_b_proj.out_per_rank // qk
        else:
            self.q_proj = ColumnParallelLinear(h, heads * qk)
            self.num_heads = self.q_proj.out_per_rank // qk
        self.kv_a_proj_with_mqa = ReplicatedLinear(h, self.rank + self.rope)
        self.kv_a_layernorm = RMSNorm(self.rank, config.rms_norm_eps)
        self.kv_b_proj = ColumnParallelLinear(self.rank, heads * (self.nope + self.v_dim))
        self.o_proj = RowParallelLinear(heads * self.v_dim, h)
        theta, scaling = rope_params(config)
        self.rotary_emb = RotaryEmbedding(self.rope, max_position, theta, scaling,
                                          interleaved=getattr(config, "rope_interleave", True))
        scale = qk ** -0.5
        if scaling and scaling.get("rope_type", scaling.get("type")) == "yarn" \
                and scaling.get("mscale_all_dim"):
            m = yarn_mscale(float(scaling["factor"]), float(scaling["mscale_all_dim"]))
            scale = scale * m * m
        self.attn = RadixAttention(self.num_heads, self.rank + self.rope, scale, 1, layer_id,
                                   kv_shared=True, v_head_dim=self.rank)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        t, n = x.shape[0], self.num_heads
        if self.q_lora:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        else:
            q = self.q_proj(x)
        q = q.view(t, n, self.nope + self.rope)
        q_nope, q_pe = q.split([self.nope, self.rope], -1)
        kv = self.kv_a_proj_with_mqa(x)
        # the heads' up-projections: [heads, nope + v, rank] -> W_UK [heads, nope, rank],
        # W_UV [heads, v, rank]
        w = self.kv_b_proj.weight.view(n, self.nope + self.v_dim, self.rank)
        w_uk, w_uv = w[:, : self.nope], w[:, self.nope:]
        fb = get_forward_batch()
        # a PREFILL step attends over expanded keys (`_fresh_prefill`), and so does an EXTEND
        # step where that costs less (`_expands`): no absorbed query then
        fresh = fb.forward_mode == ForwardMode.PREFILL and not fb.decode_tail
        expand = not fresh and self._expands(fb, x.dtype)
        q_lat = None if fresh or expand else torch.einsum("thd,hdr->thr", q_nope, w_uk)
        stored = False  # the latents are in the pool already
        if use_fused(x) and self.rope & (self.rope - 1) == 0:  # the norm, rotary, concatenations
            from srt.layers.mla_triton import mla_prep

            pool = fb.token_to_kv_pool.get_kv_buffer(self.attn.layer_id)[0]
            stored = pool.dtype == x.dtype  # (an FP8 pool: quantized by the attention layer)
            query, latent = mla_prep(q, q_lat, kv, self.kv_a_layernorm.weight,
                                     self.kv_a_layernorm.eps, positions,
                                     self.rotary_emb.cos_cache, self.rotary_emb.sin_cache,
                                     self.nope, self.rotary_emb.interleaved,
                                     pool if stored else None, fb.out_cache_loc)
            q_pe = query[..., self.rank:]
        else:
            c, k_pe = kv.split([self.rank, self.rope], dim=-1)
            c = self.kv_a_layernorm(c.contiguous())
            q_pe, k_pe = self.rotary_emb(positions, q_pe, k_pe.unsqueeze(1))
            query = None if fresh or expand else torch.cat((q_lat, q_pe), dim=-1)
            latent = torch.cat((c.unsqueeze(1), k_pe), dim=-1)  # [T, 1, rank + rope]
        if fresh:
            out = self._fresh_prefill(fb, q_nope, q_pe, latent, stored)
        elif expand:
            out = self._expanded_extend(fb, q_nope, q_pe, latent, stored)
        else:
            o = self.attn(query, latent, latent, kv_stored=stored).view(
                t, n, self.rank + self.rope)
            out = torch.einsum("thr,hvr->thv", o[..., : self.rank], w_uv)
        return self.o_proj(out.reshape(t, n * self.v_dim))

    def _fresh_prefill(self, fb: Any, q_nope: torch.Tensor, q_pe: torch.Tensor,
                       latent: torch.Tensor, stored: bool) -> torch.Tensor:
        """A PREFILL step (no cached prefix): the latents go into the pool as always, but the
        attention runs over them expanded per head (keys nope + rope, values v_dim wide), as
        transformers computes it, rather than absorbed (576-wide keys): [T, heads, v_dim]."""
        if not stored:
            k_buf, _ = fb.token_to_kv_pool.get_kv_buffer(self.attn.layer_id)
            store_kv(k_buf, fb.out_cache_loc, latent, self.attn.k_scale)
        k, v = self._expand(latent)
        q = torch.cat((q_nope, q_pe), dim=-1)
        return fresh_prefill_attention(q, k, v, fb.attn_metadata, fb.extend_lens_cpu,
                                       self.attn.scaling)

    def _expand(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Latents [T, 1, rank + rope] -> per-head keys [T, heads, nope + rope] and values
        [T, heads, v_dim] (kv_b_proj's up-projections; the rotary part shared by the heads)."""
        t, n = latent.shape[0], self.num_heads
        c, k_pe = latent[:, 0, : self.rank], latent[:, :, self.rank:]
        kv = F.linear(c, self.kv_b_proj.weight).view(t, n, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        return torch.cat((k_nope, k_pe.expand(t, n, self.rope)), dim=-1), v

    def _expands(self, fb: Any, dtype: torch.dtype) -> bool:
        """Whether an EXTEND step (not mixed) attends over expanded keys: its cached prefixes'
        latents, read from a pool in the model's dtype, expanded by kv_b_proj (2 x rank x
        (nope + v) products a prefix token and head) where the (query, key) pairs' products
        this saves against the absorbed path (scores over the latent padded to a power of
        two, values over rank, against both over nope + rope padded) are more, and the
        temporary keys and values of at most EXPAND_MAX_PREFIX_TOKENS tokens. For
        DeepSeek-V2-Lite's shapes: when a step has over 128 pairs a prefix token (a chunked
        prompt's next 4,096-token chunk, not a few draft tokens)."""
        if fb.forward_mode != ForwardMode.EXTEND or fb.decode_tail:
            return False
        prefix = sum(fb.prefix_lens_cpu)
        if not 0 < prefix <= EXPAND_MAX_PREFIX_TOKENS or fb.token_to_kv_pool.get_kv_buffer(
                self.attn.layer_id)[0].dtype != dtype:
            return False
        return expanded_extend_pays(fb.prefix_lens_cpu, fb.extend_lens_cpu, self.rank,
                                    self.rope, self.nope, self.v_dim)

    def _expanded_extend(self, fb: Any, q_nope: torch.Tensor, q_pe: torch.Tensor,
                         latent: torch.Tensor, stored: bool) -> torch.Tensor:
        """An EXTEND step over expanded keys and values: the new tokens' latents (stored as
        always) and the requests' cached ones, gathered from the pool and expanded alike."""
        k_buf, _ = fb.token_to_kv_pool.get_kv_buffer(self.attn.layer_id)
        if not stored:
            store_kv(k_buf, fb.out_cache_loc, latent, self.attn.k_scale)
        if fb.prefix_slots is None:  # (once a step: every layer reads the same slots)
            fb.prefix_slots = _prefix_slots(fb)
        k, v = self._expand(latent)
        k_prefix, v_prefix = self._expand(k_buf[fb.prefix_slots])
        q = torch.cat((q_nope, q_pe), dim=-1)
        return expanded_extend_attention(q, k, v, k_prefix, v_prefix, fb.attn_metadata,
                                         fb.prefix_lens_cpu, fb.extend_lens_cpu,
                                         self.attn.scaling)


# The most cached tokens an EXTEND step expands into temporary per-head keys and values (about
# 12 KB a token and layer on DeepSeek-V2-Lite's shapes); beyond, it keeps the absorbed path.
EXPAND_MAX_PREFIX_TOKENS = 32768


def expanded_extend_pays(prefix_lens: list[int], extend_lens: list[int], rank: int, rope: int,
                         nope: int, v_dim: int) -> bool:
    """Whether expanding the cached latents (2 x rank x (nope + v_dim) products a prefix
    token and head) costs less than the absorbed path's extra products on the step's (query,
    key) pairs: scores over the latent padded to a power of two plus values over rank, against
    scores and values over nope + rope padded."""
    pairs = sum(n * (p + (n + 1) / 2) for p, n in zip(prefix_lens, extend_lens))
    absorbed = 2 * (1 << (rank + rope - 1).bit_length()) + 2 * rank
    expanded = 4 * (1 << (nope + rope - 1).bit_length())
    return pairs * (absorbed - expanded) > sum(prefix_lens) * 2 * rank * (nope + v_dim)


def _prefix_slots(fb: Any) -> torch.Tensor:
    """The pool slots of every request's cached prefix, packed by request in position order,
    from the device's tables (the prefix lengths from the step's metadata where it holds them
    on the device: no copy that waits for the device)."""
    prefix = fb.prefix_lens_cpu
    total, dev = sum(prefix), fb.req_pool_indices.device
    lens = getattr(fb.attn_metadata, "prefix_lens", None)
    lens = lens.long() if isinstance(lens, torch.Tensor) and lens.numel() == len(prefix) \
        else torch.tensor(prefix, dtype=torch.int64, device=dev)
    rows = torch.repeat_interleave(fb.req_pool_indices, lens, output_size=total)
    firsts = torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens, output_size=total)
    cols = torch.arange(total, device=dev) - firsts
    return fb.req_to_token_pool.req_to_token[rows, cols].long()


class DeepseekMoE(nn.Module):
    def __init__(self, config: Any, v3: bool = False) -> None:
        """`v3`: DeepSeek-V3's router (sigmoid scores; experts chosen by the scores plus
        `e_score_correction_bias` within the best `topk_group` groups, each group scored by
        its two best; weighted by the scores without the bias)."""
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.num_experts = config.n_routed_experts
        self.v3 = v3
        self.method = "noaux_tc" if v3 else getattr(config, "topk_method", "greedy") or "greedy"
        if self.method not in ("greedy", "group_limited_greedy", "noaux_tc"):
            raise ValueError(f"DeepSeek topk_method {self.method!r} is not supported (greedy, "
                             "group_limited_greedy)")
        self.groups, self.topk_group = config.n_group, config.topk_group
        self.scale = float(config.routed_scaling_factor)
        self.norm = bool(getattr(config, "norm_topk_prob", False))
        # the router in float32, as the reference computes it
        self.gate = ReplicatedLinear(config.hidden_size, self.num_experts)
        self.gate.weight.data = self.gate.weight.data.float()
        if v3:
            self.gate.e_score_correction_bias = nn.Parameter(
                torch.zeros(self.num_experts, dtype=torch.float32), requires_grad=False)
        self.experts = FusedMoE(self.num_experts, self.top_k, config.hidden_size,
                                config.moe_intermediate_size)
        shared = config.n_shared_experts or 0
        # partial sums: the experts' and the shared experts' take one all-reduce together
        self.shared_experts = LlamaMLP(config.hidden_size, config.moe_intermediate_size * shared,
                                       reduce_results=False) if shared else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] float32, expert ids [T, k])."""
        logits = F.linear(x.float(), self.gate.weight)
        if use_fused(logits):  # the torch code below in one kernel
            from srt.layers.moe_route_triton import route_triton

            grouped = self.v3 or self.method == "group_limited_greedy"
            return route_triton(
                logits, self.top_k, sigmoid=self.v3,
                bias=self.gate.e_score_correction_bias if self.v3 else None,
                renormalize=self.norm, eps=1e-20, scale=self.scale,
                groups=self.groups if grouped else 1,
                topk_group=self.topk_group if grouped else 1, group_top2=self.v3)
        if self.v3:
            return self._route_v3(logits.sigmoid())
        scores = logits.softmax(dim=-1)
        if self.method == "group_limited_greedy":
            t = scores.shape[0]
            best = scores.view(t, self.groups, -1).amax(dim=-1)
            keep = torch.zeros_like(best).scatter_(1, best.topk(self.topk_group, dim=-1)[1], 1.0)
            scores = scores * keep.repeat_interleave(self.num_experts // self.groups, dim=1)
        weights, ids = scores.topk(self.top_k, dim=-1)
        if self.norm:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scale, ids

    def _route_v3(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = scores.shape[0]
        biased = scores + self.gate.e_score_correction_bias
        groups = biased.view(t, self.groups, -1).topk(2, dim=-1)[0].sum(dim=-1)
        keep = torch.zeros_like(groups).scatter_(1, groups.topk(self.topk_group, dim=-1)[1], 1.0)
        keep = keep.repeat_interleave(self.num_experts // self.groups, dim=1).bool()
        ids = biased.masked_fill(~keep, float("-inf")).topk(self.top_k, dim=-1)[1]
        weights = scores.gather(1, ids)
        if self.norm:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scale, ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.shared_experts is None:
            return self.experts.compute(x, *self.route(x))
        out = self.experts.compute(x, *self.route(x), reduce=False)
        return ps.all_reduce(out + self.shared_experts(x))


class DeepseekV2DecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_id: int, max_position: int, v3: bool) -> None:
        super().__init__()
        self.self_attn = MLAttention(config, layer_id, max_position)
        freq = getattr(config, "moe_layer_freq", 1) or 1
        if (config.n_routed_experts and layer_id >= config.first_k_dense_replace
                and layer_id % freq == 0):
            self.mlp: nn.Module = DeepseekMoE(config, v3)
        else:
            self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class DeepseekV2Model(LlamaModel):
    def __init__(self, config: Any, max_position: int, v3: bool = False) -> None:
        nn.Module.__init__(self)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DeepseekV2DecoderLayer(config, i, max_position, v3)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    # only the MLPs' gate and up are merged; MLA's projections load as they are
    stacked_params = [(".gate_proj", ".gate_up_proj", 0), (".up_proj", ".gate_up_proj", 1)]

    def build_model(self, config: Any, max_position: int) -> nn.Module:
        return DeepseekV2Model(config, max_position)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """DeepSeek-V3 / R1 (and Kimi-K2's layout): V2's layers with V3's router."""

    def build_model(self, config: Any, max_position: int) -> nn.Module:
        return DeepseekV2Model(config, max_position, v3=True)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """The checkpoint's multi-token-prediction layers (numbered from num_hidden_layers
        on) are not read: srt does not draft with them."""
        n = self.config.num_hidden_layers
        super().load_weights(
            (name, t) for name, t in weights
            if not (name.startswith("model.layers.") and int(name.split(".")[2]) >= n))
