"""Failures fail fast and loud: a fault injected (SRT_FAULT) into each process, the watchdog, the
parent killed outright, and liveness /health.

For every crash: the requests in flight (one streamed, one not) get an error within 5 s,
/health stops answering 200 within 1 s, the server exits non-zero within 30 s, and no process of
it is left. A small random Llama keeps each server cheap.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import psutil
import pytest
import requests

from tests.conftest import ServerProcess
from tests.random_models import save_random_llama

# Long enough that both requests are still running when the fault fires (after AFTER units of
# work, about 0.5 s; rounds under TP 2 on the CPU are slower: fewer of them).
LONG = {"max_new_tokens": 1500, "temperature": 0, "ignore_eos": True}
AFTER = 40
AFTER_TP2 = 8
WATCHDOG_S = 3.0


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: Any) -> str:
    return save_random_llama(str(tmp_path_factory.mktemp("tiny_faults")), num_hidden_layers=2,
                             hidden_size=64, intermediate_size=128, num_attention_heads=4,
                             num_key_value_heads=2, max_position_embeddings=32768)


def _serve(model: str, fault: str | None = None, extra: tuple[str, ...] = ()) -> ServerProcess:
    env = {"SRT_FAULT": fault} if fault else {}
    return ServerProcess(["--model-path", model, "--device", "cpu", "--dtype", "float32",
                          "--random-seed", "0", "--max-total-tokens", "4096", *extra],
                         env=env).start()


def _tree(pid: int) -> list[psutil.Process]:
    parent = psutil.Process(pid)
    return [parent, *parent.children(recursive=True)]


def _dead(p: psutil.Process) -> bool:
    try:
        return p.status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.NoSuchProcess:
        return True


@dataclass
class Answer:
    """How one request ended: ok (finished normally) or error (what the client saw), and when."""

    ok: bool = False
    error: str | None = None
    at: float = 0.0
    body: Any = None


def _plain(url: str, out: Answer, start: threading.Barrier) -> None:
    start.wait()
    try:
        r = requests.post(url + "/generate", json={"input_ids": [5, 6, 7, 8],
                                                   "sampling_params": LONG}, timeout=120)
        out.body = r.json()
        if r.status_code == 200:
            out.ok = True
        else:
            out.error = f"{r.status_code} {out.body['error']['code']}: {out.body['error']['message']}"
    except requests.RequestException as e:
        out.error = f"connection: {type(e).__name__}"
    out.at = time.monotonic()


def _stream(url: str, out: Answer, start: threading.Barrier) -> None:
    start.wait()
    try:
        with requests.post(url + "/generate", stream=True, timeout=120,
                           json={"input_ids": [9, 10, 11], "stream": True,
                                 "sampling_params": LONG}) as r:
            for line in r.iter_lines():
                if not line.startswith(b"data: "):
                    continue
                data = line[len(b"data: "):]
                if data == b"[DONE]":
                    out.ok = True
                    break
                event = json.loads(data)
                if "error" in event:
                    out.body = event
                    out.error = f"event {event['error']['code']}: {event['error']['message']}"
                    break
    except requests.RequestException as e:
        out.error = f"connection: {type(e).__name__}"
    out.at = time.monotonic()


@dataclass
class Outcome:
    answers: list[Answer]
    started: float
    first_death: float | None = None  # a process of the server seen dead
    # (time the /health request was sent, what came back), from a poller every 50 ms
    health: list[tuple[float, Any]] = field(default_factory=list)
    exit_at: float | None = None
    exit_code: int | None = None
    left: list[psutil.Process] = field(default_factory=list)

    @property
    def failed_at(self) -> float:
        """The first sign of the failure a client or operator could see."""
        times = [a.at for a in self.answers if a.error] + [self.first_death or float("inf")]
        return min(times)

    def first_unhealthy(self, answers: bool) -> tuple[float, Any] | None:
        """The first /health poll that said the server is down: a 503 when the HTTP process
        still answers, else also a refused connection (a slow answer says nothing)."""
        for sent, got in self.health:
            if isinstance(got, tuple) and got[0] != 200:
                return sent, got
            if not answers and got == "ConnectionError":
                return sent, got
        return None

    def timeline(self) -> dict[str, Any]:
        t0 = self.started

        def rel(t: float | None) -> float | None:
            return None if t is None else round(t - t0, 3)

        return {"death": rel(self.first_death), "failed": rel(self.failed_at),
                "exit": rel(self.exit_at), "exit_code": self.exit_code,
                "answers": [(rel(a.at), a.ok, a.error) for a in self.answers],
                "health": [(rel(t), g) for t, g in self.health if g != (200, None)][:5],
                "left": self.left}


def _poll_health(url: str, out: Outcome, stop: threading.Event) -> None:
    while not stop.is_set():
        sent = time.monotonic()
        try:
            r = requests.get(url + "/health", timeout=2)
            got: Any = (r.status_code, r.json().get("error", {}).get("code"))
        except requests.ConnectionError:
            got = "ConnectionError"
        except requests.RequestException as e:
            got = type(e).__name__
        out.health.append((sent, got))
        stop.wait(0.05)


def _run(srv: ServerProcess, timeout: float = 60.0) -> Outcome:
    """Send a streamed and a plain long request, then watch the server until it exits."""
    procs = _tree(srv.proc.pid)
    assert len(procs) >= 4, procs
    answers = [Answer(), Answer()]
    barrier = threading.Barrier(3)
    threads = [threading.Thread(target=f, args=(srv.url, a, barrier), daemon=True)
               for f, a in zip((_plain, _stream), answers)]
    for t in threads:
        t.start()
    barrier.wait()
    out = Outcome(answers, started=time.monotonic())
    stop = threading.Event()
    poller = threading.Thread(target=_poll_health, args=(srv.url, out, stop), daemon=True)
    poller.start()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if out.first_death is None and any(_dead(p) for p in procs):
            out.first_death = time.monotonic()
        if srv.proc.poll() is not None:
            out.exit_at, out.exit_code = time.monotonic(), srv.proc.returncode
            break
        time.sleep(0.02)
    # A server that exits at once (the HTTP process gone) may do so between two polls: keep
    # polling until one poll was sent after the exit, so the record shows what a client then saw.
    settle = time.monotonic() + 1.0
    while (out.exit_at is not None and time.monotonic() < settle
           and not any(sent > out.exit_at for sent, _ in list(out.health))):
        time.sleep(0.01)
    stop.set()
    poller.join(5)
    for t in threads:
        t.join(10)
    _, out.left = psutil.wait_procs(procs, timeout=5)
    return out


def _assert_crash_handled(out: Outcome, srv: ServerProcess, health_answers: bool) -> None:
    log = srv.log()
    tl = out.timeline()
    for a in out.answers:
        assert not a.ok and a.error, (tl, log[-3000:])
        assert a.at - out.failed_at <= 5.0, tl
    assert out.exit_code not in (None, 0), (tl, log[-3000:])
    assert out.exit_at - out.failed_at <= 30.0, tl
    unhealthy = out.first_unhealthy(health_answers)
    assert unhealthy is not None and unhealthy[0] - out.failed_at <= 1.0, tl
    if health_answers:  # the HTTP process is up: /health says 503, it does not just vanish
        assert unhealthy[1] in ((503, "server_failed"), (503, "unhealthy")), tl
        for a in out.answers:
            assert "503 server_failed" in a.error or "event server_failed" in a.error, tl
    assert out.left == [], tl


CHILD_FAULTS = [("router", "router process"), ("detokenizer", "detokenizer process"),
                ("model0", "model process (TP rank 0)")]


@pytest.mark.parametrize("kind", ["raise", "exit"])
@pytest.mark.parametrize("process,name", CHILD_FAULTS)
def test_child_fault_fails_requests_and_exits(tiny_llama: str, process: str, name: str,
                                              kind: str) -> None:
    srv = _serve(tiny_llama, f"{process}:{kind}:{AFTER}")
    try:
        out = _run(srv)
        _assert_crash_handled(out, srv, health_answers=True)
        log = srv.log()
        assert f"the {name} died" in log
        expected = "exit code 1" if kind == "raise" else "exit code 3"
        assert expected in out.answers[0].error, out.answers[0]
        if kind == "raise":  # the traceback is in the log
            assert f"the {name} crashed" in log and "InjectedFault" in log
    finally:
        srv.stop()


@pytest.mark.parametrize("kind", ["raise", "exit"])
def test_model_rank1_fault_under_tp2(tiny_llama: str, kind: str) -> None:
    srv = _serve(tiny_llama, f"model1:{kind}:{AFTER_TP2}", ("--tp-size", "2"))
    try:
        out = _run(srv)
        _assert_crash_handled(out, srv, health_answers=True)
        assert "the model process (TP rank 1) died" in srv.log()
    finally:
        srv.stop()


def test_http_raise_fails_requests_and_exits(tiny_llama: str) -> None:
    """The HTTP process's result loop dies: it fails its own requests and takes the rest down."""
    srv = _serve(tiny_llama, f"http:raise:{AFTER}")
    try:
        out = _run(srv)
        _assert_crash_handled(out, srv, health_answers=True)
        assert out.exit_code == 1
        assert "the result loop of the HTTP process crashed" in srv.log()
    finally:
        srv.stop()


