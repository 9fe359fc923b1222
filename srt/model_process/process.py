"""Entry of one TP rank's model process: build the ModelProcess, report ready, then loop on the
router's StepInputs (rank 0 answers each with a StepOutput)."""

from __future__ import annotations

import logging
from typing import Any

from srt.model_process.loop import ModelProcess
from srt.server_args import ServerArgs

logger = logging.getLogger(__name__)


def run_model_process(args: ServerArgs, ports: Any, tp_rank: int, link: Any) -> None:
    """Entry of one TP rank's process: build everything, report ready (or the traceback), loop."""
    import zmq

    from srt.faults import fault_point
    from srt.layers import parallel_state
    from srt.managers.comm import PullSocket, PushSocket
    from srt.managers.io_struct import StepOutput
    from srt.utils import run_loop, start_child
    from srt.watchdog import IDLE_POLL_MS

    sockets: list[Any] = []

    def build() -> ModelProcess:
        server = ModelProcess(args, tp_rank, ports.dist_init_port)
        ctx = zmq.Context()
        if args.node_of_rank(tp_rank) == 0:
            sockets.append(PullSocket(ctx, ports.router_to_model[tp_rank]))
        else:  # a rank of another node: node 0's router reaches it over the signed step link
            from srt.managers import node_link
            from srt.managers.io_struct import RankHello

            host, port = ports.node_link
            inbox = node_link.LinkClient(ctx, node_link.connect_addr(host, node_link.step_port(
                port)), args.node_secret, node_link.STEP, tp_rank)
            inbox.send(RankHello(tp_rank))
            sockets.append(inbox)
        sockets.append(PushSocket(ctx, ports.model_to_router) if tp_rank == 0 else None)
        return server

    def ready_info(server: ModelProcess) -> dict[str, Any]:
        info = server.runner.info()
        logger.info(
            "model %s (%s) on %s, dtype %s, quantization %s, attention %s; weights %.2f GB; "
            "KV pool %d tokens of %s (%.2f GB); up to %d running requests; context length %d",
            args.model_path, server.config.architecture, info.device, info.dtype,
            info.quantization or "none", info.attention_backend, info.weight_gb,
            info.max_total_num_tokens, info.kv_cache_dtype, info.kv_gb,
            info.max_running_requests, server.config.context_len,
        )
        return {
            "max_total_num_tokens": info.max_total_num_tokens,
            "context_length": server.config.context_len,
            "vocab_size": server.config.vocab_size,
            "image_token_id": server.config.image_token_id,
            "image_tokens": server.config.image_tokens,
            "image_size": server.config.image_size,
            "device": info.device,
            "dtype": info.dtype,
            "quantization": info.quantization,
            "kv_cache_dtype": info.kv_cache_dtype,
            "attention_backend": info.attention_backend,
            "weight_bytes_per_rank": server.runner.total_weight_bytes(),
            "cuda_graph": server.runner.graph_runner is not None,
        }

    server = start_child(link, args, f"model tp{tp_rank}", build, ready_info)
    inbox, outbox = sockets
    fault = fault_point(args.fault, f"model{tp_rank}")
    heartbeat = link.heartbeat

    # A round ends early for the next input (srt/managers/router/manager.py). Several ranks
    # must end it at the same step: rank 0's socket decides for all.
    if args.tp_size == 1:
        pending = inbox.pending
    else:
        def pending() -> bool:
            return parallel_state.flag_from_first(tp_rank == 0 and inbox.pending())

    def emit(token_out: Any) -> None:  # a decode step's outputs, before the round ends
        if outbox is not None:
            outbox.send(StepOutput(token_out, partial=True))

    def loop() -> None:
        while True:
            inp = inbox.recv(IDLE_POLL_MS)
            heartbeat.beat()  # idle, or a round done: progress either way
            if inp is None:
                if not (server.running or server.waiting):
                    server.heap.idle()
                continue
            work = bool(inp.reqs or server.running or server.waiting)
            if work:
                fault.tick()
            out = server.step(inp, emit, pending)
            if work:
                server.heap.busy()
            elif not (server.running or server.waiting):
                server.heap.idle()  # only control messages (e.g. /get_server_info polls)
            if outbox is not None:
                outbox.send(out)

    run_loop(f"model process (TP rank {tp_rank})", loop)
