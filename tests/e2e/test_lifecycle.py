"""Process life cycle: a dead child takes the server down loudly and completely; SIGTERM stops
everything cleanly; a start-up failure names the process and exits non-zero."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Any

import psutil
import pytest

from tests.conftest import BASE_ARGS, REPO, ServerProcess


def _tree(pid: int) -> list[psutil.Process]:
    parent = psutil.Process(pid)
    return [parent, *parent.children(recursive=True)]


def _all_gone(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    return alive


@pytest.fixture
def small_server(smollm2_dir: str) -> Any:
    srv = ServerProcess([*BASE_ARGS, "--max-total-tokens", "2048"]).start()
    yield srv
    srv.stop()


def _children_by_pid(srv: ServerProcess) -> list[psutil.Process]:
    procs = _tree(srv.proc.pid)
    # spawn children: 3 of them for tp 1 (+ the multiprocessing resource tracker)
    assert len(procs) >= 4, procs
    return procs


def test_killing_model_process_brings_server_down(small_server: ServerProcess) -> None:
    srv = small_server
    procs = _children_by_pid(srv)
    # The children name themselves (what `ps -o comm` shows).
    names = {p.name() for p in procs[1:]}
    assert {"srt-model-tp0", "srt-router", "srt-detokenizer"} <= names, names
    model = next(p for p in procs[1:] if p.name() == "srt-model-tp0")
    start = time.monotonic()
    model.send_signal(signal.SIGKILL)
    code = srv.proc.wait(30)
    elapsed = time.monotonic() - start
    assert code != 0
    assert elapsed < 30
    assert _all_gone(procs, timeout=10) == []
    log = srv.log()
    assert "model process (TP rank 0) died" in log and "SIGKILL" in log


def test_sigterm_stops_everything(small_server: ServerProcess) -> None:
    srv = small_server
    procs = _children_by_pid(srv)
    srv.proc.send_signal(signal.SIGTERM)
    assert srv.proc.wait(30) == 0
    assert _all_gone(procs, timeout=10) == []


def test_sigint_stops_everything(small_server: ServerProcess) -> None:
    srv = small_server
    procs = _children_by_pid(srv)
    # Ctrl-C in a terminal reaches the whole process group.
    os.killpg(srv.proc.pid, signal.SIGINT)
    assert srv.proc.wait(30) == 0
    assert _all_gone(procs, timeout=10) == []


def test_startup_failure_is_reported(tmp_path: Any) -> None:
    (tmp_path / "config.json").write_text('{"architectures": ["NoSuchModelForCausalLM"], '
                                          '"model_type": "llama", "hidden_size": 8, '
                                          '"num_attention_heads": 1, "num_hidden_layers": 1, '
                                          '"vocab_size": 8}')
    from srt.default_model import default_model_dir

    proc = subprocess.run(
        [sys.executable, "-m", "srt.server", "--model-path", str(tmp_path), "--tokenizer-path",
         default_model_dir(), "--port", "0", *BASE_ARGS],
        cwd=REPO, capture_output=True, text=True, timeout=120,
        env=dict(os.environ, PYTHONPATH=REPO),
    )
    assert proc.returncode != 0
    assert "model process (TP rank 0) failed to start" in proc.stderr
    assert "NoSuchModelForCausalLM" in proc.stderr and "LlamaForCausalLM" in proc.stderr


def test_http_setup_failure_exits_and_stops_the_children(tmp_path: Any) -> None:
    """The web framework fails to import after the children started (a broken install): the
    server logs it, stops every child and exits 1, instead of hanging."""
    fake = tmp_path / "fastapi"
    fake.mkdir()
    (fake / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'opentelemetry'\")\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "srt.server", "--port", "0", *BASE_ARGS,
         "--max-total-tokens", "2048"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{REPO}"))
    seen: dict[int, psutil.Process] = {}
    deadline = time.monotonic() + 180
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            seen.update({p.pid: p for p in _tree(proc.pid)[1:]})
        except psutil.NoSuchProcess:  # it exited meanwhile
            pass
        time.sleep(0.2)
    if proc.poll() is None:
        proc.kill()
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 1, err[-2000:]
    assert "the HTTP server could not be set up" in err and "opentelemetry" in err
    assert len(seen) >= 3, seen  # the children had started
    assert not _all_gone(list(seen.values()), timeout=10)


def test_taken_port_fails_the_start_before_any_child(smollm2_dir: str) -> None:
    """The HTTP port is claimed first: a taken one ends the start at once with status 2 and
    says which address, without loading a model or spawning a child."""
    import socket

    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        start = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-m", "srt.server", "--port", str(port), *BASE_ARGS],
            cwd=REPO, capture_output=True, text=True, timeout=120,
            env=dict(os.environ, PYTHONPATH=REPO))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"cannot serve on 127.0.0.1:{port}" in proc.stderr and "in use" in proc.stderr
    assert "starting srt" not in proc.stderr  # no child was started
    assert time.monotonic() - start < 60


def test_port_zero_serves_on_the_port_it_logs(smollm2_dir: str, tmp_path: Any) -> None:
    """--port 0: the kernel picks the port, and the ready line names that port (not 0)."""
    import re

    import requests

    log = tmp_path / "server.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "srt.server", "--port", "0", *BASE_ARGS,
             "--max-total-tokens", "2048"],
            cwd=REPO, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
            env=dict(os.environ, PYTHONPATH=REPO))
    try:
        deadline, port = time.monotonic() + 180, None
        while port is None and time.monotonic() < deadline and proc.poll() is None:
            m = re.search(r"ready: serving on http://127\.0\.0\.1:(\d+)", log.read_text())
            port = int(m.group(1)) if m else None
            time.sleep(0.3)
        assert port, log.read_text()[-2000:]
        assert port != 0
        for _ in range(50):  # the ready line comes just before uvicorn serves
            try:
                assert requests.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
                break
            except requests.ConnectionError:
                time.sleep(0.2)
        else:
            raise AssertionError(f"nothing served on {port}")
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
