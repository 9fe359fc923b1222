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
from typing import Callable

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
        self.topk = target.args.speculative_eagle_topk or 1
        self.steps = target.args.speculative_steps
        # the head's next tokens of a verification's rows, their probabilities (top-k > 1),
        # features: kept until the host knows which rows were kept
        self._pending: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor] | None = None

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
        shape = (n,) if self.topk == 1 else (n, self.topk)
        self.first_ids = torch.zeros(shape, dtype=torch.int64, device=self.device)
        # top-k > 1: the head's probabilities of first_ids (a tree's first scores)
        self.first_p = torch.zeros(shape, dtype=torch.float32, device=self.device) \
            if self.topk > 1 else None
        self.feats = torch.zeros(n, self.config.hidden_size, dtype=self.dtype,
                                 device=self.device)

    def _draft_ids(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Target ids of the head's greedy tokens (never one at or past `vocab_size`)."""
        hot = self.model.hot_ids
        if hot is None:
            return logits[:, :vocab_size].argmax(dim=-1)
        return hot.index_select(0, logits.argmax(dim=-1)).clamp_(max=vocab_size - 1)

    def _draft_topk(self, logits: torch.Tensor, vocab_size: int,
                    k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The head's k most likely tokens of each row (target ids) and their probabilities
        under its softmax, most likely first."""
        hot = self.model.hot_ids
        if hot is None:
            logits = logits[:, :vocab_size]
        p, idx = torch.softmax(logits.float(), dim=-1).topk(k, dim=-1)
        if hot is not None:
            idx = hot[idx].clamp_(max=vocab_size - 1)
        return idx, p

    def _heads_next(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What a request keeps from the head's output at its last row: its next token (top-k
        1), or its k next tokens and their probabilities."""
        vocab = self.target.config.vocab_size
        if self.topk == 1:
            return self._draft_ids(logits, vocab), None
        return self._draft_topk(logits, vocab, self.topk)

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
        tok, p = self._heads_next(logits)
        feat = self.model.feature
        if plan.verify is not None:
            self._pending = (tok, p, feat)
            return
        if select is not None:
            tok, feat = tok.index_select(0, select), feat.index_select(0, select)
            p = p.index_select(0, select) if p is not None else None
        self._keep(req_rows, tok, p, feat)

    def _keep(self, req_rows: torch.Tensor, tok: torch.Tensor, p: torch.Tensor | None,
              feat: torch.Tensor) -> None:
        self.first_ids.index_copy_(0, req_rows, tok)
        if p is not None:
            assert self.first_p is not None
            self.first_p.index_copy_(0, req_rows, p)
        self.feats.index_copy_(0, req_rows, feat)

    def accept(self, step_rows: list[int], req_rows: list[int]) -> None:
        assert self._pending is not None
        tok, p, feat = self._pending
        self._pending = None
        t = torch.tensor([step_rows, req_rows], dtype=torch.int64).to(self.device,
                                                                     non_blocking=True)
        self._keep(t[1], tok.index_select(0, t[0]),
                   p.index_select(0, t[0]) if p is not None else None,
                   feat.index_select(0, t[0]))

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

    @torch.inference_mode()
    def propose_tree(self, rows: np.ndarray, kv_lens: np.ndarray, ks: list[int],
                     slots: torch.Tensor, vocab_size: int,
                     alloc: Callable[[int], torch.Tensor],
                     free: Callable[[torch.Tensor], None]) -> tuple[list[list[int]],
                                                                   list[list[int]]]:
        """Top-k > 1: a tree of at most ks[i] nodes for each request, as `VerifyRows` reads
        it (tokens, parents). The candidates: the k tokens the head gave at the request's last
        row, scored by their probability; then each of --speculative-num-steps - 1 head steps
        feeds the k best-scored candidates of the step before (the leaves) at once, each with
        its parent's feature, and every leaf's k next tokens become candidates scored by
        leaf score x probability. The tree is the ks[i] best-scored candidates (a child never
        scores above its parent and comes after it, so ties go to the parent: the tree is
        closed under parents). Each step's rows read scratch rows (the request's row, then the
        head's KV of the leaf's ancestors in slots from `alloc`, freed at the end); `slots`,
        the verification step's, are not written here. One copy to the host at the end."""
        K, S = self.topk, self.steps
        k = np.asarray(ks, dtype=np.int64)
        active = np.flatnonzero(k > 0)
        B = len(active)
        dev = self.device
        pool = self.req_to_token_pool
        r = rows[active]
        base = kv_lens[active]
        r_dev = torch.from_numpy(r).to(dev, non_blocking=True)
        assert self.first_p is not None
        leaf_tok = self.first_ids[r_dev]  # [B, K]
        leaf_score = self.first_p[r_dev]
        leaf_id = torch.arange(K, device=dev).expand(B, K)  # candidate numbers
        feat = self.feats[r_dev].unsqueeze(1).expand(B, K, -1)
        toks, scores = [leaf_tok], [leaf_score]
        parents = [torch.full((B, K), -1, dtype=torch.int64, device=dev)]
        if S > 1:
            temp = alloc(B * K * (S - 1))
            scr = np.asarray(pool.scratch[: B * K], dtype=np.int64)
            pool.fork_rows(scr, np.repeat(r, K), int(base.max()))
            scr_dev = torch.from_numpy(scr).to(dev, non_blocking=True).view(B, K)
            base_dev = torch.from_numpy(base).to(dev, non_blocking=True)
            path = torch.empty((B, K, 0), dtype=torch.int64, device=dev)
            for j in range(1, S):
                loc = temp[(j - 1) * B * K : j * B * K]
                positions = np.repeat(base + j - 1, K)
                t = self.inputs.build(None, positions, loc, scr, positions + 1)
                full = torch.cat((path, t.out_cache_loc.view(B, K, 1)), dim=2)  # [B, K, j]
                cols = base_dev.view(B, 1, 1) + torch.arange(j, device=dev)
                pool.req_to_token[scr_dev.unsqueeze(2).expand(B, K, j), cols.expand(B, K, j)] \
                    = full.to(torch.int32)
                fb = ForwardBatch(
                    forward_mode=ForwardMode.DECODE, batch_size=B * K,
                    input_ids=leaf_tok.reshape(-1), positions=t.positions,
                    out_cache_loc=t.out_cache_loc, req_pool_indices=t.req_pool_indices,
                    seq_lens=t.seq_lens, seq_lens_cpu=(positions + 1).tolist(),
                    prefix_lens_cpu=positions.tolist(), extend_lens_cpu=[1] * (B * K),
                    req_to_token_pool=pool, token_to_kv_pool=self.token_to_kv_pool,
                    attn_backend=self.attn_backend, spec_hidden=feat.reshape(B * K, -1))
                ids, p = self._draft_topk(self.forward(fb), vocab_size, K)
                h = self.model.feature.view(B, K, -1)
                score = (leaf_score.unsqueeze(2) * p.view(B, K, K)).view(B, K * K)
                ids = ids.view(B, K * K)
                toks.append(ids)
                scores.append(score)
                parents.append(leaf_id.unsqueeze(2).expand(B, K, K).reshape(B, K * K))
                if j == S - 1:
                    break
                sel = score.topk(K, dim=-1).indices  # the next leaves
                up = sel // K  # their parents among this step's leaves
                leaf_tok, leaf_score = ids.gather(1, sel), score.gather(1, sel)
                leaf_id = K + (j - 1) * K * K + sel
                feat = h.gather(1, up.unsqueeze(2).expand(B, K, h.shape[-1]))
                path = full.gather(1, up.unsqueeze(2).expand(B, K, j))
            free(temp)
        # every rank must draft the same trees (they shape the verification step)
        ti = parallel_state.broadcast_from_first(
            torch.cat((torch.cat(toks, dim=1), torch.cat(parents, dim=1)), dim=1)).cpu().numpy()
        sc = parallel_state.broadcast_from_first(torch.cat(scores, dim=1)).cpu().numpy()
        m = sc.shape[1]
        drafts: list[list[int]] = [[] for _ in ks]
        tree_parents: list[list[int]] = [[] for _ in ks]
        for b, i in enumerate(active):
            tok, par = ti[b, :m], ti[b, m:]
            best = np.lexsort((np.arange(m), -sc[b]))[: k[i]]
            node: dict[int, int] = {}
            for c in np.sort(best):
                up = int(par[c])
                if up >= 0 and up not in node:
                    continue  # (its parent was dropped below)
                pn = node[up] if up >= 0 else -1
                t = int(tok[c])
                if any(drafts[i][j] == t and tree_parents[i][j] == pn
                       for j in range(len(drafts[i]))):
                    continue  # a sibling holds it (two head ids clamped to one)
                node[int(c)] = len(drafts[i])
                drafts[i].append(t)
                tree_parents[i].append(pn)
        return drafts, tree_parents