def test_http_exit_takes_every_child_down(tiny_llama: str) -> None:
    """The HTTP process vanishes (as if killed): its clients see the connection drop and every
    child notices its parent is gone and exits on its own."""
    srv = _serve(tiny_llama, f"http:exit:{AFTER}")
    try:
        out = _run(srv)
        _assert_crash_handled(out, srv, health_answers=False)
        assert out.exit_code == 3
        assert all(a.error.startswith("connection") for a in out.answers), out.answers
    finally:
        srv.stop()


@pytest.mark.parametrize("process,name", CHILD_FAULTS)
def test_stalled_child_is_caught_by_the_watchdog(tiny_llama: str, process: str,
                                                 name: str) -> None:
    srv = _serve(tiny_llama, f"{process}:stall:{AFTER}", ("--watchdog-timeout", str(WATCHDOG_S)))
    try:
        out = _run(srv)
        _assert_crash_handled(out, srv, health_answers=True)
        # the stall, then WATCHDOG_S without progress, then the error (with slack for a slow
        # machine to reach the stall)
        assert out.failed_at - out.started <= WATCHDOG_S + 10.0, out
        for a in out.answers:
            assert name in a.error and "made no progress" in a.error, a
        log = srv.log()
        # every process's stacks, the stalled one showing where it is stuck
        dumps = log[log.index("stacks of the HTTP process"):]
        for other in ("router process", "detokenizer process", "model process (TP rank 0)"):
            assert f"stacks of the {other}" in dumps, other
        stalled = dumps[dumps.index(f"stacks of the {name}"):]
        assert "faults.py" in stalled and "in tick" in stalled, stalled[:3000]
    finally:
        srv.stop()


