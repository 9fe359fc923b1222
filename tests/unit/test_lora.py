"""LoRA's host side: --lora-paths and the pool's limits (srt/lora/args.py), adapter checks
(srt/lora/adapter.py), the HTTP process's adapter table (srt/lora/registry.py) and the radix
cache's namespaces, which keep adapters' prefixes apart."""

from __future__ import annotations

import json
import math
import os
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from srt.lora.adapter import BaseShapes, LoraAdapter, LoraError, expand_targets
from srt.lora.args import LoraSpec, parse_lora_path
from srt.lora.registry import LoraRegistry
from srt.managers.request_types import RequestError
from srt.model_process.radix_cache import RadixCache, shared_prefix_len
from srt.server_args import ServerArgs

BASE = BaseShapes(2, {"q_proj": (32, 32), "k_proj": (32, 16), "v_proj": (32, 16),
                      "o_proj": (32, 32), "gate_proj": (32, 64), "up_proj": (32, 64),
                      "down_proj": (64, 32)})


def write_adapter(path: str, rank: int = 4, targets: tuple[str, ...] = ("q_proj", "v_proj"),
                  config: dict[str, Any] | None = None, layers: int = 2,
                  skip: str | None = None, extra: dict[str, torch.Tensor] | None = None) -> str:
    os.makedirs(path, exist_ok=True)
    cfg = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
           "target_modules": list(targets), "bias": "none", **(config or {})}
    json.dump(cfg, open(os.path.join(path, "adapter_config.json"), "w"))
    tensors = {}
    for i in range(layers):
        for t in targets:
            fan_in, fan_out = BASE.shapes[t]
            part = "mlp" if t in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = f"base_model.model.model.layers.{i}.{part}.{t}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in)
            if skip != "B":
                tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank)
    save_file({**tensors, **(extra or {})}, os.path.join(path, "adapter_model.safetensors"))
    return path


def test_parse_lora_path_forms() -> None:
    assert parse_lora_path("a=/x/y") == LoraSpec("a", "/x/y")
    assert parse_lora_path("/x/y") == LoraSpec("/x/y", "/x/y")
    assert parse_lora_path('{"lora_name": "b", "lora_path": "/z"}') == LoraSpec("b", "/z")
    for bad in ("=x", "a=", '{"lora_name": 1}', "{nope"):
        with pytest.raises(ValueError):
            parse_lora_path(bad)


def test_expand_targets() -> None:
    assert expand_targets(["qkv_proj", "down_proj"]) == ("q_proj", "k_proj", "v_proj",
                                                        "down_proj")
    assert len(expand_targets(["all"])) == 7
    with pytest.raises(LoraError, match="embed_tokens"):
        expand_targets(["embed_tokens"])


def test_server_args_take_limits_from_the_adapters(tmp_path: Any) -> None:
    a = write_adapter(str(tmp_path / "a"), 4, ("q_proj", "v_proj"))
    b = write_adapter(str(tmp_path / "b"), 8, ("gate_proj",))
    args = ServerArgs.from_cli(["--lora-paths", f"x={a}", b]).resolve()
    assert args.enable_lora and args.max_lora_rank == 8
    assert args.lora_target_modules == ("q_proj", "v_proj", "gate_proj")
    assert [s.name for s in args.lora_specs] == ["x", b]
    args = ServerArgs.from_cli(["--lora-paths", a, "--max-lora-rank", "16",
                                "--lora-target-modules", "all"]).resolve()
    assert args.max_lora_rank == 16 and len(args.lora_target_modules) == 7


