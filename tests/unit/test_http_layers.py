"""The HTTP layers' pure parts: path normalization, the auth decision, the limit checks, the
error envelope of a real FastAPI app (a bug is a JSON 500, a pydantic failure a 400), and log
escaping."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from fastapi import FastAPI
from pydantic import BaseModel
from starlette.testclient import TestClient

from srt.http.auth import AuthPolicy, bearer_token, normalize_path
from srt.http.errors import ApiError, error_type, install_error_handlers
from srt.http.limits import QueueGate, RequestLimits
from srt.logsafe import SafeFormatter, escape
from srt.server_args import ServerArgs


@pytest.mark.parametrize("raw,norm", [
    ("/generate", "/generate"), ("//generate", "/generate"), ("/generate/", "/generate"),
    ("/./generate", "/generate"), ("/a/../generate", "/generate"), ("/../../generate",
                                                                    "/generate"),
    ("/v1//chat///completions/", "/v1/chat/completions"), ("/", "/"), ("", "/"),
    ("/health/../flush_cache", "/flush_cache"), ("/v1%2Fcompletions", "/v1%2Fcompletions"),
])
def test_normalize_path(raw: str, norm: str) -> None:
    assert normalize_path(raw) == norm


def test_auth_decisions() -> None:
    p = AuthPolicy("user", "admin", frozenset({"/health"}))
    assert p.decide("/health", None) is None
    assert p.decide("/generate", None)[0] == 401
    assert p.decide("/generate", b"nope")[0] == 401
    assert p.decide("/generate", b"user") is None
    assert p.decide("/generate", b"admin") is None
    assert p.decide("/flush_cache", b"user")[0] == 403
    assert p.decide("/flush_cache", b"admin") is None
    assert p.decide("/flush_cache", None)[0] == 401
    only_user = AuthPolicy("user", None, frozenset())
    assert only_user.decide("/flush_cache", b"user") is None
    only_admin = AuthPolicy(None, "admin", frozenset())
    assert only_admin.decide("/generate", None) is None
    assert only_admin.decide("/abort_request", b"user")[0] == 401
    assert AuthPolicy(None, None, frozenset()).decide("/flush_cache", None) is None


def test_bearer_token() -> None:
    assert bearer_token([(b"authorization", b"Bearer k1")]) == b"k1"
    assert bearer_token([(b"Authorization", b"bearer   k1 ")]) == b"k1"
    assert bearer_token([(b"authorization", b"Basic k1")]) is None
    assert bearer_token([(b"authorization", b"Bearer")]) is None
    assert bearer_token([]) is None


def test_limits() -> None:
    lim = RequestLimits(2, 3, 5, 2, 4, 8, 50)
    assert lim.check_generate({"text": ["a", "b"], "sampling_params": {"n": 3}}) == 6
    assert lim.check_generate({"text": "a", "sampling_params": [{"n": 2}]}) == 2
    assert lim.check_generate({"text": "a", "sampling_params": {"n": "x", "stop": 5}}) == 1
    rows = [
        ({"text": ["a"] * 3}, "text"), ({"input_ids": [[1]] * 3}, "input_ids"),
        ({"text": "a", "sampling_params": {"n": 4}}, "n"),
        ({"text": "a", "top_logprobs_num": [1, 6]}, "top_logprobs_num"),
        ({"text": "a", "sampling_params": {"stop": ["a", "b", "c"]}}, "stop"),
        ({"text": "a", "sampling_params": {"stop": "abcde"}}, "stop"),
        ({"text": "a", "sampling_params": {"regex": "a" * 9}}, "regex"),
        ({"text": "a", "sampling_params": {"json_schema": {"d": "x" * 50}}}, "json_schema"),
    ]
    for body, param in rows:
        with pytest.raises(ApiError) as e:
            lim.check_generate(body)
        assert (e.value.status, e.value.param, e.value.code) == (400, param, "limit_exceeded")
    with pytest.raises(ApiError):
        lim.check_chat({"top_logprobs": 6})
    with pytest.raises(ApiError) as e:
        lim.check_completion({"prompt": [[1], [2], [3]]})
    assert e.value.param == "prompt"


def test_queue_gate() -> None:
    held = [0]
    gate = QueueGate(3, lambda: held[0])
    gate.admit(3)
    held[0] = 2
    with pytest.raises(ApiError) as e:
        gate.admit(2)
    assert e.value.status == 503 and e.value.headers == {"Retry-After": "1"}
    with pytest.raises(ApiError) as e:
        gate.admit(4)
    assert e.value.status == 400


class Item(BaseModel):
    x: int


def test_error_envelope_of_a_real_app() -> None:
    app = FastAPI()
    install_error_handlers(app)

    @app.get("/bug")
    async def bug() -> Any:
        raise RuntimeError("boom \x1b secret")

    @app.post("/typed")
    async def typed(item: Item) -> Any:
        return item

    client = TestClient(app, raise_server_exceptions=False)
    r = client.get("/bug")
    assert r.status_code == 500 and r.headers["content-type"] == "application/json"
    assert r.json() == {"error": {"message": "internal server error", "type": "server_error",
                                  "param": None, "code": "internal_error"}}
    r = client.post("/typed", json={"x": "no"})
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param",
                                                                "code"}
    assert client.get("/missing").json()["error"]["code"] == "not_found"
    assert [error_type(s) for s in (400, 401, 403, 404, 413, 429, 500, 503)] == [
        "invalid_request_error", "authentication_error", "permission_error",
        "invalid_request_error", "invalid_request_error", "rate_limit_error", "server_error",
        "server_error"]


def test_log_escaping() -> None:
    assert escape("a\x1b[1m\r\n\x00\x85\u2028b\tc") == "a\\x1b[1m\\x0d\\x0a\\x00\\x85\\u2028b\tc"
    record = logging.LogRecord("x", logging.INFO, "f", 1, "got %s", ("p\rq\nFORGED",), None)
    text = SafeFormatter("%(levelname)s %(message)s").format(record)
    assert text == "INFO got p\\x0dq\n    FORGED"


def test_flags_and_defaults() -> None:
    args = ServerArgs.from_cli([])
    assert args.host == "127.0.0.1"
    assert (args.api_key, args.admin_api_key, args.cors_allow_origins) == (None, None, None)
    assert args.max_image_bytes == 20 * 2**20 and args.max_image_pixels == 4096 * 4096
    assert args.max_top_logprobs == 20 and args.max_queued_requests == 1024
    assert args.log_requests is False
    with pytest.raises(ValueError):
        ServerArgs.from_cli(["--max-top-logprobs", "21"]).validate()
    with pytest.raises(ValueError):
        ServerArgs.from_cli(["--api-key", " "]).validate()
