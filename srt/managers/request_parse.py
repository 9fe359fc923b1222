"""A /generate body -> a ParsedRequest of validated single-sample requests.

`RequestParser.parse` either returns requests that fit the model (vocabulary, context, KV pool,
image token) or raises RequestError naming the offending field: nothing invalid crosses into the
other processes. It keeps no per-request state; the client rids in flight are passed in.
Regexes, JSON schemas and images are checked later, off the event loop (TokenizerManager).
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Container
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from srt import field_policy
from srt.managers.io_struct import LogprobOptions
from srt.managers.request_types import (
    MAX_TOP_LOGPROBS,
    ModelLimits,
    ParsedRequest,
    RequestError,
    SingleRequest,
    checked_fields,
)
from srt.sampling_params import SamplingParamError, SamplingParams, is_valid_utf8
from srt.server_args import ServerArgs

if TYPE_CHECKING:
    from srt.lora.registry import LoraRegistry


@dataclass
class RequestParser:
    """Checks requests against one model: its tokenizer, its limits, its served name."""

    args: ServerArgs
    tokenizer: Any  # a transformers tokenizer
    limits: ModelLimits
    loras: "LoraRegistry | None" = None  # the LoRA adapters (None: LoRA off)

    def parse(self, body: Any, rids_in_use: Container[str]) -> ParsedRequest:
        """Validate a /generate body. Raises RequestError naming the offending field; a client
        rid in `rids_in_use` (the requests in flight) is refused too."""
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object", None, "invalid_type")
        body = checked_fields(field_policy.GENERATE, body)
        self.check_model(body.get("model"))
        text, input_ids = body.get("text"), body.get("input_ids")
        if (text is None) == (input_ids is None):
            raise RequestError("give exactly one of text and input_ids", "text")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise RequestError("stream must be a boolean", "stream", "invalid_type")
        if text is not None:
            prompts, is_batch = self._parse_text(text)
            prompt_ids = [self._encode(t) for t in prompts]
        else:
            prompt_ids, is_batch = self._parse_ids(input_ids)
        params = self._parse_params(body.get("sampling_params"), len(prompt_ids))
        rids = self._parse_rids(body.get("rid"), len(prompt_ids))
        prompt_field = "text" if text is not None else "input_ids"
        images = self._parse_images(body.get("image_data"), prompt_ids, prompt_field)
        # With an image, prompt positions count the positions the image fills.
        lens = [len(ids) + (self.limits.image_tokens - 1 if img is not None else 0)
                for ids, img in zip(prompt_ids, images)]
        logprobs = self._parse_logprobs(body, lens)
        loras = self._parse_lora(body.get("lora_path"), len(prompt_ids))
        reqs: list[SingleRequest] = []
        for i, (ids, p, rid, lp, img, n, lora) in enumerate(
                zip(prompt_ids, params, rids, logprobs, images, lens, loras)):
            self._check_lengths(n, p, prompt_field)
            if p.n == 1:
                reqs.append(SingleRequest(rid, ids, p, len(reqs), None, lp, rid,
                                          image_source=img, prompt_len=n, lora_id=lora))
                continue
            group = uuid.uuid4().hex
            for k in range(p.n):
                # each sample its own seed, or they would all draw the same tokens
                pk = p if p.seed is None else dataclasses.replace(p, seed=(p.seed + k) % 2**63)
                reqs.append(SingleRequest(f"{rid}-{k}", ids, pk, len(reqs), group, lp, rid,
                                          image_source=img, prompt_len=n, lora_id=lora))
        seen: set[str] = set()
        for r in reqs:
            if r.rid in rids_in_use or r.rid in seen:
                raise RequestError(f"rid {r.rid!r} is already in use", "rid", "duplicate_rid")
            seen.add(r.rid)
        is_batch = is_batch or any(p.n > 1 for p in params)
        return ParsedRequest(reqs, stream, is_batch)

    @property
    def served_model_name(self) -> str:
        return self.args.served_model_name or str(self.args.model_path)

    def check_model(self, model: Any) -> None:
        """`model` on /generate (SGLang's gateway sends it, often null), /tokenize and
        /detokenize: null, "default" or the served model's name (404 otherwise)."""
        if model is None or model in ("default", self.served_model_name):
            return
        if not isinstance(model, str):
            raise RequestError("model must be a string or null", "model", "invalid_type")
        raise RequestError(f"the model {model!r} does not exist; this server serves "
                           f"{self.served_model_name!r}", "model", "model_not_found", status=404)

    def _parse_text(self, text: Any) -> tuple[list[str], bool]:
        if isinstance(text, str):
            prompts, is_batch = [text], False
        elif isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            prompts, is_batch = text, True
        else:
            raise RequestError("text must be a string or a non-empty list of strings", "text",
                               "invalid_type")
        if any(t == "" for t in prompts):
            raise RequestError("text must not be empty", "text")
        if not all(is_valid_utf8(t) for t in prompts):
            raise RequestError("text must be valid Unicode (no lone surrogates)", "text")
        return prompts, is_batch

    def _encode(self, text: str) -> list[int]:
        ids = self.tokenizer.encode(text)
        if not ids:
            raise RequestError("text encodes to no tokens", "text")
        return ids

    def _parse_ids(self, input_ids: Any) -> tuple[list[list[int]], bool]:
        def is_ids(x: Any) -> bool:
            return isinstance(x, list) and all(
                isinstance(t, int) and not isinstance(t, bool) for t in x
            )

        if is_ids(input_ids):
            batch, is_batch = [input_ids], False
        elif isinstance(input_ids, list) and input_ids and all(is_ids(x) for x in input_ids):
            batch, is_batch = input_ids, True
        else:
            raise RequestError("input_ids must be a list of integers or a list of such lists",
                               "input_ids", "invalid_type")
        vocab = self.limits.vocab_size
        for ids in batch:
            if not ids:
                raise RequestError("input_ids must not be empty", "input_ids")
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise RequestError(
                    f"token id {bad} is outside the vocabulary [0, {vocab})", "input_ids"
                )
        return batch, is_batch

    def _parse_params(self, raw: Any, n_prompts: int) -> list[SamplingParams]:
        try:
            if isinstance(raw, list):
                if len(raw) != n_prompts:
                    raise RequestError(
                        f"sampling_params has {len(raw)} entries for {n_prompts} prompts",
                        "sampling_params",
                    )
                return [SamplingParams.from_dict(p) for p in raw]
            p = SamplingParams.from_dict(raw)
        except SamplingParamError as e:
            raise RequestError(str(e), e.param, e.code) from None
        return [p] * n_prompts

    def _parse_lora(self, raw: Any, n: int) -> list[int]:
        """lora_path (SGLang's field: an adapter name for every prompt, or a list with one name
        or null per prompt) -> per prompt its adapter id (0: the base model)."""
        if raw is None:
            return [0] * n
        if isinstance(raw, str):
            names: list[Any] = [raw] * n
        elif isinstance(raw, list) and len(raw) == n:
            names = raw
        else:
            raise RequestError("lora_path must be an adapter name, or a list with one name or "
                               "null per prompt", "lora_path", "invalid_type")
        if any(x is not None and not isinstance(x, str) for x in names):
            raise RequestError("lora_path entries must be adapter names or null", "lora_path",
                               "invalid_type")
        if self.loras is None:
            if any(x is not None for x in names):
                raise RequestError("lora_path names a LoRA adapter but this server was started "
                                   "without --enable-lora", "lora_path")
            return [0] * n
        return [0 if x is None else self.loras.resolve(x, "lora_path") for x in names]

    def _parse_rids(self, raw: Any, n: int) -> list[str]:
        if raw is None:
            return [uuid.uuid4().hex for _ in range(n)]
        def ok(r: Any) -> bool:
            return isinstance(r, str) and r != "" and is_valid_utf8(r)

        if n == 1 and ok(raw):
            return [raw]
        if isinstance(raw, list) and len(raw) == n and all(map(ok, raw)) and len(set(raw)) == n:
            return list(raw)
        raise RequestError("rid must be a non-empty string, or a list of distinct strings with "
                           "one per prompt", "rid", "invalid_type")

    def _parse_images(self, raw: Any, prompt_ids: list[list[int]],
                      prompt_field: str) -> list[str | None]:
        """image_data (a string, or a list with one string or null per prompt) -> per prompt
        its image source. A prompt with an image holds the image token exactly once; one
        without holds none."""
        n = len(prompt_ids)
        if raw is None:
            sources: list[str | None] = [None] * n
        elif isinstance(raw, str) and n == 1:
            sources = [raw]
        elif isinstance(raw, list) and len(raw) == n and all(
                x is None or isinstance(x, str) for x in raw):
            sources = list(raw)
        else:
            raise RequestError("image_data must be a string (one prompt), or a list with one "
                               "string or null per prompt", "image_data", "invalid_type")
        token = self.limits.image_token_id
        if token is None:
            if any(x is not None for x in sources):
                raise RequestError("this model does not take images", "image_data",
                                   "unsupported")
            return sources
        name = self.tokenizer.convert_ids_to_tokens(token)
        for ids, src in zip(prompt_ids, sources):
            count = ids.count(token)
            if src is not None and src == "":
                raise RequestError("image_data must not be empty", "image_data")
            if src is not None and count != 1:
                raise RequestError(f"a prompt with an image must hold the image token {name!r} "
                                   f"exactly once (found {count})", prompt_field)
            if src is None and count:
                raise RequestError(f"the prompt holds the image token {name!r} but no "
                                   "image_data was given", prompt_field)
        return sources

    def _parse_logprobs(self, body: dict[str, Any],
                        prompt_lens: list[int]) -> list[LogprobOptions | None]:
        """The logprob fields (each a value, or a list with one per prompt) -> per prompt the
        options, or None where return_logprob is false."""
        n = len(prompt_lens)

        def per_prompt(name: str, default: Any) -> list[Any]:
            raw = body.get(name)
            if isinstance(raw, list):
                if len(raw) != n:
                    raise RequestError(f"{name} has {len(raw)} entries for {n} prompts", name)
                return [default if v is None else v for v in raw]
            return [default if raw is None else raw] * n

        def check_bool(name: str, v: Any) -> None:
            if not isinstance(v, bool):
                raise RequestError(f"{name} must be a boolean", name, "invalid_type")

        def check_int(name: str, v: Any, lo: int, hi: int) -> None:
            if isinstance(v, bool) or not isinstance(v, int):
                raise RequestError(f"{name} must be an integer", name, "invalid_type")
            if not lo <= v <= hi:
                raise RequestError(f"{name} must be in [{lo}, {hi}], got {v}", name)

        out: list[LogprobOptions | None] = []
        for length, ret, start, top, text in zip(
            prompt_lens, per_prompt("return_logprob", False), per_prompt("logprob_start_len", -1),
            per_prompt("top_logprobs_num", 0), per_prompt("return_text_in_logprobs", False),
        ):
            check_bool("return_logprob", ret)
            check_int("logprob_start_len", start, -1, length - 1)
            check_int("top_logprobs_num", top, 0, MAX_TOP_LOGPROBS)
            check_bool("return_text_in_logprobs", text)
            out.append(LogprobOptions(start, top, text) if ret else None)
        return out

    def _check_lengths(self, n_tokens: int, p: SamplingParams, prompt_field: str) -> None:
        """prompt + max_new_tokens must fit the context and the KV pool; the error names the
        prompt when the prompt alone does not fit, else max_new_tokens."""
        limits = [(self.limits.context_length, f"the context length {self.limits.context_length}",
                   "context_length_exceeded"),
                  (self.limits.max_total_num_tokens,
                   f"the KV cache capacity ({self.limits.max_total_num_tokens} tokens)",
                   "kv_capacity_exceeded")]
        for limit, what, code in limits:
            if n_tokens > limit:
                raise RequestError(f"the prompt has {n_tokens} tokens: it exceeds {what}",
                                   prompt_field, code)
            need = n_tokens + p.max_new_tokens
            if need > limit:
                raise RequestError(
                    f"the prompt has {n_tokens} tokens and max_new_tokens is "
                    f"{p.max_new_tokens}: {need} exceeds {what}", "max_new_tokens", code)
