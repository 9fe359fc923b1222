"""The field policy (srt/field_policy.py): its lists against SGLang 0.5.23's own request models
(read from the installed package's source, never imported), and its rules on their own.
The same lists are checked over HTTP in tests/e2e/test_sglang_api.py."""

from __future__ import annotations

import ast
import os
from typing import Any

import pytest

from srt import field_policy
from srt.field_policy import FieldError, NoOp, is_noop

# (file of the sglang package, class) -> our surface for it
SGLANG_MODELS = [
    ("srt/managers/io_struct.py", "GenerateReqInput", field_policy.GENERATE),
    ("srt/sampling/sampling_params.py", "SamplingParams", field_policy.SAMPLING),
    ("srt/entrypoints/openai/protocol.py", "CompletionRequest", field_policy.COMPLETION),
    ("srt/entrypoints/openai/protocol.py", "ChatCompletionRequest", field_policy.CHAT),
    ("srt/entrypoints/openai/protocol.py", "TokenizeRequest", field_policy.TOKENIZE),
    ("srt/entrypoints/openai/protocol.py", "DetokenizeRequest", field_policy.DETOKENIZE),
]
# SamplingParams' fields that normalize() fills in; no client sends them
SGLANG_INTERNAL = {"stop_strs", "stop_regex_strs", "stop_str_max_len", "stop_regex_max_len",
                   "is_normalized", "ebnf_full_assistant"}


def declared_fields(path: str, cls: str) -> dict[str, Any]:
    """Public annotated fields of a class (and its bases in the same file) -> their default
    as source text."""
    tree = ast.parse(open(path).read())
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    out: dict[str, Any] = {}

    def walk(name: str) -> None:
        node = classes[name]
        for base in node.bases:
            if isinstance(base, ast.Name) and base.id in classes:
                walk(base.id)
        for st in node.body:
            if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name) \
                    and not st.target.id.startswith("_"):
                out[st.target.id] = ast.unparse(st.value) if st.value is not None else None

    walk(cls)
    return out


@pytest.mark.parametrize("path,cls,surface", SGLANG_MODELS,
                         ids=[m[1] for m in SGLANG_MODELS])
def test_every_sglang_field_is_listed(sglang_clients: str, path: str, cls: str,
                                      surface: field_policy.Surface) -> None:
    fields = declared_fields(os.path.join(sglang_clients, "sglang", path), cls)
    assert len(fields) >= 3, fields
    missing = sorted(set(fields) - SGLANG_INTERNAL - surface.names)
    assert not missing, f"{cls} fields srt neither implements nor lists: {missing}"


def test_surfaces_are_disjoint_and_unknown_names_fail() -> None:
    for s in field_policy.SURFACES:
        assert not s.implemented & set(s.unsupported), s.where
        with pytest.raises(FieldError) as e:
            s.apply({"no_such_field_xyz": 1})
        assert e.value.code == "unknown_field" and e.value.name == "no_such_field_xyz"


@pytest.mark.parametrize("value,rule,expected", [
    (None, NoOp(False), True),
    (False, NoOp(False), True),
    (True, NoOp(False), False),
    (0, NoOp(False), False),  # 0 is not false
    (False, NoOp(0), False),
    (0.0, NoOp(0), True),
    ([], NoOp(), True),
    ({}, NoOp(), True),
    ([None, None], NoOp(), True),  # one value per prompt
    ([None, "a"], NoOp(), False),
    ({"a": 1}, NoOp(), False),
    ("", NoOp(), False),
    (1, NoOp(None, (1,)), True),
    ("auto", NoOp("auto", ("none",)), True),
    ("required", NoOp("auto", ("none",)), False),
])
def test_is_noop(value: Any, rule: NoOp, expected: bool) -> None:
    assert is_noop(value, rule) is expected


def test_apply_drops_noops_and_keeps_implemented() -> None:
    body = {"text": "hi", "background": False, "lora_id": None, "log_metrics": True,
            "lora_path": "a"}
    assert field_policy.GENERATE.apply(body) == {"text": "hi", "lora_path": "a"}
    with pytest.raises(FieldError) as e:
        field_policy.GENERATE.apply({"text": "hi", "log_metrics": False, "background": True})
    assert e.value.code == "unsupported" and e.value.name == "background"  # first by name
    assert "background" in str(e.value)


README_LINES = {field_policy.SAMPLING.where: "- `sampling_params`:",
                field_policy.GENERATE.where: "- `POST /generate`:",
                field_policy.COMPLETION.where: "- `POST /v1/completions`:",
                field_policy.CHAT.where: "- `POST /v1/chat/completions`:",
                field_policy.TOKENIZE.where: "- `POST /tokenize`:"}


def test_readme_lists_the_unimplemented_fields() -> None:
    import re

    readme = open(os.path.join(os.path.dirname(__file__), "..", "..", "README.md")).read()
    surfaces = {s.where: s for s in field_policy.SURFACES if s.unsupported}
    assert set(surfaces) == set(README_LINES)
    for where, start in README_LINES.items():
        surface = surfaces[where]
        line = next(ln for ln in readme.splitlines() if ln.startswith(start))
        listed = set(re.findall(r"`([a-z_0-9]+)`", line[len(start):]))
        assert listed == set(surface.unsupported), (surface.where,
                                                    listed ^ set(surface.unsupported))
