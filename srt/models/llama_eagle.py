"""EAGLE and EAGLE3 draft heads over a Llama-shaped target, in the public checkpoint layouts.

A head drafts from the target's features. Its row at position p takes the token at p + 1 and a
feature of position p, and outputs a feature of position p + 1 whose logits give the token at
p + 2; the next draft step feeds that feature back with the token drafted. The target's
embedding is always shared; so is its LM head, except an EAGLE3 head with its own vocabulary.

- EAGLE (EAGLE-1/2; `LlamaForCausalLM` or `LlamaForCausalLMEagle` in the head's config):
  `fc` [H, 2H] (+ bias) over (token embedding, feature), then the head's Llama layers, the
  first without its input norm, and no final norm: the feature is the last layer's residual
  stream, and the target's LM head reads it as it is. The target's feature is its hidden state
  after its final norm.
- EAGLE3 (`LlamaForCausalLMEagle3`): the target's feature is the input of three of its layers
  side by side, `fc` [H, 3H_target] maps it to H; one `midlayer` whose attention reads
  (normed embedding, normed feature) [2H]; the feature is its residual stream, and a final norm
  and the head's LM head over `draft_vocab_size` ids give the logits; `d2t` maps a draft id d
  to the target id d + d2t[d].

Checkpoint names carry no `model.` prefix (`fc.weight`, `layers.0...`, `midlayer...`); the
head's own `embed_tokens` is ignored.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable

import torch
from torch import nn

from srt.layers.embedding import ParallelLMHead
from srt.layers.forward_batch import ForwardBatch
from srt.layers.layernorm import RMSNorm
from srt.layers.linear import QKVParallelLinear
from srt.layers.logits_processor import LogitsProcessor
from srt.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP

logger = logging.getLogger(__name__)

EAGLE_ARCHITECTURES = {"EAGLE": ("LlamaForCausalLM", "LlamaForCausalLMEagle"),
                       "EAGLE3": ("LlamaForCausalLMEagle3",)}


def eagle3_aux_layers(head_config: Any, target_layers: int) -> tuple[int, ...]:
    """The target layers whose inputs make an EAGLE3 head's feature: the head config's
    `eagle_config.eagle_aux_hidden_state_layer_ids` name layer outputs (so the next layers'
    inputs), else layers 2, L / 2 and L - 3 as the public heads were trained."""
    ids = (getattr(head_config, "eagle_config", None) or {}).get(
        "eagle_aux_hidden_state_layer_ids")
    if ids:
        layers = tuple(int(i) + 1 for i in ids)
    else:
        layers = (2, target_layers // 2, target_layers - 3)
    layers = tuple(sorted(layers))  # side by side in layer order, as they are captured
    if len(layers) != 3 or not all(0 <= i <= target_layers for i in layers):
        raise ValueError(f"EAGLE3 feature layers {layers} do not fit a target of "
                         f"{target_layers} layers")
    return layers


def _ends(fb: ForwardBatch, x: torch.Tensor) -> torch.Tensor:
    """The rows the logits processor projects: each request's last in an extend step."""
    if not fb.forward_mode.is_extend():
        return x
    return x[torch.tensor(fb.extend_lens_cpu, device=x.device).cumsum(0) - 1]


class _Head(LlamaForCausalLM):
    """What both heads share: the target's modules, the feature out, the loader."""

    def _init_head(self, config: Any) -> None:
        nn.Module.__init__(self)
        self.config = config
        self.tie_word_embeddings = False
        self.capture_hidden = None
        self.spec_hidden = None
        self.feature: torch.Tensor | None = None  # of the rows of the last forward's logits
        self.hot_ids: torch.Tensor | None = None  # draft id -> target id (EAGLE3's d2t)
        self._target: list[LlamaForCausalLM] = []  # not a submodule: its weights are not ours

    def share(self, target: LlamaForCausalLM) -> None:
        """Read the target's embedding (and LM head, unless the head has its own)."""
        if target.config.hidden_size != self.config.hidden_size:
            raise ValueError(f"the draft head's hidden size ({self.config.hidden_size}) is not "
                             f"the target's ({target.config.hidden_size})")
        self._target = [target]

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self._target[0].model.embed_tokens(ids)

    def lm_head_weight(self) -> torch.Tensor:
        return self._target[0].lm_head_weight()

    # checkpoint names the head does not hold (the target's, or a training artifact)
    _skip = ("embed_tokens.weight", "t2d")

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        own_head = "lm_head.weight" in dict(self.named_parameters())
        bias = self.model.fc.bias

        def renamed() -> Iterable[tuple[str, Any]]:
            has_bias = False
            for name, tensor in weights:
                name = name.removeprefix("model.")
                if name.endswith(self._skip) or self._skip_name(name):
                    continue
                if name == "d2t":
                    d2t = tensor[:].to(torch.int64)
                    self.hot_ids = d2t + torch.arange(len(d2t), device=d2t.device)
                    continue
                if name == "lm_head.weight":
                    if own_head:
                        yield name, tensor
                    continue
                has_bias |= name == "fc.bias"
                yield "model." + name, tensor
            if bias is not None and not has_bias:  # a head saved without its bias has none
                yield "model.fc.bias", torch.zeros_like(bias)

        super().load_weights(renamed())

    def _skip_name(self, name: str) -> bool:
        return False