@pytest.mark.parametrize("flags,message", [
    (["--enable-lora"], "needs --max-lora-rank and --lora-target-modules"),
    (["--lora-paths", "x=/a", "x=/b"], "more than once"),
    (["--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "all",
      "--is-embedding"], "not supported with --is-embedding"),
    (["--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "lm_head"],
     "unsupported LoRA target module"),
    (["--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "all",
      "--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", "/x"],
     "NGRAM only"),
])
def test_server_args_refuse(flags: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ServerArgs.from_cli(flags).resolve()


def test_adapter_load_scales_b(tmp_path: Any) -> None:
    path = write_adapter(str(tmp_path / "a"), 4, ("q_proj", "down_proj"))
    a = LoraAdapter.load("a", path, BASE, 8, None)
    assert a.rank == 4 and a.scaling == 2.0 and a.targets == ("q_proj", "down_proj")
    assert set(a.weights) == {(i, t) for i in range(2) for t in ("q_proj", "down_proj")}
    path = write_adapter(str(tmp_path / "r"), 4, config={"use_rslora": True})
    assert LoraAdapter.load("r", path, BASE, 8, None).scaling == pytest.approx(8 / math.sqrt(4))


@pytest.mark.parametrize("case,message", [
    ("rank", "over the server's --max-lora-rank 4"),
    ("dora", "use_dora"),
    ("bias", "bias='all'"),
    ("missing_b", "lacks lora_B"),
    ("layer", "layer 2 does not exist"),
    ("embed", "unsupported tensor"),
    ("served", "not among the server's --lora-target-modules"),
    ("no_dir", "is not a directory"),
    ("bin", "adapter_model.bin is not"),
    ("shape", "the base model needs A"),
])
def test_adapter_load_refuses(tmp_path: Any, case: str, message: str) -> None:
    p = str(tmp_path / case)
    served = None
    if case == "rank":
        write_adapter(p, 8)
    elif case == "dora":
        write_adapter(p, config={"use_dora": True})
    elif case == "bias":
        write_adapter(p, config={"bias": "all"})
    elif case == "missing_b":
        write_adapter(p, skip="B")
    elif case == "layer":
        write_adapter(p, layers=3)
    elif case == "embed":
        write_adapter(p, extra={"base_model.model.model.embed_tokens.lora_embedding_A":
                                torch.zeros(4, 8)})
    elif case == "served":
        write_adapter(p, targets=("q_proj", "o_proj"))
        served = ("q_proj", "v_proj")
    elif case == "bin":
        write_adapter(p)
        os.rename(os.path.join(p, "adapter_model.safetensors"),
                  os.path.join(p, "adapter_model.bin"))
    elif case == "shape":
        write_adapter(p)
        json.dump({"peft_type": "LORA", "r": 2, "target_modules": ["q_proj"]},
                  open(os.path.join(p, "adapter_config.json"), "w"))
    with pytest.raises(LoraError, match=message.replace("(", r"\(").replace("[", r"\[")):
        LoraAdapter.load(case, p, BASE, 4 if case == "rank" else 16, served)


def test_adapter_load_splits_fused_modules(tmp_path: Any) -> None:
    """Phi-3's fused qkv_proj / gate_up_proj adapters: one A shared by the parts, B cut by the
    parts' output rows (B A x = [B_q A x; B_k A x; B_v A x]); a part adapted both fused and
    alone is refused."""
    path = str(tmp_path / "f")
    os.makedirs(path)
    json.dump({"peft_type": "LORA", "r": 4, "lora_alpha": 4, "bias": "none",
               "target_modules": ["qkv_proj", "gate_up_proj"]},
              open(os.path.join(path, "adapter_config.json"), "w"))
    g = torch.Generator().manual_seed(0)
    t = {}
    for i in range(2):
        for part, mod, rows in (("self_attn", "qkv_proj", 64), ("mlp", "gate_up_proj", 128)):
            key = f"base_model.model.model.layers.{i}.{part}.{mod}"
            t[f"{key}.lora_A.weight"] = torch.randn(4, 32, generator=g)
            t[f"{key}.lora_B.weight"] = torch.randn(rows, 4, generator=g)
    save_file(t, os.path.join(path, "adapter_model.safetensors"))
    a = LoraAdapter.load("f", path, BASE, 8, None)
    assert a.targets == ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
    b = t["base_model.model.model.layers.1.self_attn.qkv_proj.lora_B.weight"]
    a_in = t["base_model.model.model.layers.1.self_attn.qkv_proj.lora_A.weight"]
    for name, rows in (("q_proj", slice(0, 32)), ("k_proj", slice(32, 48)),
                       ("v_proj", slice(48, 64))):
        got_a, got_b = a.weights[(1, name)]
        assert torch.equal(got_a, a_in) and torch.equal(got_b, b[rows])
    assert a.weights[(0, "up_proj")][1].shape == (64, 4)
    t["base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight"] = torch.randn(4, 32)
    t["base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight"] = torch.randn(16, 4)
    save_file(t, os.path.join(path, "adapter_model.safetensors"))
    with pytest.raises(LoraError, match="adapts k_proj twice"):
        LoraAdapter.load("f", path, BASE, 8, None)


def test_registry_states_and_ids() -> None:
    reg = LoraRegistry(True, [LoraSpec("a", "/a"), LoraSpec("b", "/b")], max_loaded=3)
    assert reg.resolve("a", "lora_path") == 1 and reg.resolve("b", "lora_path") == 2
    ref = reg.begin_load("c", "/c")
    assert ref.lora_id == 3
    with pytest.raises(RequestError, match="is loading"):
        reg.resolve("c", "lora_path")
    with pytest.raises(RequestError, match="--max-loaded-loras"):
        reg.begin_load("d", "/d")
    reg.end_load(ref, True)
    assert reg.resolve("c", "lora_path") == 3
    with pytest.raises(RequestError, match="2 request"):
        reg.begin_unload("a", in_flight=2)
    gone = reg.begin_unload("a", in_flight=0)
    with pytest.raises(RequestError, match="is unloading"):
        reg.resolve("a", "lora_path")
    reg.end_unload(gone, True)
    with pytest.raises(RequestError, match="unknown LoRA adapter 'a'"):
        reg.resolve("a", "lora_path")
    again = reg.begin_load("a", "/a")
    assert again.lora_id == 4  # ids are never reused
    reg.end_load(again, False)
    assert "a" not in reg.refs
    off = LoraRegistry(False, [], None)
    with pytest.raises(RequestError, match="without --enable-lora"):
        off.resolve("a", "lora_path")


class Pool:
    def __init__(self) -> None:
        self.freed: list[int] = []

    def free(self, slots: torch.Tensor) -> None:
        self.freed.extend(slots.tolist())


def test_radix_namespaces_never_share() -> None:
    pool = Pool()
    cache = RadixCache(pool)
    key = [1, 2, 3, 4]
    assert cache.insert(key, torch.tensor([10, 11, 12, 13])) == 0
    assert cache.insert(key, torch.tensor([20, 21, 22, 23]), namespace=5) == 0
    slots, node0 = cache.match_prefix(key)
    assert slots.tolist() == [10, 11, 12, 13]
    slots, node5 = cache.match_prefix(key, 5)
    assert slots.tolist() == [20, 21, 22, 23]
    assert len(cache.match_prefix(key, 6)[0]) == 0
    assert shared_prefix_len([node0, node5]) == 0
    assert cache.total_size() == 8 and len(cache.roots()) == 3
    cache.inc_lock_ref(node5)
    with pytest.raises(RuntimeError, match="locked"):
        cache.drop_namespace(5)
    assert cache.evict(100) == 4 and sorted(pool.freed) == [10, 11, 12, 13]  # 5 is locked
    cache.dec_lock_ref(node5)
    cache.drop_namespace(5)
    assert sorted(pool.freed) == [10, 11, 12, 13, 20, 21, 22, 23]
    assert cache.total_size() == 0 and cache.evictable_size() == 0
    assert len(cache.match_prefix(key, 5)[0]) == 0


def test_radix_reset_covers_every_namespace() -> None:
    pool = Pool()
    cache = RadixCache(pool)
    cache.insert([1, 2], torch.tensor([1, 2]))
    cache.insert([1, 2], torch.tensor([3, 4]), namespace=2)
    cache.reset()
    assert sorted(pool.freed) == [1, 2, 3, 4] and cache.total_size() == 0


def test_cuda_graph_buffers_take_a_steps_grouping(tmp_path: Any) -> None:
    """The graph runner's static LoRA buffers (built on the CPU here; capture needs a GPU):
    a step's grouping from the LoraManager (Triton path) lands in them, the blocks past it are
    padding, a step of no adapter leaves every block padding, and each graph's views are as
    long as its batch needs."""
    from types import SimpleNamespace

    import numpy as np
    from transformers import LlamaConfig

    from srt.lora.manager import LoraManager
    from srt.model_process.cuda_graph_runner import CudaGraphRunner
    from srt.models.llama import LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=64)
    manager = LoraManager(LlamaForCausalLM(cfg, 64), cfg, 3, 4, ("q_proj", "down_proj"),
                          torch.device("cpu"), torch.float32)
    manager.triton = True  # the GPU's grouping (block table), computed on the CPU
    for i in (1, 2):
        shapes = {"q_proj": (32, 32), "down_proj": (64, 32)}
        adapter = LoraAdapter("a", "/a", 4, 1.0, ("q_proj", "down_proj"), {
            (layer, m): (torch.randn(4, fi), torch.randn(fo, 4))
            for layer in range(2) for m, (fi, fo) in shapes.items()})
        manager.add(i, adapter)
    runner = SimpleNamespace(attn_backend=None, device=torch.device("cpu"), lora=manager,
                             token_to_kv_pool=SimpleNamespace(size=100),
                             req_to_token_pool=None)
    graphs = CudaGraphRunner(runner, 40, lambda fb: None)
    info = manager.batch_info(np.array([1, 0, 2, 1, 1] + [2] * 20))
    graphs.load_lora(info)
    nb = info.block_slot.shape[0]
    assert torch.equal(graphs.lora.block_slot[:nb], info.block_slot)
    assert (graphs.lora.block_slot[nb:] == -1).all()
    assert torch.equal(graphs.lora.rows[:24], info.rows)  # (row 1 uses no adapter)
    assert graphs.lora.indptr.tolist() == info.indptr.tolist() == [0, 3, 24, 24]
    static = graphs._static_batch(32, [1] * 32)
    assert static.lora.block_slot.shape[0] == 2 + 3 and static.lora.rows.shape[0] == 32
    graphs.load_lora(None)
    assert (graphs.lora.block_slot == -1).all()


@pytest.mark.parametrize("policy,evicted", [("lru", 2), ("fifo", 1)])
def test_slot_eviction_policy(policy: str, evicted: int) -> None:
    """Two slots, three adapters: 1 and 2 are placed, 1 is used again, then 3 needs a slot:
    lru evicts 2 (used longest ago), fifo evicts 1 (placed first)."""
    from transformers import LlamaConfig

    from srt.lora.manager import LoraManager
    from srt.models.llama import LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=64)
    manager = LoraManager(LlamaForCausalLM(cfg, 64), cfg, 2, 4, ("q_proj",),
                          torch.device("cpu"), torch.float32, policy)
    for i in (1, 2, 3):
        manager.add(i, LoraAdapter("a", "/a", 4, 1.0, ("q_proj",), {
            (layer, "q_proj"): (torch.randn(4, 32), torch.randn(32, 4)) for layer in range(2)}))
    for ids in ([1], [2], [1], [3]):
        manager.batch_info(np.array(ids))
    assert set(manager.slot_of) == {1, 2, 3} - {evicted}
    assert manager.slot_of[3] == (0 if evicted == 1 else 1)
