"""The speculative decoding part of ServerArgs: the derived sizes (draft tokens, steps, a tree's
depth) and the start-up checks of the `--speculative-*` flags (their fields are ServerArgs')."""

from __future__ import annotations

import os


class SpeculativeArgs:
    """Mixed into ServerArgs, whose `speculative_*` fields these read."""

    speculative_algorithm: str | None
    speculative_draft_model_path: str | None
    speculative_num_steps: int | None
    speculative_eagle_topk: int | None
    speculative_num_draft_tokens: int | None
    speculative_accept_threshold_single: float
    speculative_ngram_min_match_window_size: int
    speculative_ngram_max_match_window_size: int
    speculative_ngram_max_bfs_breadth: int
    speculative_disable_by_batch_size: int

    @property
    def speculative_draft_tokens(self) -> int:
        """Draft tokens per request and verification (0: speculation off)."""
        if self.speculative_algorithm is None:
            return 0
        topk = self.speculative_eagle_topk or 1
        if topk > 1:  # the nodes of a tree
            steps = self.speculative_num_steps or 3
            return (self.speculative_num_draft_tokens or min(64, steps * topk + 1)) - 1
        if self.speculative_num_steps is not None:
            return self.speculative_num_steps
        default = 8 if self.speculative_algorithm == "NGRAM" else 4
        return (self.speculative_num_draft_tokens or default) - 1

    @property
    def speculative_tree_depth(self) -> int:
        """Deepest node of a draft tree (0: drafts are chains): EAGLE's steps, NGRAM's
        drafts."""
        if (self.speculative_eagle_topk or 1) > 1:
            return self.speculative_steps
        if self.speculative_algorithm == "NGRAM" and self.speculative_ngram_max_bfs_breadth > 1:
            return self.speculative_draft_tokens
        return 0

    @property
    def speculative_steps(self) -> int:
        """Draft steps of a draft model per verification (the depth of its drafts)."""
        if (self.speculative_eagle_topk or 1) > 1:
            return self.speculative_num_steps or 3
        return self.speculative_draft_tokens

    def _validate_speculative(self) -> None:
        algo = self.speculative_algorithm
        if algo is None:
            given = [n for n in ("speculative_draft_model_path", "speculative_num_steps",
                                 "speculative_eagle_topk", "speculative_num_draft_tokens")
                     if getattr(self, n) is not None]
            if given:
                raise ValueError(f"--{given[0].replace('_', '-')} needs "
                                 "--speculative-algorithm")
            return
        if algo == "NGRAM":
            for name in ("speculative_draft_model_path", "speculative_num_steps",
                         "speculative_eagle_topk"):
                if getattr(self, name) is not None:
                    raise ValueError(f"--{name.replace('_', '-')} does not apply to "
                                     "--speculative-algorithm NGRAM (it has no draft model)")
        else:
            self._validate_draft_model()
        n = self.speculative_num_draft_tokens
        if n is not None and not 2 <= n <= 64:
            raise ValueError("--speculative-num-draft-tokens must be in 2..64 (the last "
                             "accepted token plus at least one draft)")
        if self.speculative_accept_threshold_single != 1.0:
            raise ValueError("--speculative-accept-threshold-single must be 1.0: srt accepts "
                             "draft tokens exactly (relaxed acceptance changes the output)")
        lo, hi = (self.speculative_ngram_min_match_window_size,
                  self.speculative_ngram_max_match_window_size)
        if not 1 <= lo <= hi:
            raise ValueError("--speculative-ngram-min-match-window-size must be >= 1 and <= "
                             "--speculative-ngram-max-match-window-size")
        if not 1 <= self.speculative_ngram_max_bfs_breadth <= 64:
            raise ValueError("--speculative-ngram-max-bfs-breadth must be in 1..64")
        if self.speculative_disable_by_batch_size < 1:
            raise ValueError("--speculative-disable-by-batch-size must be >= 1")

    def _validate_draft_model(self) -> None:
        """STANDALONE, EAGLE, EAGLE3: a draft model directory, and a chain of drafts
        (top-k 1)."""
        path = self.speculative_draft_model_path
        algo = self.speculative_algorithm
        if path is None:
            what = ("a smaller model of the same tokenizer" if algo == "STANDALONE"
                    else f"an {algo} head checkpoint")
            raise ValueError(f"--speculative-algorithm {algo} needs "
                             f"--speculative-draft-model-path ({what})")
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ValueError(f"--speculative-draft-model-path {path!r} is not a model directory "
                             "(no config.json)")
        topk = self.speculative_eagle_topk
        if topk is not None and topk != 1:
            if algo == "STANDALONE":
                raise ValueError("--speculative-eagle-topk must be 1 with STANDALONE: its draft "
                                 "model proposes one chain of tokens (trees are drafted by "
                                 "EAGLE / EAGLE3 heads)")
            if not 1 <= topk <= 16:
                raise ValueError("--speculative-eagle-topk must be in 1..16")
        steps, n = self.speculative_num_steps, self.speculative_num_draft_tokens
        if steps is not None and not 1 <= steps <= 63:
            raise ValueError("--speculative-num-steps must be in 1..63")
        if topk is not None and topk > 1:
            s = self.speculative_steps
            most = topk + (s - 1) * topk * topk  # candidates the head's steps produce
            if not 1 <= self.speculative_draft_tokens <= most:
                raise ValueError(f"--speculative-num-draft-tokens must be in 2..{most + 1} with "
                                 f"--speculative-num-steps {s} and --speculative-eagle-topk "
                                 f"{topk} (the last accepted token plus at most {most} draft "
                                 "nodes)")
            return
        if steps is not None and n is not None and n != steps + 1:
            raise ValueError(f"--speculative-num-draft-tokens ({n}) must be "
                             f"--speculative-num-steps + 1 ({steps + 1}) with top-k 1: each "
                             "draft step proposes one token, verified with the last accepted one")
