"""PortArgs: the addresses that join a server's processes (the ZMQ ring's ipc:// sockets, the TP
group's rendezvous, the node links)."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

from srt.utils import free_port


@dataclass(frozen=True)
class PortArgs:
    """Addresses of the ring; ipc:// paths inside a private temporary directory. With several
    nodes, the TP group's rendezvous and the node links are TCP on --dist-init-addr's host
    (ports in srt/managers/node_link.py)."""

    ipc_dir: str
    tokenizer_to_router: str
    router_to_model: tuple[str, ...]  # one per TP rank of node 0 (every rank on one node)
    model_to_router: str
    router_to_detokenizer: str
    detokenizer_to_tokenizer: str
    dist_init_port: int | None  # TCP port of the TP group's rendezvous (tp_size > 1)
    dist_init_host: str = "127.0.0.1"
    # (host, port) of --dist-init-addr with several nodes, else None
    node_link: tuple[str, int] | None = None

    @classmethod
    def create(cls, tp_size: int, dist_init: tuple[str, int] | None = None,
               ranks_on_node0: int | None = None) -> "PortArgs":
        """dist_init: (host, port) of --dist-init-addr when the ranks span several nodes;
        ranks_on_node0: how many of the tp_size ranks node 0 runs (default: all)."""
        d = tempfile.mkdtemp(prefix="srt-ipc-")
        os.chmod(d, 0o700)  # only this user may reach the sockets

        def addr(name: str) -> str:
            return f"ipc://{os.path.join(d, name)}"

        return cls(
            ipc_dir=d,
            tokenizer_to_router=addr("tokenizer_to_router"),
            router_to_model=tuple(addr(f"router_to_model_{r}")
                                  for r in range(ranks_on_node0 or tp_size)),
            model_to_router=addr("model_to_router"),
            router_to_detokenizer=addr("router_to_detokenizer"),
            detokenizer_to_tokenizer=addr("detokenizer_to_tokenizer"),
            dist_init_port=(dist_init[1] if dist_init else
                            free_port() if tp_size > 1 else None),
            dist_init_host=dist_init[0] if dist_init else "127.0.0.1",
            node_link=dist_init,
        )
