"""The output processor: appending a sampled token (with every stop check), and the TokenOut
messages that carry a request's new ids to the detokenizer."""

from __future__ import annotations

from typing import Any

from srt.managers.io_struct import TokenLogprobs, TokenOut
from srt.model_process.req import FinishReason, Req
from srt.stop_regex import SEARCH_TIMEOUT_S, match_stop


class OutputProcessor:
    def __init__(self, tokenizer: Any, eos_ids: set[int], stream_interval: int) -> None:
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.stream_interval = stream_interval
        self.generated = 0  # tokens appended (net of jump re-tokenizing), for the stats line

    def stop_ids(self, req: Req) -> set[int]:
        """The ids that end the request (min_new_tokens keeps them out before that)."""
        ids = set(req.sampling_params.stop_token_ids)
        if not req.sampling_params.ignore_eos:
            ids |= self.eos_ids
        return ids

    def append(self, req: Req, tok: int, logprob: TokenLogprobs | None = None,
               dead_end: bool = True) -> None:
        """Append one output id and finish the request if it ends here: the grammar (its EOS, a
        token outside it, a completed pattern), stop ids, stop strings / regexes, the length.
        `dead_end=False` leaves the completed-pattern check to a later `finish_dead_ends` over
        the whole step (which prefetches the matchers' next masks together)."""
        req.output_ids.append(tok)
        if logprob is not None:
            req.output_logprobs.extend(logprob)
        self.generated += 1
        p = req.sampling_params
        if req.matcher is not None:
            if req.matcher.is_stop_token(tok):
                req.end(FinishReason.stop(tok))
                return
            if not req.matcher.accept(tok):
                # cannot happen under the mask; never continue off the pattern
                req.end(FinishReason.abort("token outside the pattern"))
                return
        if len(req.output_ids) >= p.min_new_tokens:
            if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_ids):
                req.end(FinishReason.stop(tok))
                return
            if p.stop or p.stop_regex:
                try:
                    matched = match_stop(lambda ids: self.tokenizer.decode(
                        ids, skip_special_tokens=p.skip_special_tokens),
                        req.output_ids, p.stop, p.stop_regex)
                except TimeoutError:
                    req.end(FinishReason.abort(
                        f"a stop_regex took over {SEARCH_TIMEOUT_S} s to search the output"))
                    return
                if matched is not None:
                    req.end(FinishReason.stop(matched))
                    return
        if len(req.output_ids) >= p.max_new_tokens:
            req.end(FinishReason.of_length(len(req.output_ids)))
        elif dead_end and req.matcher is not None and req.matcher.is_dead_end():
            # The pattern is complete and nothing may follow: done without sampling EOS.
            req.end(FinishReason.stop(None))

    @staticmethod
    def finish_dead_ends(reqs: list[Req]) -> None:
        """The completed-pattern check that `append(..., dead_end=False)` left out, for every
        unfinished constrained request of `reqs`; each backend first prefetches its matchers."""
        groups: dict[type, list[Any]] = {}
        for r in reqs:
            if not r.finished and r.matcher is not None:
                groups.setdefault(type(r.matcher), []).append(r.matcher)
        for cls, ms in groups.items():
            cls.prefetch(ms)
        for r in reqs:
            if not r.finished and r.matcher is not None and r.matcher.is_dead_end():
                r.end(FinishReason.stop(None))

    def due(self, req: Req) -> bool:
        """A streamed request has at least its stream interval of unsent ids."""
        interval = req.sampling_params.stream_interval or self.stream_interval
        return req.stream and len(req.output_ids) - req.sent_len >= interval

    def token_out(self, r: Req) -> TokenOut:
        """The request's unsent ids (and logprobs), marked sent."""
        new = r.output_ids[r.sent_len :]
        out_lp = r.output_logprobs.since(r.sent_len) if r.logprob is not None else None
        in_lp, r.input_logprobs = r.input_logprobs, None  # the prompt's are sent once
        r.sent_len = len(r.output_ids)
        p = r.sampling_params
        return TokenOut(
            rid=r.rid,
            new_ids=new,
            prompt_tokens=len(r.origin_input_ids),
            cached_tokens=max(0, r.cached_tokens),
            completion_tokens=len(r.output_ids),
            finish_reason=r.finish.to_dict() if r.finish is not None else None,
            forward_passes=r.forward_passes,
            spec=r.spec,
            skip_special_tokens=p.skip_special_tokens,
            spaces_between_special_tokens=p.spaces_between_special_tokens,
            stop=list(p.stop),
            stop_regex=list(p.stop_regex),
            no_stop_trim=p.no_stop_trim,
            input_logprobs=in_lp,
            output_logprobs=out_lp,
            return_text_in_logprobs=r.logprob is not None and r.logprob.return_text_in_logprobs,
            embedding=r.embedding,
        )
