"""Shared pieces of the benchmark scripts: model shapes for `--load-format dummy`, and the
hardware floors (copy bandwidth, matmul rate) measured in the same run as the figures."""

from __future__ import annotations

import concurrent.futures
import json
import multiprocessing
import os
import platform
import statistics
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

# Shapes of real checkpoints, served with random weights (same speed).
SHAPES: dict[str, dict[str, Any]] = {
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                      max_position_embeddings=8192, rope_theta=500000.0,
                      tie_word_embeddings=False),
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                         max_position_embeddings=8192, rope_theta=100000.0,
                         tie_word_embeddings=True),
    # Gemma 2 9B: 21 sliding-window layers (4096) between 21 global ones, soft-capped scores
    # and logits, head_dim 256 (not hidden / heads)
    "gemma2-9b": dict(config_class="Gemma2Config", hidden_size=3584, intermediate_size=14336,
                      num_hidden_layers=42, num_attention_heads=16, num_key_value_heads=8,
                      head_dim=256, vocab_size=256000, max_position_embeddings=8192,
                      rope_theta=10000.0, sliding_window=4096, attn_logit_softcapping=50.0,
                      final_logit_softcapping=30.0, query_pre_attn_scalar=256,
                      hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True),
    # DeepSeek-V2-Lite: MLA (latent 512 + rotary 64), 64 routed experts (top 6) + 2 shared,
    # YaRN; the context held to 8192 here (the checkpoint's is 163,840)
    "deepseek-v2-lite": dict(
        config_class="DeepseekV2Config", hidden_size=2048, intermediate_size=10944,
        moe_intermediate_size=1408, num_hidden_layers=27, num_attention_heads=16,
        num_key_value_heads=16, n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6,
        first_k_dense_replace=1, kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, head_dim=64, vocab_size=102400,
        routed_scaling_factor=1.0, topk_method="greedy", n_group=1, topk_group=1,
        norm_topk_prob=False, max_position_embeddings=8192, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=40.0,
                             original_max_position_embeddings=4096, beta_fast=32.0,
                             beta_slow=1.0, mscale=0.707, mscale_all_dim=0.707)),
    # Qwen3-30B-A3B: 128 experts of 768 (top 8, renormalized) on every layer, q/k norms
    "qwen3-30b-a3b": dict(
        config_class="Qwen3MoeConfig", hidden_size=2048, intermediate_size=6144,
        moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], vocab_size=151936,
        max_position_embeddings=40960, rope_theta=1000000.0, tie_word_embeddings=False),
    # Not a real model: two small layers, for tests of the benchmark scripts on the CPU.
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=1024,
                 max_position_embeddings=4096, rope_theta=10000.0, tie_word_embeddings=True),
}


