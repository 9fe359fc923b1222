"""Capacity model: how many replicas meet a latency target, by routing policy.

    python benchmarks/capacity.py --curves serving.json --rate 40 \\
        --mix "1:256:256,0.2:8192:128" --prefix-share 0.5 --tenants 8 \\
        --ttft-p99-ms 2000 --itl-p99-ms 100 --policy both --out capacity.json

Input: one replica's measured curves, from one or more JSON files of either shape:

- `bench_serving.py` output (`{"runs": [...], ...}`). Each run needs `request_rate`,
  `out_tok_per_s`, `ttft_ms_p50`, `ttft_ms_p99`, `itl_ms_p50`, `itl_ms_p99`; it may carry
  `tpot_ms_p50` / `tpot_ms_mean` / `itl_ms_mean` (used for the decode step, below), `req_per_s`
  (the rate of an all-at-once run, whose `request_rate` is Infinity), and `input_tokens` /
  `completed`; a long-mix file's top-level `long_input_len` with the runs' `long_ttft_ms_p50`.
  The server's `max_total_num_tokens` is the default prefix-cache capacity.
- a plain curve file, for synthetic curves: `{"points": [{"rate", "ttft_p50_ms", "ttft_p99_ms",
  "itl_p50_ms", "itl_p99_ms", "out_tok_per_s"}, optionally "step_ms", "itl_mean_ms"], ...],
  "prefill_tok_per_s": P, optionally "cache_tokens": C}`.

What the simulation derives from the curves (one replica, one GPU):

- Prefill speed P (tokens/s): the plain file's value, or `--prefill-tok-per-s`; from bench_serving
  runs the best of prompt tokens / TTFT p50 (the long prompts' TTFT in a long-mix file). TTFT
  includes queueing and HTTP, so this estimate is low: the model is pessimistic about prefill.
- Decode step time as a function of the batch size n. Each measured point gives a step time (TPOT
  p50 where measured, since a stream may coalesce tokens and make the inter-chunk p50 near zero;
  else ITL p50) and, by Little's law, the number of streams decoding at once (output tok/s x the
  mean gap per token). Between points: linear, made non-decreasing; below the smallest batch: that
  step; above the largest: the step grows in proportion to n (decode throughput stays at the
  largest measured one).
The measured TTFT / ITL percentiles are printed beside the prediction, not fitted.

The simulation (discrete events, `random.Random(seed)`): Poisson arrivals at the total rate, each
request drawing a (prompt, output) class from the mix by weight and a tenant uniformly; a fraction
`prefix_share` of its prompt is that tenant's shared system prompt (one prefix per tenant and
shared length). Rate only scales the same arrival sequence, so runs at different rates, replica
counts and policies see the same requests.

- Gateway: `round_robin`, or `cache_aware` as SGLang's gateway does it. The router keeps, per
  replica, an LRU set of the tenant prefixes it sent there (capacity in tokens). When the load
  (requests in flight) is imbalanced, max - min > `balance_abs_threshold` and max >
  min x `balance_rel_threshold`, it sends the request to the least-loaded replica; otherwise to
  the least-loaded replica holding the prefix when the prefix's share of the prompt is above
  `cache_threshold`, else to the replica with the smallest prefix set (ties in turn).
- Replica: one GPU running a prefill-first scheduler. When requests wait it prefills them as one
  batch (up to `max_prefill_tokens`, at least one request) taking uncached tokens / P seconds: a
  prompt whose tenant prefix is in the replica's own LRU cache pays only for the rest. The first
  token comes at the end of that batch (TTFT). Otherwise it runs decode steps of step(n) for its
  n running requests; a request finishes after its output tokens. A gap between two tokens of a
  stream (ITL) therefore includes any prefill that ran between them.
- Replicas needed: the smallest count, from the count whose utilization (best case: every prefix
  cached) is below 1 up to `--max-replicas`, whose TTFT p99 and ITL p99 meet the target. A target
  below the unloaded floor (the prefill of the p99 prompt, or one decode step) is reported as not
  reachable without simulating.

What it ignores: KV-pool limits on running requests (no retraction, no admission limit), chunked
and mixed prefill (a prompt is prefilled whole; the prefill-first order is SGLang's default),
attention cost growing with context length beyond what the measured mix had (measure the curve
with a mix like the target's), the prefill rate varying with batch size, HTTP and tokenizer time,
cache space taken by running requests, prefix sharing beyond the tenant prefix, tenant popularity
skew, replica failures and warm-up, and the router's view of a cache ever differing from the
replica's except through its own LRU capacity. All requests count towards the percentiles,
including the first ones on cold caches.
"""

