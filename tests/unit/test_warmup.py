"""The model process's start-up warm-up (on a GPU, unless --skip-warmup): it runs the fill and
decode paths and leaves nothing behind (pool, rows, tree, statistics, random state)."""

import random
import tempfile

import srt.managers.router.model_rpc as model_rpc
from benchmarks.common import write_shape_dir
from srt.layers.forward_batch import ForwardMode
from srt.managers.router.model_rpc import ModelRpcServer
from srt.server_args import ServerArgs


def _args(path: str, **kw) -> ServerArgs:
    return ServerArgs(model_path=path, tokenizer_path=path, load_format="dummy",
                      dtype="float32", device="cpu", attention_backend="torch",
                      random_seed=0, **kw)


def test_warm_up_runs_every_path_and_leaves_nothing(monkeypatch) -> None:
    path = write_shape_dir("tiny", tempfile.mkdtemp(prefix="srt-warmup-"))
    seen: list[tuple[ForwardMode, list[int]]] = []
    run = ModelRpcServer._run

    def spy(self, batch, mode, *a, **kw):
        seen.append((mode, [len(r.prefix_indices) for r in batch]))
        return run(self, batch, mode, *a, **kw)

    monkeypatch.setattr(model_rpc.ModelRpcServer, "_run", spy)
    server = ModelRpcServer(_args(path), 0, None)
    assert seen == []  # on the CPU the model process does not warm up by itself
    server._warm_up()
    modes = [m for m, _ in seen]
    assert modes[0] == ForwardMode.PREFILL and len(seen[0][1]) == 3
    ext = [p for m, p in seen if m == ForwardMode.EXTEND]
    assert ext and any(ext[0]) and not all(ext[0])  # with and without a cached prefix
    assert ForwardMode.DECODE in modes
    assert server.pool.available_size() == server.pool.size
    assert server.req_pool.available_size() == server.req_pool.size
    assert server.tree.evictable_size() == 0 and not server.waiting and not server.running
    assert server.stats()["cache_hit_rate"] == 0 and server.prompt_tokens_total == 0
    assert server.rng.getstate() == random.Random(0).getstate() and server.arrivals == 0

