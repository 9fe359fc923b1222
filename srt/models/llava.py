"""LLaVA (1.5): a CLIP vision tower, a two-layer projector and a Llama language model, in
transformers' `LlavaForConditionalGeneration` checkpoint format.

The scheduler gives each image's positions pad token ids (so the radix cache can match the
image); during an extend step this model embeds the tokens, computes the projected features of
the images that `ForwardBatch.images` lists, writes them over the rows of those positions and
runs the language model on the result. Positions the prefix cache already holds are not in the
step and get no features.

Tensor parallelism: the vision tower and projector are replicated on every rank (they are small
and run once per image; every rank computes the same features); the language model uses the
tensor-parallel layers as any Llama.

Checkpoint layouts (all loaded): transformers < 4.52 and the files transformers 5 writes
(`language_model.model.*`, `language_model.lm_head.*`, `vision_tower[.vision_model].*`,
`multi_modal_projector.*`) and transformers 4.52+ (`model.language_model.*`, `lm_head.*`,
`model.vision_tower.vision_model.*`, `model.multi_modal_projector.*`).
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import torch
from torch import nn

from srt.layers.forward_batch import ForwardBatch, ImageSpanInput
from srt.models.clip import ClipVisionTower, activation
from srt.models.llama import LlamaForCausalLM
from srt.models.mistral import MistralForCausalLM

# The language model by the text config's model_type (LLaVA-1.5 uses Llama/Vicuna).
_LANGUAGE_MODELS: dict[str, type[LlamaForCausalLM]] = {
    "llama": LlamaForCausalLM,
    "mistral": MistralForCausalLM,
}
_PARTS = ("language_model", "vision_tower", "multi_modal_projector")


class LlavaProjector(nn.Module):
    """linear_1 -> activation -> linear_2, from the vision width to the text width."""

    def __init__(self, vision_width: int, text_width: int, act: str, bias: bool) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(vision_width, text_width, bias=bias)
        self.linear_2 = nn.Linear(text_width, text_width, bias=bias)
        self.act = activation(act)
        self.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


def split_checkpoint_name(name: str) -> tuple[str, str]:
    """A checkpoint tensor's name in any supported layout -> (part, name inside the part).

    Parts: "language_model" (names as LlamaForCausalLM loads them: `model.*`, `lm_head.*`),
    "vision_tower" (ClipVisionTower names) and "multi_modal_projector". ValueError for a name
    of none of them."""
    head, _, rest = name.partition(".")
    if head == "model" and rest.partition(".")[0] in _PARTS:
        head, _, rest = rest.partition(".")
    if head == "lm_head":
        return "language_model", name
    if head == "language_model":
        if rest.startswith(("model.", "lm_head.")):
            return "language_model", rest
        return "language_model", "model." + rest  # 4.52+: the head sits outside
    if head == "vision_tower":
        return "vision_tower", rest.removeprefix("vision_model.")
    if head == "multi_modal_projector":
        return "multi_modal_projector", rest
    raise ValueError(f"unexpected weight {name!r} in the checkpoint")


class LlavaForConditionalGeneration(nn.Module):
    def __init__(self, config: Any, max_position: int) -> None:
        super().__init__()
        self.config = config
        text, vision = config.text_config, config.vision_config
        layers = config.vision_feature_layer
        layers = [layers] if isinstance(layers, int) else list(layers)
        self.drop_cls = getattr(config, "vision_feature_select_strategy", "default") == "default"
        self.vision_tower = ClipVisionTower(vision, layers)
        self.multi_modal_projector = LlavaProjector(
            vision.hidden_size * len(layers), text.hidden_size,
            getattr(config, "projector_hidden_act", "gelu"),
            bool(getattr(config, "multimodal_projector_bias", True)),
        )
        lm_cls = _LANGUAGE_MODELS.get(text.model_type)
        if lm_cls is None:
            raise ValueError(f"LLaVA with a {text.model_type!r} language model is not supported "
                             f"({', '.join(sorted(_LANGUAGE_MODELS))})")
        self.language_model = lm_cls(text, max_position)

    def image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[images, channels, size, size] -> projected features [images, positions, hidden],
        one row per position an image fills in the prompt."""
        states = self.vision_tower(pixel_values)
        if self.drop_cls:
            states = states[:, 1:]
        return self.multi_modal_projector(states)

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """Float32 logits [batch, vocab] for each request's next token."""
        lm = self.language_model
        embeds = None
        if fb.images:
            embeds = lm.model.embed_tokens(fb.input_ids)
            self._write_image_features(embeds, fb.images)
        hidden = lm.model(fb.input_ids, fb.positions, input_embeds=embeds)
        return lm.logits_processor(hidden, lm.lm_head_weight(), fb)

    def _write_image_features(self, embeds: torch.Tensor, images: list[ImageSpanInput]) -> None:
        pixels = torch.stack([im.pixel_values for im in images]).to(embeds.device, embeds.dtype)
        features = self.image_features(pixels)
        for i, im in enumerate(images):
            embeds[im.row_start : im.row_start + im.count] = (
                features[i, im.feature_start : im.feature_start + im.count])

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Route each tensor to its part; the language model loads (and shards) its own."""
        own = {
            "vision_tower": dict(self.vision_tower.named_parameters()),
            "multi_modal_projector": dict(self.multi_modal_projector.named_parameters()),
        }
        loaded: set[tuple[str, str]] = set()

        def language_weights() -> Iterator[tuple[str, Any]]:
            for name, tensor in weights:
                part, inner = split_checkpoint_name(name)
                if part == "language_model":
                    yield inner, tensor
                    continue
                if part == "vision_tower" and not self.vision_tower.wants(inner):
                    continue  # layers after the selected feature layer
                params = own[part]
                if inner not in params:
                    raise ValueError(f"unexpected weight {name!r} in the checkpoint")
                params[inner].data.copy_(tensor[:])
                loaded.add((part, inner))

        self.language_model.load_weights(language_weights())
        missing = [f"{part}.{n}" for part, params in own.items() for n in params
                   if (part, n) not in loaded]
        if missing:
            raise ValueError(f"weights missing from the checkpoint: {missing[:5]}")