from __future__ import annotations

import argparse
import bisect
import heapq
import json
import math
import random
import sys
from collections import OrderedDict, deque
from dataclasses import asdict, dataclass
from typing import Any, Sequence

POLICIES = ("round_robin", "cache_aware")

# ---------------------------------------------------------------------------------------------
# Curves


@dataclass(frozen=True)
class CurvePoint:
    """One replica measured at one request rate."""

    rate: float  # requests/s offered (achieved, for an all-at-once run)
    out_tok_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    step_ms: float  # one decode step at this load
    streams: float  # requests decoding at once at this load (Little's law)


@dataclass(frozen=True)
class ReplicaCurve:
    """Measured points sorted by rate, the prefill speed, and the prefix-cache capacity."""

    points: tuple[CurvePoint, ...]
    prefill_tok_per_s: float
    cache_tokens: int | None  # None: unlimited
    sources: tuple[str, ...]
    prefill_overhead_ms: float = 0.0  # fixed cost of one prefill batch (a fully cached prompt)


def _point(rate: float, out_tok_per_s: float, ttft: tuple[float, float], itl: tuple[float, float],
           step_ms: float, mean_gap_ms: float) -> CurvePoint:
    if not (rate > 0 and out_tok_per_s > 0 and step_ms > 0):
        raise ValueError(f"curve point needs a positive rate, throughput and step: rate={rate} "
                         f"out_tok_per_s={out_tok_per_s} step_ms={step_ms}")
    streams = max(1.0, out_tok_per_s * mean_gap_ms / 1e3)
    return CurvePoint(rate, out_tok_per_s, ttft[0], ttft[1], itl[0], itl[1], step_ms, streams)


def _points_from_bench(doc: dict[str, Any]) -> list[CurvePoint]:
    points = []
    for run in doc["runs"]:
        if not run.get("completed"):
            continue
        rate = run["request_rate"]
        if math.isinf(rate):
            rate = run["req_per_s"]
        step = run.get("tpot_ms_p50", run["itl_ms_p50"])
        gap = run.get("tpot_ms_mean", run.get("itl_ms_mean", step))
        points.append(_point(rate, run["out_tok_per_s"], (run["ttft_ms_p50"], run["ttft_ms_p99"]),
                             (run["itl_ms_p50"], run["itl_ms_p99"]), step, gap))
    return points


def _prefill_estimate_from_bench(doc: dict[str, Any]) -> float | None:
    """Prompt tokens over TTFT p50, best over runs: a lower bound on the prefill speed."""
    best = None
    for run in doc["runs"]:
        rates = []
        if run.get("completed") and run.get("input_tokens") and run.get("ttft_ms_p50"):
            rates.append(run["input_tokens"] / run["completed"] / (run["ttft_ms_p50"] / 1e3))
        if doc.get("long_input_len") and run.get("long_ttft_ms_p50"):
            rates.append(doc["long_input_len"] / (run["long_ttft_ms_p50"] / 1e3))
        for r in rates:
            if r > 0 and math.isfinite(r):
                best = r if best is None else max(best, r)
    return best