@dataclass(frozen=True)
class Shape:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool

    @classmethod
    def of(cls, name: str) -> "Shape":
        c = SHAPES[name]
        return cls(name, c["num_hidden_layers"], c["hidden_size"], c["num_attention_heads"],
                   c["num_key_value_heads"],
                   c.get("head_dim", c["hidden_size"] // c["num_attention_heads"]),
                   c["intermediate_size"], c["vocab_size"], c["tie_word_embeddings"])

    @property
    def params(self) -> int:
        d, h = self.head_dim, self.hidden
        attn = h * (self.heads + 2 * self.kv_heads) * d + self.heads * d * h
        mlp = 3 * h * self.intermediate
        embed = self.vocab * h * (1 if self.tied else 2)
        return self.layers * (attn + mlp + 2 * h) + h + embed

    @property
    def matmul_params(self) -> int:
        """Parameters multiplied per token (all but the input embedding lookup)."""
        return self.params - (0 if self.tied else self.vocab * self.hidden)

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes

    def attention_flops(self, ctx: int) -> int:
        """FLOPs of one query token attending over ctx tokens (QK and PV), all layers."""
        return 4 * self.layers * self.heads * self.head_dim * ctx


def write_shape_dir(name: str, path: str, **config: Any) -> str:
    """config.json (bf16) and a word-level tokenizer for `name` under `path`; returns `path`.
    `config` overrides fields of the shape (e.g. max_position_embeddings=32768). A shape's
    `config_class` names its transformers config (default LlamaConfig)."""
    import transformers

    from tests.random_models import save_word_tokenizer

    os.makedirs(path, exist_ok=True)
    fields = {**SHAPES[name], **config}
    cls_name = fields.pop("config_class", "LlamaConfig")
    eps = 1e-5 if cls_name == "LlamaConfig" else 1e-6
    cfg = getattr(transformers, cls_name)(
        **fields, rms_norm_eps=eps, bos_token_id=1, eos_token_id=1, pad_token_id=0,
        torch_dtype="bfloat16", architectures=[cls_name.replace("Config", "ForCausalLM")])
    cfg.save_pretrained(path)
    save_word_tokenizer(path, cfg.vocab_size)
    return path


LORA_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_lora_adapters(name: str, n: int, rank: int, root: str) -> list[str]:
    """n random PEFT adapters of rank `rank` on all 7 projections of the Llama-shaped `name`
    (bf16, N(0, 0.01) A and B, lora_alpha 2 x rank: the peer kit's vllm_bench.py writes the
    same); returns their directories."""
    from safetensors.torch import save_file

    s = Shape.of(name)
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    dims = {"q_proj": (s.hidden, q), "k_proj": (s.hidden, kv), "v_proj": (s.hidden, kv),
            "o_proj": (q, s.hidden), "gate_proj": (s.hidden, s.intermediate),
            "up_proj": (s.hidden, s.intermediate), "down_proj": (s.intermediate, s.hidden)}
    paths = []
    for k in range(n):
        g = torch.Generator().manual_seed(k)
        w = {}
        for layer in range(s.layers):
            for m, (fan_in, fan_out) in dims.items():
                part = "mlp" if m in ("gate_proj", "up_proj", "down_proj") else "self_attn"
                key = f"base_model.model.model.layers.{layer}.{part}.{m}"
                w[key + ".lora_A.weight"] = (torch.randn(rank, fan_in, generator=g)
                                             * 0.01).to(torch.bfloat16)
                w[key + ".lora_B.weight"] = (torch.randn(fan_out, rank, generator=g)
                                             * 0.01).to(torch.bfloat16)
        d = os.path.join(root, f"adapter{k}")
        os.makedirs(d, exist_ok=True)
        save_file(w, os.path.join(d, "adapter_model.safetensors"))
        with open(os.path.join(d, "adapter_config.json"), "w") as f:
            json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
                       "target_modules": LORA_MODULES}, f)
        paths.append(d)
    return paths


def save_layer_prefix(src: str, dst: str, layers: int) -> str:
    """A draft model for STANDALONE speculative decoding cut from a Llama-family checkpoint:
    its first `layers` decoder layers with its embeddings, final norm and LM head (a layer-skip
    self-draft), and its tokenizer files; returns `dst`."""
    import shutil

    from safetensors.torch import load_file, save_file

    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config["num_hidden_layers"] = layers
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    kept: dict[str, torch.Tensor] = {}
    for name in sorted(os.listdir(src)):
        if name.endswith(".safetensors"):
            for key, t in load_file(os.path.join(src, name)).items():
                parts = key.split(".")
                if "layers" in parts and int(parts[parts.index("layers") + 1]) >= layers:
                    continue
                kept[key] = t.contiguous()
        elif name != "config.json" and not name.endswith(".safetensors.index.json") \
                and os.path.isfile(os.path.join(src, name)):  # tokenizer, generation config
            shutil.copy(os.path.join(src, name), os.path.join(dst, name))
    save_file(kept, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return dst


def add_engine_args(p: Any) -> None:
    """The arguments every Engine benchmark takes (an argparse parser)."""
    p.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--cuda-graph-max-bs", type=int, default=None,
                   help="largest captured decode batch (default: the server's)")
    p.add_argument("--disable-radix-cache", action="store_true")
    p.add_argument("--disable-overlap-schedule", action="store_true",
                   help="run each decode step to the end before launching the next")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default="bfloat16",
                   help="float32 is faster for a CPU smoke test")
    p.add_argument("--max-total-tokens", type=int, default=None,
                   help="KV pool size (default: from --mem-fraction-static)")
    p.add_argument("--max-prefill-tokens", type=int, default=None,
                   help="most new tokens in one fill batch (default: the server's)")
    p.add_argument("--awq-group-size", type=int, default=0, metavar="G",
                   help="random AWQ int4 weights with this group size (a quantization_config "
                   "in the shape's config.json); 0: the model dtype")
    p.add_argument("--log-level", default="warning")
    p.add_argument("--out", default=None)


