"""Schemathesis against the server's own /openapi.json: every operation, positive and negative
examples (a bounded number each). No answer may be a 5xx, every error must be the envelope,
and afterwards the server is healthy and a greedy prompt still gives the answer it gave before.

Generated bodies are made cheap before they are sent (max_new_tokens and n capped, no regex or
schema to compile): the fuzzing is about the HTTP layer's validation, and a CPU decodes about
15 tokens a second.
"""

from __future__ import annotations

import json
from typing import Any

import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

EXAMPLES_PER_MODE = 8
KNOWN = {"text": "The capital of France is",
         "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}
BUDGETS = ("max_new_tokens", "max_tokens", "max_completion_tokens")
PROMPT_CHARS = 24


def _short(value: Any) -> Any:
    """Strings cut to PROMPT_CHARS, lists to 2 items (recursively)."""
    if isinstance(value, str):
        return value[:PROMPT_CHARS]
    if isinstance(value, list):
        return [_short(v) for v in value[:2]]
    if isinstance(value, dict):
        return {k: _short(v) for k, v in value.items()}
    return value


def _shorten_prompts(body: dict[str, Any]) -> None:
    for name in ("text", "prompt", "messages"):
        if name in body:
            body[name] = _short(body[name])


def cheapen(body: Any) -> Any:
    """Bound the work one generated body can cause (in place where it is an object)."""
    if not isinstance(body, dict):
        return body
    for p in [body, *(body.get("sampling_params") if isinstance(body.get("sampling_params"),
                                                                  list) else
                      [body.get("sampling_params")])]:
        if not isinstance(p, dict):
            continue
        for name in BUDGETS:
            if isinstance(p.get(name), int) and not isinstance(p[name], bool):
                p[name] = min(p[name], 2)
        if "messages" in p and p.get("max_tokens") is None \
                and p.get("max_completion_tokens") is None:
            p["max_tokens"] = 2  # the chat default is "the rest of the context"
        if isinstance(p.get("n"), int) and not isinstance(p["n"], bool) and p["n"] > 2:
            p["n"] = 2
        p.pop("regex", None)
        p.pop("json_schema", None)
        p.pop("response_format", None)
    _shorten_prompts(body)
    if "sampling_params" not in body and ("text" in body or "input_ids" in body):
        body["sampling_params"] = {"max_new_tokens": 2}
    if isinstance(body.get("sampling_params"), dict):
        body["sampling_params"].setdefault("max_new_tokens", 2)
    if "prompt" in body:
        body.setdefault("max_tokens", 2)
    if isinstance(body.get("model"), str):
        body["model"] = "default"
    return body


def test_fuzz_openapi(server: Any) -> None:
    before = server.generate(KNOWN)
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    operations = [r.ok() for r in schema.get_all_operations()]
    assert len(operations) >= 10, [op.label for op in operations]
    seen: dict[str, int] = {}
    bad: list[str] = []
    no_negative: list[str] = []
    session = requests.Session()

    for op in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            @settings(max_examples=EXAMPLES_PER_MODE, deadline=None, database=None,
                      suppress_health_check=list(HealthCheck), derandomize=True)
            @given(case=op.as_strategy(generation_mode=mode))
            def run(case: Any) -> None:
                if case.body is not None and not isinstance(case.body, (bytes, str)):
                    case.body = cheapen(case.body)
                r = case.call(base_url=server.url, session=session, timeout=120)
                key = f"{op.label} {mode.value} {r.status_code}"
                seen[key] = seen.get(key, 0) + 1
                if r.status_code >= 500:
                    bad.append(f"{key}: {r.text[:300]} for {case.body!r:.300}")
                elif r.status_code >= 400 and case.method.upper() != "HEAD":
                    try:
                        err = r.json()["error"]
                        ok = set(err) == {"message", "type", "param", "code"}
                    except (ValueError, KeyError, TypeError):
                        ok = False
                    if not ok:
                        bad.append(f"{key}: not the error envelope: {r.text[:300]}")

            try:
                run()
            except Unsatisfiable:
                # an operation without parameters or body has no negative examples
                assert mode == GenerationMode.NEGATIVE, op.label
                no_negative.append(op.label)
    assert not bad, "\n".join(bad[:20])
    # both modes reached the generation endpoints, and a generation endpoint accepted something
    # (positive examples follow the schema, which cannot say everything the server checks: an
    # empty text, an integer written as 3.0; which endpoint gets a valid one varies with the
    # examples drawn)
    gen = ("POST /generate", "POST /v1/completions", "POST /v1/chat/completions")
    assert any(k.startswith(gen) and k.endswith("positive 200") for k in seen), seen
    for label in ("POST /generate", "POST /v1/completions", "POST /v1/chat/completions"):
        assert any(k.startswith(f"{label} negative 4") for k in seen), (label, seen)
        assert label not in no_negative
    assert requests.get(server.url + "/health", timeout=30).status_code == 200
    assert requests.get(server.url + "/health_generate", timeout=60).status_code == 200
    after = server.generate(KNOWN)
    assert after["output_ids"] == before["output_ids"], (before, after)
    assert after["text"] == before["text"]
    print(json.dumps(seen, indent=1, sort_keys=True))