def _points_from_plain(doc: dict[str, Any]) -> list[CurvePoint]:
    points = []
    for p in doc["points"]:
        step = p.get("step_ms", p["itl_p50_ms"])
        points.append(_point(p["rate"], p["out_tok_per_s"], (p["ttft_p50_ms"], p["ttft_p99_ms"]),
                             (p["itl_p50_ms"], p["itl_p99_ms"]), step,
                             p.get("itl_mean_ms", step)))
    return points


def curve_from_docs(docs: Sequence[tuple[str, dict[str, Any]]],
                    prefill_tok_per_s: float | None = None,
                    cache_tokens: int | None = None,
                    prefill_overhead_ms: float | None = None) -> ReplicaCurve:
    """Merge the points of several parsed files (name, document) into one replica's curve.

    Explicit arguments win over the files; explicit values in plain files must agree; bench
    estimates of the prefill speed are lower bounds, so the largest is kept. Raises ValueError
    on an unknown shape, no points, or no prefill speed.
    """
    points: list[CurvePoint] = []
    explicit_prefill: set[float] = set()
    estimates: list[float] = []
    caches: list[int] = []
    overheads: list[float] = []
    for name, doc in docs:
        if "points" in doc:
            points += _points_from_plain(doc)
            if "prefill_overhead_ms" in doc:
                overheads.append(float(doc["prefill_overhead_ms"]))
            if "prefill_tok_per_s" in doc:
                explicit_prefill.add(float(doc["prefill_tok_per_s"]))
            if doc.get("cache_tokens") is not None:
                caches.append(int(doc["cache_tokens"]))
        elif "runs" in doc:
            points += _points_from_bench(doc)
            est = _prefill_estimate_from_bench(doc)
            if est is not None:
                estimates.append(est)
            pool = (doc.get("server") or {}).get("max_total_num_tokens")
            if pool:
                caches.append(int(pool))
        else:
            raise ValueError(f"{name}: neither bench_serving output ('runs') nor a curve "
                             "('points')")
    if not points:
        raise ValueError("no measured points in the curve files")
    if len(explicit_prefill) > 1:
        raise ValueError(f"curve files disagree on prefill_tok_per_s: {sorted(explicit_prefill)}")
    if prefill_tok_per_s is None:
        prefill_tok_per_s = next(iter(explicit_prefill), max(estimates, default=None))
    if not prefill_tok_per_s or prefill_tok_per_s <= 0:
        raise ValueError("no prefill speed: give prefill_tok_per_s or --prefill-tok-per-s")
    if cache_tokens is None and caches:
        cache_tokens = min(caches)
    if prefill_overhead_ms is None:
        prefill_overhead_ms = max(overheads, default=0.0)
    if prefill_overhead_ms < 0:
        raise ValueError("prefill_overhead_ms must be >= 0")
    return ReplicaCurve(tuple(sorted(points, key=lambda p: p.rate)), float(prefill_tok_per_s),
                        cache_tokens, tuple(name for name, _ in docs), prefill_overhead_ms)


def load_curve(paths: Sequence[str], prefill_tok_per_s: float | None = None,
               cache_tokens: int | None = None,
               prefill_overhead_ms: float | None = None) -> ReplicaCurve:
    """Read curve files (bench_serving output or plain curves; see the module docstring)."""
    docs = []
    for path in paths:
        with open(path) as f:
            docs.append((path, json.load(f)))  # bench_serving writes Infinity for rate inf
    return curve_from_docs(docs, prefill_tok_per_s, cache_tokens, prefill_overhead_ms)