def engine_kwargs(a: Any) -> dict[str, Any]:
    """ServerArgs fields for the arguments of `add_engine_args` (random weights, seed 0)."""
    kw: dict[str, Any] = dict(
        load_format="dummy", dtype=a.dtype, device=a.device, tp_size=a.tp_size,
        attention_backend=a.attention_backend, disable_cuda_graph=a.disable_cuda_graph,
        disable_radix_cache=a.disable_radix_cache, random_seed=0, log_level=a.log_level,
        disable_overlap_schedule=a.disable_overlap_schedule)
    if a.cuda_graph_max_bs is not None:
        kw["cuda_graph_max_bs"] = a.cuda_graph_max_bs
    if a.max_total_tokens is not None:
        kw["max_total_tokens"] = a.max_total_tokens
    if a.max_prefill_tokens is not None:
        kw["max_prefill_tokens"] = a.max_prefill_tokens
    return kw


def parse_with_server_args(p: Any, argv: list[str] | None = None) -> Any:
    """`p.parse_known_args`, then the arguments `p` does not know parsed as srt.ServerArgs
    flags (e.g. `--chunked-prefill-size 8192`, `--enable-mixed-chunk`): the ones given land in
    `a.server_args` as ServerArgs fields, for `start_engine(a, **a.server_args)` or a launched
    server. An argument that is no ServerArgs flag is an error naming it."""
    import argparse

    from srt.server_args import ServerArgs

    a, rest = p.parse_known_args(argv)
    sp = argparse.ArgumentParser(prog="srt.ServerArgs", add_help=False, allow_abbrev=False)
    ServerArgs.add_cli_args(sp)
    for act in sp._actions:  # only the flags given land in the namespace
        act.default = argparse.SUPPRESS
    ns, unknown = sp.parse_known_args(rest)
    if unknown:
        p.error(f"neither this benchmark's nor a srt.ServerArgs argument: {' '.join(unknown)}")
    a.server_args = vars(ns)
    return a


def awq_config(group_size: int) -> dict[str, Any]:
    """config.json fields for random AWQ int4 weights of this group size ({} for 0)."""
    if not group_size:
        return {}
    return {"quantization_config": {"quant_method": "awq", "zero_point": True,
                                    "group_size": group_size, "bits": 4, "version": "gemm"}}


def start_engine(a: Any, *, shape_config: dict[str, Any] | None = None,
                 **overrides: Any) -> tuple[Any, float]:
    """An srt.Engine on the shape `a.shape` with random weights (`engine_kwargs(a)`, then
    `overrides`), and its start-up seconds. `shape_config` overrides fields of the shape's
    config.json (`write_shape_dir`)."""
    import srt

    shape_config = {**(shape_config or {}), **awq_config(getattr(a, "awq_group_size", 0))}
    model_dir = write_shape_dir(a.shape, tempfile.mkdtemp(prefix=f"srt-{a.shape}-"),
                                **shape_config)
    t0 = time.perf_counter()
    engine = srt.Engine(model_dir, **{**engine_kwargs(a), **overrides})
    return engine, time.perf_counter() - t0


def decode_step_times(engine: Any) -> dict[str, Any]:
    """Rank 0's decode-step phase sums (seconds) so far; difference two with
    `srt.model_process.step_timing.per_step_ms`."""
    return engine.get_server_info()["decode_step_times"]


