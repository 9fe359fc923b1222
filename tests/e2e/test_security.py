"""A server with --api-key (from SRT_API_KEY), --admin-api-key, --log-requests, CORS for one
origin and small request limits, tested over HTTP: the authentication bypass matrix on raw
sockets (paths as sent, not normalized by a client), admin routes, CORS, each limit, the
queue's 503, and what the log holds."""

from __future__ import annotations

import json
import os
import time
from typing import Any

import openai
import pytest
import requests

from tests.conftest import BASE_ARGS, ServerProcess
from tests.e2e.raw_http import request as raw

API_KEY = "user-key-4f1d9c2b7a"
ADMIN_KEY = "admin-key-8e3a6d0f51"
ALLOWED_ORIGIN = "https://allowed.example"
USER = {"Authorization": f"Bearer {API_KEY}"}
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
GEN = {"text": "The capital of France is",
       "sampling_params": {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True}}
LIMIT_ARGS = ["--max-request-body-bytes", "65536", "--max-batch-prompts", "4", "--max-n", "3",
              "--max-top-logprobs", "5", "--max-stop-strings", "2",
              "--max-stop-string-length", "8", "--max-regex-length", "16",
              "--max-json-schema-bytes", "200", "--max-queued-requests", "3"]


class SecuredServer(ServerProcess):
    """Reads /get_server_info with the admin key (the KV-invariant check after each test)."""

    def server_info(self) -> dict[str, Any]:
        r = requests.get(self.url + "/get_server_info", headers=ADMIN, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()


@pytest.fixture(scope="module")
def srv(smollm2_dir: str) -> Any:
    old = os.environ.get("SRT_API_KEY")
    os.environ["SRT_API_KEY"] = API_KEY  # the API key comes from the environment
    try:
        s = SecuredServer([*BASE_ARGS, "--max-total-tokens", "4096", "--admin-api-key",
                           ADMIN_KEY, "--log-requests", "--cors-allow-origins", ALLOWED_ORIGIN,
                           *LIMIT_ARGS])
        s.start()
    finally:
        if old is None:
            del os.environ["SRT_API_KEY"]
        else:
            os.environ["SRT_API_KEY"] = old
    yield s
    s.stop()


def assert_envelope(body: Any, code: str | None = None) -> dict[str, Any]:
    data = json.loads(body) if isinstance(body, (bytes, str)) else body
    assert set(data) == {"error"}, data
    err = data["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    if code is not None:
        assert err["code"] == code, err
    return err


# ---------------------------------------------------------------- authentication

GEN_BYTES = json.dumps(GEN).encode()
# Request targets that reach a protected route once normalized.
PROTECTED_TARGETS = [
    "/generate", "//generate", "/./generate", "/generate/", "/generate//", "/v1/../generate",
    "/health/../generate", "/health/%2e%2e/generate", "/%2Fgenerate", "/health%2F..%2Fgenerate",
    "/gen%65rate", "/v1/completions", "//v1/completions", "/v1//completions",
    "/v1/completions/", "/v1%2Fcompletions", "/x/../v1/completions", "/v1/chat/completions",
    "/flush_cache", "/health/../flush_cache", "/abort_request", "/get_server_info",
    "/openapi.json", "/docs", "/v1/models", "/no_such_route", "http://127.0.0.1/generate",
]
BAD_CREDENTIALS: list[dict[str, str]] = [
    {},
    {"Authorization": "Bearer wrong-key"},
    {"Authorization": f"Bearer {API_KEY}x"},
    {"Authorization": f"Bearer {API_KEY[:-1]}"},
    {"Authorization": f"Basic {API_KEY}"},
    {"Authorization": API_KEY},
    {"Authorization": "Bearer"},
    {"X-Api-Key": API_KEY},
    {"Host": "localhost"},
    {"Host": "127.0.0.1:30000", "X-Forwarded-For": "127.0.0.1"},
    {"X-Original-URL": "/health", "X-Rewrite-URL": "/health"},
]


@pytest.mark.parametrize("target", PROTECTED_TARGETS)
def test_protected_targets_need_a_key(srv: Any, target: str) -> None:
    for method in ("POST", "GET", "HEAD", "OPTIONS"):
        for creds in BAD_CREDENTIALS:
            body = GEN_BYTES if method == "POST" else b""
            r = raw(srv.port, method, target, creds, body)
            assert r.status == 401, (method, target, creds, r.status, r.body)
            assert r.headers.get("www-authenticate") == "Bearer"
            if method != "HEAD":
                assert_envelope(r.body, "invalid_api_key")


def test_chunked_body_needs_a_key(srv: Any) -> None:
    r = raw(srv.port, "POST", "//generate", {}, GEN_BYTES, chunked=True)
    assert r.status == 401, r.body


@pytest.mark.parametrize("target", ["/health", "/health/", "//health", "/metrics",
                                    "/health_generate", "/x/../health"])
def test_exempt_paths_need_no_key(srv: Any, target: str) -> None:
    r = raw(srv.port, "GET", target)
    assert r.status == 200, (target, r.status, r.body)


def test_key_opens_every_spelling_of_a_route(srv: Any) -> None:
    plain = requests.post(srv.url + "/generate", json=GEN, headers=USER, timeout=120)
    assert plain.status_code == 200, plain.text
    for target in ("//generate", "/v1/../generate/", "/gen%65rate"):
        r = raw(srv.port, "POST", target, USER, GEN_BYTES)
        assert r.status == 200, (target, r.status, r.body)
        assert r.json()["output_ids"] == plain.json()["output_ids"]
    # the admin key is accepted on user routes too
    r = requests.post(srv.url + "/generate", json=GEN, headers=ADMIN, timeout=120)
    assert r.status_code == 200, r.text


def test_admin_routes_need_the_admin_key(srv: Any) -> None:
    for target in ("/flush_cache", "//flush_cache/", "/abort_request", "/v1/../abort_request"):
        r = raw(srv.port, "POST", target, USER, b'{"rid": "x"}')
        assert r.status == 403, (target, r.status, r.body)
        assert_envelope(r.body, "admin_key_required")["type"] == "permission_error"
    assert requests.post(srv.url + "/flush_cache", headers=ADMIN, timeout=60).status_code == 200
    r = requests.post(srv.url + "/abort_request", json={"rid": "none"}, headers=ADMIN,
                      timeout=60)
    assert r.status_code == 404 and assert_envelope(r.json())["code"] == "rid_not_found"


def test_openai_client_needs_the_key(srv: Any) -> None:
    bad = openai.OpenAI(base_url=srv.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as exc:
        bad.completions.create(model="default", prompt="Hi", max_tokens=1)
    assert exc.value.status_code == 401
    good = openai.OpenAI(base_url=srv.url + "/v1", api_key=API_KEY, max_retries=0)
    out = good.chat.completions.create(model="default", max_tokens=2, temperature=0,
                                       messages=[{"role": "user", "content": "Hi"}])
    assert out.usage.completion_tokens == 2


def test_server_info_hides_keys(srv: Any) -> None:
    r = requests.get(srv.url + "/get_server_info", headers=USER, timeout=60)
    assert r.status_code == 200
    assert API_KEY not in r.text and ADMIN_KEY not in r.text
    assert r.json()["api_key"] == "<set>" and r.json()["admin_api_key"] == "<set>"


# ---------------------------------------------------------------- CORS

def preflight(srv: Any, origin: str) -> Any:
    return raw(srv.port, "OPTIONS", "/v1/chat/completions",
               {"Origin": origin, "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization, content-type"})


def test_cors_allows_only_the_configured_origin(srv: Any) -> None:
    r = preflight(srv, ALLOWED_ORIGIN)
    assert r.status == 200, r.body
    assert r.headers.get("access-control-allow-origin") == ALLOWED_ORIGIN
    r = preflight(srv, "https://evil.example")
    assert "access-control-allow-origin" not in r.headers
    assert r.status == 401
    assert_envelope(r.body)
    # a real request from the allowed origin still needs the key
    r = raw(srv.port, "POST", "/generate", {"Origin": ALLOWED_ORIGIN}, GEN_BYTES)
    assert r.status == 401


# ---------------------------------------------------------------- limits

def post(srv: Any, path: str, body: Any) -> requests.Response:
    return requests.post(srv.url + path, json=body, headers=USER, timeout=120)


def body_with(**params: Any) -> dict[str, Any]:
    return {"text": "Hi", "sampling_params": {"max_new_tokens": 1, **params}}


CHAT = {"model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
LIMIT_ROWS = [
    ("/generate", {"text": ["a"] * 5}, "text"),
    ("/generate", {"input_ids": [[1]] * 5}, "input_ids"),
    ("/generate", {"text": ["a"] * 2, "sampling_params": [{}] * 5}, "sampling_params"),
    ("/generate", body_with(n=4), "n"),
    ("/generate", {**body_with(), "return_logprob": True, "top_logprobs_num": 6},
     "top_logprobs_num"),
    ("/generate", body_with(stop=["a", "b", "c"]), "stop"),
    ("/generate", body_with(stop="123456789"), "stop"),
    ("/generate", body_with(stop_token_ids=[1, 2, 3]), "stop_token_ids"),
    ("/generate", body_with(regex="a" * 17), "regex"),
    ("/generate", body_with(json_schema={"type": "object", "description": "x" * 200}),
     "json_schema"),
    ("/v1/completions", {"model": "default", "prompt": ["a"] * 5, "max_tokens": 1}, "prompt"),
    ("/v1/completions", {"model": "default", "prompt": "a", "logprobs": 6}, "logprobs"),
    ("/v1/completions", {"model": "default", "prompt": "a", "n": 4}, "n"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 6}, "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "stop": ["a", "b", "c"]}, "stop"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "description": "x" * 200}}}},
     "response_format"),
]


@pytest.mark.parametrize("path,payload,param", LIMIT_ROWS)
def test_limits_are_400_naming_the_field(srv: Any, path: str, payload: Any, param: str) -> None:
    r = post(srv, path, payload)
    assert r.status_code == 400, (r.status_code, r.text)
    err = assert_envelope(r.json(), "limit_exceeded")
    assert err["param"] == param, err


def test_limits_come_before_per_item_validation(srv: Any) -> None:
    """Five prompts, each invalid text: the count is refused before any prompt is looked at."""
    r = requests.post(srv.url + "/generate", headers={**USER, "Content-Type": "application/json"},
                      data=b'{"text": ["\\ud800", "\\ud800", "\\ud800", "\\ud800", "\\ud800"]}',
                      timeout=60)
    assert r.status_code == 400 and assert_envelope(r.json())["code"] == "limit_exceeded"


def test_body_size_is_413(srv: Any) -> None:
    big = json.dumps({"text": "a" * 70000}).encode()
    for chunked in (False, True):
        r = raw(srv.port, "POST", "/generate", USER, big, chunked=chunked)
        assert r.status == 413, (chunked, r.status, r.body)
        assert assert_envelope(r.body, "request_too_large")["type"] == "invalid_request_error"
    # just under the limit is read (and then refused for its length in tokens, not its size)
    ok = json.dumps({"text": "a " * 30000, "sampling_params": {"max_new_tokens": 1}}).encode()
    assert len(ok) < 65536
    r = raw(srv.port, "POST", "/generate", USER, ok)
    assert r.status == 400 and r.json()["error"]["param"] == "text", r.body


def test_queue_full_is_503_with_retry_after(srv: Any) -> None:
    long = {"text": "Count from one to one hundred:", "stream": True,
            "sampling_params": {"max_new_tokens": 300, "temperature": 0, "ignore_eos": True,
                                "n": 3}}
    with requests.post(srv.url + "/generate", json=long, headers=USER, stream=True,
                       timeout=120) as held:
        assert held.status_code == 200
        lines = held.iter_lines()
        next(line for line in lines if line)  # three samples are held now
        r = post(srv, "/generate", GEN)
        assert r.status_code == 503, r.text
        assert r.headers["Retry-After"] == "1"
        err = assert_envelope(r.json(), "queue_full")
        assert err["type"] == "server_error"
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key=API_KEY, max_retries=0)
        with pytest.raises(openai.APIStatusError) as exc:
            client.completions.create(model="default", prompt="Hi", max_tokens=1)
        assert exc.value.status_code == 503
    # the stream was closed: its samples are aborted and the queue frees up
    deadline = time.monotonic() + 30
    while (r := post(srv, "/generate", GEN)).status_code == 503 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert r.status_code == 200, r.text
    # a request that alone holds more samples than the queue admits is a 400
    r = post(srv, "/generate", {"text": ["a", "b"], "sampling_params": {"n": 2,
                                                                         "max_new_tokens": 1}})
    assert r.status_code == 400 and assert_envelope(r.json(), "limit_exceeded")


# ---------------------------------------------------------------- logs

def test_log_requests_escapes_and_never_holds_keys(srv: Any) -> None:
    marker = "LOGMARK-31c7"
    prompt = f"{marker} \x1b[31mred\x1b[0m\r\nFORGED-LINE \x00\x07 \u2028 end"
    r = post(srv, "/generate", {"text": prompt, "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 200, r.text
    # a refused request whose path carries control characters
    raw(srv.port, "GET", "/x%1b[2J%0d%0aFORGED-PATH", {"Authorization": "Bearer wrong-key"})
    log = srv.log()
    assert marker in log  # --log-requests: the prompt is logged ...
    assert "\\u001b[31mred" in log  # ... escaped
    assert "output" in log and json.dumps(r.json()["text"]) in log
    for ch in ("\x1b", "\r", "\x00", "\x07", "\u2028"):
        assert ch not in log, repr(ch)
    for line in log.splitlines():
        assert not line.startswith(("FORGED-LINE", "FORGED-PATH")), line
    assert "\\x1b[2J\\x0d\\x0aFORGED-PATH" in log, "the refused path is logged escaped"
    assert API_KEY not in log and ADMIN_KEY not in log and "wrong-key" not in log