class DecodeStepModel:
    """Decode step time (ms) as a function of the batch size, from the curve's points."""

    def __init__(self, points: Sequence[CurvePoint]) -> None:
        pairs = sorted((p.streams, p.step_ms) for p in points)
        self.streams = [n for n, _ in pairs]
        self.steps = []
        for _, s in pairs:  # a bigger batch is never faster; a dip is measurement noise
            self.steps.append(max(s, self.steps[-1]) if self.steps else s)
        self._memo: dict[int, float] = {}

    def step_ms(self, n: int) -> float:
        if n not in self._memo:
            self._memo[n] = self._interp(float(n))
        return self._memo[n]

    def _interp(self, n: float) -> float:
        ns, ss = self.streams, self.steps
        if n <= ns[0]:
            return ss[0]
        if n >= ns[-1]:
            return ss[-1] * n / ns[-1]
        i = bisect.bisect_right(ns, n)
        frac = (n - ns[i - 1]) / (ns[i] - ns[i - 1])
        return ss[i - 1] + frac * (ss[i] - ss[i - 1])

    def min_ms_per_token(self) -> float:
        """The cheapest decode token: step/n is monotone on each linear piece, so a breakpoint."""
        return min(s / n for n, s in zip(self.streams, self.steps))


# ---------------------------------------------------------------------------------------------
# Workload


@dataclass(frozen=True)
class MixClass:
    weight: float
    prompt_len: int
    output_len: int


@dataclass(frozen=True)
class Workload:
    """Total request rate, length mix, and the per-tenant shared system prompt."""

    rate: float  # requests/s over all replicas
    mix: tuple[MixClass, ...]
    prefix_share: float = 0.0  # fraction of each prompt that is its tenant's system prompt
    tenants: int = 1
    num_requests: int = 5000
    seed: int = 0

    def shared_len(self, c: MixClass) -> int:
        return int(round(self.prefix_share * c.prompt_len))


def parse_mix(text: str) -> tuple[MixClass, ...]:
    """"w:prompt:output,..." -> classes. Raises ValueError on a malformed or empty mix."""
    classes = []
    for item in text.split(","):
        parts = item.strip().split(":")
        if len(parts) != 3:
            raise ValueError(f"mix item {item!r} is not weight:prompt_len:output_len")
        c = MixClass(float(parts[0]), int(parts[1]), int(parts[2]))
        if c.weight <= 0 or c.prompt_len < 1 or c.output_len < 1:
            raise ValueError(f"mix item {item!r} needs weight > 0 and lengths >= 1")
        classes.append(c)
    if not classes:
        raise ValueError("empty mix")
    return tuple(classes)


@dataclass(frozen=True)
class Request:
    arrival: float  # seconds
    prompt_len: int
    output_len: int
    shared_len: int  # leading tokens that are the tenant's system prompt
    prefix_key: tuple[int, int] | None  # (tenant, shared_len); None without a shared part


def make_requests(w: Workload) -> list[Request]:
    """The arrival sequence: the same draws for every rate (the rate only scales the gaps)."""
    if w.rate <= 0 or w.tenants < 1 or not 0.0 <= w.prefix_share <= 1.0:
        raise ValueError("workload needs rate > 0, tenants >= 1 and 0 <= prefix_share <= 1")
    rng = random.Random(w.seed)
    cum, total = [], 0.0
    for c in w.mix:
        total += c.weight
        cum.append(total)
    t, out = 0.0, []
    for _ in range(w.num_requests):
        t += rng.expovariate(1.0) / w.rate
        c = w.mix[min(bisect.bisect_right(cum, rng.random() * total), len(w.mix) - 1)]
        tenant = rng.randrange(w.tenants)
        shared = w.shared_len(c)
        out.append(Request(t, c.prompt_len, c.output_len, shared,
                           (tenant, shared) if shared > 0 else None))
    return out


# ---------------------------------------------------------------------------------------------
# Simulation


@dataclass(frozen=True)
class SimConfig:
    """Scheduler and gateway knobs; the thresholds default to the gateway's current defaults."""

    max_prefill_tokens: int = 16384
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5


