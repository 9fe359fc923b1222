"""Which JSON-Schema keywords a grammar backend enforces, and the refusal of the rest.

xgrammar and llguidance accept some keywords without enforcing them (xgrammar: `not`, `allOf`,
`if`/`then`, `uniqueItems`, `multipleOf` on numbers, unknown `format` values, `contentEncoding`;
found by compiling each keyword and feeding a violating value). A schema is checked against an
allow-list before it is compiled, so anything else is a 400 naming the keyword rather than output
that silently violates the schema.

`exact_formats` replaces `format: date` / `date-time` by patterns that also check the day of the
month (xgrammar's own format grammar admits 2024-02-30, which no date parser accepts), and
`email` by one with RFC 5321's length limits.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# Carry no constraint.
ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$schema", "$id",
                         "$comment", "deprecated", "readOnly", "writeOnly", "discriminator"})
# Their value maps names to subschemas (the names are not keywords) ...
_NAME_MAPS = ("properties", "$defs", "definitions", "patternProperties")
# ... or is data, not a schema.
_DATA_KEYWORDS = ("enum", "const", "default", "examples", "required", "discriminator")


@dataclass(frozen=True)
class SchemaSupport:
    """The keywords and `format` values one backend enforces."""

    keywords: frozenset[str]
    formats: frozenset[str]
    integer_multiple_of_only: bool = False  # multipleOf enforced for integer types only
    # Keywords ignored on a string that also has a `format` (xgrammar's format grammar wins:
    # an email with maxLength 24 came out hundreds of characters long).
    not_with_format: frozenset[str] = frozenset()

    def check(self, schema: Any, path: str = "$") -> None:
        """Raise ValueError naming the first keyword of `schema` that would not be enforced."""
        if isinstance(schema, list):
            for i, sub in enumerate(schema):
                self.check(sub, f"{path}[{i}]")
            return
        if not isinstance(schema, dict):
            return
        for key, value in schema.items():
            if key in ANNOTATIONS and key in _DATA_KEYWORDS:
                continue
            if key not in self.keywords and key not in ANNOTATIONS:
                raise ValueError(f"the keyword {key!r} at {path} is not supported (it would "
                                 "not be enforced)")
            if key == "format" and (not isinstance(value, str) or value not in self.formats):
                raise ValueError(f"the keyword 'format' at {path} has the value {value!r}, "
                                 "which is not supported (it would not be enforced)")
            if key in self.not_with_format and "format" in schema:
                raise ValueError(f"the keyword {key!r} at {path} is not supported together "
                                 "with 'format' (it would not be enforced)")
            if key == "multipleOf" and self.integer_multiple_of_only and not (
                    schema.get("type") == "integer" and isinstance(value, int)
                    and not isinstance(value, bool)):
                raise ValueError(f"the keyword 'multipleOf' at {path} is supported only as an "
                                 "integer on an integer type")
            if key in _DATA_KEYWORDS:
                continue
            if key in _NAME_MAPS and isinstance(value, dict):
                for name, sub in value.items():
                    self.check(sub, f"{path}.{key}.{name}")
                continue
            self.check(value, f"{path}.{key}")


_COMMON = frozenset({
    "type", "properties", "required", "additionalProperties", "items", "prefixItems",
    "minItems", "maxItems", "enum", "const", "anyOf", "$ref", "$defs", "definitions",
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "pattern",
    "minLength", "maxLength", "format",
})
# oneOf is compiled as anyOf: exact for the unions pydantic writes (discriminated by a const).
XGRAMMAR = SchemaSupport(
    keywords=_COMMON | {"oneOf", "contains"},
    formats=frozenset({"date", "time", "date-time", "duration", "email", "hostname", "ipv4",
                       "ipv6", "uri", "uri-reference", "uuid", "uri-template", "json-pointer",
                       "relative-json-pointer"}),
    integer_multiple_of_only=True,
    not_with_format=frozenset({"minLength", "maxLength", "pattern"}),
)
# llguidance refuses unknown keywords and formats itself; the list is the same check up front.
LLGUIDANCE = SchemaSupport(
    keywords=_COMMON | {"oneOf", "patternProperties", "minProperties", "maxProperties", "allOf"},
    formats=frozenset({"date", "time", "date-time", "duration", "email", "hostname", "ipv4",
                       "ipv6", "uri", "uuid"}),
)

_YEAR = "([0-9]{3}[1-9]|[0-9]{2}[1-9][0-9]|[0-9][1-9][0-9]{2}|[1-9][0-9]{3})"
_LEAP_YEAR = "([0-9]{2}(0[48]|[2468][048]|[13579][26])|([2468][048]|[13579][26]|0[48])00)"
_MONTH_DAY = ("((0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])|(0[469]|11)-(0[1-9]|[12][0-9]|30)"
              "|02-(0[1-9]|1[0-9]|2[0-8]))")
DATE_PATTERN = f"({_YEAR}-{_MONTH_DAY}|{_LEAP_YEAR}-02-29)"
_TIME = "([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
DATE_TIME_PATTERN = f"{DATE_PATTERN}T{_TIME}"
# RFC 5321's length limits (local part 64, a label 63): xgrammar's email grammar has none, and
# at temperature 1 a model can write one local part past any max_new_tokens.
EMAIL_PATTERN = "[A-Za-z0-9._%+-]{1,64}@([A-Za-z0-9-]{1,63}[.]){1,3}[A-Za-z]{2,24}"
_EXACT = {"date": DATE_PATTERN, "date-time": DATE_TIME_PATTERN, "email": EMAIL_PATTERN}


def exact_formats(schema_json: str) -> str:
    """The schema with `format: date` / `date-time` / `email` (on strings without a pattern of
    their own) replaced by an anchored pattern that admits only real calendar dates / emails
    within RFC 5321's lengths."""
    def walk(node: Any) -> Any:
        if isinstance(node, list):
            return [walk(x) for x in node]
        if not isinstance(node, dict):
            return node
        out = {k: (v if k in _DATA_KEYWORDS else walk(v)) for k, v in node.items()}
        fmt = out.get("format")
        if isinstance(fmt, str) and fmt in _EXACT and "pattern" not in out:
            del out["format"]
            out["pattern"] = f"^{_EXACT[fmt]}$"
        return out

    return json.dumps(walk(json.loads(schema_json)), separators=(",", ":"))


def closed_objects(schema_json: str) -> str:
    """The schema with `additionalProperties: false` on every object schema that lists
    `properties` or `patternProperties` and says nothing of other keys: the behaviour of
    xgrammar's strict mode and outlines-core, so that every backend writes only the listed keys
    (JSON Schema's own default would let llguidance add keys of its choosing)."""
    def schema(node: Any) -> Any:
        if isinstance(node, list):
            return [schema(x) for x in node]
        if not isinstance(node, dict):
            return node
        out: dict[str, Any] = {}
        for key, value in node.items():
            if key in _DATA_KEYWORDS:
                out[key] = value
            elif key in _NAME_MAPS and isinstance(value, dict):
                out[key] = {name: schema(sub) for name, sub in value.items()}
            else:
                out[key] = schema(value)
        if ("properties" in out or "patternProperties" in out) \
                and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out

    return json.dumps(schema(json.loads(schema_json)), separators=(",", ":"))
