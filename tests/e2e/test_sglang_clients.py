"""SGLang's own clients, unchanged, against real srt servers: the frontend language (sglang
0.5.23) and the `smg` gateway (sglang-router 0.3.2) in front of two srt servers. Both come from
the package registry (scripts/sglang_clients.sh) and run in processes of their own."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Any, Iterator

import jsonschema
import openai
import pytest
import requests

from benchmarks.launch import stop_process
from tests.conftest import BASE_ARGS, ServerProcess, free_port

HERE = os.path.dirname(os.path.abspath(__file__))


def _client_env(clients: str) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=clients, PYTHONUNBUFFERED="1")


# ------------------------------------------------------------------ the frontend language

FORK_PREFIX = "The following is a long shared context about geography.\n" * 20


@pytest.fixture(scope="module")
def frontend(server: Any, sglang_clients: str) -> dict[str, Any]:
    """What tests/e2e/sglang_frontend_program.py gave against the shared server."""
    out = subprocess.run(
        [sys.executable, os.path.join(HERE, "sglang_frontend_program.py"), server.url,
         FORK_PREFIX], capture_output=True, text=True, timeout=900,
        env=_client_env(sglang_clients), cwd=tempfile.gettempdir())
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _native(server: Any, text: str, **params: Any) -> dict[str, Any]:
    return server.generate({"text": text, "sampling_params": {"temperature": 0, **params}})


def test_frontend_gen_equals_native(server: Any, frontend: dict[str, Any]) -> None:
    native = _native(server, "The capital of France is", max_new_tokens=16, stop=["."])
    assert frontend["gen"]["text"] == native["text"]
    assert frontend["gen"]["meta"]["finish_reason"] == native["meta_info"]["finish_reason"]
    assert frontend["gen"]["meta"]["completion_tokens"] == \
        native["meta_info"]["completion_tokens"]


def test_frontend_select(frontend: dict[str, Any]) -> None:
    assert frontend["select"] in ("Paris", "London", "Berlin")


def test_frontend_fork_shares_the_prefix(server: Any, frontend: dict[str, Any]) -> None:
    prompts = [FORK_PREFIX + f"Question {i}: what is this text about? Answer:" for i in (0, 1)]
    ids = [requests.post(server.url + "/tokenize", json={"prompt": p}, timeout=30).json()
           ["tokens"] for p in prompts]
    shared = next(i for i, (a, b) in enumerate(zip(*ids)) if a != b)
    assert shared >= 200
    assert frontend["fork"]["prompt_tokens"] == [len(i) for i in ids]
    # the fork that came second in its fill round (or both, if the prefix was cached first)
    assert max(frontend["fork"]["cached_tokens"]) >= shared, (frontend["fork"], shared)


def test_frontend_regex_and_json(frontend: dict[str, Any]) -> None:
    assert re.fullmatch(frontend["regex"]["pattern"], frontend["regex"]["text"]), frontend
    value = json.loads(frontend["json"]["text"])
    jsonschema.validate(value, frontend["json"]["schema"])
    assert list(value) == list(frontend["json"]["schema"]["properties"])


def test_frontend_chat(frontend: dict[str, Any]) -> None:
    chat = frontend["chat"]
    assert chat["roles"] == ["system", "user", "assistant", "user", "assistant"]
    assert chat["first"].strip() and chat["second"].strip()
    # chatml, as asked, with the answers in their turns
    assert chat["text"].startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>")
    assert f"<|im_start|>assistant\n{chat['first']}<|im_end|>" in chat["text"]


def test_frontend_stream_and_batch(server: Any, frontend: dict[str, Any]) -> None:
    assert "".join(frontend["stream"]["chunks"]) == frontend["gen"]["text"]
    expect = [_native(server, p, max_new_tokens=16, stop=["."])["text"]
              for p in ("The capital of Italy is", "The capital of Spain is",
                        "The capital of France is")]
    assert frontend["run_batch"] == expect


def test_frontend_flush_cache_and_server_info(frontend: dict[str, Any]) -> None:
    assert frontend["flush_cache"] is True
    assert {"model_path", "max_total_num_tokens", "num_running_reqs"} <= set(
        frontend["server_info"]["keys"])


# ------------------------------------------------------------------ behind the smg gateway

WORKER_ARGS = [*BASE_ARGS, "--max-total-tokens", "8192", "--host", "127.0.0.1"]
API_KEY = "srt-test-key"  # on the workers and the gateway, as a deployment would have it
AUTH = {"Authorization": f"Bearer {API_KEY}"}


class Gateway:
    """`smg launch` (python -m sglang_router launch) over the given worker URLs."""

    def __init__(self, clients: str, workers: list[str]) -> None:
        self.port = free_port()
        fd, self.log_path = tempfile.mkstemp(prefix="smg-", suffix=".log")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sglang_router", "launch", "--host", "127.0.0.1",
             "--port", str(self.port), "--policy", "cache_aware", "--api-key", API_KEY,
             # a dead worker is out of the rotation after two failed checks a second apart
             "--health-check-interval-secs", "1", "--health-failure-threshold", "2",
             # its metrics listener takes a fixed port otherwise
             "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
             "--worker-urls", *workers],
            stdout=fd, stderr=subprocess.STDOUT, env=_client_env(clients),
            cwd=tempfile.gettempdir(), start_new_session=True)
        os.close(fd)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def healthy(self) -> dict[str, bool]:
        """Each worker URL -> whether the gateway counts it healthy (its /workers list)."""
        r = requests.get(self.url + "/workers", headers=AUTH, timeout=30)
        assert r.status_code == 200, r.text
        return {w["url"]: w["is_healthy"] for w in r.json()["workers"]}

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log()[-4000:]
            try:
                r = requests.post(self.url + "/generate", timeout=30, headers=AUTH, json={
                    "text": "Hi", "sampling_params": {"max_new_tokens": 1}})
                if r.status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.5)
        raise AssertionError(f"gateway not serving after {timeout} s:\n{self.log()[-4000:]}")

    def stop(self) -> None:
        stop_process(self.proc)


@pytest.fixture(scope="module")
def cluster(smollm2_dir: str, sglang_clients: str) -> Iterator[tuple[Gateway, list[Any]]]:
    workers = [ServerProcess(list(WORKER_ARGS), env={"SRT_API_KEY": API_KEY}).start()
               for _ in range(2)]
    gateway = Gateway(sglang_clients, [w.url for w in workers])
    try:
        gateway.wait_ready()
        yield gateway, workers
    finally:
        gateway.stop()
        for w in workers:
            w.stop()


def _post(url: str, path: str, body: dict[str, Any], **kw: Any) -> requests.Response:
    return requests.post(url + path, json=body, headers=AUTH, timeout=300, **kw)


def _generate(url: str, body: dict[str, Any]) -> dict[str, Any]:
    r = _post(url, "/generate", body)
    assert r.status_code == 200, r.text
    return r.json()


def _sse(r: requests.Response) -> list[dict[str, Any]]:
    assert r.status_code == 200, r.text
    return [json.loads(line[6:]) for line in r.iter_lines()
            if line.startswith(b"data: ") and line != b"data: [DONE]"]


def test_gateway_generate(cluster: tuple[Gateway, list[Any]]) -> None:
    gateway, workers = cluster
    body = {"text": "The capital of France is",
            "sampling_params": {"max_new_tokens": 12, "temperature": 0}}
    direct = _generate(workers[0].url, body)
    via = _generate(gateway.url, body)
    assert via["text"] == direct["text"] and via["output_ids"] == direct["output_ids"]
    events = _sse(_post(gateway.url, "/generate", {**body, "stream": True}, stream=True))
    assert events[-1]["text"] == direct["text"]
    assert events[-1]["meta_info"]["finish_reason"] == direct["meta_info"]["finish_reason"]
    # the gateway asks its clients for the key too
    assert requests.post(gateway.url + "/generate", json=body, timeout=60).status_code == 401


def test_gateway_openai(cluster: tuple[Gateway, list[Any]]) -> None:
    gateway, workers = cluster
    direct = openai.OpenAI(base_url=workers[1].url + "/v1", api_key=API_KEY)
    via = openai.OpenAI(base_url=gateway.url + "/v1", api_key=API_KEY)
    model = direct.models.list().data[0].id
    assert model in [m.id for m in via.models.list().data]
    kw = {"model": model, "max_tokens": 12, "temperature": 0}

    def completion(c: openai.OpenAI, stream: bool) -> str:
        out = c.completions.create(prompt="The capital of France is", stream=stream, **kw)
        return "".join(ch.choices[0].text for ch in out) if stream else out.choices[0].text

    def chat(c: openai.OpenAI, stream: bool) -> str:
        out = c.chat.completions.create(
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            stream=stream, **kw)
        if stream:
            return "".join(ch.choices[0].delta.content or "" for ch in out if ch.choices)
        return out.choices[0].message.content

    for call in (completion, chat):
        want = call(direct, False)
        assert want
        assert call(via, False) == want, call.__name__
        assert call(via, True) == want, call.__name__


def test_gateway_cache_aware(cluster: tuple[Gateway, list[Any]]) -> None:
    gateway, workers = cluster
    prefix = f"Note {uuid.uuid4().hex}. " + "The library opens at nine and closes at five. " * 22
    n_prefix = len(_post(workers[0].url, "/tokenize", {"prompt": prefix}).json()["tokens"])
    assert n_prefix >= 200
    cached = []
    for i in range(8):
        out = _generate(gateway.url, {"text": prefix + f"Question {i}: when does it open?",
                                      "sampling_params": {"max_new_tokens": 2, "temperature": 0}})
        cached.append(out["meta_info"]["cached_tokens"])
    assert all(c >= 200 for c in cached[1:]), cached


def test_gateway_survives_a_dead_worker(cluster: tuple[Gateway, list[Any]]) -> None:
    """Kill the worker that holds a prefix: the gateway's cache-aware choice for requests with
    that prefix is then a dead worker, and the other must serve them."""
    gateway, workers = cluster
    prefix = f"Log {uuid.uuid4().hex}. " + "The ferry leaves the harbour every hour. " * 24
    params = {"max_new_tokens": 6, "temperature": 0}
    for i in range(2):
        _generate(gateway.url, {"text": prefix + f"Entry {i}.", "sampling_params": params})
    probe = {"text": prefix + "Probe.", "sampling_params": {"max_new_tokens": 0}}
    cached = [_generate(w.url, probe)["meta_info"]["cached_tokens"] for w in workers]
    owner = max(range(2), key=lambda k: cached[k])
    assert cached[owner] >= 200 > cached[1 - owner], cached  # one worker holds the prefix
    os.killpg(workers[owner].proc.pid, signal.SIGKILL)  # the whole server, at once
    workers[owner].proc.wait(10)
    # Until its health checks fail, smg 0.3.2 still picks the dead worker for this prefix (its
    # retries go to the same choice and the request is a 500); then it routes around it.
    deadline = time.monotonic() + 30
    while gateway.healthy().get(workers[owner].url, False):
        assert time.monotonic() < deadline, gateway.healthy()
        time.sleep(0.2)
    survivor = workers[1 - owner]
    prompts = [prefix + f"Question {i}: how often does it leave?" for i in range(6)]
    for p in prompts:
        r = _post(gateway.url, "/generate", {"text": p, "sampling_params": params})
        assert r.status_code == 200, (r.status_code, r.text, gateway.log()[-3000:])
        assert r.json()["text"] == _generate(survivor.url, {
            "text": p, "sampling_params": params})["text"]
