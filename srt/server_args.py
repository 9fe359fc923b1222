"""ServerArgs: the one frozen configuration of a server, and the argparse parser built from it.

Defaults and help live on the fields. Values the HTTP process can settle without importing torch
are resolved once by `resolve()`; device, dtype and attention backend are resolved by the model
process (it owns the device) and reported back in its ready handshake.
Environment variables are read here only.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
from dataclasses import dataclass, field
from typing import Any, get_args

from srt.lora.args import LoraArgs
from srt.speculative_args import SpeculativeArgs

_HEURISTICS = ("lpm", "dfs-weight", "fcfs", "random")


def _f(default: Any, help: str, choices: tuple[str, ...] | None = None) -> Any:
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass(frozen=True)
class ServerArgs(SpeculativeArgs, LoraArgs):
    model_path: str | None = _f(
        None, "Hugging Face model directory. Empty: serve the default SmolLM2-135M-Instruct."
    )
    tokenizer_path: str | None = _f(None, "Tokenizer directory (default: the model path).")
    host: str = _f("127.0.0.1", "Address the HTTP server binds.")
    port: int = _f(30000, "Port of the HTTP server.")
    tp_size: int = _f(1, "Tensor-parallel ranks (one model process each).")
    device: str = _f("auto", "Where the model runs; auto picks cuda when available.",
                     ("auto", "cpu", "cuda"))
    dtype: str = _f(
        "auto",
        "Weight and activation dtype. auto: the checkpoint's dtype on a GPU (float16 if it is "
        "float32), float32 on the CPU.",
        ("auto", "float32", "float16", "bfloat16"),
    )
    load_format: str = _f("auto", "auto/safetensors read the checkpoint; dummy uses random "
                          "weights (benchmarks).", ("auto", "safetensors", "dummy"))
    quantization: str | None = _f(
        None, "Weight quantization. fp8: the linear layers and experts of the language model "
        "quantized to FP8 (e4m3) at load, one scale per output channel; linear layers scale "
        "activations per token (GPU: torch._scaled_mm on Hopper or newer; CPU: dequantized per "
        "product), experts are weight-only (an FP8 checkpoint loads as it is). awq / gptq: the "
        "checkpoint must be AWQ / GPTQ int4 (detected from its quantization_config anyway); "
        "awq_marlin / gptq_marlin (vLLM's and SGLang's names for their Marlin kernels) serve "
        "the same checkpoints on srt's int4 kernels; compressed-tensors: the checkpoint must be "
        "llm-compressor's FP8.",
        ("fp8", "awq", "gptq", "awq_marlin", "gptq_marlin", "compressed-tensors"))
    kv_cache_dtype: str = _f(
        "auto", "Storage dtype of the KV cache. auto: the model dtype. fp8_e4m3 (or fp8) / "
        "fp8_e5m2: one byte per value (the pool holds twice the tokens of bf16), a per-tensor "
        "scale per layer from the checkpoint's k_scale / v_scale when present, else 1.0; every "
        "attention backend reads it (auto picks triton).",
        ("auto", "fp8_e4m3", "fp8_e5m2", "fp8"))
    attention_backend: str = _f(
        "auto", "Attention implementation; auto picks triton on a GPU (its decode measured "
        "faster than flashinfer's; with flashinfer installed, its prefill for EXTEND steps), and "
        "torch on the CPU.", ("auto", "torch", "triton", "flashinfer"))
    prefill_attention_backend: str | None = _f(
        None, "Attention backend of EXTEND/PREFILL steps (default: --attention-backend's).",
        ("torch", "triton", "flashinfer"))
    decode_attention_backend: str | None = _f(
        None, "Attention backend of DECODE steps (default: --attention-backend's).",
        ("torch", "triton", "flashinfer"))
    context_length: int | None = _f(None, "Context length (default: the model's).")
    mem_fraction_static: float = _f(
        0.88, "Fraction of device memory for weights plus KV pool (on the CPU: of free RAM).")
    max_total_tokens: int | None = _f(None, "KV pool size in tokens (overrides the fraction).")
    max_running_requests: int | None = _f(None, "Most requests running at once (rows of "
                                          "req_to_token). Default: min(512, pool size).")
    max_prefill_tokens: int = _f(8192, "Most new tokens in one fill batch (with chunking "
                                 "off, a single longer prompt still runs alone).")
    chunked_prefill_size: int = _f(
        8192, "Most new tokens one fill computes (and at most --max-prefill-tokens): a longer "
        "prompt is computed in chunks over "
        "several fills (its KV kept between them), so running requests keep decoding between "
        "(or, with --enable-mixed-chunk, inside) those fills. -1 turns chunking off.")
    max_fill_tokens_while_decoding: int | None = _f(
        None, "While requests are decoding, a fill computes at most this many new tokens (a "
        "longer prompt is chunked to it, also with chunking off), so a decode step waits for "
        "at most a fill of this size; with none decoding, --chunked-prefill-size applies. "
        "Smaller bounds the streams' longest gap and costs long-prompt throughput (one H100, "
        "Llama-3-8B shape: longest gap 131 ms at 4096 for 0.9% of long-prompt throughput, "
        "73 ms at 2048 for 4.8%). -1: no separate cap. Default: 8192 for MoE models (each "
        "fill reads every expert: fewer, larger fills), 4096 otherwise.")
    min_fill_tokens_while_decoding: int | None = _f(
        None, "While requests are decoding and others wait for room, a fill that would "
        "compute fewer new tokens than this (and does not take every waiting request) waits, "
        "for at most --max-fill-wait-steps decode steps, until more requests fit: every "
        "separate fill round reads the weights again, which for a MoE model (a fill of a few "
        "hundred tokens reaches every expert) costs as much as a decode step. With nothing "
        "waiting beyond the fill, or nothing decoding, a fill never waits. Default: 2048 for "
        "MoE models, 0 (never wait) otherwise.")
    max_fill_wait_steps: int = _f(
        8, "Most decode steps a fill waits under --min-fill-tokens-while-decoding.")
    is_embedding: bool = _f(
        False, "Serve embeddings (/v1/embeddings, /encode): each input's vector pooled from the "
        "model's last hidden states as its sentence-transformers configuration says (default: "
        "the last token's, normalized); the text routes answer 400.")
    # Multi-LoRA serving (SGLang's flag names; srt/lora/)
    enable_lora: bool = _f(
        False, "Serve LoRA adapters (PEFT layout) on the base model: each request names its "
        "adapter (lora_path on /generate, the model field on /v1/*), requests of different "
        "adapters run in one batch. Implied by --lora-paths.")
    lora_paths: tuple[str, ...] = _f(
        (), "Adapters to load at start-up: NAME=PATH, a PATH (named by itself) or a JSON object "
        "with lora_name and lora_path; more with POST /load_lora_adapter.")
    max_loras_per_batch: int = _f(
        8, "Adapters one batch may use (the slots of the adapter pool on the device; adapters "
        "beyond it wait in host memory).")
    max_lora_rank: int | None = _f(
        None, "Largest adapter rank the pool holds (default: the largest of --lora-paths').")
    lora_target_modules: tuple[str, ...] = _f(
        (), "Projections adapters may adapt: q_proj k_proj v_proj o_proj gate_proj up_proj "
        "down_proj, qkv_proj, gate_up_proj or all (default: those of --lora-paths' adapters).")
    max_loaded_loras: int | None = _f(
        None, "Most adapters loaded at once (default: no limit).")
    lora_backend: str = _f(
        "triton", "Kernels of the LoRA products: triton or csgmv (SGLang's names) both run "
        "srt's segmented Triton kernels over the rows grouped by adapter (a torch loop on the "
        "CPU).", ("triton", "csgmv"))
    lora_eviction_policy: str = _f(
        "lru", "The pool slot a step's adapter takes when none is free: lru (the least "
        "recently used) or fifo (the one placed first).", ("lru", "fifo"))
    ep_size: int = _f(
        1, "Expert parallelism: 1 shards every expert of a mixture of experts over the "
        "--tp-size ranks (slices of its intermediate size); equal to --tp-size, each rank "
        "holds its share of the experts whole and computes only those.")
    enable_mixed_chunk: bool = _f(
        False, "Run the running requests' next decode tokens inside each fill step (one forward "
        "carries a prefill chunk and a token of every running request). Off: a decode step "
        "runs between two chunks of a prompt.")
    schedule_heuristic: str = _f("lpm", "Order of the waiting queue.", _HEURISTICS)
    schedule_conservativeness: float = _f(
        1.0, "Scales the share of running requests' remaining tokens reserved at admission; "
        "larger admits fewer requests and retracts less.")
    disable_radix_cache: bool = _f(False, "Turn off prefix matching (same code path).")
    disable_cuda_graph: bool = _f(False, "Run decode steps without CUDA graphs (GPU only; the "
                                  "CPU never uses them).")
    cuda_graph_max_bs: int = _f(256, "Largest decode batch captured in a CUDA graph; larger "
                                "batches run without one.")
    graph_fill_max_tokens: int | None = _f(
        None, "Fills of at most this many new tokens (all requests of the fill together) run "
        "as decode rows, one per token, through the decode CUDA graphs: a short prompt's first "
        "token costs one graph replay instead of an eager forward's launches. 0 turns it off; "
        "default 256 where decode graphs are captured (capped at --cuda-graph-max-bs), else "
        "0. On the CPU a value runs the same rows eagerly.")
    prefill_graph_max_tokens: int = _f(
        0, "PREFILL steps (fills of new prompts, no cached prefix) of up to this many new "
        "tokens replay CUDA graphs captured at start-up for token counts from 512 up (the fill "
        "padded to the next one) instead of launching each kernel: for models of many small "
        "kernels a layer (fine-grained MoE). Triton attention, models without sliding windows "
        "or logit caps. 0 (default) turns it off.")
    random_seed: int | None = _f(None, "Seed of the sampler (default: random).")
    stream_interval: int = _f(1, "Tokens per streamed chunk.")
    served_model_name: str | None = _f(None, "Model name of the OpenAI API (default: the "
                                       "model path).")
    chat_template: str | None = _f(None, "A Jinja chat template file to use instead of the "
                                   "tokenizer's, or a built-in one by name: chatml-tools "
                                   "(chatml with Hermes-style tool calls; used by default for "
                                   "requests with tools when the tokenizer's chatml template "
                                   "cannot render them).")
    tool_call_parser: str = _f("hermes", "How tool calls are read from the text of a chat "
                               "answer with tool_choice auto (the format the chat template "
                               "teaches: hermes/qwen25 for chatml-tools).",
                               ("hermes", "qwen25", "llama3", "mistral"))
    reasoning_parser: str | None = _f(None, "Separate a reasoning model's thinking into "
                                      "reasoning_content on the chat route (default: off).",
                                      ("qwen3", "deepseek-r1"))
    grammar_backend: str = _f(
        "xgrammar", "Compiles regex / JSON-schema / EBNF constraints and masks each step "
        "(README: why xgrammar is the default). outlines (outlines-core) has no EBNF.",
        ("xgrammar", "llguidance", "outlines"))
    constrained_cache_size: int = _f(64, "Compiled regex / JSON-schema / EBNF grammars kept "
                                     "per process (least recently used dropped first).")
    constrained_compile_timeout: float = _f(10.0, "Seconds a regex / JSON schema may take to "
                                            "compile before the request is refused (400).")
    constrained_max_states: int = _f(100000, "Most FSM states a regex / JSON schema may "
                                     "compile to before the request is refused (400; "
                                     "--grammar-backend outlines).")
    constrained_max_grammar_bytes: int = _f(
        256 * 2**20, "Largest compiled grammar (xgrammar: its memory size; llguidance: its "
        "grammar size limit, in bytes of grammar) before the request is refused (400).")
    allowed_local_media_path: str | None = _f(
        None, "Directory under which image_data may name local files (default: no file access).")
    allow_image_urls: bool = _f(False, "Let image_data be an http(s) URL that the server "
                                "fetches (off by default: it reaches any address the server can).")
    enable_custom_all_reduce: bool = _f(False, "Send tensor-parallel all-reduces of up to 512 "
                                        "KiB (decode steps) through a one-shot all-reduce over "
                                        "PyTorch symmetric memory instead of NCCL (on two H200s "
                                        "it measured no faster: 18.2 vs 17.7 us per call).")
    disable_regex_jump_forward: bool = _f(
        False, "Sample every token of a regex / JSON-schema output, instead of appending at "
        "once the text the pattern forces (e.g. a schema's keys).")
    jump_forward_min_tokens: int = _f(
        1, "Jump forward inside a running batch only when it adds at least this many ids (the "
        "batch's next step then computes one row per new id, from a CUDA graph while the rows "
        "fit the largest one).")
    disable_overlap_schedule: bool = _f(
        False, "Run each decode step to the end before launching the next. By default the next "
        "step is launched from the sampled ids on the device while the host reads the step "
        "before and does its work (stop checks, streaming, admission); batches with an FSM "
        "mask or penalties wait for the host first.")
    # Speculative decoding (SGLang's flag names; srt/model_process/speculative/)
    speculative_algorithm: str | None = _f(
        None, "Speculative decoding: NGRAM drafts each request's next tokens from its own "
        "prompt and output (prompt lookup, no extra model), STANDALONE with a smaller model of "
        "the same tokenizer (--speculative-draft-model-path), EAGLE / EAGLE3 with an EAGLE head "
        "over the model's features (Llama-shaped models); the model verifies them in one "
        "step; greedy output is unchanged and sampling keeps the model's distribution "
        "(rejection sampling).",
        ("NGRAM", "STANDALONE", "EAGLE", "EAGLE3"))
    speculative_draft_model_path: str | None = _f(
        None, "Draft model directory: STANDALONE a causal LM of the target's tokenizer, EAGLE / "
        "EAGLE3 an EAGLE head checkpoint; either has its own KV pool over the target's slots.")
    speculative_num_steps: int | None = _f(
        None, "Draft tokens per verification of a draft model (STANDALONE, EAGLE, EAGLE3; "
        "default 3).")
    speculative_eagle_topk: int | None = _f(
        None, "EAGLE / EAGLE3: tokens the head proposes after each draft node; above 1 the "
        "drafts form a tree (the best --speculative-num-draft-tokens - 1 nodes by the head's "
        "path probability), verified in one step. Default 1 (a chain).")
    speculative_num_draft_tokens: int | None = _f(
        None, "Tokens verified per step and request, the last accepted one included (so at "
        "most this minus one draft tokens). Default: 8 for NGRAM, --speculative-num-steps + 1 "
        "for the draft models with top-k 1, steps x top-k + 1 (at most 64) for a tree.")
    speculative_accept_threshold_single: float = _f(
        1.0, "SGLang's relaxed acceptance of a draft token; only 1.0 (exact: the output "
        "distribution is the model's) is supported.")
    speculative_ngram_min_match_window_size: int = _f(
        1, "NGRAM: shortest suffix of a request's tokens looked up in its own tokens.")
    speculative_ngram_max_match_window_size: int = _f(
        12, "NGRAM: longest suffix looked up (the longest one found wins, its latest "
        "occurrence).")
    speculative_ngram_max_bfs_breadth: int = _f(
        1, "NGRAM: above 1, a tree of drafts merged from the continuations of the suffix's "
        "latest occurrences (up to 8), at most this many children a node; 1: one chain.")
    speculative_disable_by_batch_size: int = _f(
        32, "Decode without drafts while this many requests or more run (verifying drafts "
        "costs throughput once a step is no longer bound by reading the weights).")
    speculative_chain: str = _f(
        "auto", "NGRAM: chain the verification steps of eligible batches on the device, each "
        "launched before the host reads the one before (drafts, positions and acceptance "
        "computed there; greedy chains as CUDA graphs), so the host's work overlaps the "
        "device's. auto: on where greedy chains run as CUDA graphs (decode graphs captured, "
        "one rank, no LoRA), so off on the CPU; "
        "off: each verification step waits for the host. Outputs are the same either way.",
        ("auto", "on", "off"))
    skip_warmup: bool = _f(False, "Report ready without first serving two small warm-up "
                           "requests (they compile the fill kernels at start-up instead of in "
                           "the first users' requests).")
    log_level: str = _f("info", "Logging level.", ("debug", "info", "warning", "error"))
    log_stats_interval: float = _f(5.0, "Seconds between stats lines while busy.")
    log_requests: bool = _f(False, "Log each request's body and output text (escaped). Off: "
                            "prompts and outputs are never logged.")

    gc_warning_threshold_secs: float = _f(
        0.1, "Log a warning when one garbage collection pauses a process this many seconds "
        "or more (0: never). Every process freezes what it holds at the end of start-up out "
        "of the collector's reach, so such pauses should be rare.")

    # Failure handling (srt/watchdog.py, srt/http/lifecycle.py)
    watchdog_timeout: float = _f(
        300.0, "Seconds a process may go without progress while it has work (a stalled loop) "
        "before the server dumps every process's stacks and exits as after a crash.")
    shutdown_timeout: float = _f(
        30.0, "On SIGTERM or Ctrl-C: seconds in-flight requests get to finish (new ones are "
        "refused with 503) before the rest are aborted and the server exits.")
    # Several machines (SGLang's flag names; srt/node_hub.py, srt/node_worker.py,
    # srt/managers/node_link.py for the ports and the authentication)
    nnodes: int = _f(1, "Machines the TP ranks are spread over, --tp-size / --nnodes ranks "
                     "each.")
    node_rank: int = _f(0, "This machine's index. Node 0 runs the HTTP server, router and "
                        "detokenizer besides its ranks; another node runs only its ranks.")
    dist_init_addr: str | None = _f(
        None, "HOST:PORT of node 0, the same on every node: the TP group's rendezvous on PORT, "
        "the authenticated node links on PORT+1 and PORT+2.")
    dist_timeout: float = _f(300.0, "Seconds node 0 waits for the other nodes to join (and "
                             "another node waits for node 0 to admit it) before giving up.")
    node_secret_file: str | None = _f(
        None, "File holding the secret every node shares (default: $SRT_NODE_SECRET); each "
        "frame between nodes carries an HMAC-SHA256 under it. Required with --nnodes > 1.")
    node_secret: str | None = field(default=None, repr=False, metadata={"cli": False})
    # Fault injection for tests (srt/faults.py): from $SRT_FAULT only, never a flag.
    fault: str | None = field(default=None, metadata={"cli": False})

    # Operations and security (srt/http/). Keys are never logged or reported.
    api_key: str | None = field(default=None, repr=False, metadata={"help": (
        "Require 'Authorization: Bearer KEY' on every route but --auth-exempt-paths "
        "(default: $SRT_API_KEY; none: no authentication).")})
    admin_api_key: str | None = field(default=None, repr=False, metadata={"help": (
        "Key required on the control routes (/flush_cache, /abort_request); it is also "
        "accepted everywhere else (default: $SRT_ADMIN_API_KEY; none: those routes take "
        "--api-key).")})
    auth_exempt_paths: str = _f("/health,/health_generate,/metrics",
                                "Comma-separated paths served without a key.")
    cors_allow_origins: str | None = _f(None, "Comma-separated origins allowed by CORS ('*': "
                                        "any). None: CORS is off.")
    max_request_body_bytes: int = _f(32 * 2**20, "Largest request body; a larger one is a 413.")
    max_batch_prompts: int = _f(256, "Most prompts in one batch request.")
    max_n: int = _f(128, "Most samples per prompt (n), at most 128.")
    max_top_logprobs: int = _f(20, "Most top logprobs per token (top_logprobs_num, logprobs, "
                               "top_logprobs), at most 20.")
    max_stop_strings: int = _f(16, "Most stop strings (and most stop token ids) per request.")
    max_stop_string_length: int = _f(256, "Longest stop string, in characters.")
    max_regex_length: int = _f(4096, "Longest regex constraint, in characters.")
    max_json_schema_bytes: int = _f(32768, "Largest JSON schema constraint, in bytes of JSON.")
    max_ebnf_bytes: int = _f(32768, "Largest EBNF grammar constraint, in bytes.")
    max_image_bytes: int = _f(20 * 2**20, "Largest image input, in bytes after base64 "
                              "decoding or download.")
    max_image_pixels: int = _f(4096 * 4096, "Largest image input, in pixels (width x height).")
    max_queued_requests: int = _f(1024, "Most requests (samples) the server holds at once, "
                                  "running or waiting; past it a request is a 503 with "
                                  "Retry-After.")

    def resolve(self) -> "ServerArgs":
        """Settle the values that need no device: seed, tokenizer path. Validate ranges."""
        seed = self.random_seed if self.random_seed is not None else random.randrange(1 << 30)
        args = dataclasses.replace(
            self,
            random_seed=seed,
            tokenizer_path=self.tokenizer_path or self.model_path,
            served_model_name=self.served_model_name or self.model_path,
            api_key=self.api_key or os.environ.get("SRT_API_KEY") or None,
            admin_api_key=self.admin_api_key or os.environ.get("SRT_ADMIN_API_KEY") or None,
            fault=self.fault or os.environ.get("SRT_FAULT") or None,
            node_secret=(self.node_secret or _read_node_secret(self.node_secret_file)
                         or os.environ.get("SRT_NODE_SECRET") or None),
        )
        if args.lora_paths and not args.enable_lora:
            args = dataclasses.replace(args, enable_lora=True)
        args.validate()
        if args.enable_lora:
            rank, targets = args.lora_limits()
            args = dataclasses.replace(args, max_lora_rank=rank, lora_target_modules=targets)
        if args.nnodes > 1 and args.node_secret is None:
            raise ValueError("--nnodes > 1 needs a secret shared by every node: set "
                             "SRT_NODE_SECRET or pass --node-secret-file PATH")
        return args

    # Several machines: ranks K * ranks_per_node .. (K + 1) * ranks_per_node - 1 live on node K.
    @property
    def ranks_per_node(self) -> int:
        return self.tp_size // self.nnodes

    def node_of_rank(self, tp_rank: int) -> int:
        return tp_rank // self.ranks_per_node

    @property
    def local_tp_ranks(self) -> range:
        """The TP ranks this node runs."""
        return range(self.node_rank * self.ranks_per_node,
                     (self.node_rank + 1) * self.ranks_per_node)

    @property
    def dist_init(self) -> tuple[str, int]:
        """--dist-init-addr as (host, port); ValueError if malformed."""
        host, sep, port = (self.dist_init_addr or "").rpartition(":")
        if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65533:
            raise ValueError(f"--dist-init-addr must be HOST:PORT with PORT in 1..65533 "
                             f"(PORT+1 and PORT+2 are used too), not {self.dist_init_addr!r}")
        return host.strip("[]"), int(port)

    def validate(self) -> None:
        if self.tp_size < 1:
            raise ValueError("--tp-size must be >= 1")
        if not 0.0 < self.mem_fraction_static < 1.0:
            raise ValueError("--mem-fraction-static must be in (0, 1)")
        if self.max_total_tokens is not None and self.max_total_tokens < 16:
            raise ValueError("--max-total-tokens must be >= 16")
        if self.max_running_requests is not None and self.max_running_requests < 1:
            raise ValueError("--max-running-requests must be >= 1")
        for name in ("graph_fill_max_tokens", "prefill_graph_max_tokens",
                     "min_fill_tokens_while_decoding", "max_fill_wait_steps"):
            if (getattr(self, name) or 0) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, not "
                                 f"{getattr(self, name)}")
        if self.chunked_prefill_size == 0 or self.chunked_prefill_size < -1:
            raise ValueError("--chunked-prefill-size must be >= 1, or -1 (no chunking)")
        cap = self.max_fill_tokens_while_decoding
        if cap is not None and (cap == 0 or cap < -1):
            raise ValueError("--max-fill-tokens-while-decoding must be >= 1, or -1 (no cap)")
        if self.ep_size not in (1, self.tp_size):
            raise ValueError(f"--ep-size must be 1 or --tp-size ({self.tp_size}): experts are "
                             "split over the tensor-parallel ranks")
        if self.is_embedding and self.speculative_algorithm is not None:
            raise ValueError("--is-embedding serves no generated tokens: speculative decoding "
                             "does not apply")
        if self.schedule_conservativeness <= 0:
            raise ValueError("--schedule-conservativeness must be > 0")
        if self.watchdog_timeout <= 0:
            raise ValueError("--watchdog-timeout must be > 0")
        if self.shutdown_timeout < 0:
            raise ValueError("--shutdown-timeout must be >= 0")
        if self.gc_warning_threshold_secs < 0:
            raise ValueError("--gc-warning-threshold-secs must be >= 0 (0: no warnings)")
        if self.nnodes < 1:
            raise ValueError("--nnodes must be >= 1")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank must be in 0..{self.nnodes - 1} (--nnodes "
                             f"{self.nnodes}), not {self.node_rank}")
        if self.nnodes > 1:
            if self.tp_size % self.nnodes:
                raise ValueError(f"--tp-size {self.tp_size} is not a multiple of --nnodes "
                                 f"{self.nnodes}: every node runs tp_size / nnodes ranks")
            if self.dist_init_addr is None:
                raise ValueError("--nnodes > 1 needs --dist-init-addr HOST:PORT (node 0's "
                                 "address, the same on every node)")
            self.dist_init  # noqa: B018 - raises if malformed
            if self.dist_timeout <= 0:
                raise ValueError("--dist-timeout must be > 0")
        self._validate_lora()
        self._validate_speculative()
        if self.fault is not None:
            from srt.faults import FaultSpec

            FaultSpec.parse(self.fault)
        positive = ("max_request_body_bytes", "max_batch_prompts", "max_n", "max_stop_strings",
                    "max_stop_string_length", "max_regex_length", "max_json_schema_bytes",
                    "max_ebnf_bytes", "max_image_bytes", "max_image_pixels", "max_queued_requests",
                    "cuda_graph_max_bs", "stream_interval", "jump_forward_min_tokens")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.max_n > 128:
            raise ValueError("--max-n must be <= 128")
        if not 0 <= self.max_top_logprobs <= 20:
            raise ValueError("--max-top-logprobs must be in [0, 20]")
        for name in ("api_key", "admin_api_key"):
            key = getattr(self, name)
            if key is not None and (not key.strip() or key != key.strip()):
                raise ValueError(f"--{name.replace('_', '-')} must be non-empty, without "
                                 "surrounding spaces")
        if self.allowed_local_media_path is not None and not os.path.isdir(
                self.allowed_local_media_path):
            raise ValueError(f"--allowed-local-media-path {self.allowed_local_media_path!r} is "
                             "not a directory")

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        for f in dataclasses.fields(cls):
            if f.metadata.get("cli") is False:
                continue
            flag = "--" + f.name.replace("_", "-")
            help_ = f.metadata.get("help", "").replace("%", "%%")  # (argparse formats it)
            if f.type in ("bool", bool):
                parser.add_argument(flag, action="store_true", help=help_)
                continue
            if str(f.type).startswith("tuple"):  # a list of values
                parser.add_argument(flag, nargs="*", default=f.default, help=help_)
                continue
            typ = _scalar_type(f.type)
            parser.add_argument(flag, type=typ, default=f.default, help=help_,
                                choices=f.metadata.get("choices"))

    @classmethod
    def from_cli(cls, argv: list[str] | None = None) -> "ServerArgs":
        parser = argparse.ArgumentParser(prog="python -m srt.server")
        cls.add_cli_args(parser)
        ns = parser.parse_args(argv)
        values = {f.name: getattr(ns, f.name) for f in dataclasses.fields(cls)
                  if hasattr(ns, f.name)}
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})


def _read_node_secret(path: str | None) -> str | None:
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            secret = f.read().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--node-secret-file {path!r} cannot be read: {e}") from None
    if not secret:
        raise ValueError(f"--node-secret-file {path!r} is empty")
    return secret


def _scalar_type(annotation: Any) -> type:
    text = annotation if isinstance(annotation, str) else str(annotation)
    for name, typ in (("int", int), ("float", float), ("str", str)):
        if text.startswith(name):
            return typ
    args = [a for a in get_args(annotation) if a is not type(None)]
    return args[0] if args else str


def cache_dir() -> str:
    """Where srt keeps prepared models: $SRT_CACHE_DIR, else ~/.cache/srt."""
    return os.environ.get("SRT_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "srt"
    )
