"""The model process's start-up warm-up (on a GPU, unless --skip-warmup): it runs the fill and
decode paths and leaves nothing behind (pool, rows, tree, statistics, random state)."""

import random
import tempfile

from benchmarks.common import write_shape_dir
from srt.layers.forward_batch import ForwardMode
from srt.model_process.executor import StepExecutor
from srt.model_process.loop import ModelProcess
from srt.model_process.warmup import warm_up
from srt.models.deepseek_v2 import expanded_extend_pays
from srt.server_args import ServerArgs


def _args(path: str, **kw) -> ServerArgs:
    return ServerArgs(model_path=path, tokenizer_path=path, load_format="dummy",
                      dtype="float32", device="cpu", attention_backend="torch",
                      random_seed=0, **kw)


def test_warm_up_runs_every_path_and_leaves_nothing(monkeypatch) -> None:
    path = write_shape_dir("tiny", tempfile.mkdtemp(prefix="srt-warmup-"))
    seen: list[tuple[ForwardMode, list[int]]] = []
    extends: list[tuple[list[int], list[int]]] = []
    launch = StepExecutor.launch

    def spy(self, plan, *args):
        seen.append((plan.mode, list(plan.prefix_lens)))
        if plan.mode == ForwardMode.EXTEND:
            extends.append((list(plan.prefix_lens), list(plan.extend_lens)))
        return launch(self, plan, *args)

    monkeypatch.setattr(StepExecutor, "launch", spy)
    server = ModelProcess(_args(path), 0, None)
    assert seen == []  # on the CPU the model process does not warm up by itself
    warm_up(server)
    modes = [m for m, _ in seen]
    assert modes[0] == ForwardMode.PREFILL and len(seen[0][1]) == 3
    ext = [p for m, p in seen if m == ForwardMode.EXTEND]
    assert ext and any(ext[0]) and not all(ext[0])  # with and without a cached prefix
    # steps that DeepSeek-V2-Lite computes over expanded latents (kv_lora_rank 512, rope 64,
    # nope 128, v 128), with an even and an odd number of new tokens
    expanded = [sum(e) for p, e in extends if any(p) and expanded_extend_pays(p, e, 512, 64,
                                                                               128, 128)]
    assert {x % 2 for x in expanded} == {0, 1}, extends
    assert ForwardMode.DECODE in modes
    assert server.kv.pool.available_size() == server.kv.pool.size
    assert server.kv.req_pool.available_size() == server.kv.req_pool.size
    assert server.kv.tree.evictable_size() == 0 and not server.waiting and not server.running
    assert server.stats()["cache_hit_rate"] == 0 and server.counters.prompt_tokens == 0
    assert server.rng.getstate() == random.Random(0).getstate() and server.arrivals == 0



def test_experts_warmed_once_per_shape(monkeypatch) -> None:
    """The fused MoE's tile configurations are compiled once per distinct expert shape of the
    model (every layer of one shape shares the compiled kernels), with the model's dtype."""
    import torch

    from srt.layers import parallel_state as ps
    from srt.layers.moe import FusedMoE
    from srt.model_process.warmup import warm_up_experts

    monkeypatch.setattr(ps, "_group", ps.TPGroup(0, 1))
    calls: list[tuple] = []

    def spy(self, dtype):
        calls.append((tuple(self.w13_weight.shape), self.top_k, dtype))
        return True

    monkeypatch.setattr(FusedMoE, "warm_up", spy)
    model = torch.nn.ModuleList([FusedMoE(4, 2, 32, 64), FusedMoE(4, 2, 32, 64),
                                 torch.nn.Linear(2, 2), FusedMoE(8, 2, 32, 48),
                                 FusedMoE(4, 3, 32, 64)])
    assert warm_up_experts(model, torch.bfloat16) == 3
    assert calls == [((4, 128, 32), 2, torch.bfloat16), ((8, 96, 32), 2, torch.bfloat16),
                     ((4, 128, 32), 3, torch.bfloat16)]
    # without CUDA a layer never takes the fused kernel: nothing to compile
    monkeypatch.undo()
    monkeypatch.setattr(ps, "_group", ps.TPGroup(0, 1))
    assert warm_up_experts(model, torch.float32) == 0
