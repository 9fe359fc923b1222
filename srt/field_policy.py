"""Which request fields each endpoint accepts: SGLang's names, implemented or at a no-op value.

SGLang's clients (its frontend language, its `smg` gateway) send every field of SGLang 0.5's
request models, most at their defaults (`"background": false`, `"return_hidden_states": false`,
`"stop_regex": []`). So each surface here lists

* the fields srt implements (the endpoint's parser reads them), and
* the fields of SGLang's models that srt does not implement, each with its no-op values: null,
  SGLang's default, an empty list or object, or a list of no-op values (one per prompt). Such a
  field at a no-op value is accepted and dropped; at any other value it is a 400 `unsupported`
  naming it.

Any other name is a 400 `unknown_field`, so a typo still fails loudly. The lists were read from
SGLang 0.5.23 (`GenerateReqInput`, `SamplingParams`, the OpenAI protocol's `CompletionRequest`,
`ChatCompletionRequest`, `TokenizeRequest`, `DetokenizeRequest`); the README lists the fields that
are accepted but not implemented. Imports nothing beyond the standard library (every process
loads the sampling parameters' surface).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Mapping


class FieldError(ValueError):
    """A field is refused: `code` is "unknown_field" or "unsupported"; `name` names it."""

    def __init__(self, name: str, code: str, message: str) -> None:
        super().__init__(message)
        self.name = name
        self.code = code


@dataclass(frozen=True)
class NoOp:
    """An unimplemented field: the values at which it does nothing (besides null, empty
    containers and lists of no-op values)."""

    default: Any = None
    also: tuple[Any, ...] = ()


def _same(a: Any, b: Any) -> bool:
    # false is not 0 and 1 is not true here: JSON keeps them apart, so do we
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    return type(a) is type(b) and a == b


def is_noop(value: Any, rule: NoOp) -> bool:
    """True when `value` makes the field do nothing."""
    if value is None or _same(value, rule.default) or any(_same(value, a) for a in rule.also):
        return True
    if isinstance(value, (list, dict)) and not value:
        return True
    if isinstance(value, list):  # one value per prompt
        return all(is_noop(v, rule) for v in value)
    return False


@dataclass(frozen=True)
class Surface:
    """The fields of one request object (a route's body, or its sampling parameters)."""

    where: str
    implemented: frozenset[str]
    unsupported: Mapping[str, NoOp] = field(default_factory=dict)

    def __post_init__(self) -> None:
        both = self.implemented & set(self.unsupported)
        assert not both, f"{self.where}: listed as implemented and unsupported: {sorted(both)}"

    @property
    def names(self) -> frozenset[str]:
        return self.implemented | frozenset(self.unsupported)

    def apply(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """The implemented fields of `body`. Raises FieldError for the first (by name) unknown
        field, else the first unimplemented field at a value that would do something."""
        unknown = sorted(set(body) - self.names)
        if unknown:
            raise FieldError(unknown[0], "unknown_field",
                             f"unknown field {unknown[0]!r} in {self.where}")
        for name in sorted(set(body) & set(self.unsupported)):
            if not is_noop(body[name], self.unsupported[name]):
                raise FieldError(name, "unsupported",
                                 f"{name} is not supported by this server (only at its no-op "
                                 f"value: {_describe(self.unsupported[name])})")
        return {k: v for k, v in body.items() if k in self.implemented}


def _describe(rule: NoOp) -> str:
    """The no-op values as JSON: "null, false"."""
    return ", ".join(dict.fromkeys(json.dumps(v) for v in (None, rule.default, *rule.also)))


def _nulls(*names: str) -> dict[str, NoOp]:
    return {n: NoOp() for n in names}


def _falses(*names: str) -> dict[str, NoOp]:
    return {n: NoOp(False) for n in names}


# -- sampling parameters (`sampling_params` of /generate; the OpenAI routes map theirs onto it)

SAMPLING = Surface(
    "sampling_params",
    frozenset({
        "max_new_tokens", "min_new_tokens", "temperature", "top_p", "top_k", "min_p",
        "frequency_penalty", "presence_penalty", "repetition_penalty", "stop", "stop_token_ids",
        "stop_regex", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
        "no_stop_trim", "n", "seed", "sampling_seed", "regex", "json_schema", "ebnf",
        "stream_interval",
    }),
    {
        **_nulls("structural_tag", "logit_bias", "custom_params", "watermark"),
        "beam_width": NoOp(None, (1,)),
    },
)

# Fields a router or gateway may add to any request (SGLang's PD and DP routing). srt is one
# data-parallel rank: rank 0 is where every request goes anyway.
_ROUTING = {
    **_nulls("bootstrap_host", "bootstrap_port", "bootstrap_room", "disagg_prefill_dp_rank"),
    "routed_dp_rank": NoOp(None, (0,)),
    "data_parallel_rank": NoOp(None, (0,)),
}

# -- POST /generate (SGLang's GenerateReqInput; `model` is what smg adds)

GENERATE = Surface(
    "the /generate body",
    frozenset({
        "text", "input_ids", "sampling_params", "stream", "rid", "return_logprob",
        "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs", "image_data", "model",
        "lora_path",
    }),
    {
        **_ROUTING,
        **_nulls(
            "session_id", "input_embeds", "video_data", "audio_data", "mm_hashes",
            "mm_content_hashes", "video_config", "watermark", "token_ids_logprob",
            "sampling_logprobs_mode", "modalities", "session_params", "lora_id",
            "custom_logit_processor", "positional_embed_overrides", "bootstrap_pair_key",
            "decode_tp_size", "routing_key", "conversation_id", "http_worker_ipc",
            "max_thinking_tokens", "priority", "extra_key", "custom_labels",
            "external_trace_header", "received_time", "need_wait_for_mm_inputs",
            "num_items_assigned", "encoder_urls", "max_dynamic_patch", "min_dynamic_patch",
            "image_max_dynamic_patch", "video_max_dynamic_patch", "images_config",
            "mm_processor_kwargs", "multi_item_delimiter_indices", "token_indices_to_pool",
            "cache_salt", "kv_hints",
        ),
        **_falses(
            "use_audio_in_video", "return_sampling_mask", "return_flat_raw_top_logprobs",
            "return_flat_raw_output_top_logprobs", "return_flat_raw_top_logprobs_b64",
            "return_hidden_states", "return_routed_experts", "return_indexer_topk", "background",
            "require_reasoning", "no_logs", "return_bytes", "return_entropy",
            "return_prompt_token_ids",
        ),
        "log_metrics": NoOp(True),
        "routed_experts_start_len": NoOp(0),
    },
)

# -- the OpenAI routes

# Sampling fields both OpenAI routes take (SGLang's extras beside OpenAI's own).
_OPENAI_IMPLEMENTED = frozenset({
    "model", "frequency_penalty", "presence_penalty", "max_tokens", "n", "seed", "stop",
    "stream", "stream_options", "temperature", "top_p", "user", "response_format", "rid",
    "top_k", "min_p", "min_tokens", "repetition_penalty", "stop_token_ids", "stop_regex",
    "no_stop_trim", "ignore_eos", "skip_special_tokens", "regex", "json_schema", "ebnf",
    "logprobs", "lora_path",
    # OpenAI fields that only describe the caller: nothing to do
    "metadata", "store", "service_tier",
})

_OPENAI_UNSUPPORTED = {
    **_ROUTING,
    **_nulls("logit_bias", "session_id", "session_params",
             "custom_params", "custom_logit_processor", "watermark", "images_config",
             "mm_processor_kwargs", "extra_key", "cache_salt", "priority"),
    **_falses("return_hidden_states", "return_routed_experts", "return_cached_tokens_details",
              "return_spec_tokens_details", "return_token_ids"),
    "routed_experts_start_len": NoOp(0),
}

COMPLETION = Surface(
    "the /v1/completions body",
    _OPENAI_IMPLEMENTED | {"prompt", "best_of", "echo"},
    {**_OPENAI_UNSUPPORTED, **_nulls("suffix", "custom_labels")},
)

CHAT = Surface(
    "the /v1/chat/completions body",
    _OPENAI_IMPLEMENTED | {"messages", "top_logprobs", "max_completion_tokens", "tools",
                           "tool_choice", "parallel_tool_calls", "separate_reasoning",
                           "stream_reasoning"},
    {
        **_OPENAI_UNSUPPORTED,
        **_nulls("sampling_logprobs_mode", "reasoning_effort", "thinking", "task",
                 "chat_template_kwargs", "max_dynamic_patch", "min_dynamic_patch",
                 "video_config", "input_ids", "functions"),
        **_falses("return_prompt_token_ids", "return_meta_info", "return_input_ids_in_sglext",
                  "return_output_ids_in_sglext", "return_sampling_mask",
                  "return_flat_raw_output_top_logprobs", "continue_final_message",
                  "use_audio_in_video"),
        "function_call": NoOp(None, ("none",)),
        # Without flat logprobs (not implemented) their encoding does nothing either way.
        "return_flat_raw_top_logprobs_b64": NoOp(True, (False,)),
    },
)

# -- POST /tokenize and /detokenize (SGLang's shapes)

TOKENIZE = Surface(
    "the /tokenize body",
    frozenset({"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt"}),
    {
        **_nulls("tools", "reasoning_effort", "chat_template_kwargs"),
        "tool_choice": NoOp(None, ("auto", "none")),
        "continue_final_message": NoOp(False),
    },
)

DETOKENIZE = Surface(
    "the /detokenize body",
    frozenset({"model", "tokens", "skip_special_tokens"}),
)

SURFACES: tuple[Surface, ...] = (SAMPLING, GENERATE, COMPLETION, CHAT, TOKENIZE, DETOKENIZE)