class PrefixLRU:
    """Tenant prefixes held by one replica (or the router's view of it), least recent first.

    Total size stays <= capacity tokens (None: unlimited); a prefix larger than the capacity
    is never kept.
    """

    def __init__(self, capacity: int | None) -> None:
        self.capacity = capacity
        self.entries: OrderedDict[tuple[int, int], int] = OrderedDict()
        self.size = 0

    def __contains__(self, key: tuple[int, int]) -> bool:
        return key in self.entries

    def touch(self, key: tuple[int, int], tokens: int) -> None:
        if key in self.entries:
            self.entries.move_to_end(key)
            return
        if self.capacity is not None and tokens > self.capacity:
            return
        self.entries[key] = tokens
        self.size += tokens
        while self.capacity is not None and self.size > self.capacity:
            _, freed = self.entries.popitem(last=False)
            self.size -= freed


@dataclass
class SimStats:
    ttft_ms: list[float]
    itl_ms: list[tuple[float, float]]  # (gap, how many tokens had it)
    prefix_requests: int = 0
    prefix_hits: int = 0


class Replica:
    """One GPU: prefill-first, whole-prompt prefill batches, decode steps from the curve.

    `advance_to(t)` commits every piece of work that starts at or before t (a step in progress
    at t runs to its end); `submit(req)` must follow `advance_to(req.arrival)`.
    """

    def __init__(self, decode: DecodeStepModel, prefill_tok_per_s: float,
                 cache_tokens: int | None, cfg: SimConfig, stats: SimStats,
                 prefill_overhead_s: float = 0.0) -> None:
        self.decode = decode
        self.prefill_tok_per_s = prefill_tok_per_s
        self.prefill_overhead_s = prefill_overhead_s
        self.cfg = cfg
        self.stats = stats
        self.cache = PrefixLRU(cache_tokens)
        self.clock = 0.0  # when the committed work ends
        self.waiting: deque[Request] = deque()
        self.running: list[int] = []  # heap of the decode step index at which each finishes
        self.steps = 0
        self.synced_at = 0.0  # last decode step's end: the last token of the old streams
        self.fresh: list[tuple[int, float]] = []  # (count, prefill end) since that step

    @property
    def load(self) -> int:
        return len(self.waiting) + len(self.running)

    def submit(self, req: Request) -> None:
        self.waiting.append(req)

    def advance_to(self, t: float) -> None:
        while self.clock <= t:
            if self.waiting:
                self._prefill()
            elif self.running:
                self._decode(t)
            else:
                self.clock = t
                return

    def _uncached(self, req: Request) -> int:
        hit = req.prefix_key is not None and req.prefix_key in self.cache
        return max(1, req.prompt_len - req.shared_len) if hit else req.prompt_len

    def _prefill(self) -> None:
        batch, tokens = [], 0
        while self.waiting:
            n = self._uncached(self.waiting[0])
            if batch and tokens + n > self.cfg.max_prefill_tokens:
                break
            req = self.waiting.popleft()
            if req.prefix_key is not None:
                self.stats.prefix_requests += 1
                self.stats.prefix_hits += int(n < req.prompt_len)
                self.cache.touch(req.prefix_key, req.shared_len)
            batch.append(req)
            tokens += n
        self.clock += self.prefill_overhead_s + tokens / self.prefill_tok_per_s
        joined = 0
        for req in batch:
            self.stats.ttft_ms.append((self.clock - req.arrival) * 1e3)
            if req.output_len > 1:  # the prefill made the first token
                heapq.heappush(self.running, self.steps + req.output_len - 1)
                joined += 1
        if joined:
            self.fresh.append((joined, self.clock))

    def _decode(self, t: float) -> None:
        n = len(self.running)
        step = self.decode.step_ms(n) / 1e3
        until_finish = self.running[0] - self.steps
        fit = math.inf if math.isinf(t) else math.floor((t - self.clock) / step)
        j = max(1, min(until_finish, fit))  # no arrival or finish inside these j steps
        first_end = self.clock + step
        n_old = n - sum(c for c, _ in self.fresh)
        if n_old:
            self.stats.itl_ms.append(((first_end - self.synced_at) * 1e3, n_old))
        for count, ended in self.fresh:
            self.stats.itl_ms.append(((first_end - ended) * 1e3, count))
        if j > 1:
            self.stats.itl_ms.append((step * 1e3, n * (j - 1)))
        self.clock += j * step
        self.steps += j
        self.synced_at = self.clock
        self.fresh = []
        while self.running and self.running[0] <= self.steps:
            heapq.heappop(self.running)


