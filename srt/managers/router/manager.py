"""The router process: batches what arrived from the HTTP process and drives every TP rank one round
at a time, in lockstep. Rank 0's results go on to the detokenizer.

What arrives during a round is sent on at once as the next round's input: the model processes
end a round of several decode steps early when their next input is waiting, so a new request is
admitted after the decode step in flight, not after the round. (With several ranks, rank 0's
socket decides and a host-side broadcast tells the others, so all end it at the same step.)
"""

from __future__ import annotations

import logging
from typing import Any

import zmq

from srt.faults import fault_point
from srt.managers.comm import PullSocket, PushSocket
from srt.managers.io_struct import AbortReq, StepInput, TokenizedGenerateReq
from srt.port_args import PortArgs
from srt.server_args import ServerArgs
from srt.utils import ChildLink, run_loop, start_child
from srt.watchdog import IDLE_POLL_MS, Heartbeat

logger = logging.getLogger(__name__)


class RouterManager:
    def __init__(self, args: ServerArgs, ports: PortArgs, heartbeat: Heartbeat) -> None:
        self.heartbeat = heartbeat
        self.fault = fault_point(args.fault, "router")
        self.ctx = zmq.Context()
        self.from_tokenizer = PullSocket(self.ctx, ports.tokenizer_to_router)
        self.to_models: list[Any] = [PushSocket(self.ctx, a) for a in ports.router_to_model]
        if args.nnodes > 1:  # the ranks of the other nodes, over the signed step link
            from srt.managers import node_link

            host, port = ports.node_link
            self.step_link = node_link.LinkServer(
                self.ctx, node_link.bind_addr(host, node_link.step_port(port)),
                args.node_secret, node_link.STEP)
            # Every rank said hello before its node reported ready, which was before the first
            # step; the wait only covers the hello still being in flight.
            self.to_models += [self.step_link.sender(r, wait_s=30.0)
                               for r in range(args.ranks_per_node, args.tp_size)]
        self.from_model = PullSocket(self.ctx, ports.model_to_router)
        self.to_detokenizer = PushSocket(self.ctx, ports.router_to_detokenizer)
        self._poller = zmq.Poller()
        self._poller.register(self.from_model.zmq_socket, zmq.POLLIN)
        self._poller.register(self.from_tokenizer.zmq_socket, zmq.POLLIN)

    def _wait(self, inbox: PullSocket) -> Any:
        """The next message of `inbox`, beating while none comes (waiting is not stalling)."""
        while True:
            msg = inbox.recv(IDLE_POLL_MS)
            self.heartbeat.beat()
            if msg is not None:
                return msg

    def _model_output(self, or_new_input: bool) -> Any:
        """The model's next output; with `or_new_input`, None as soon as the HTTP process sent
        something first."""
        if not or_new_input:
            return self._wait(self.from_model)
        while True:
            ready = dict(self._poller.poll(IDLE_POLL_MS))
            self.heartbeat.beat()
            if self.from_model.zmq_socket in ready:
                return self.from_model.recv()
            if self.from_tokenizer.zmq_socket in ready:
                return None

    def _send(self, msgs: list[Any], has_work: bool) -> None:
        step = StepInput()
        for m in msgs:
            if isinstance(m, TokenizedGenerateReq):
                step.reqs.append(m)
            elif isinstance(m, AbortReq):
                step.aborts.append(m)
            else:
                step.controls.append(m)
        if step.reqs or has_work:
            self.fault.tick()
        for sock in self.to_models:
            sock.send(step)

    def loop(self) -> None:
        has_work = False
        sent_next = False  # the next round's input went out during the round before
        while True:
            if not sent_next:
                # Idle: block until something arrives. Busy: take what is queued and step on.
                msgs = [] if has_work else [self._wait(self.from_tokenizer)]
                self._send(msgs + self.from_tokenizer.drain(), has_work)
            sent_next = False
            while True:  # a round's partial outputs (streaming), then its last StepOutput
                out = self._model_output(not sent_next)
                if out is None:  # arrived mid-round: the model ends the round for it
                    self._send(self.from_tokenizer.drain(), True)
                    sent_next = True
                    continue
                if out.token_out is not None:
                    self.to_detokenizer.send(out.token_out)
                if not out.partial:
                    break
            has_work = out.has_work
            for c in out.controls:
                self.to_detokenizer.send(c)


def run_router_process(args: ServerArgs, ports: PortArgs, link: ChildLink) -> None:
    router = start_child(link, args, "router",
                         lambda: RouterManager(args, ports, link.heartbeat))
    run_loop("router process", router.loop)
