"""The scheduling policy: which waiting requests join the next fill batch (queue order, the
admission arithmetic, `select_fill`), the new-token ratio, and which request to retract first.

Admission (DESIGN section 3): a fill batch may use

    available = free + evictable - sum(remaining max_new_tokens of running requests) * new_token_ratio

and admits requests in queue order while `extend_len + max_new_tokens` fits `available` and the
batch's new tokens fit the prefill budget. The running requests' reservation is scaled by a ratio
(most requests stop before max_new_tokens); if decoding then runs out of slots the model process
retracts requests and raises the ratio.

Chunked prefill (`--chunked-prefill-size`): a fill computes at most that many new tokens. The
request that crosses the limit is admitted whole (its whole remaining prompt and max_new_tokens
must fit `available`, so it can always be finished) but computes only the tokens up to the
limit; it then waits, PREFILLING, with its computed KV locked, and the next fill continues it
first. At most one request is between chunks at a time.
"""

from __future__ import annotations

import random
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable


def order_queue(waiting: list[Any], policy: str, rng: random.Random,
                roots: list[Any] | None = None) -> list[Any]:
    """Order requests whose `prefix_indices` / `last_node` were just matched.

    lpm: longest cached prefix first. dfs-weight: depth-first over the radix tree, heavier subtrees
    (more waiting requests) first, so requests sharing a prefix run together. fcfs: arrival order.
    random: shuffled (with the server's seeded generator, so every rank agrees).
    """
    if policy == "lpm":
        return sorted(waiting, key=lambda r: (-len(r.prefix_indices), r.arrival))
    if policy == "fcfs":
        return sorted(waiting, key=lambda r: r.arrival)
    if policy == "random":
        out = sorted(waiting, key=lambda r: r.arrival)
        rng.shuffle(out)
        return out
    if policy == "dfs-weight":
        return _dfs_weight(waiting, roots or [])
    raise ValueError(f"unknown schedule heuristic {policy!r}")


def _dfs_weight(waiting: list[Any], roots: list[Any]) -> list[Any]:
    by_node: dict[int, list[Any]] = defaultdict(list)
    weight: dict[int, int] = defaultdict(int)
    for r in sorted(waiting, key=lambda r: r.arrival):
        by_node[id(r.last_node)].append(r)
        node = r.last_node
        while node is not None:
            weight[id(node)] += 1
            node = node.parent
    out: list[Any] = []
    stack = list(roots)
    while stack:
        node = stack.pop()
        out.extend(by_node.get(id(node), ()))
        children = [c for c in node.children.values() if weight.get(id(c), 0) > 0]
        # push lightest first so the heaviest subtree is visited next
        children.sort(key=lambda c: weight[id(c)])
        stack.extend(children)
    return out