def test_health_is_fast_liveness_and_sigkill_of_the_parent_leaves_no_child(
        tiny_llama: str) -> None:
    """/health answers 200 in milliseconds while a generation runs (no model work behind it);
    the parent killed outright, every child exits on its own within 5 s."""
    srv = _serve(tiny_llama)
    try:
        answer = Answer()
        barrier = threading.Barrier(2)
        threading.Thread(target=_stream, args=(srv.url, answer, barrier), daemon=True).start()
        barrier.wait()
        times = []
        for _ in range(20):
            t = time.monotonic()
            r = requests.get(srv.url + "/health", timeout=5)
            times.append(time.monotonic() - t)
            assert r.status_code == 200 and r.json() == {"status": "ok"}
        assert sorted(times)[len(times) // 2] < 0.1, times
        assert not answer.at, "the generation ended before /health was measured under load"
        children = _tree(srv.proc.pid)[1:]
        assert len(children) >= 3, children
        srv.proc.send_signal(signal.SIGKILL)
        start = time.monotonic()
        _, alive = psutil.wait_procs(children, timeout=5)
        assert alive == [], alive
        assert time.monotonic() - start <= 5.0
    finally:
        srv.stop()


def _stream_events(url: str, body: dict[str, Any], first: threading.Event,
                   out: list[dict[str, Any]]) -> None:
    with requests.post(url + "/generate", json={**body, "stream": True}, stream=True,
                       timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                out.append({"at": time.monotonic(), **json.loads(line[len(b"data: "):])})
                first.set()


def test_sigterm_drains_then_exits_zero(tiny_llama: str) -> None:
    """In flight at SIGTERM: a request that finishes within --shutdown-timeout finishes; one that
    cannot is aborted at the timeout; a new request meanwhile gets 503; the exit status is 0."""
    timeout = 3.0
    srv = _serve(tiny_llama, extra=("--shutdown-timeout", str(timeout),
                                    "--max-total-tokens", "32768"))
    try:
        procs = _tree(srv.proc.pid)
        # Ids shared across the two so the slow machine has one prompt to cache, not two.
        finite = {"input_ids": [5, 6, 7], "sampling_params": {**LONG, "max_new_tokens": 200}}
        endless = {"input_ids": [5, 6, 8], "sampling_params": {**LONG, "max_new_tokens": 30000}}
        events: dict[str, list[dict[str, Any]]] = {"finite": [], "endless": []}
        threads = []
        for name, body in (("endless", endless), ("finite", finite)):
            first = threading.Event()
            t = threading.Thread(target=_stream_events,
                                 args=(srv.url, body, first, events[name]), daemon=True)
            t.start()
            assert first.wait(30), name
            threads.append(t)
        srv.proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        time.sleep(0.2)
        r = requests.post(srv.url + "/generate", json=finite, timeout=10)
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down", r.text
        r = requests.get(srv.url + "/health", timeout=10)
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down", r.text
        for t in threads:
            t.join(timeout + 15)
        done = events["finite"][-1]
        assert done["meta_info"]["finish_reason"] == {"type": "length", "length": 200}, done
        assert done["at"] < sent + timeout
        cut = events["endless"][-1]
        assert cut["meta_info"]["finish_reason"]["type"] == "abort", cut
        assert "shutting down" in cut["meta_info"]["finish_reason"]["message"]
        assert sent + timeout - 0.5 <= cut["at"] <= sent + timeout + 5.0, (cut["at"] - sent)
        assert 0 < cut["meta_info"]["completion_tokens"] < 30000
        assert srv.proc.wait(30) == 0
        _, left = psutil.wait_procs(procs, timeout=5)
        assert left == [], left
    finally:
        srv.stop()