def slow_rounds_since(engine: Any, since: float, top: int = 8) -> dict[str, Any]:
    """Rank 0's longest model-loop rounds (over its 100 ms threshold; a round is one fill or a
    few decode steps) that began at or after the wall-clock time `since`: the longest `top`,
    and how many of those kept began then. A few rounds of seconds among many short ones are
    Triton compiling a new specialization; uniformly long fill rounds are the fills' cost."""
    slow = engine.get_server_info()["slow_rounds"]
    rounds = [r for r in slow["longest"] if r["wall_time"] >= since]
    return {"threshold_ms": slow["threshold_ms"], "kept": len(rounds), "longest": rounds[:top]}


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def cuda_time_ms(fn: Callable[[], Any], warmup: int = 5, iters: int = 20) -> float:
    """Median device time of fn in ms (CUDA events; wall time where there is no GPU)."""
    if not torch.cuda.is_available():
        return wall_time_ms(fn, warmup=1, iters=3)
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def wall_time_ms(fn: Callable[[], Any], warmup: int = 1, iters: int = 3) -> float:
    """Median wall time of fn in ms (the CPU stand-in for `cuda_time_ms`)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def copy_bandwidth(device: str | None = None) -> float:
    """Bytes read + written per second by a device-to-device copy (2 GiB; 256 MiB on the CPU)."""
    device = device or default_device()
    numel = (1 << 30) if device != "cpu" else (1 << 27)
    src = torch.empty(numel, dtype=torch.float16, device=device).normal_()
    dst = torch.empty_like(src)
    ms = cuda_time_ms(lambda: dst.copy_(src))
    return 2 * numel * 2 / (ms / 1e3)


def matmul_rate(device: str | None = None, n: int | None = None) -> float:
    """FLOP/s of an n^3 matmul: bf16 8192^3 on a GPU, float32 1024^3 on the CPU."""
    device = device or default_device()
    dtype = torch.bfloat16 if device != "cpu" else torch.float32
    n = n or (8192 if device != "cpu" else 1024)
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    ms = cuda_time_ms(lambda: a @ b)
    return 2 * n**3 / (ms / 1e3)


def device_rates(fp8: bool = False, child: bool | None = None
                 ) -> tuple[float, float, float | None]:
    """(copy_bandwidth, matmul_rate, fp8_matmul_rate if `fp8` else None). On a GPU (or with
    `child`) they are measured in a spawned child process: a benchmark that then starts an
    engine holds no CUDA context or cached blocks of its own, which would shrink the KV pool
    the engine sizes from the device's free memory (by 2.6 GiB, a fifth of Qwen3-30B-A3B's
    pool on one H100)."""
    if child is None:
        child = torch.cuda.is_available()
    if not child:
        return _rates(fp8)
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool:
        return pool.submit(_rates, fp8).result()


def _rates(fp8: bool) -> tuple[float, float, float | None]:
    return copy_bandwidth(), matmul_rate(), fp8_matmul_rate() if fp8 else None


def fp8_matmul_rate(n: int = 8192) -> float:
    """FLOP/s of an n^3 e4m3 product through torch._scaled_mm with row-wise scales (what
    srt's FP8 layers run at large batches), bf16 out. GPU only."""
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    sa = torch.ones(n, 1, device="cuda")
    sb = torch.ones(1, n, device="cuda")
    ms = cuda_time_ms(lambda: torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb,
                                               out_dtype=torch.bfloat16))
    return 2 * n**3 / (ms / 1e3)


def hardware() -> dict[str, Any]:
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {"gpus": gpus, "cpus": os.cpu_count(), "torch": torch.__version__,
            "python": platform.python_version(), "date": time.strftime("%Y-%m-%d")}


def write_json(path: str | None, data: dict[str, Any]) -> None:
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(data, f, indent=1)


def print_table(rows: list[dict[str, Any]], cols: list[str]) -> None:
    def fmt(v: Any) -> str:
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    cells = [[fmt(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(x[i]) for x in cells)) for i, c in enumerate(cols)]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    for x in cells:
        print("  ".join(v.ljust(w) for v, w in zip(x, widths)), flush=True)
