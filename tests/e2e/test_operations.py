"""Operations on the default server (no key, default limits): the error envelope on every
status the routes produce, /metrics, /health_generate, no request content in the log, and
nothing listening beyond loopback."""

from __future__ import annotations

import concurrent.futures as cf
import os
import threading
from typing import Any

import requests
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.raw_http import request as raw

GEN = {"text": "The capital of France is",
       "sampling_params": {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}}


def assert_envelope(r: Any, status: int, code: str | None = None) -> dict[str, Any]:
    status_code = r.status_code if hasattr(r, "status_code") else r.status
    data = r.json()
    assert status_code == status, (status_code, data)
    assert set(data) == {"error"}, data
    err = data["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    if code is not None:
        assert err["code"] == code, err
    return err


# ---------------------------------------------------------------- envelope

def test_error_envelope_on_every_status(server: Any) -> None:
    url = server.url
    assert_envelope(requests.get(url + "/no_such_route", timeout=30), 404, "not_found")
    assert_envelope(requests.get(url + "/generate", timeout=30), 405, "method_not_allowed")
    assert_envelope(requests.delete(url + "/v1/models", timeout=30), 405)
    assert_envelope(requests.post(url + "/generate", data=b"{", timeout=30), 400,
                    "invalid_json")
    assert_envelope(requests.post(url + "/v1/completions", json={"model": "nope", "prompt": "a"},
                                  timeout=30), 404, "model_not_found")
    assert_envelope(requests.post(url + "/abort_request", json={"rid": "none"}, timeout=30),
                    404, "rid_not_found")
    # 413 from the declared length alone: the 40 MB are never sent
    r = raw(server.port, "POST", "/generate", {"Content-Length": str(40 * 2**20)})
    err = assert_envelope(r, 413, "request_too_large")
    assert str(32 * 2**20) in err["message"]
    r = raw(server.port, "POST", "/generate", {"Content-Length": "abc"})
    assert r.status == 400  # rejected by the HTTP parser or by us; never reaches a route


def test_openapi_describes_the_request_bodies(server: Any) -> None:
    spec = requests.get(server.url + "/openapi.json", timeout=30).json()
    schemas = spec["components"]["schemas"]
    for path, model in (("/generate", "GenerateBody"), ("/v1/completions", "CompletionBody"),
                        ("/v1/chat/completions", "ChatCompletionBody")):
        body = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        assert body["schema"]["$ref"] == f"#/components/schemas/{model}"
        assert model in schemas
    assert "temperature" in schemas["SamplingParamsBody"]["properties"]
    assert "422" not in str(spec["paths"]["/generate"]["post"]["responses"])


def test_cors_is_off_by_default(server: Any) -> None:
    r = raw(server.port, "OPTIONS", "/v1/chat/completions",
            {"Origin": "https://allowed.example", "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in r.headers, r.headers
    assert_envelope(r, 405, "method_not_allowed")


# ---------------------------------------------------------------- metrics

def scrape(server: Any) -> dict[tuple[str, tuple], float]:
    r = requests.get(server.url + "/metrics", timeout=30)
    assert r.status_code == 200, r.text
    out: dict[tuple[str, tuple], float] = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metrics_exist_and_move(server: Any) -> None:
    before = scrape(server)
    names = {name for name, _ in before}
    for name in ("srt_time_to_first_token_seconds_count", "srt_inter_token_latency_seconds_count",
                 "srt_e2e_request_latency_seconds_count", "srt_prompt_tokens_total",
                 "srt_generation_tokens_total", "srt_num_running_reqs", "srt_num_waiting_reqs",
                 "srt_kv_cache_usage_ratio", "srt_cache_hit_rate"):
        assert name in names, name
    plain = server.generate(GEN)
    streamed = requests.post(server.url + "/generate", json={**GEN, "stream": True}, timeout=120)
    assert streamed.status_code == 200
    requests.post(server.url + "/generate", json={"text": ""}, timeout=30)  # a 400
    after = scrape(server)

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("srt_http_requests_total", endpoint="/generate", status="200") == 2
    assert delta("srt_http_requests_total", endpoint="/generate", status="400") == 1
    assert delta("srt_http_requests_total", endpoint="/metrics", status="200") >= 1
    assert delta("srt_e2e_request_latency_seconds_count") == 2
    assert delta("srt_time_to_first_token_seconds_count") == 1  # the streamed one
    assert delta("srt_inter_token_latency_seconds_count") == 2  # its 3 tokens: 2 gaps
    prompt_tokens = plain["meta_info"]["prompt_tokens"]
    assert delta("srt_prompt_tokens_total") == 2 * prompt_tokens
    assert delta("srt_generation_tokens_total") == 6
    assert after[("srt_cache_hit_rate", ())] > 0  # the second request reused the prompt
    assert 0 <= after[("srt_kv_cache_usage_ratio", ())] <= 1


# ---------------------------------------------------------------- readiness

def test_health_generate_runs_one_probe_at_a_time(server: Any) -> None:
    def e2e_count() -> float:
        return scrape(server)[("srt_e2e_request_latency_seconds_count", ())]

    assert requests.get(server.url + "/health_generate", timeout=60).status_code == 200
    start = e2e_count()
    barrier = threading.Barrier(6)

    def probe() -> int:
        barrier.wait()
        return requests.get(server.url + "/health_generate", timeout=60).status_code

    with cf.ThreadPoolExecutor(6) as pool:
        codes = list(pool.map(lambda _: probe(), range(6)))
    assert codes == [200] * 6
    # six callers shared fewer generations than six (one probe in flight at a time)
    assert 1 <= e2e_count() - start < 6


# ---------------------------------------------------------------- logs

def test_prompts_and_outputs_are_not_logged_by_default(server: Any) -> None:
    marker = "NOLOG-9b2e51"
    out = server.generate({"text": f"{marker} says", "rid": f"{marker}-rid",
                           "sampling_params": {"max_new_tokens": 3, "temperature": 0}})
    r = requests.post(server.url + "/v1/chat/completions", timeout=120, json={
        "model": "default", "max_tokens": 2, "messages": [{"role": "user", "content": marker}]})
    assert r.status_code == 200
    assert out["meta_info"]["id"] == f"{marker}-rid"
    assert marker not in server.log()  # neither prompt nor rid


# ---------------------------------------------------------------- sockets

def _process_tree(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += children.get(p, [])
    return tree


def _socket_inodes(pids: list[int]) -> set[str]:
    inodes = set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[len("socket:["):-1])
    return inodes


def _address(hex_addr: str) -> str:
    ip, port = hex_addr.split(":")
    raw_ip = bytes.fromhex(ip)
    if len(raw_ip) == 4:
        return ".".join(str(b) for b in reversed(raw_ip)) + f":{int(port, 16)}"
    words = [raw_ip[i:i + 4][::-1].hex() for i in range(0, 16, 4)]  # 4 little-endian words
    return "[" + "".join(words) + f"]:{int(port, 16)}"


LOOPBACK = ("127.", "[00000000000000000000000000000001]",
            "[0000000000000000ffff00007f")  # ::1, ::ffff:127.x


def test_nothing_listens_beyond_loopback(server: Any) -> None:
    pids = _process_tree(server.proc.pid)
    assert len(pids) >= 4, pids  # server, router, model process, detokenizer
    inodes = _socket_inodes(pids)
    listening: list[str] = []
    for table, listen_state in (("tcp", "0A"), ("tcp6", "0A"), ("udp", "07"), ("udp6", "07")):
        with open(f"/proc/net/{table}") as f:
            rows = f.read().splitlines()[1:]
        for row in rows:
            cols = row.split()
            local, state, inode = cols[1], cols[3], cols[9]
            if inode in inodes and state == listen_state:
                listening.append(f"{table} {_address(local)}")
    assert any(a == f"tcp 127.0.0.1:{server.port}" for a in listening), listening
    for entry in listening:
        addr = entry.split(" ", 1)[1]
        assert addr.startswith(LOOPBACK), f"listening beyond loopback: {entry} ({listening})"