class RoundRobinRouter:
    def __init__(self, replicas: int) -> None:
        self.replicas = replicas
        self.next = 0

    def pick(self, req: Request, loads: list[int]) -> int:
        i = self.next
        self.next = (i + 1) % self.replicas
        return i


class CacheAwareRouter:
    """SGLang's gateway's cache-aware policy over per-replica LRU sets of tenant prefixes."""

    def __init__(self, replicas: int, cache_tokens: int | None, cfg: SimConfig) -> None:
        self.trees = [PrefixLRU(cache_tokens) for _ in range(replicas)]
        self.cfg = cfg
        self.next = 0  # turn among equally small trees

    def pick(self, req: Request, loads: list[int]) -> int:
        lo, hi = min(loads), max(loads)
        if hi - lo > self.cfg.balance_abs_threshold and hi > lo * self.cfg.balance_rel_threshold:
            i = loads.index(lo)
        else:
            i = self._by_cache(req, loads)
        if req.prefix_key is not None:
            self.trees[i].touch(req.prefix_key, req.shared_len)
        return i

    def _by_cache(self, req: Request, loads: list[int]) -> int:
        key = req.prefix_key
        holders = [i for i, tree in enumerate(self.trees) if key is not None and key in tree]
        if holders and req.shared_len / req.prompt_len > self.cfg.cache_threshold:
            return min(holders, key=lambda i: loads[i])
        k = len(self.trees)
        smallest = min(tree.size for tree in self.trees)
        for step in range(k):
            i = (self.next + step) % k
            if self.trees[i].size == smallest:
                self.next = (i + 1) % k
                return i
        raise AssertionError("unreachable: some tree has the smallest size")


@dataclass(frozen=True)
class SimResult:
    policy: str
    replicas: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    hit_rate: float  # requests whose tenant prefix was cached, over those that have one
    ttft_mean_ms: float = math.nan
    meets: bool = False


def weighted_percentile(samples: Sequence[tuple[float, float]], q: float) -> float:
    """The smallest value whose cumulative weight reaches q% (q in [0, 100]) of the total.

    With integer counts as weights this is the nearest-rank percentile; nan when empty.
    """
    total = sum(w for _, w in samples)
    if total <= 0:
        return math.nan
    seen = 0.0
    for value, weight in sorted(samples):
        seen += weight
        if seen >= q / 100 * total:
            return value
    return max(v for v, _ in samples)  # float rounding left the last bit of weight short


def simulate(curve: ReplicaCurve, workload: Workload, policy: str, replicas: int,
             cfg: SimConfig = SimConfig(), requests: list[Request] | None = None) -> SimResult:
    """Run the workload through `replicas` replicas behind `policy`; all requests count."""
    decode = DecodeStepModel(curve.points)
    stats = SimStats([], [])
    pool = [Replica(decode, curve.prefill_tok_per_s, curve.cache_tokens, cfg, stats,
                    curve.prefill_overhead_ms / 1e3) for _ in range(replicas)]
    if policy == "round_robin":
        router: RoundRobinRouter | CacheAwareRouter = RoundRobinRouter(replicas)
    elif policy == "cache_aware":
        router = CacheAwareRouter(replicas, curve.cache_tokens, cfg)
    else:
        raise ValueError(f"unknown policy {policy!r}; one of {POLICIES}")
    for req in requests if requests is not None else make_requests(workload):
        for r in pool:  # the router reads every replica's load at this instant
            r.advance_to(req.arrival)
        pool[router.pick(req, [r.load for r in pool])].submit(req)
    for r in pool:
        r.advance_to(math.inf)
    ttft = [(x, 1.0) for x in stats.ttft_ms]
    hit_rate = stats.prefix_hits / stats.prefix_requests if stats.prefix_requests else 0.0
    return SimResult(policy, replicas, weighted_percentile(ttft, 50), weighted_percentile(ttft, 99),
                     weighted_percentile(stats.itl_ms, 50), weighted_percentile(stats.itl_ms, 99),
                     hit_rate, sum(stats.ttft_ms) / len(stats.ttft_ms) if stats.ttft_ms
                     else math.nan)


