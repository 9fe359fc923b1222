"""ModelRunner: the model, its KV pools and attention backend on one device, and one forward.

Resolves device, dtype and attention backend (`auto` values the HTTP process cannot settle without
the device), loads the weights, sizes the KV pool from what memory is left, and runs a ForwardBatch
under `forward_context`.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from srt import cpu_threads
from srt.layers import parallel_state
from srt.layers.pooler import PoolingConfig
from srt.layers.attention import create_step_backends, resolve_step_backends
from srt.layers.forward_batch import ForwardBatch, forward_context
from srt.layers.kv_cache_dtype import resolve_kv_cache_dtype
from srt.layers.radix_attention import RadixAttention
from srt.model_process.cuda_graph_runner import CudaGraphRunner
from srt.model_process.prefill_graph_runner import PrefillGraphRunner
from srt.model_process.prefill_graph_runner import supported as prefill_graphs_supported
from srt.memory_pool import ReqToTokenPool, TokenToKVPool
from srt.model_config import ModelConfig
from srt.models.loader import init_dummy_weights, iterate_safetensors
from srt.models.registry import get_model_class
from srt.server_args import ServerArgs

if TYPE_CHECKING:
    from srt.lora.manager import LoraManager
    from srt.model_process.draft_runner import DraftRunner

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# On the CPU the pool's pages are only touched when used, but a bound keeps reports sane.
_CPU_DEFAULT_MAX_TOKENS = 1 << 16
# Largest all-reduce that takes the one-shot path: a decode batch of 64 at hidden 4096 in bf16.
ONE_SHOT_MAX_BYTES = 512 << 10


@dataclass(frozen=True)
class RunnerInfo:
    device: str
    dtype: str
    attention_backend: str
    max_total_num_tokens: int
    max_running_requests: int
    kv_gb: float
    weight_gb: float
    quantization: str | None = None  # of the weights (None: the model dtype)
    kv_cache_dtype: str = ""


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was asked for but no CUDA device is visible")
    return torch.device(name)


def resolve_dtype(name: str, config_dtype: str | None, device: torch.device) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32  # half precision matmuls are slow on most CPUs
    dtype = _DTYPES.get(config_dtype or "", torch.float16)
    return torch.float16 if dtype == torch.float32 else dtype


class ModelRunner:
    # whether decode steps run from CUDA graphs on a GPU (unless --disable-cuda-graph)
    use_cuda_graphs = True

    def __init__(self, args: ServerArgs, config: ModelConfig, tp_rank: int,
                 dist_init_port: int | None = None) -> None:
        self.args = args
        self.config = config
        self.tp_rank = tp_rank
        self.device = resolve_device(args.device)
        if self.device.type == "cuda":
            visible = torch.cuda.device_count()
            if args.ranks_per_node > visible:
                raise RuntimeError(
                    f"--tp-size {args.tp_size} needs {args.ranks_per_node} GPUs on this node "
                    f"(one per rank) but {visible} are visible"
                )
            self.device = torch.device("cuda", tp_rank % args.ranks_per_node)
            torch.cuda.set_device(self.device)
        elif (threads := cpu_threads.threads_per_rank(args.ranks_per_node)) is not None:
            torch.set_num_threads(threads)  # the node's cores shared among its ranks
        if self.device.type == "cpu" and tp_rank == args.local_tp_ranks[0]:
            logger.info("CPU compute threads per rank: %d (OMP_NUM_THREADS overrides), "
                        "GOMP_SPINCOUNT %s", torch.get_num_threads(),
                        os.environ.get("GOMP_SPINCOUNT", "libgomp's default"))
        parallel_state.init_tp_group(
            tp_rank, args.tp_size, self.device, dist_init_port,
            args.dist_init[0] if args.nnodes > 1 else "127.0.0.1", args.ep_size > 1)
        self.dtype = resolve_dtype(args.dtype, config.torch_dtype, self.device)
        torch.manual_seed(args.random_seed or 0)
        self.quantization: str | None = None  # of the weights, once loaded
        self.model = self._load_model()
        # --is-embedding: the model's forward pools its hidden states (srt/layers/pooler.py)
        self.pooling: PoolingConfig | None = None
        if args.is_embedding:
            if not hasattr(self.model, "pooling"):
                raise ValueError(f"--is-embedding: {config.architecture} has no text decoder "
                                 "to pool (Llama-shaped text models only)")
            self.pooling = PoolingConfig.load(args.model_path)
            self.model.pooling = self.pooling.mode
            logger.info("embeddings: %s-token pooling%s", self.pooling.mode,
                        ", normalized" if self.pooling.normalize else "")
        # --enable-lora: the adapters' pool on the device, --lora-paths' adapters loaded
        self.lora: LoraManager | None = None
        if args.enable_lora:
            from srt.lora import manager  # (imported only when LoRA serves)

            self.lora = manager.LoraManager(self.model, config.hf_config, args.max_loras_per_batch,
                                            args.max_lora_rank, tuple(args.lora_target_modules),
                                            self.device, self.dtype, args.lora_eviction_policy)
            for i, spec in enumerate(args.lora_specs):
                self.lora.load(i + 1, spec.name, spec.path)
        if args.enable_custom_all_reduce:
            parallel_state.init_one_shot_all_reduce(ONE_SHOT_MAX_BYTES, self.dtype, self.device)
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        # STANDALONE speculative decoding: the draft model, loaded before the pool is sized
        self.draft: DraftRunner | None = None
        if args.speculative_algorithm == "STANDALONE":
            from srt.model_process import draft_runner

            self.draft = draft_runner.DraftRunner(self)
        elif args.speculative_algorithm in ("EAGLE", "EAGLE3"):
            from srt.model_process.eagle_runner import EagleRunner

            self.draft = EagleRunner(self)
        if self.device.type == "cuda":
            # the model-dtype weights that quantization replaced are free now: give the cached
            # blocks back so that the pool sizing below counts them as free
            torch.cuda.empty_cache()
        self.kv_cache_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, self.dtype)
        self._check_fp8_support()
        # every slot holds its token's KV in the draft's pool too (same slot indices)
        kv_values_per_token = self.kv_values_per_token() + (
            self.draft.kv_values_per_token() if self.draft is not None else 0)
        self.max_total_num_tokens = self._pool_tokens(
            kv_values_per_token * self.kv_cache_dtype.itemsize,
            kv_values_per_token * self.dtype.itemsize)
        self.max_running_requests = args.max_running_requests or min(512, self.max_total_num_tokens)
        # A draft tree's branches read scratch rows (VerifyRows): up to max(top-k, nodes) per
        # request of a batch that drafts.
        depth = args.speculative_tree_depth
        scratch = 0 if not depth else max(args.speculative_eagle_topk or 1,
                                          args.speculative_draft_tokens) * min(
            self.max_running_requests, args.speculative_disable_by_batch_size)
        # (a tree's rows reach up to its depth past the context's last position)
        width = config.context_len + 8 + depth
        self.req_to_token_pool = ReqToTokenPool(
            self.max_running_requests, width, self.device, scratch)
        self.init_pool_and_backend()
        if self.draft is not None:
            self.draft.init_pool_and_backend()

    def kv_values_per_token(self) -> int:
        """K and V values a token holds in this model's pool on this rank (one latent vector
        a layer under multi-head latent attention)."""
        kv = 1 if self.kv_shared() else 2
        return kv * self.config.num_layers * self.model_kv_heads() * self.kv_head_dim()

    def kv_head_dim(self) -> int:
        """The pool's head dimension: the attention layers' (MLA: the latent's)."""
        return self._attention_layers()[0].head_dim

    def kv_shared(self) -> bool:
        return self._attention_layers()[0].kv_shared

    def init_pool_and_backend(self) -> None:
        """The token pool (max_total_num_tokens slots), the attention backends and the CUDA
        graphs; max_total_num_tokens, max_running_requests and req_to_token_pool are set."""
        args, config = self.args, self.config
        self.token_to_kv_pool = TokenToKVPool(
            self.max_total_num_tokens,
            config.num_layers,
            self.model_kv_heads(),
            self.kv_head_dim(),
            self.kv_cache_dtype,
            self.device,
            shared_kv=self.kv_shared(),
        )
        prefill_name, decode_name = resolve_step_backends(
            args.attention_backend, args.prefill_attention_backend,
            args.decode_attention_backend, self.device.type,
            fp8_kv=self.kv_cache_dtype != self.dtype,
            triton_only=not all(a.flashinfer_supported for a in self._attention_layers()))
        self.backend_name = (prefill_name if prefill_name == decode_name
                             else f"{prefill_name} (prefill) + {decode_name} (decode)")
        if "triton" in (prefill_name, decode_name) and self.device.type == "cpu":
            # Must be set before the kernels are defined; Triton has no CPU code generator.
            os.environ["TRITON_INTERPRET"] = "1"
            logger.warning("triton attention on the CPU runs in Triton's interpreter (slow)")
        self.attn_backend = create_step_backends(prefill_name, decode_name, runner=self)
        self.sampler_generator = torch.Generator(device=self.device)
        self.sampler_generator.manual_seed(args.random_seed or 0)
        self.graph_runner: CudaGraphRunner | None = None
        self.prefill_graphs: PrefillGraphRunner | None = None
        if self.device.type == "cuda" and not args.disable_cuda_graph and self.use_cuda_graphs \
                and not args.is_embedding:  # (embeddings never decode)
            if self.attn_backend.supports_cuda_graph:
                self.graph_runner = CudaGraphRunner(
                    self, min(args.cuda_graph_max_bs, self.max_running_requests),
                    self._model_forward,
                )
                self.graph_runner.capture()
            else:
                logger.info("attention backend %s has no CUDA graph support: decoding without",
                            self.backend_name)
        self._init_prefill_graphs()

    def _init_prefill_graphs(self) -> None:
        """PREFILL graphs (srt.model_process.prefill_graph_runner) where --prefill-graph-max-
        tokens asks for them, captured in the decode graphs' memory pool. Only beside decode
        graphs, except on the CPU with the flag set: there the same padded steps run eagerly
        (how the tests check them). Never for a draft model's runner, a target with a draft
        (the draft mirrors the target's fills eagerly) or embeddings."""
        if (getattr(self, "target", None) is not None or self.draft is not None
                or self.pooling is not None):
            return
        tokens = self.args.prefill_graph_max_tokens
        eager = self.graph_runner is None
        if tokens <= 0 or (eager and self.device.type != "cpu"):
            return
        if not prefill_graphs_supported(self):
            logger.info("no prefill graphs: the attention backend (%s) or a layer's window or "
                        "cap does not allow them", self.backend_name)
            return
        graphs = PrefillGraphRunner(self, tokens, self._model_forward, replay=not eager)
        if not eager:
            try:
                self.graph_runner.mempool = graphs.capture(self.graph_runner.mempool)
            except RuntimeError as e:  # e.g. a layer that reads a device value on the host
                torch.cuda.synchronize(self.device)
                logger.warning("prefill graphs could not be captured, fills run eagerly: %s", e)
                return
        self.prefill_graphs = graphs

    def _check_fp8_support(self) -> None:
        """Triton's e4m3 needs compute capability 8.9 (Ada, Hopper) or newer: refuse an e4m3 KV
        cache and FP8 experts (read by Triton kernels) on older GPUs, at start-up."""
        if self.device.type != "cuda" or torch.cuda.get_device_capability(self.device) >= (8, 9):
            return
        experts = any(getattr(m, "fp8", False) is True for m in self.model.modules())
        if self.kv_cache_dtype == torch.float8_e4m3fn or experts:
            what = "--kv-cache-dtype fp8_e4m3" if not experts else "FP8 experts"
            raise RuntimeError(f"{what} needs a GPU of compute capability 8.9 or newer (FP8 e4m3 "
                               f"in Triton); this one is "
                               f"{'.'.join(map(str, torch.cuda.get_device_capability(self.device)))}"
                               "; use --kv-cache-dtype fp8_e5m2 or auto, and for experts an "
                               "unquantized checkpoint")

    def _attention_layers(self) -> list[RadixAttention]:
        return [m for m in self.model.modules() if isinstance(m, RadixAttention)]

    def model_kv_heads(self) -> int:
        """KV heads held by this rank."""
        return self._attention_layers()[0].num_kv_heads

    def num_heads_per_rank(self) -> int:
        return self._attention_layers()[0].num_heads

    def attn_scaling(self) -> float:
        """The softmax scale, the same for every layer (backends plan once per step)."""
        scales = {layer.scaling for layer in self._attention_layers()}
        if len(scales) != 1:
            raise ValueError(f"attention layers disagree on the softmax scale: {scales}")
        return scales.pop()

    def total_weight_bytes(self) -> int:
        """This rank's weights, a speculative draft model's included."""
        return self.weight_bytes + (self.draft.weight_bytes if self.draft is not None else 0)

    def info(self) -> RunnerInfo:
        """What this rank holds; a speculative draft's weights and KV pool are counted in."""
        per_token = self.token_to_kv_pool.bytes_per_token + (
            self.draft.token_to_kv_pool.bytes_per_token if self.draft is not None else 0)
        return RunnerInfo(
            device=str(self.device),
            dtype=str(self.dtype).replace("torch.", ""),
            attention_backend=self.backend_name,
            max_total_num_tokens=self.max_total_num_tokens,
            max_running_requests=self.max_running_requests,
            kv_gb=self.max_total_num_tokens * per_token / 1e9,
            weight_gb=self.total_weight_bytes() / 1e9,
            quantization=self.quantization,
            kv_cache_dtype=str(self.kv_cache_dtype).replace("torch.", ""),
        )

    def _model_class(self) -> type:
        return get_model_class(self.config.architecture)

    def _load_model(self) -> torch.nn.Module:
        cls = self._model_class()
        old = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                model = cls(self.config.hf_config, self.config.context_len)
        finally:
            torch.set_default_dtype(old)
        from srt.layers.quant_config import checkpoint_quant

        # A quantized checkpoint's layers take its layout, also for random weights (dummy)
        ckpt = checkpoint_quant(self.config.path)
        if ckpt is not None and ckpt.is_fp8:
            from srt.layers.fp8 import prepare_fp8_checkpoint

            n = prepare_fp8_checkpoint(model, ckpt.quantized, ckpt.block)
            self.quantization = f"fp8 ({ckpt.method} checkpoint" + (
                f", blocks of {ckpt.block[0]}x{ckpt.block[1]})" if ckpt.block else ")")
            logger.info("FP8 checkpoint (%s): %d layers load in FP8 e4m3",
                        ckpt.method, n)
        elif ckpt is not None and ckpt.method == "gptq":
            from srt.layers.gptq import prepare_gptq_checkpoint

            n = prepare_gptq_checkpoint(model, ckpt.quantized, ckpt.group_size)
            group = "per channel" if ckpt.group_size == -1 else f"group {ckpt.group_size}"
            self.quantization = f"gptq (int4, {group})"
            logger.info("GPTQ checkpoint (%s): %d linear layers load in int4, %s",
                        "gptq_v2" if ckpt.gptq_v2 else "gptq", n, group)
        elif ckpt is not None:
            from srt.layers.awq import prepare_awq_checkpoint

            n = prepare_awq_checkpoint(model, ckpt.quantized, ckpt.group_size)
            self.quantization = f"awq (int4, group {ckpt.group_size})"
            logger.info("AWQ checkpoint: %d linear layers load in int4, group size %d",
                        n, ckpt.group_size)
        if self.args.load_format == "dummy":
            init_dummy_weights(model, seed=self.args.random_seed or 0)
        else:
            model.load_weights(iterate_safetensors(self.config.path))
        if ckpt is not None and ckpt.block is not None:
            from srt.layers.fp8_block import finish_block_fp8_experts

            n = finish_block_fp8_experts(model, self.dtype)
            if n:
                logger.info("block-FP8 experts of %d layers dequantized to %s at load (no "
                            "block-scaled expert kernel yet)", n, str(self.dtype).split(".")[-1])
        if ckpt is not None and ckpt.method == "gptq":
            from srt.layers.gptq import finish_gptq

            finish_gptq(model, ckpt.gptq_v2, ckpt.group_size)  # into AWQ's kernel weight
        if self.args.quantization == "fp8" and self.quantization is None:
            from srt.layers.fp8 import quantize_model_fp8

            n = quantize_model_fp8(model)
            self.quantization = "fp8"
            logger.info("quantization fp8: %d layers in FP8 e4m3 (linear layers: per-channel "
                        "weight scales; on the GPU weight-only up to 16 rows, per-token "
                        "activation scales above; experts: per-channel weight scales, "
                        "activations in the model dtype)", n)
        if self.device.type == "cuda":
            from srt.layers.awq import to_kernel_layout

            to_kernel_layout(model)  # rows along the input axis, for the GPU kernels
        return model.eval()

    def _pool_tokens(self, bytes_per_token: int, model_dtype_bytes_per_token: int) -> int:
        """KV slots: what the memory budget holds at `bytes_per_token`. On the CPU the budget
        is also capped at _CPU_DEFAULT_MAX_TOKENS slots in the model dtype, so an FP8 cache
        still holds more tokens in the same bytes."""
        if self.args.max_total_tokens is not None:
            return self.args.max_total_tokens
        frac = self.args.mem_fraction_static
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = total * frac - (total - free)
            gib = 1 << 30
            logger.info("KV pool budget %.2f GiB: %.2f GiB x %.2f less %.2f GiB in use (tensors "
                        "%.2f GiB, weights %.2f GiB; the rest the CUDA context and libraries)",
                        budget / gib, total / gib, frac, (total - free) / gib,
                        torch.cuda.memory_allocated(self.device) / gib, self.weight_bytes / gib)
        else:
            budget = min(frac * _mem_available(),
                         _CPU_DEFAULT_MAX_TOKENS * model_dtype_bytes_per_token)
        # Every rank must make the same scheduling decisions: all take the smallest pool.
        tokens = parallel_state.min_over_ranks(int(budget // bytes_per_token), self.device)
        if tokens < 16:
            raise RuntimeError(
                f"not enough memory for the KV cache ({budget / 1e9:.2f} GB left after the "
                f"weights); raise --mem-fraction-static or set --max-total-tokens"
            )
        return tokens

    def wants_shared_prefix(self, bs: int) -> bool:
        """Whether a DECODE batch of `bs` requests would use `ForwardBatch.shared_prefix_len`:
        the backend reads it, and the step runs eagerly (graphs are captured without it)."""
        if not getattr(self.attn_backend, "supports_shared_prefix", False) or bs < 2:
            return False
        return self.graph_runner is None or bs > self.graph_runner.max_bs

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """Float32 logits [batch, vocab] of each request's next token."""
        if self.graph_runner is not None and self.graph_runner.can_run(fb):
            return self.graph_runner.replay(fb)
        if self.prefill_graphs is not None and self.prefill_graphs.can_run(fb):
            return self.prefill_graphs.run(fb)
        self.attn_backend.init_forward_metadata(fb)
        with forward_context(fb):
            return self._model_forward(fb)

    def _model_forward(self, fb: ForwardBatch) -> torch.Tensor:
        """The model on a batch whose attention metadata is ready (also what graphs capture)."""
        return self.model(fb)


def _mem_available() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))