@dataclass
class Admission:
    """The running arithmetic of one fill batch. `try_admit` is the only mutator."""

    available: int
    max_prefill_tokens: int
    free_rows: int
    chunk_size: int | None = None  # most new tokens of the fill; None: prompts are not chunked
    batch_new_tokens: int = 0
    admitted: int = 0

    @classmethod
    def start(
        cls,
        free: int,
        evictable: int,
        running_remaining: list[int],
        new_token_ratio: float,
        max_prefill_tokens: int,
        free_rows: int,
        chunk_size: int | None = None,
    ) -> "Admission":
        reserved = sum(running_remaining) * new_token_ratio
        return cls(int(free + evictable - reserved), max_prefill_tokens, free_rows, chunk_size)

    def _computed(self, extend_len: int, max_new: int, held_row: bool) -> int | None:
        """How many of the request's extend_len tokens this fill would compute (None: it is
        not admitted)."""
        if not held_row and self.free_rows <= 0:
            return None
        if extend_len + max_new > self.available:
            return None
        if self.chunk_size is not None:  # --max-prefill-tokens bounds the fill too
            left = min(self.chunk_size, self.max_prefill_tokens) - self.batch_new_tokens
            return min(extend_len, left) if left > 0 else None
        # A prompt longer than the budget still runs, alone.
        if self.admitted == 0 or self.batch_new_tokens + extend_len <= self.max_prefill_tokens:
            return extend_len
        return None

    def admit(self, extend_len: int, max_new: int, lock: Callable[[], int],
              unlock: Callable[[], int], held_row: bool = False) -> int | None:
        """Admit one request if it fits; return how many of its extend_len tokens this fill
        computes (less than extend_len when its prompt is chunked; None: not admitted).

        `lock()` locks its matched prefix and returns the change of evictable tokens (<= 0); if
        the lock made it no longer fit, `unlock()` undoes it. The whole request is reserved
        (extend_len + max_new), also when only a chunk is computed now. `held_row`: the
        request already holds its req_to_token row (the next chunk of a chunked prefill)."""
        if self._computed(extend_len, max_new, held_row) is None:
            return None
        self.available += lock()
        n = self._computed(extend_len, max_new, held_row)
        if n is None:
            self.available += unlock()
            return None
        self.available -= extend_len + max_new
        self.batch_new_tokens += n
        self.admitted += 1
        if not held_row:
            self.free_rows -= 1
        return n

    def try_admit(
        self, extend_len: int, max_new: int, lock: Callable[[], int], unlock: Callable[[], int]
    ) -> bool:
        """Admit one request whole if it fits (see `admit`)."""
        n = self.admit(extend_len, max_new, lock, unlock)
        return n is not None and n == extend_len


# A request waits a round for another of its fill batch only when they share at least this
# many uncomputed prompt tokens (SGLang's threshold): below it the wait costs more than it saves.
IN_ROUND_SHARED_TOKENS = 32


@dataclass
class InRoundPrefixes:
    """Requests of one fill round that would compute the same uncomputed prompt prefix.

    A request's key is the radix node its cached prefix ends at and the next `min_shared` prompt
    tokens after it: two requests with one key share that many tokens beyond what the tree holds.
    Once a request with a key is in the batch, the next ones with that key wait a round; by then
    the first has put its prompt in the tree and theirs matches it (`cached_tokens` counts it).
    Keys name nodes by identity, so an instance lives for one round only.
    """

    min_shared: int = IN_ROUND_SHARED_TOKENS
    keys: set[tuple[int, tuple[int, ...]]] = field(default_factory=set)

    def _key(self, r: Any) -> tuple[int, tuple[int, ...]] | None:
        m = len(r.prefix_indices)
        if len(r.fill_ids) < m + self.min_shared:
            return None
        return id(r.last_node), tuple(r.fill_ids[m : m + self.min_shared])

    def should_wait(self, r: Any) -> bool:
        key = self._key(r)
        return key is not None and key in self.keys

    def add(self, r: Any) -> None:
        key = self._key(r)
        if key is not None:
            self.keys.add(key)


# --min-fill-tokens-while-decoding where it is not set: MoE models wait for fills of this many
# tokens. One H100, Qwen3-30B-A3B shape, 100 requests decoding: a separate fill round of 462 to
# 1,858 new tokens takes 49-60 ms (its kernels 37 ms, the grouped expert products 18-30 ms of
# it: every expert is read whatever the fill's size), a decode step 21-26 ms.
MOE_MIN_FILL_TOKENS = 2048


# --max-fill-tokens-while-decoding where it is not set. One H100, DeepSeek-V2-Lite shape W1, one
# start: 34 fill rounds of up to 4,096 tokens took 2.40 s (17.25 s in all), 18 of up to 8,192 took
# 1.99 s (16.76 s): each round reads every expert, so MoE models take fewer, larger rounds.
MOE_MAX_FILL_TOKENS = 8192
DENSE_MAX_FILL_TOKENS = 4096


def _has_experts(model: Any) -> bool:
    """Whether `model` routes tokens to experts (any FusedMoE module)."""
    from srt.layers.moe import FusedMoE

    return any(isinstance(m, FusedMoE) for m in model.modules())


def fill_wait_tokens(args: Any, model: Any) -> int:
    """--min-fill-tokens-while-decoding, or where unset MOE_MIN_FILL_TOKENS for a model with
    routed experts and 0 for any other."""
    if args.min_fill_tokens_while_decoding is not None:
        return args.min_fill_tokens_while_decoding
    return MOE_MIN_FILL_TOKENS if _has_experts(model) else 0


