"""Llama (Llama 2/3, SmolLM2) from our tensor-parallel layers, and the decoder the other
Llama-shaped families reuse (Mistral, Qwen2, Qwen3, Mixtral): what differs between them is said by
`ArchOptions` (projection biases, per-head q/k norm, a mixture-of-experts MLP)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable

import torch
from torch import nn

from srt.layers.activation import SiluAndMul
from srt.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from srt.layers.forward_batch import ForwardBatch
from srt.layers.fp8 import FP8_DTYPE, weight_scale_rows
from srt.layers.layernorm import RMSNorm
from srt.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from srt.layers.logits_processor import LogitsProcessor
from srt.layers.moe import SparseMoeBlock
from srt.layers.pooler import pool_rows
from srt.layers.radix_attention import RadixAttention
from srt.layers.rotary import RotaryEmbedding
from srt.model_config import layer_window, rope_params, rotary_dim


@dataclass(frozen=True)
class ArchOptions:
    qkv_bias: bool = False  # biases on the q, k and v projections
    o_bias: bool = False  # bias on the output projection
    mlp_bias: bool = False
    qk_norm: bool = False  # RMSNorm over each q and k head before rotary (Qwen3)
    moe: bool = False  # the MLP is a top-k mixture of experts (Mixtral's block_sparse_moe)
    # Qwen2/3-MoE: `mlp` is a mixture of experts on the layers `moe_layer` says (the others a
    # dense MLP), of `moe_intermediate_size`, `norm_topk_prob`, a shared expert if sized
    qwen_moe: bool = False


def qwen_moe_layer(config: Any, layer_id: int) -> bool:
    """A Qwen-MoE layer whose MLP is sparse: not in `mlp_only_layers`, and every
    `decoder_sparse_step`-th layer."""
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return (layer_id not in (getattr(config, "mlp_only_layers", None) or [])
            and config.num_experts > 0 and (layer_id + 1) % step == 0)


class LlamaMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool = False,
                 act: nn.Module | None = None, reduce_results: bool = True) -> None:
        """`act`: the gated activation over [gate, up] (default SiLU-and-mul);
        `reduce_results=False`: the rank's partial sum (RowParallelLinear's)."""
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate] * 2, bias=bias)
        self.down_proj = RowParallelLinear(intermediate, hidden, bias=bias,
                                           reduce_results=reduce_results)
        self.act = act if act is not None else SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    def __init__(self, config: Any, layer_id: int, max_position: int, opts: ArchOptions) -> None:
        super().__init__()
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, head_dim, heads, kv_heads, bias=opts.qkv_bias
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        self.head_dim = head_dim
        self.o_proj = RowParallelLinear(heads * head_dim, config.hidden_size, bias=opts.o_bias)
        self.qk_norm = opts.qk_norm
        if opts.qk_norm:
            self.q_norm = RMSNorm(head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(head_dim, config.rms_norm_eps)
        theta, scaling = rope_params(config)
        self.rotary_emb = RotaryEmbedding(head_dim, max_position, theta, scaling,
                                          rotary_dim(config, head_dim))
        self.attn = RadixAttention(
            self.num_heads, head_dim, head_dim**-0.5, self.num_kv_heads, layer_id,
            sliding_window=layer_window(config, layer_id),
        )

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        o = self.attn(q, k, v, self.rotary_emb, positions)
        return self.o_proj(o)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_id: int, max_position: int, opts: ArchOptions) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_id, max_position, opts)
        self.moe = opts.moe
        if opts.moe:
            # Mixtral's checkpoint name for the MLP
            self.block_sparse_moe = SparseMoeBlock(
                config.hidden_size, config.intermediate_size, config.num_local_experts,
                config.num_experts_per_tok,
            )
        elif opts.qwen_moe and qwen_moe_layer(config, layer_id):
            size = getattr(config, "shared_expert_intermediate_size", 0) or 0
            self.mlp = SparseMoeBlock(
                config.hidden_size, config.moe_intermediate_size, config.num_experts,
                config.num_experts_per_tok, bool(getattr(config, "norm_topk_prob", False)),
                LlamaMLP(config.hidden_size, size, reduce_results=False) if size else None)
        else:
            self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size, opts.mlp_bias)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x)
        x, residual = self.post_attention_layernorm(x, residual)
        return (self.block_sparse_moe(x) if self.moe else self.mlp(x)), residual


class LlamaModel(nn.Module):
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def __init__(self, config: Any, max_position: int, opts: ArchOptions) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, max_position, opts)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                input_embeds: torch.Tensor | None = None,
                aux_layers: tuple[int, ...] = (),
                aux: list[torch.Tensor] | None = None) -> torch.Tensor:
        """input_embeds, when given, replaces the embedding of input_ids (a multimodal model
        wrote image features into some rows). `aux`: receives the input of each layer of
        `aux_layers` (the residual stream, EAGLE3's features; the number of layers: the last
        layer's output before the final norm)."""
        x = self.embed(input_ids) if input_embeds is None else input_embeds
        residual = None
        for i, layer in enumerate(self.layers):
            if i in aux_layers and aux is not None:
                aux.extend([x if residual is None else x + residual] * aux_layers.count(i))
            x, residual = layer(positions, x, residual)
        if len(self.layers) in aux_layers and aux is not None:
            aux.extend([x + residual] * aux_layers.count(len(self.layers)))
        x, _ = self.norm(x, residual)
        return x


def _is_fp8(tensor: Any) -> bool:
    """A checkpoint tensor (CheckpointTensor or torch.Tensor) stored in FP8."""
    if isinstance(tensor, torch.Tensor):
        return tensor.dtype.itemsize == 1 and tensor.dtype.is_floating_point
    return getattr(tensor, "dtype_name", "").startswith("F8")


class LlamaForCausalLM(nn.Module):
    # checkpoint name fragment -> (our fragment, shard id)
    stacked_params = [
        (".q_proj", ".qkv_proj", "q"),
        (".k_proj", ".qkv_proj", "k"),
        (".v_proj", ".qkv_proj", "v"),
        (".gate_proj", ".gate_up_proj", 0),
        (".up_proj", ".gate_up_proj", 1),
    ]
    # a mixture of experts' per-expert tensors -> (our parameter, shard id); see FusedMoE
    # (Mixtral names them w1 / w3 / w2, Qwen-MoE gate_proj / up_proj / down_proj)
    expert_params = {
        "w1": ("w13_weight", "w1"), "w3": ("w13_weight", "w3"), "w2": ("w2_weight", "w2"),
        "gate_proj": ("w13_weight", "w1"), "up_proj": ("w13_weight", "w3"),
        "down_proj": ("w2_weight", "w2"),
    }
    _expert_name = re.compile(r"^(.*\.experts)\.(\d+)\.(w[123]|gate_proj|up_proj|down_proj)"
                              r"\.(weight|weight_scale|weight_scale_inv)$")

    @classmethod
    def arch_options(cls, config: Any) -> ArchOptions:
        bias = bool(getattr(config, "attention_bias", False))
        return ArchOptions(
            qkv_bias=bias, o_bias=bias, mlp_bias=bool(getattr(config, "mlp_bias", False))
        )

    def __init__(self, config: Any, max_position: int) -> None:
        super().__init__()
        self.config = config
        self.model = self.build_model(config, max_position)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if not self.tie_word_embeddings:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        # (Gemma 2 soft-caps its final logits)
        self.logits_processor = LogitsProcessor(
            config.vocab_size, getattr(config, "final_logit_softcapping", None))
        # EAGLE speculative decoding reads the hidden states of every row of a step
        # (`spec_hidden`): None keeps none, () the final normed ones (EAGLE), layer indices the
        # inputs of those layers side by side (EAGLE3).
        self.capture_hidden: tuple[int, ...] | None = None
        self.spec_hidden: torch.Tensor | None = None
        # --is-embedding: forward returns each request's pooled hidden state instead of logits
        self.pooling: str | None = None

    def build_model(self, config: Any, max_position: int) -> nn.Module:
        """The decoder stack (families with other layers override this)."""
        return LlamaModel(config, max_position, self.arch_options(config))

    def lm_head_weight(self) -> torch.Tensor:
        if self.tie_word_embeddings:
            return self.model.embed_tokens.weight
        return self.lm_head.weight

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """Float32 logits [batch, vocab] for each request's next token (with `pooling`, its
        pooled hidden state [batch, H] instead: srt.layers.pooler.pool_rows)."""
        if self.pooling is not None:
            return pool_rows(self.model(fb.input_ids, fb.positions), fb.extend_lens_cpu,
                             fb.prefix_lens_cpu, self.pooling)
        if self.capture_hidden is None:
            hidden = self.model(fb.input_ids, fb.positions)
        else:
            aux: list[torch.Tensor] = []
            hidden = self.model(fb.input_ids, fb.positions, aux_layers=self.capture_hidden,
                                aux=aux)
            self.spec_hidden = torch.cat(aux, dim=-1) if aux else hidden
        return self.logits_processor(hidden, self.lm_head_weight(), fb)

    def _load_kv_scale(self, name: str, tensor: Any) -> None:
        """A checkpoint's per-tensor KV-cache scale (`...self_attn.k_scale`, `v_scale`, or
        `kv_scale` for both), kept on the layer's RadixAttention for an FP8 KV cache."""
        owner, which = name.rsplit(".", 1)
        attn = self.get_submodule(owner + ".attn")
        t = tensor if isinstance(tensor, torch.Tensor) else tensor[:]
        value = float(t.float().reshape(-1)[0])
        if not value > 0:
            raise ValueError(f"{name} = {value}: a KV-cache scale must be positive")
        if which in ("k_scale", "kv_scale"):
            attn.k_scale = value
        if which in ("v_scale", "kv_scale"):
            attn.v_scale = value

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """weights: (checkpoint name, tensor or CheckpointTensor); each layer's loader reads
        only its rank's shard."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()

        def resolve(target: str, tensor: Any) -> tuple[str, Any]:
            """The parameter a checkpoint tensor fills: an FP8 layer's `weight` is its
            `qweight`; its `weight_scale` is read as one scale per output row."""
            if target.endswith(".weight") and target not in params:
                fp8 = target[: -len(".weight")] + ".qweight"
                if fp8 in params:
                    if not _is_fp8(tensor) or params[fp8].dtype != FP8_DTYPE:
                        raise ValueError(f"{name!r} is {getattr(tensor, 'dtype_name', '')} in "
                                         "the checkpoint but srt holds that layer quantized "
                                         f"({params[fp8].dtype}): its quantization_config "
                                         "does not match its tensors")
                    return fp8, tensor
            if target.endswith(".weight_scale") and target in params:
                return target, weight_scale_rows(tensor, params[target].shape[0])
            refuse_fp8(target, tensor)
            return target, tensor

        def refuse_fp8(target: str, tensor: Any) -> None:
            """An FP8 tensor for a parameter srt keeps in the model dtype would lose its scale:
            refused rather than loaded wrong."""
            if _is_fp8(tensor) and target in params and params[target].dtype != FP8_DTYPE:
                raise ValueError(f"{target!r} is FP8 in the checkpoint but srt keeps that "
                                 "layer in the model dtype (FP8 is loaded for the linear "
                                 "layers and experts of the language model only)")

        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name.endswith(".input_scale"):
                continue  # a static activation scale: activations are scaled per token
            if name.endswith(".g_idx"):  # GPTQ's input-channel groups
                from srt.layers.gptq import keep_g_idx

                owner = name[: -len(".g_idx")]
                for src, dst, _ in self.stacked_params:
                    if src in owner:
                        owner = owner.replace(src, dst)
                        break
                keep_g_idx(self.get_submodule(owner), name, tensor[:])  # for finish_gptq
                continue
            if name.endswith((".k_scale", ".v_scale", ".kv_scale")):
                self._load_kv_scale(name, tensor)
                continue
            if name.endswith((".k_proj.output_scale", ".v_proj.output_scale")):
                # older llm-compressor checkpoints: the KV scales as the projections' outputs'
                self._load_kv_scale(name.replace(".k_proj.output_scale", ".k_scale")
                                    .replace(".v_proj.output_scale", ".v_scale"), tensor)
                continue
            if self.tie_word_embeddings and name == "lm_head.weight":
                continue
            expert = self._expert_name.match(name)
            if expert is not None:
                prefix, expert_id, which, kind = expert.groups()
                param_name, shard = self.expert_params[which]
                if kind != "weight":  # FP8 experts: w13_scale / w2_scale, or block
                    # scales w13_scale_inv / w2_scale_inv
                    param_name = param_name.replace("_weight", kind[len("weight"):])
                    if f"{prefix}.{param_name}" not in params:
                        raise ValueError(f"unexpected weight {name!r} in the checkpoint (its "
                                         "experts are not FP8 in srt)")
                target = f"{prefix}.{param_name}"
                if kind == "weight_scale":
                    tensor = weight_scale_rows(tensor, params[target].shape[1])
                refuse_fp8(target, tensor)
                self.get_submodule(prefix).weight_loader(
                    params[target], tensor, int(expert_id), shard
                )
                loaded.add(target)
                continue
            for src, dst, shard in self.stacked_params:
                if src in name:
                    target, tensor = resolve(name.replace(src, dst), tensor)
                    module = self.get_submodule(target.rsplit(".", 1)[0])
                    module.weight_loader(params[target], tensor, shard)
                    loaded.add(target)
                    break
            else:
                target, tensor = resolve(name, tensor)
                if target not in params:
                    raise ValueError(f"unexpected weight {name!r} in the checkpoint")
                module = self.get_submodule(target.rsplit(".", 1)[0])
                loader = getattr(module, "weight_loader", None)
                if loader is None:
                    params[target].data.copy_(tensor[:])
                else:
                    loader(params[target], tensor)
                loaded.add(target)
        missing = set(params) - loaded
        if missing:
            raise ValueError(f"weights missing from the checkpoint: {sorted(missing)[:5]}")