# ---------------------------------------------------------------------------------------------
# Search


@dataclass(frozen=True)
class Target:
    ttft_p99_ms: float
    itl_p99_ms: float

    def met_by(self, r: SimResult) -> bool:
        # nan (no decode gaps at all: every output is one token) meets any ITL target
        itl_ok = math.isnan(r.itl_p99_ms) or r.itl_p99_ms <= self.itl_p99_ms
        return r.ttft_p99_ms <= self.ttft_p99_ms and itl_ok


@dataclass(frozen=True)
class Prediction:
    policy: str
    replicas: int | None  # None: not reachable within max_replicas
    tried: tuple[SimResult, ...]
    first_tried: int  # fewer replicas cannot keep up even with every prefix cached
    reason: str


def unloaded_floor(curve: ReplicaCurve, workload: Workload) -> tuple[float, float]:
    """(TTFT p99, ITL) of an idle replica with every prefix cached: no target can beat these."""
    prefill = [(max(1, c.prompt_len - workload.shared_len(c)) / curve.prefill_tok_per_s * 1e3
                + curve.prefill_overhead_ms, c.weight) for c in workload.mix]
    return weighted_percentile(prefill, 99), DecodeStepModel(curve.points).step_ms(1)


def min_replicas(curve: ReplicaCurve, workload: Workload) -> int:
    """Smallest count whose utilization is below 1 with every prefix cached (best case)."""
    total = sum(c.weight for c in workload.mix)
    token_s = DecodeStepModel(curve.points).min_ms_per_token() / 1e3
    # (the fixed prefill cost is shared by a batch: left out of this best case)
    per_req_s = sum(c.weight / total * (
        max(1, c.prompt_len - workload.shared_len(c)) / curve.prefill_tok_per_s
        + (c.output_len - 1) * token_s) for c in workload.mix)
    return math.floor(workload.rate * per_req_s) + 1


def predict(curve: ReplicaCurve, workload: Workload, target: Target, policy: str,
            max_replicas: int, cfg: SimConfig = SimConfig()) -> Prediction:
    """Smallest replica count in [min_replicas, max_replicas] meeting the target, or None."""
    floor_ttft, floor_itl = unloaded_floor(curve, workload)
    lo = min_replicas(curve, workload)
    limit = f"not reachable within --max-replicas {max_replicas}"
    if floor_ttft > target.ttft_p99_ms or floor_itl > target.itl_p99_ms:
        return Prediction(policy, None, (), lo, f"{limit}: the target is below the unloaded "
                          f"floor (TTFT p99 {floor_ttft:.1f} ms, ITL {floor_itl:.2f} ms)")
    if lo > max_replicas:
        return Prediction(policy, None, (), lo, f"{limit}: keeping up needs at least {lo}")
    requests = make_requests(workload)
    tried = []
    for k in range(lo, max_replicas + 1):
        r = simulate(curve, workload, policy, k, cfg, requests)
        r = SimResult(**{**asdict(r), "meets": target.met_by(r)})
        tried.append(r)
        if r.meets:
            return Prediction(policy, k, tuple(tried), lo, "meets the target")
    return Prediction(policy, None, tuple(tried), lo, limit)


# ---------------------------------------------------------------------------------------------
# CLI


