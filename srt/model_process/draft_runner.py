"""The draft model of STANDALONE speculative decoding: a smaller causal LM of the same tokenizer,
its own KV pool, and the draft steps that propose each request's next tokens.

The draft's pool has the target's slots: slot s holds the draft's KV of the same token whose
target KV is at slot s, and both models read their KV through the target's `req_to_token`
rows. So the radix cache, retraction, chunked prefill and the freeing of rejected rows keep
both pools right without knowing the draft exists, on one condition, kept by the step executor:
every target forward is also run by the draft (`mirror`) on the same inputs and slots, fills,
decode steps, mixed steps and verification steps alike. Where the target has computed a
position's KV, the draft has too.

A verification round (`propose`): request i, with kv_lens[i] positions computed and its last
sampled id t not yet, drafts k_i tokens greedily in k_i DECODE steps of the draft: step j feeds
t (j = 0) or the draft token of step j - 1 at position kv_lens[i] + j, writes the draft's KV
into the slot the verification step gives that position, and takes the argmax. The draft's KV
of those positions is then rewritten with the same values when the verification is mirrored,
which also computes the last draft token's position. A greedy draft is a fixed function of the
context, so verifying it by exact rejection of a fixed draft token (`verify_sample`) keeps the
target's distribution when sampling.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import torch

from srt.layers import parallel_state
from srt.layers.forward_batch import ForwardBatch, ForwardMode
from srt.model_config import ModelConfig
from srt.model_process.batch import StepPlan
from srt.model_process.model_runner import ModelRunner
from srt.model_process.step_inputs import StepInputBuilder

logger = logging.getLogger(__name__)


class DraftRunner(ModelRunner):
    """The draft model on the target's device and TP group. Built in two stages: the model at
    once (so the target can size the pool with both models' memory in mind), the pool and
    backends once the target has its own (`init_pool_and_backend`)."""

    def __init__(self, target: ModelRunner) -> None:
        args = target.args
        assert args.speculative_draft_model_path is not None
        self.args = args
        self.target = target
        # positions up to the target's context: the rotary tables must reach them
        self.config = ModelConfig.load(args.speculative_draft_model_path,
                                       target.config.context_len)
        _check_pair(target.config, self.config)
        self.tp_rank = target.tp_rank
        self.device = target.device
        self.dtype = target.dtype
        self.quantization = None
        self.draft = None
        self.lora = None  # adapters apply to the target only
        self.model = self._load_model()
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.inputs = StepInputBuilder(self.device)
        logger.info("%s draft model %s (%s, %d layers, %.2f GB)",
                    args.speculative_algorithm, args.speculative_draft_model_path, self.config.architecture,
                    self.config.num_layers, self.weight_bytes / 1e9)

    def init_pool_and_backend(self) -> None:
        t = self.target
        self.max_total_num_tokens = t.max_total_num_tokens
        self.max_running_requests = t.max_running_requests
        self.req_to_token_pool = t.req_to_token_pool
        self.kv_cache_dtype = t.kv_cache_dtype
        super().init_pool_and_backend()

    def _own_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Ids the draft can embed: a smaller draft vocabulary (e.g. padded less than the
        target's) reads any id past it as id 0 (a worse draft there, never a crash)."""
        if self.config.vocab_size >= self.target.config.vocab_size:
            return ids
        return torch.where(ids < self.config.vocab_size, ids, torch.zeros_like(ids))

    def mirror(self, fb: ForwardBatch, plan: StepPlan, ids: torch.Tensor,
               req_rows: torch.Tensor, select: torch.Tensor | None) -> None:
        """Run the draft on a target step (`fb`, launched from `plan`) after its sampling:
        its KV of the step's positions, at the same slots. `ids`: what the step sampled (one
        per request, or per row of a verification); `req_rows`: each request's req_to_token
        row; `select`: the rows sampled (None: each request's last). A STANDALONE draft reads
        the step's own inputs, so only `fb` matters to it (its logits are not needed)."""
        self.forward(self._on_draft(fb, self._own_ids(fb.input_ids)))

    def _on_draft(self, fb: ForwardBatch, input_ids: torch.Tensor,
                  spec_hidden: torch.Tensor | None = None) -> ForwardBatch:
        """A target step's batch with other inputs, on the draft's pool and backend."""
        return dataclasses.replace(
            fb, input_ids=input_ids, spec_hidden=spec_hidden,
            token_to_kv_pool=self.token_to_kv_pool, attn_backend=self.attn_backend,
            attn_metadata=None, prompt_logprobs=None)

    def accept(self, step_rows: list[int], req_rows: list[int]) -> None:
        """After a verification step: request j kept the step's rows up to step_rows[j]
        (its req_to_token row req_rows[j]). A STANDALONE draft keeps nothing per row."""

    @torch.inference_mode()
    def propose(self, rows: np.ndarray, kv_lens: np.ndarray, last_ids: list[int],
                ks: list[int], slots: torch.Tensor, vocab_size: int) -> list[list[int]]:
        """Greedy drafts: ks[i] tokens for the request of req_to_token row rows[i], which has
        kv_lens[i] positions computed and last sampled id last_ids[i]. `slots` are the
        verification step's (request i's 1 + ks[i] rows in order, as `Batch.prepare_verify`
        lays them out); draft step j writes its KV at request i's slot j. Token ids at or above
        `vocab_size` (the target's) are never drafted. One copy to the host at the end."""
        k = np.asarray(ks, dtype=np.int64)
        starts = np.concatenate(([0], np.cumsum(1 + k)[:-1]))
        dev = self.device
        pool = self.req_to_token_pool
        steps: list[torch.Tensor] = []
        actives: list[np.ndarray] = []
        ids = torch.empty(0, dtype=torch.int64, device=dev)
        for j in range(int(k.max(initial=0))):
            active = np.flatnonzero(k > j)
            positions = kv_lens[active] + j
            loc = slots[torch.from_numpy(starts[active] + j)]
            r = rows[active]
            first = [last_ids[i] for i in active] if j == 0 else None
            t = self.inputs.build(first, positions, loc, r, positions + 1)
            if j == 0:
                input_ids = self._own_ids(t.input_ids)
            else:  # the previous step's drafts of the requests still drafting
                keep = np.searchsorted(actives[-1], active)
                input_ids = ids.index_select(0, torch.from_numpy(keep).to(dev))
            pool.req_to_token[t.req_pool_indices, t.positions] = t.out_cache_loc.to(torch.int32)
            if pool.host is not pool.req_to_token:
                pool.host.numpy()[r, positions] = loc.numpy()
            fb = ForwardBatch(
                forward_mode=ForwardMode.DECODE, batch_size=len(active), input_ids=input_ids,
                positions=t.positions, out_cache_loc=t.out_cache_loc,
                req_pool_indices=t.req_pool_indices, seq_lens=t.seq_lens,
                seq_lens_cpu=(positions + 1).tolist(), prefix_lens_cpu=positions.tolist(),
                extend_lens_cpu=[1] * len(active), req_to_token_pool=pool,
                token_to_kv_pool=self.token_to_kv_pool, attn_backend=self.attn_backend)
            logits = self.forward(fb)
            ids = logits[:, :vocab_size].argmax(dim=-1)
            # every rank must draft the same tokens (they shape the verification step)
            ids = parallel_state.broadcast_from_first(ids)
            steps.append(ids)
            actives.append(active)
        drafts: list[list[int]] = [[] for _ in ks]
        if steps:
            host = torch.cat(steps).tolist()
            n = 0
            for active in actives:
                for i in active:
                    drafts[i].append(host[n])
                    n += 1
        return drafts


def _check_pair(target: ModelConfig, draft: ModelConfig) -> None:
    """Refuse a draft that cannot propose the target's tokens."""
    where = f"--speculative-draft-model-path {draft.path}"
    if target.image_token_id is not None:
        raise ValueError("STANDALONE speculative decoding needs a text-only target model "
                         f"({target.architecture} takes images)")
    if draft.image_token_id is not None:
        raise ValueError(f"{where}: the draft must be a text-only causal LM "
                         f"({draft.architecture} takes images)")
    # A draft's embedding may be padded past the tokenizer (or the target's): ids beyond the
    # target's vocabulary are never drafted. A much smaller one is another tokenizer.
    if draft.vocab_size < 0.9 * target.vocab_size:
        raise ValueError(f"{where}: its vocabulary ({draft.vocab_size} ids) does not cover the "
                         f"target's ({target.vocab_size}): the draft must use the target's "
                         "tokenizer")
