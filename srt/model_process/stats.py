"""The model process's counters, its `/get_server_info` figures and the periodic stats line."""

from __future__ import annotations

import heapq
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from srt.gc_watch import process_watch
from srt.layers.moe import FusedMoE
from srt.model_process.step_timing import StepTimer

if TYPE_CHECKING:
    from srt.model_process.loop import ModelProcess

logger = logging.getLogger(__name__)


@dataclass
class Counters:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    retracted: int = 0
    mixed_steps: int = 0  # steps of the running batch after jumps inside it
    mixed_fills: int = 0  # fill steps that carried the running requests' decode tokens too
    graph_fills: int = 0  # fill steps run as decode rows (--graph-fill-max-tokens)
    prefill_chunks: int = 0  # fills that computed a chunk of a longer prompt
    overlapped_steps: int = 0  # decode steps launched before the previous one was read
    rounds_cut: int = 0  # decode rounds ended early because the next input was waiting
    fills_waited: int = 0  # decode steps a small fill waited (--min-fill-tokens-while-decoding)
    timer: StepTimer = field(default_factory=StepTimer)
    last_log: float = field(default_factory=time.monotonic)
    generated_at_log: int = 0
    slow_rounds: "SlowRounds" = field(default_factory=lambda: SlowRounds())


@dataclass
class SlowRounds:
    """The longest rounds of the model loop (over `threshold_s`): when (wall clock), how long,
    and what they did, to line up with the stalls clients see. Keeps the `keep` longest."""

    threshold_s: float = 0.1
    keep: int = 50
    count: int = 0
    rounds: list[tuple[float, float, str, int, int]] = field(default_factory=list)

    def note(self, began: float, seconds: float, kind: str, fill_tokens: int,
             running: int) -> None:
        if seconds < self.threshold_s:
            return
        self.count += 1
        heapq.heappush(self.rounds, (seconds, began, kind, fill_tokens, running))
        if len(self.rounds) > self.keep:
            heapq.heappop(self.rounds)

    def snapshot(self) -> dict[str, Any]:
        return {"threshold_ms": self.threshold_s * 1e3, "count": self.count, "longest": [
            {"wall_time": round(b, 4), "ms": round(s * 1e3, 1), "kind": k, "fill_tokens": f,
             "running": n} for s, b, k, f, n in sorted(self.rounds, reverse=True)]}


def stats(p: ModelProcess) -> dict[str, Any]:
    info = p.runner.info()
    c = p.counters
    return {
        "max_total_num_tokens": info.max_total_num_tokens,
        "available_kv_tokens": p.kv.pool.available_size(),
        "evictable_kv_tokens": p.kv.tree.evictable_size(),
        "locked_kv_tokens": p.kv.tree.locked_size(),
        "num_running_reqs": len(p.running),
        "num_waiting_reqs": len(p.waiting),
        "num_prefilling_reqs": sum(r.prefilling for r in p.waiting),
        "num_requests_total": p.arrivals,  # requests received since start
        "cache_hit_rate": c.cached_tokens / max(1, c.prompt_tokens),
        "retracted_reqs": c.retracted,
        "jump_forwards": p.constraints.jumps,
        "jump_forward_tokens": p.constraints.jump_tokens,
        "jump_forward_batch_steps": c.mixed_steps,
        "overlapped_decode_steps": c.overlapped_steps,
        "mixed_fill_steps": c.mixed_fills,
        "decode_rounds_ended_for_input": c.rounds_cut,
        "graph_fill_steps": c.graph_fills,
        "graph_fill_max_tokens": p.graph_fill.max_tokens if not p.graph_fill.off else 0,
        "prefill_graph_steps": 0 if p.runner.prefill_graphs is None
        else p.runner.prefill_graphs.replays,
        "prefill_graph_max_tokens": 0 if p.runner.prefill_graphs is None
        else p.runner.prefill_graphs.max_tokens,
        "slow_rounds": c.slow_rounds.snapshot(),
        "prefill_chunks": c.prefill_chunks,
        "chunked_prefill_size": p.chunk_size or -1,
        "max_fill_tokens_while_decoding": p.fill_cap,
        "min_fill_tokens_while_decoding": p.fill_wait.min_tokens,
        "fill_wait_steps": c.fills_waited,
        "overlap_schedule": p.overlap,
        "max_running_requests": info.max_running_requests,
        "device": info.device,
        "dtype": info.dtype,
        "quantization": info.quantization,
        "kv_cache_dtype": info.kv_cache_dtype,
        "attention_backend": info.attention_backend,
        "context_length": p.config.context_len,
        "tp_size": p.args.tp_size,
        "ep_size": p.args.ep_size,
        # --enable-lora: the pool's limits and the adapters each rank holds (None: LoRA off)
        "lora": p.runner.lora.info() if p.runner.lora is not None else None,
        # a mixture of experts: the experts each rank holds (whole with --ep-size, else slices)
        "experts_per_rank": next((m.local for m in p.runner.model.modules()
                                  if isinstance(m, FusedMoE)), None),
        # Each rank holds this many tokens of KV for its own heads.
        "kv_pool_per_rank": {
            "tokens": info.max_total_num_tokens,
            "kv_heads": p.runner.model_kv_heads(),
            "gb": round(info.kv_gb, 4),
        },
        "speculative": p.spec.snapshot() if p.spec is not None else None,
        "decode_step_times": c.timer.snapshot(),
        "heap": p.heap.stats(),
        "gc": watch.stats() if (watch := process_watch()) is not None else {},
    }


def maybe_log(p: ModelProcess) -> None:
    """Rank 0, every --log-stats-interval seconds while busy: one line of load figures."""
    c = p.counters
    now = time.monotonic()
    if p.tp_rank != 0 or now - c.last_log < p.args.log_stats_interval:
        return
    generated = p.output.generated - c.generated_at_log
    if p.running or p.waiting or generated:
        total = p.runner.max_total_num_tokens
        used = total - p.kv.pool.available_size()
        logger.info(
            "running=%d waiting=%d kv_used=%.1f%% (%d/%d tokens, %d evictable) "
            "cache_hit_rate=%.1f%% gen_throughput=%.1f tok/s",
            len(p.running), len(p.waiting), 100.0 * used / total, used, total,
            p.kv.tree.evictable_size(), 100.0 * c.cached_tokens / max(1, c.prompt_tokens),
            generated / (now - c.last_log),
        )
    c.generated_at_log = p.output.generated
    c.last_log = now