def fill_cap_tokens(args: Any, model: Any) -> int:
    """--max-fill-tokens-while-decoding (-1: no separate cap), or where unset
    MOE_MAX_FILL_TOKENS for a model with routed experts and DENSE_MAX_FILL_TOKENS for any
    other."""
    if args.max_fill_tokens_while_decoding is not None:
        return args.max_fill_tokens_while_decoding
    return MOE_MAX_FILL_TOKENS if _has_experts(model) else DENSE_MAX_FILL_TOKENS


@dataclass
class FillWait:
    """Whether a fill waits a decode step for more requests to become admissible (see
    --min-fill-tokens-while-decoding). `waited`: the steps the fill in view has waited."""

    min_tokens: int
    max_steps: int
    waited: int = 0

    def hold(self, fill_tokens: int, budget: int, takes_queue: bool, decoding: bool,
             continues_prompt: bool) -> bool:
        """True: skip this fill now (the running requests take a step, then the fill is
        chosen again). Never while nothing decodes, when the fill takes every waiting request
        (nothing more can join it: an arrival waits for no one), continues a chunked prompt,
        has min_tokens new tokens or its `budget` (the most a fill may compute), or has
        waited max_steps."""
        if (fill_tokens >= min(self.min_tokens, budget) or takes_queue or not decoding
                or continues_prompt or self.waited >= self.max_steps):
            self.waited = 0
            return False
        self.waited += 1
        return True


def next_fill(p: Any) -> list[Any]:
    """This round's fill of model process `p` (srt/model_process/loop.py): `select_fill`
    under its chunk limits, or [] where its FillWait holds the fill back a step."""
    from srt.model_process.logprob_step import prefix_limit

    # While requests decode, a fill is held to --max-fill-tokens-while-decoding.
    chunk = p.decoding_chunk_size if p.batch else p.chunk_size
    queued = len(p.waiting)
    fill = select_fill(p.waiting, p.running, p.kv, p.args, p.rng, p.ratio.value, prefix_limit,
                       chunk)
    budget = min(chunk or p.args.max_prefill_tokens, p.args.max_prefill_tokens)
    if fill and p.fill_wait.hold(sum(r.extend_input_len for r in fill), budget,
                                 len(fill) == queued, bool(p.batch),
                                 any(r.prefilling for r in fill)):
        p.counters.fills_waited += 1
        return unselect_fill(fill, p.waiting, p.kv.tree)
    return fill


def unselect_fill(fill: list[Any], waiting: list[Any], tree: Any) -> list[Any]:
    """Undo `select_fill`: the requests wait again (first), their matched prefixes unlocked;
    the next selection matches them again. Returns an empty fill."""
    for r in fill:
        tree.dec_lock_ref(r.last_node)
    waiting[:0] = fill
    return []


# Retraction re-estimates the ratio as if every request still ran this many steps.
RETRACT_LOOKAHEAD_STEPS = 20


@dataclass
class TokenRatio:
    """Share of running requests' remaining max_new_tokens reserved at admission.

    Starts high, decays every decode step towards its floor (requests usually stop early), and is
    raised again when decoding runs out of slots (`after_retraction`).
    """

    value: float
    floor: float
    decay: float

    @classmethod
    def from_conservativeness(cls, c: float) -> "TokenRatio":
        return cls(value=min(0.7 * c, 1.0), floor=min(0.1 * c, 1.0), decay=0.001)

    def step(self) -> None:
        self.value = max(self.floor, self.value - self.decay)

    def after_retraction(self, running: list[Any]) -> None:
        total_max = sum(r.sampling_params.max_new_tokens for r in running) or 1
        done = sum(len(r.output_ids) for r in running)
        estimate = (done + RETRACT_LOOKAHEAD_STEPS * len(running)) / total_max
        self.value = min(1.0, max(self.value, estimate))