def _table(rows: list[dict[str, Any]], cols: list[str]) -> str:
    cells = [[f"{r[c]:.4g}" if isinstance(r[c], float) else str(r[c]) for c in cols] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(cols)]
    lines = [" | ".join(c.rjust(w) for c, w in zip(cols, widths))]
    lines += [" | ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--curves", nargs="+", required=True, help="bench_serving JSONs or curve files")
    p.add_argument("--rate", type=float, required=True, help="total requests/s")
    p.add_argument("--mix", required=True, help='"weight:prompt_len:output_len,..."')
    p.add_argument("--prefix-share", type=float, default=0.0,
                   help="fraction of each prompt that is its tenant's shared system prompt")
    p.add_argument("--tenants", type=int, default=1)
    p.add_argument("--ttft-p99-ms", type=float, required=True)
    p.add_argument("--itl-p99-ms", type=float, required=True)
    p.add_argument("--policy", choices=[*POLICIES, "both"], default="both")
    p.add_argument("--max-replicas", type=int, default=16)
    p.add_argument("--num-requests", type=int, default=5000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prefill-tok-per-s", type=float, default=None,
                   help="override the curve's prefill speed")
    p.add_argument("--cache-tokens", type=int, default=None,
                   help="prefix-cache capacity per replica (default: the curve's)")
    p.add_argument("--prefill-overhead-ms", type=float, default=None,
                   help="fixed cost of one prefill batch, e.g. the TTFT of a fully cached "
                   "prompt on an idle replica (default: the curve's, else 0)")
    p.add_argument("--max-prefill-tokens", type=int, default=SimConfig.max_prefill_tokens)
    p.add_argument("--cache-threshold", type=float, default=SimConfig.cache_threshold)
    p.add_argument("--balance-abs-threshold", type=int, default=SimConfig.balance_abs_threshold)
    p.add_argument("--balance-rel-threshold", type=float,
                   default=SimConfig.balance_rel_threshold)
    p.add_argument("--out", default=None, help="write the prediction as JSON")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    curve = load_curve(a.curves, a.prefill_tok_per_s, a.cache_tokens, a.prefill_overhead_ms)
    workload = Workload(a.rate, parse_mix(a.mix), a.prefix_share, a.tenants, a.num_requests, a.seed)
    target = Target(a.ttft_p99_ms, a.itl_p99_ms)
    cfg = SimConfig(a.max_prefill_tokens, a.cache_threshold, a.balance_abs_threshold,
                    a.balance_rel_threshold)
    print(f"measured curve (prefill {curve.prefill_tok_per_s:.0f} tok/s + "
          f"{curve.prefill_overhead_ms:.1f} ms per batch, "
          f"prefix cache {curve.cache_tokens or 'unlimited'} tokens per replica):")
    print(_table([asdict(p) for p in curve.points], list(CurvePoint.__dataclass_fields__)))
    policies = POLICIES if a.policy == "both" else (a.policy,)
    preds = [predict(curve, workload, target, pol, a.max_replicas, cfg) for pol in policies]
    rows = [asdict(r) for pred in preds for r in pred.tried]
    if rows:
        print("\nsimulated:")
        print(_table(rows, list(SimResult.__dataclass_fields__)))
    print()
    for pred in preds:
        answer = f"{pred.replicas} replicas" if pred.replicas is not None else pred.reason
        if pred.first_tried > 1:
            answer += f" ({pred.first_tried - 1} or fewer cannot keep up, not simulated)"
        print(f"{pred.policy}: {answer}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"bench": "capacity", "argv": sys.argv[1:] if argv is None else argv,
                       "curve": asdict(curve), "workload": asdict(workload),
                       "target": asdict(target), "config": asdict(cfg),
                       "predictions": [asdict(p) for p in preds]}, f, indent=1)
    return 0 if all(p.replicas is not None for p in preds) else 1


if __name__ == "__main__":
    sys.exit(main())