class _EagleModel(nn.Module):
    def __init__(self, config: Any, max_position: int, opts: Any) -> None:
        super().__init__()
        h = config.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=True)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i, max_position, opts)
                                    for i in range(config.num_hidden_layers))
        self.layers[0].input_layernorm = nn.Identity()  # EAGLE's first layer has none


class LlamaEagleHead(_Head):
    """EAGLE-1/2 head (`fc` over embedding and normed target hidden, Llama layers)."""

    def __init__(self, config: Any, max_position: int) -> None:
        self._init_head(config)
        self.model = _EagleModel(config, max_position, self.arch_options(config))
        self.logits_processor = LogitsProcessor(config.vocab_size)

    def _skip_name(self, name: str) -> bool:
        # a head saved with its first layer's input norm: EAGLE does not apply it
        return name == "layers.0.input_layernorm.weight"

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        assert fb.spec_hidden is not None
        x = self.model.fc(torch.cat((self.embed(fb.input_ids), fb.spec_hidden), dim=-1))
        residual = None
        for layer in self.model.layers:
            x, residual = layer(fb.positions, x, residual)
        feature = x + residual
        self.feature = _ends(fb, feature)
        return self.logits_processor(feature, self.lm_head_weight(), fb)


class _Eagle3MidLayer(nn.Module):
    def __init__(self, config: Any, max_position: int, opts: Any) -> None:
        super().__init__()
        h = config.hidden_size
        self.self_attn = LlamaAttention(config, 0, max_position, opts)
        a = self.self_attn
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        a.qkv_proj = QKVParallelLinear(2 * h, a.head_dim, heads, kv_heads, bias=opts.qkv_bias)
        self.mlp = LlamaMLP(h, config.intermediate_size, opts.mlp_bias)
        self.input_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, embeds: torch.Tensor,
                hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        residual = hidden
        x = torch.cat((self.input_layernorm(embeds), self.hidden_norm(hidden)), dim=-1)
        x = self.self_attn(positions, x)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class _Eagle3Model(nn.Module):
    def __init__(self, config: Any, max_position: int, opts: Any) -> None:
        super().__init__()
        h = config.hidden_size
        h_in = getattr(config, "target_hidden_size", None) or h
        self.fc = nn.Linear(3 * h_in, h, bias=bool(getattr(config, "bias", False)))
        self.midlayer = _Eagle3MidLayer(config, max_position, opts)
        self.norm = RMSNorm(h, config.rms_norm_eps)


class LlamaEagle3Head(_Head):
    """EAGLE3 head (`fc` over three target layers' inputs, one mid layer, its own norm and,
    with `draft_vocab_size`, its own LM head and `d2t`)."""

    def __init__(self, config: Any, max_position: int) -> None:
        self._init_head(config)
        self.model = _Eagle3Model(config, max_position, self.arch_options(config))
        self.draft_vocab = getattr(config, "draft_vocab_size", None) or config.vocab_size
        self.own_head = getattr(config, "draft_vocab_size", None) is not None \
            and not getattr(config, "tie_word_embeddings", False)
        if self.own_head:
            self.lm_head = ParallelLMHead(self.draft_vocab, config.hidden_size)
        self.logits_processor = LogitsProcessor(self.draft_vocab)

    def share(self, target: LlamaForCausalLM) -> None:
        super().share(target)
        if not self.own_head and self.draft_vocab != target.config.vocab_size:
            raise ValueError("an EAGLE3 head without its own LM head must have the target's "
                             "vocabulary")

    def lm_head_weight(self) -> torch.Tensor:
        return self.lm_head.weight if self.own_head else super().lm_head_weight()

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        assert fb.spec_hidden is not None
        embeds = self.embed(fb.input_ids)
        hidden = fb.spec_hidden
        if hidden.shape[-1] != embeds.shape[-1]:  # the target's features: three layers' inputs
            hidden = self.model.fc(hidden)
        x, residual = self.model.midlayer(fb.positions, embeds, hidden)
        normed, feature = self.model.norm(x, residual)
        self.feature = _ends(fb, feature)
        return self.logits_processor(normed, self.lm_head_weight(), fb)