def retraction_victim(running: list[Any]) -> Any:
    """The running request to retract first: least progress (fewest generated tokens), then the
    longest prompt."""
    return min(running, key=lambda r: (len(r.output_ids), -len(r.origin_input_ids)))


def select_fill(waiting: list[Any], running: list[Any], kv: Any, args: Any, rng: random.Random,
                ratio: float, prefix_limit: Callable[[Any], int],
                chunk_size: int | None = None) -> list[Any]:
    """The waiting requests of the next fill batch, in order (their prefixes matched and
    locked, `extend_input_len` set to what this fill computes); they are removed from `waiting`.

    `prefix_limit(r)`: how many leading tokens may come from the tree (at least one token is
    computed, and every prompt position whose logprobs are asked for). `chunk_size`: the most
    new tokens of the fill (None: no chunking). A PREFILLING request (between chunks) goes first
    and continues from the KV it holds; it is not matched again."""
    if not waiting:
        return []
    tree = kv.tree
    for r in waiting:
        if r.prefilling:
            continue
        r.prefix_indices, r.last_node = tree.match_prefix(r.fill_ids[: prefix_limit(r)],
                                                          r.lora_id)
        if r.image is not None:
            keep = r.image.safe_prefix_len(len(r.prefix_indices))
            if keep < len(r.prefix_indices):
                r.prefix_indices, r.last_node = tree.match_prefix(r.fill_ids[:keep], r.lora_id)
    for r in waiting:
        r.extend_input_len = len(r.fill_ids) - len(r.prefix_indices)
    chunked = [r for r in waiting if r.prefilling]
    queue = chunked + order_queue([r for r in waiting if not r.prefilling],
                                  args.schedule_heuristic, rng, tree.roots())
    adm = Admission.start(
        free=kv.pool.available_size(),
        evictable=tree.evictable_size(),
        running_remaining=[r.remaining_new_tokens - r.in_flight for r in running],
        new_token_ratio=ratio,
        max_prefill_tokens=args.max_prefill_tokens,
        free_rows=kv.req_pool.available_size(),
        chunk_size=chunk_size,
    )
    batch: list[Any] = []
    # Samples of a prompt that another sample is computing (this round, or chunk by chunk)
    # wait and then reuse its KV.
    groups: set[str] = {r.group for r in chunked if r.group is not None}
    shared = InRoundPrefixes()
    # LoRA: a batch uses at most --max-loras-per-batch adapters (the device pool's slots)
    adapters = {r.lora_id for r in running if r.lora_id} | \
        {r.lora_id for r in chunked if r.lora_id}
    max_adapters = args.max_loras_per_batch if args.enable_lora else 0
    for r in queue:
        if r.grammar_pending:
            continue  # its grammar is still compiling
        if max_adapters and r.lora_id and r.lora_id not in adapters \
                and len(adapters) >= max_adapters:
            continue  # its adapter would be one too many: a later batch
        if r.group is not None and r.group in groups and not r.prefilling:
            continue
        sharing = not tree.disable and not r.wants_prompt_logprobs
        if sharing and shared.should_wait(r):
            continue  # another request of this batch computes its prompt's next tokens
        node = r.last_node
        if r.prefilling:  # its prefix is locked since its last chunk
            n = adm.admit(r.extend_input_len, r.remaining_new_tokens, lambda: 0, lambda: 0,
                          held_row=True)
        else:
            n = adm.admit(r.extend_input_len, r.remaining_new_tokens,
                          lock=lambda n=node: tree.inc_lock_ref(n),
                          unlock=lambda n=node: tree.dec_lock_ref(n))
        if n is None:
            break
        r.extend_input_len = n
        batch.append(r)
        if r.lora_id:
            adapters.add(r.lora_id)
        if sharing:
            shared.add(r)
        if r.group is not None and sharing \
                and len(r.prefix_indices) < len(r.origin_input_ids) - 1:
            # This batch computes the group's prompt. (Samples that want prompt logprobs
            # compute it themselves anyway: they do not wait.)
            groups.add(r.group)
    if batch:
        chosen = set(map(id, batch))
        waiting[:] = [r for r in waiting if id(r) not in chosen]
    return batch
