"""The draft head of EAGLE / EAGLE3 speculative decoding (srt/models/llama_eagle.py): its own
KV pool over the target's slots, as a STANDALONE draft's, and features carried per request.

The head's row at position p reads the token at p + 1 and the target's feature of p, so the
target's step is mirrored after its sampling (`mirror`): each row is fed the token after it (the
next input id inside a step, the sampled id at a request's last row, the next prompt id at the
end of a chunk that is not the last) and the target's features of the step's rows. What the
head outputs at a request's last row is its first draft token and the feature that continues
it, kept on the device per req_to_token row (`first_ids`, `feats`). In a verification step
every row is sampled and every row's token is the one after it wherever the row is kept, so the
head's output of every row is held (`_pending`) until the host knows how many rows each request
kept (`accept`).

A verification round (`propose`) of k drafts: the first is `first_ids`; k - 1 DECODE steps of
the head then feed (draft token, feature) at positions kv_lens[i], kv_lens[i] + 1, ... into the
verification step's slots, whose draft KV the verification's mirror rewrites with the kept
values. The radix cache shares the head's KV like the target's: at the last position of a
matched prefix that KV was computed with the token that followed it in the request that cached
it, which may differ from this request's (a worse draft there, never a wrong output).
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from srt.layers import parallel_state
from srt.layers.forward_batch import ForwardBatch, ForwardMode
from srt.model_process.batch import StepPlan
from srt.model_process.draft_runner import DraftRunner
from srt.model_process.model_runner import ModelRunner
from srt.models.llama import LlamaForCausalLM
from srt.models.llama_eagle import (EAGLE_ARCHITECTURES, LlamaEagle3Head, LlamaEagleHead,
                                    eagle3_aux_layers)

logger = logging.getLogger(__name__)


class EagleRunner(DraftRunner):
    use_cuda_graphs = False  # the head's steps run eagerly (its inputs include features)

    def __init__(self, target: ModelRunner) -> None:
        self.algorithm = target.args.speculative_algorithm
        if not isinstance(target.model, LlamaForCausalLM):
            raise ValueError(f"--speculative-algorithm {self.algorithm} needs a Llama-shaped "
                             f"text model (Llama, Mistral, Qwen2/3, Mixtral); "
                             f"{target.config.architecture} is not")
        super().__init__(target)
        head: LlamaEagleHead = self.model  # type: ignore[assignment]
        head.share(target.model)
        target.model.capture_hidden = eagle3_aux_layers(
            self.config.hf_config, target.config.num_layers) if self.algorithm == "EAGLE3" \
            else ()
        if head.hot_ids is not None:
            head.hot_ids = head.hot_ids.to(self.device)
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None

    def _model_class(self) -> type:
        arch = self.config.architecture
        if arch not in EAGLE_ARCHITECTURES[self.algorithm]:
            raise ValueError(f"--speculative-draft-model-path {self.config.path}: {arch} is not "
                             f"an {self.algorithm} head (expected "
                             f"{' or '.join(EAGLE_ARCHITECTURES[self.algorithm])})")
        return LlamaEagle3Head if self.algorithm == "EAGLE3" else LlamaEagleHead

    def init_pool_and_backend(self) -> None:
        super().init_pool_and_backend()
        n = self.req_to_token_pool.size
        self.first_ids = torch.zeros(n, dtype=torch.int64, device=self.device)
        self.feats = torch.zeros(n, self.config.hidden_size, dtype=self.dtype,
                                 device=self.device)

    def _draft_ids(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Target ids of the head's greedy tokens (never one at or past `vocab_size`)."""
        hot = self.model.hot_ids
        if hot is None:
            return logits[:, :vocab_size].argmax(dim=-1)
        return hot.index_select(0, logits.argmax(dim=-1)).clamp_(max=vocab_size - 1)

    def _next_ids(self, fb: ForwardBatch, plan: StepPlan, ids: torch.Tensor,
                  select: torch.Tensor | None) -> torch.Tensor:
        """The token after each row of the step."""
        if fb.forward_mode == ForwardMode.DECODE and select is None:
            return ids  # a decode or verification step: every row was sampled
        nxt = torch.roll(fb.input_ids, -1)
        if select is not None:  # a step after a jump: each request samples its last row
            nxt[select] = ids
            return nxt
        # an extend step: a request's last row is followed by what it sampled, or by the
        # next chunk's first id
        ends: list[int] = []
        after: list[int] = []
        end = -1
        for r, pre, e in zip(plan.reqs, plan.prefix_lens, plan.extend_lens):
            end += e
            ends.append(end)
            after.append(r.fill_ids[pre + e] if pre + e < len(r.fill_ids) else -1)
        t = torch.tensor([ends, after], dtype=torch.int64).to(self.device, non_blocking=True)
        nxt[t[0]] = torch.where(t[1] >= 0, t[1], ids)
        return nxt

    def mirror(self, fb: ForwardBatch, plan: StepPlan, ids: torch.Tensor,
               req_rows: torch.Tensor, select: torch.Tensor | None) -> None:
        nxt = self._next_ids(fb, plan, ids, select)
        hidden = self.target.model.spec_hidden
        assert hidden is not None and hidden.shape[0] == nxt.shape[0]
        logits = self.forward(self._on_draft(fb, nxt, hidden))
        tok = self._draft_ids(logits, self.target.config.vocab_size)
        feat = self.model.feature
        if plan.verify is not None:
            self._pending = (tok, feat)
            return
        if select is not None:
            tok, feat = tok.index_select(0, select), feat.index_select(0, select)
        self.first_ids.index_copy_(0, req_rows, tok)
        self.feats.index_copy_(0, req_rows, feat)

    def accept(self, step_rows: list[int], req_rows: list[int]) -> None:
        assert self._pending is not None
        tok, feat = self._pending
        self._pending = None
        t = torch.tensor([step_rows, req_rows], dtype=torch.int64).to(self.device,
                                                                     non_blocking=True)
        self.first_ids.index_copy_(0, t[1], tok.index_select(0, t[0]))
        self.feats.index_copy_(0, t[1], feat.index_select(0, t[0]))

    @torch.inference_mode()
    def propose(self, rows: np.ndarray, kv_lens: np.ndarray, last_ids: list[int],
                ks: list[int], slots: torch.Tensor, vocab_size: int) -> list[list[int]]:
        """As `DraftRunner.propose`; the first draft of each request is its `first_ids`, and
        draft step j writes its KV at request i's slot j (position kv_lens[i] + j)."""
        k = np.asarray(ks, dtype=np.int64)
        starts = np.concatenate(([0], np.cumsum(1 + k)[:-1]))
        dev = self.device
        pool = self.req_to_token_pool
        rows_dev = torch.from_numpy(rows).to(dev, non_blocking=True)
        ids, feat = self.first_ids[rows_dev], self.feats[rows_dev]
        steps = [ids]
        actives = [np.arange(len(ks))]
        for j in range(int(k.max(initial=0)) - 1):
            active = np.flatnonzero(k > j + 1)
            keep = torch.from_numpy(np.searchsorted(actives[-1], active)).to(dev)
            positions = kv_lens[active] + j
            loc = slots[torch.from_numpy(starts[active] + j)]
            r = rows[active]
            t = self.inputs.build(None, positions, loc, r, positions + 1)
            pool.req_to_token[t.req_pool_indices, t.positions] = t.out_cache_loc.to(torch.int32)
            if pool.host is not pool.req_to_token:
                pool.host.numpy()[r, positions] = loc.numpy()
            fb = ForwardBatch(
                forward_mode=ForwardMode.DECODE, batch_size=len(active),
                input_ids=ids.index_select(0, keep), positions=t.positions,
                out_cache_loc=t.out_cache_loc, req_pool_indices=t.req_pool_indices,
                seq_lens=t.seq_lens, seq_lens_cpu=(positions + 1).tolist(),
                prefix_lens_cpu=positions.tolist(), extend_lens_cpu=[1] * len(active),
                req_to_token_pool=pool, token_to_kv_pool=self.token_to_kv_pool,
                attn_backend=self.attn_backend, spec_hidden=feat.index_select(0, keep))
            ids = self._draft_ids(self.forward(fb), vocab_size)
            feat = self.model.feature
            steps.append(ids)
            actives.append(active)
        # every rank must draft the same tokens (they shape the verification step)
        host = parallel_state.broadcast_from_first(torch.cat(steps)).tolist()
        drafts: list[list[int]] = [[] for _ in ks]
        n = 0
        for active in actives:
            for i in active:
                if k[i]:
                    drafts[i].append(host[n])
                n += 1
        return drafts
