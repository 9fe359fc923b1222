"""Starting and supervising the router, model and detokenizer processes.

Shared by the HTTP server (`srt.server`) and the in-process `srt.Engine`: both call
`prepare_args` then `start_runtime`, and talk to the ring through a TokenizerManager. Children
are spawned (never forked: CUDA and ZMQ do not survive a fork), report ready or their traceback
over a pipe, and are stopped together.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing as mp
import os
import shutil
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Callable, Iterator, Protocol

from srt import cpu_threads
from srt.port_args import PortArgs
from srt.server_args import ServerArgs
from srt.utils import ChildLink, describe_exit
from srt.watchdog import Heartbeat, dump_stacks

logger = logging.getLogger("srt.launcher")

MODEL_RANK0 = "model process (TP rank 0)"


@dataclass(frozen=True)
class Failure:
    reason: str  # names the processes and what happened to them
    stalled: bool  # no progress (the watchdog), rather than dead


@dataclass
class Child:
    name: str
    process: mp.process.BaseProcess
    ready: Connection
    heartbeat: Heartbeat


class RemoteNodes(Protocol):
    """Processes on other machines that the supervisor watches beside its children
    (srt/node_hub.py on node 0, the link to node 0 on another node)."""

    def ready(self) -> bool:
        """Whether they reported ready (start-up waits for it)."""

    def failure(self) -> str | None:
        """Why they cannot serve (dead, silent, refused, late), naming node and ranks; or None."""

    def stop(self) -> None:
        """Tell them this node stops; release the link."""


@contextlib.contextmanager
def _environment(extra: dict[str, str]) -> Iterator[None]:
    """`extra` in os.environ for the block (a spawned child copies it at start), then as before."""
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class Supervisor:
    """Owns the child processes: start, wait for ready, watch, stop.

    Watching covers deaths and stalls: a supervised loop (each child's, plus any loop of this
    process registered with `add_loop`) whose heartbeat is older than `watchdog_timeout` has
    stalled (srt/watchdog.py). With several nodes it also watches the other nodes
    (`add_remote`): start-up waits for them and their failure is a failure.
    """

    def __init__(self, watchdog_timeout: float = 300.0, name: str = "launcher process") -> None:
        self.name = name  # of this process, in stack dumps
        self.watchdog_timeout = watchdog_timeout
        self.children: list[Child] = []
        self.loops: list[tuple[str, Heartbeat]] = []  # loops of this process
        self.remotes: list[RemoteNodes] = []
        self.stopping = False
        self.all_ready = False

    def start(self, name: str, target: Callable[..., None], *args: Any,
              env: dict[str, str] | None = None) -> None:
        """Spawn `target(*args, link)`; `env` is added to the child's environment only (it is
        in place from the child's first instruction, before any library loads)."""
        ctx = mp.get_context("spawn")
        reader, writer = ctx.Pipe(duplex=False)
        heartbeat = Heartbeat()
        link = ChildLink(os.getpid(), writer, heartbeat)
        proc = ctx.Process(target=target, args=(*args, link), name=name, daemon=False)
        with _environment(env or {}):
            proc.start()
        writer.close()
        self.children.append(Child(name, proc, reader, heartbeat))

    def add_loop(self, name: str, heartbeat: Heartbeat) -> None:
        """Watch a loop of this process (the HTTP event loop) like a child."""
        self.loops.append((name, heartbeat))

    def add_remote(self, remote: RemoteNodes) -> None:
        self.remotes.append(remote)

    def wait_ready(self) -> dict[str, dict[str, Any]]:
        """Block until every child (and remote node) reported ready; raise with the child's
        traceback (or the remote failure) otherwise."""
        infos: dict[str, dict[str, Any]] = {}
        pending = list(self.children)
        while pending or not all(r.ready() for r in self.remotes):
            for remote in self.remotes:
                reason = remote.failure()
                if reason is not None:
                    raise RuntimeError(reason)
            if not pending:
                time.sleep(0.1)
            for child in list(pending):
                if child.ready.poll(0.1):
                    try:
                        status, payload = child.ready.recv()
                    except EOFError:
                        status, payload = "error", "it exited before reporting ready"
                    if status != "ready":
                        raise RuntimeError(f"the {child.name} failed to start:\n{payload}")
                    infos[child.name] = payload
                    pending.remove(child)
                elif not child.process.is_alive():
                    raise RuntimeError(
                        f"the {child.name} died during start-up "
                        f"({describe_exit(child.process.exitcode)})"
                    )
        self.all_ready = True
        return infos

    def stalled(self) -> list[str]:
        """Names of the supervised loops without a heartbeat for watchdog_timeout, oldest
        first."""
        beats = [(c.name, c.heartbeat) for c in self.children] + self.loops
        old = [(hb.age(), name) for name, hb in beats if hb.age() > self.watchdog_timeout]
        return [name for _, name in sorted(old, reverse=True)]

    def failure(self) -> Failure | None:
        """Why the runtime cannot serve (processes died or stalled), or None."""
        # All that are dead: a TP rank that loses its peer dies too, maybe before the poll.
        dead = [f"the {c.name} died ({describe_exit(c.process.exitcode)})"
                for c in self.children if not c.process.is_alive()]
        dead += [reason for r in self.remotes if (reason := r.failure()) is not None]
        if dead:
            return Failure("; ".join(dead), stalled=False)
        stalled = self.stalled()
        if stalled:
            names = " and ".join(f"the {name}" for name in stalled)
            return Failure(f"{names} made no progress for {self.watchdog_timeout:g} s "
                           "(--watchdog-timeout)", stalled=True)
        return None

    def healthy(self) -> bool:
        """Liveness: every process started, alive and beating. No I/O; microseconds."""
        return self.all_ready and not self.stopping and self.failure() is None

    def watch(self, on_failure: Callable[[Failure], None], interval: float = 0.25) -> None:
        """Call on_failure once, from a thread, when a process dies or stalls."""
        def run() -> None:
            while not self.stopping:
                failure = self.failure()
                if failure is not None and not self.stopping:
                    logger.error("%s", failure.reason)
                    on_failure(failure)
                    return
                time.sleep(interval)

        threading.Thread(target=run, daemon=True, name="supervisor").start()

    def dump_stacks(self) -> None:
        """Every process's stacks into the log (this one's, then each child's)."""
        dump_stacks(self.name, [(c.name, c.process.pid) for c in self.children])

    def stop(self, timeout: float = 5.0) -> None:
        self.stopping = True
        for r in self.remotes:
            r.stop()
        for c in self.children:
            if c.process.is_alive():
                c.process.terminate()
        deadline = time.monotonic() + timeout
        for c in self.children:
            c.process.join(max(0.0, deadline - time.monotonic()))
            if c.process.is_alive():
                c.process.kill()
                c.process.join(1.0)


