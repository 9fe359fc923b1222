"""Start `python -m srt.server` in a subprocess for a benchmark, and stop it again."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def server_argv(model_path: str, port: int, kwargs: dict[str, Any]) -> list[str]:
    """The command line for ServerArgs fields `kwargs` (booleans become bare flags)."""
    argv = [sys.executable, "-m", "srt.server", "--model-path", model_path, "--port", str(port)]
    for k, v in kwargs.items():
        flag = "--" + k.replace("_", "-")
        if isinstance(v, bool):
            argv += [flag] if v else []
        elif v is not None:
            argv += [flag, str(v)]
    return argv


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


@dataclass
class LaunchedServer:
    proc: subprocess.Popen
    url: str
    log_path: str

    def log_tail(self, n: int = 40) -> str:
        with open(self.log_path, errors="replace") as f:
            return "".join(f.readlines()[-n:])

    def stop(self) -> None:
        """SIGTERM (the server stops its children), then SIGKILL to the group after 30 s."""
        stop_process(self.proc, 30.0, group=False)


def stop_process(proc: subprocess.Popen, timeout: float = 20.0, group: bool = True) -> None:
    """SIGTERM to the process (to its whole process group with `group`), then SIGKILL to the
    group if it is still there after `timeout` seconds. A process that has exited is left be."""
    if proc.poll() is not None:
        return
    if group:
        os.killpg(proc.pid, signal.SIGTERM)
    else:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)


def launch_server(model_path: str, kwargs: dict[str, Any], port: int, log_path: str,
                  timeout: float = 600.0) -> LaunchedServer:
    """Start the server and wait until /health answers 200; raises RuntimeError (with the log's
    tail) if it exits or is not healthy within `timeout` seconds."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(server_argv(model_path, port, kwargs), stdout=log,
                                stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                start_new_session=True)
    srv = LaunchedServer(proc, f"http://127.0.0.1:{port}", log_path)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited ({proc.returncode}):\n{srv.log_tail()}")
            if _healthy(srv.url):
                return srv
            time.sleep(0.5)
    except BaseException:  # interrupted (a SIGTERM from `timeout`): leave no server behind
        print(f"server not up; its log:\n{srv.log_tail()}", file=sys.stderr)
        srv.stop()
        raise
    srv.stop()
    raise RuntimeError(f"server not healthy after {timeout} s:\n{srv.log_tail()}")
