"""Sampling parameters of one request, and their validation.

Loaded by every process, so it imports nothing heavy (no torch). The HTTP process validates every
request with `SamplingParams.from_dict` before anything crosses into another process; the other
processes trust what they receive.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from srt import field_policy
from srt import stop_regex as stop_patterns
from srt.constrained.grammar import ConstraintSpec


class SamplingParamError(ValueError):
    """A sampling parameter is invalid. `param` names the field, for the 400 answer."""

    def __init__(self, param: str, message: str, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.param = param
        self.code = code


DEFAULT_MAX_NEW_TOKENS = 128


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request. temperature 0 means greedy."""

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: whole vocabulary
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    # Regexes searched in the output text (srt/stop_regex.py); trimmed like stop strings.
    stop_regex: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    seed: int | None = None  # SGLang's name for it, sampling_seed, is accepted too
    # Tokens per streamed chunk for this request; None: the server's --stream-interval.
    stream_interval: int | None = None
    # Constrained decoding: the output must fully match `regex`, be JSON valid under
    # `json_schema` (the schema as compact JSON text, its keys in the client's order: the
    # order of `properties` is the order of the output's keys), or be a sentence of the EBNF
    # grammar `ebnf` (xgrammar's GBNF-like syntax, root rule `root`). At most one of the three.
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None

    @property
    def is_greedy(self) -> bool:
        # Temperatures this small would overflow logits / t: they mean greedy.
        return self.temperature < 1e-5 or self.top_k == 1

    @property
    def constraint(self) -> ConstraintSpec | None:
        """The request's constraint, or None when unconstrained."""
        if self.regex is not None:
            return ConstraintSpec("regex", self.regex)
        if self.json_schema is not None:
            return ConstraintSpec("json_schema", self.json_schema)
        if self.ebnf is not None:
            return ConstraintSpec("ebnf", self.ebnf)
        return None

    @property
    def constraint_key(self) -> str | None:
        """Identifies the constraint (the compile cache key), or None when unconstrained."""
        spec = self.constraint
        return spec.key if spec is not None else None

    @property
    def uses_penalties(self) -> bool:
        return (
            self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @classmethod
    def from_dict(cls, d: Any) -> "SamplingParams":
        """Build and validate from a JSON object. Raises SamplingParamError naming the field."""
        if d is None:
            d = {}
        if not isinstance(d, dict):
            raise SamplingParamError("sampling_params", "sampling_params must be an object")
        try:
            d = field_policy.SAMPLING.apply(d)
        except field_policy.FieldError as e:
            raise SamplingParamError(e.name, str(e), e.code) from None
        kw: dict[str, Any] = {}
        for name, value in d.items():
            if value is None:
                continue  # JSON null means "use the default"
            kw[name] = _coerce(name, value)
        if "sampling_seed" in kw:  # SGLang's name of seed
            seed = kw.pop("sampling_seed")
            if kw.get("seed", seed) != seed:
                raise SamplingParamError("sampling_seed", "seed and sampling_seed differ (they "
                                         "are two names of one parameter)")
            kw["seed"] = seed
        params = cls(**kw)
        params.validate()
        return params

    def validate(self) -> None:
        """Raise SamplingParamError for the first invalid field."""
        if self.max_new_tokens < 0:
            raise SamplingParamError("max_new_tokens", "max_new_tokens must be >= 0")
        if self.min_new_tokens < 0:
            raise SamplingParamError("min_new_tokens", "min_new_tokens must be >= 0")
        if self.min_new_tokens > self.max_new_tokens:
            raise SamplingParamError(
                "min_new_tokens", "min_new_tokens must be <= max_new_tokens"
            )
        if self.temperature < 0:
            raise SamplingParamError("temperature", "temperature must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingParamError("top_p", "top_p must be in (0, 1]")
        if self.top_k == 0 or self.top_k < -1:
            raise SamplingParamError("top_k", "top_k must be -1 (disabled) or >= 1")
        if not 0.0 <= self.min_p <= 1.0:
            raise SamplingParamError("min_p", "min_p must be in [0, 1]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise SamplingParamError("frequency_penalty", "frequency_penalty must be in [-2, 2]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise SamplingParamError("presence_penalty", "presence_penalty must be in [-2, 2]")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise SamplingParamError("repetition_penalty", "repetition_penalty must be in (0, 2]")
        if self.n < 1:
            raise SamplingParamError("n", "n must be >= 1")
        if self.n > 128:
            raise SamplingParamError("n", "n must be <= 128")
        if any(s == "" for s in self.stop):
            raise SamplingParamError("stop", "stop strings must not be empty")
        given = [n for n in ("regex", "json_schema", "ebnf") if getattr(self, n) is not None]
        if len(given) > 1:
            raise SamplingParamError(given[0], "give at most one of regex, json_schema and ebnf")
        if self.regex == "":
            raise SamplingParamError("regex", "regex must not be empty")
        if self.ebnf is not None and not self.ebnf.strip():
            raise SamplingParamError("ebnf", "ebnf must not be empty")
        if any(t < 0 for t in self.stop_token_ids):
            raise SamplingParamError("stop_token_ids", "stop_token_ids must be >= 0")
        if self.stream_interval is not None and self.stream_interval < 1:
            raise SamplingParamError("stream_interval", "stream_interval must be >= 1")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_INT_FIELDS = {"max_new_tokens", "min_new_tokens", "top_k", "n", "stream_interval"}
_FLOAT_FIELDS = {
    "temperature",
    "top_p",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
}
_BOOL_FIELDS = {"ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"}


def _coerce(name: str, value: Any) -> Any:
    """Check the JSON type of one field. bool is not accepted where a number is meant."""
    if name in _INT_FIELDS or name in ("seed", "sampling_seed"):
        if isinstance(value, bool) or not isinstance(value, int):
            raise SamplingParamError(name, f"{name} must be an integer")
        lo, hi = (-(2**63), 2**63 - 1) if "seed" in name else (-(2**31), 2**31 - 1)
        if not lo <= value <= hi:
            raise SamplingParamError(name, f"{name} must be in [{lo}, {hi}]")
        return value
    if name in _FLOAT_FIELDS:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SamplingParamError(name, f"{name} must be a number")
        if value != value or value in (float("inf"), float("-inf")):
            raise SamplingParamError(name, f"{name} must be finite")
        return float(value)
    if name in _BOOL_FIELDS:
        if not isinstance(value, bool):
            raise SamplingParamError(name, f"{name} must be a boolean")
        return value
    if name == "stop":
        stops = [value] if isinstance(value, str) else value
        if isinstance(stops, list) and all(isinstance(s, str) for s in stops):
            if not all(is_valid_utf8(s) for s in stops):
                raise SamplingParamError(name, "stop strings must be valid Unicode text")
            return tuple(stops)
        raise SamplingParamError(name, "stop must be a string or a list of strings")
    if name == "stop_regex":
        patterns = [value] if isinstance(value, str) else value
        # (a tuple: from_dict of to_dict)
        if not isinstance(patterns, (list, tuple)) or not all(isinstance(p, str)
                                                              for p in patterns):
            raise SamplingParamError(name, "stop_regex must be a string or a list of strings")
        if len(patterns) > stop_patterns.MAX_STOP_REGEXES:
            raise SamplingParamError(
                name, f"at most {stop_patterns.MAX_STOP_REGEXES} stop_regex patterns are allowed")
        for p in patterns:
            why = "stop_regex must be valid Unicode text" if not is_valid_utf8(p) \
                else stop_patterns.validate(p)
            if why is not None:
                raise SamplingParamError(name, why)
        return tuple(dict.fromkeys(patterns))
    if name == "regex":
        if not isinstance(value, str) or not is_valid_utf8(value):
            raise SamplingParamError(name, "regex must be a string")
        return value
    if name == "ebnf":
        if not isinstance(value, str) or not is_valid_utf8(value):
            raise SamplingParamError(name, "ebnf must be a string")
        return value
    if name == "json_schema":
        if not isinstance(value, (str, dict)):
            raise SamplingParamError(name, "json_schema must be an object or a JSON string")
        try:
            schema = json.loads(value) if isinstance(value, str) else value
            if not isinstance(schema, dict):
                raise ValueError("not an object")
            # Not sorted: outlines-core writes the keys of an object in the order of its
            # schema's `properties`, and clients (pydantic models) expect that order.
            return json.dumps(schema, separators=(",", ":"))
        except (ValueError, TypeError) as e:
            raise SamplingParamError(name, f"json_schema must be a JSON object: {e}") from None
    if name == "stop_token_ids":
        if isinstance(value, list) and all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**31 for t in value
        ):
            return tuple(value)
        raise SamplingParamError(
            name, "stop_token_ids must be a list of integers in [0, 2**31)"
        )
    raise SamplingParamError(name, f"unknown sampling parameter {name!r}")


def is_valid_utf8(text: str) -> bool:
    """False for strings that cannot be encoded as UTF-8 (JSON allows lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