@dataclass
class Runtime:
    """The started ring minus its front end: what a TokenizerManager needs to talk to it."""

    args: ServerArgs
    ports: PortArgs
    supervisor: Supervisor
    limits: Any  # srt.managers.request_types.ModelLimits
    model_info: dict[str, Any]

    def stop(self) -> None:
        self.supervisor.stop()
        shutil.rmtree(self.ports.ipc_dir, ignore_errors=True)


def prepare_args(args: ServerArgs) -> ServerArgs:
    """Fill in the default model, resolve and validate; ValueError/OSError for what cannot run
    (checked from config.json before any process starts)."""
    if args.model_path is None:
        from srt.default_model import ensure_default_model

        args = dataclasses.replace(args, model_path=ensure_default_model())
    args = args.resolve()
    from srt.model_config import check_quantization, check_tp_size

    for path in (args.model_path, args.speculative_draft_model_path):
        if path is not None:  # the draft model (STANDALONE) is sharded and loaded alike
            check_tp_size(path, args.tp_size)
            check_quantization(path, args.quantization)
    return args


def start_runtime(args: ServerArgs, name: str = "launcher process") -> Runtime:
    """Spawn one model process per TP rank, the router and the detokenizer; return once all are
    ready. On failure everything started is stopped and RuntimeError says which child and why.
    `name`: what this process is called in logs (the HTTP process, an Engine's process)."""
    from srt.managers.detokenizer_manager import run_detokenizer_process
    from srt.managers.router.manager import run_router_process
    from srt.model_process.process import run_model_process
    from srt.managers.request_types import ModelLimits

    logger.info("starting srt: model %s, tp_size %d", args.model_path, args.tp_size)
    ports = PortArgs.create(args.tp_size, args.dist_init if args.nnodes > 1 else None,
                            args.ranks_per_node)
    supervisor = Supervisor(args.watchdog_timeout, name)
    try:
        if args.nnodes > 1:
            from srt.node_hub import NodeHub

            supervisor.add_remote(NodeHub(args, ports.node_link))
        for rank in args.local_tp_ranks:
            supervisor.start(f"model process (TP rank {rank})", run_model_process, args, ports,
                             rank, env=cpu_threads.child_env())
        supervisor.start("router process", run_router_process, args, ports)
        supervisor.start("detokenizer process", run_detokenizer_process, args, ports)
        infos = supervisor.wait_ready()
    except BaseException:
        supervisor.stop()
        shutil.rmtree(ports.ipc_dir, ignore_errors=True)
        raise
    model = infos[MODEL_RANK0]
    limits = ModelLimits(model["context_length"], model["vocab_size"],
                         model["max_total_num_tokens"], model["image_token_id"],
                         model["image_tokens"], model["image_size"])
    return Runtime(args, ports, supervisor, limits, model)
