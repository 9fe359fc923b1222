"""The detokenizer process: token ids -> text, incrementally and UTF-8 safe, with stop strings
trimmed; the texts of tokens in logprobs when asked for; control results pass through. Imports
only the tokenizer and the messages.
"""

from __future__ import annotations

import logging

import zmq

from srt.faults import fault_point
from srt.managers.comm import PullSocket, PushSocket
from srt.managers.detokenize import IncrementalDetokenizer
from srt.managers.io_struct import BatchStrOut, BatchTokenIdOut, StrOut, TokenLogprobs, TokenOut
from srt.port_args import PortArgs
from srt.server_args import ServerArgs
from srt.utils import ChildLink, run_loop, start_child
from srt.watchdog import IDLE_POLL_MS, Heartbeat

logger = logging.getLogger(__name__)


class DetokenizerManager:
    def __init__(self, args: ServerArgs, ports: PortArgs, heartbeat: Heartbeat) -> None:
        from transformers import AutoTokenizer

        self.heartbeat = heartbeat
        self.fault = fault_point(args.fault, "detokenizer")
        self.tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_path)
        self.ctx = zmq.Context()
        self.inbox = PullSocket(self.ctx, ports.router_to_detokenizer)
        self.outbox = PushSocket(self.ctx, ports.detokenizer_to_tokenizer)
        self.states: dict[str, IncrementalDetokenizer] = {}

    def handle(self, batch: BatchTokenIdOut) -> BatchStrOut:
        return BatchStrOut([self._one(o) for o in batch.outs])

    def _one(self, o: TokenOut) -> StrOut:
        det = self.states.get(o.rid)
        if det is None:
            det = IncrementalDetokenizer(
                self.tokenizer,
                skip_special_tokens=o.skip_special_tokens,
                stop_strings=tuple(o.stop),
                no_stop_trim=o.no_stop_trim,
                spaces_between_special_tokens=o.spaces_between_special_tokens,
                stop_regexes=tuple(o.stop_regex),
            )
            self.states[o.rid] = det
        shown = det.state.shown  # what the request's StrOuts gave so far
        text = det.add(o.new_ids)  # (extends what was shown)
        start = len(shown)
        if o.finish_reason is not None:
            matched = o.finish_reason.get("matched")
            text = det.finish(matched if isinstance(matched, str) else None)
            start = _common_prefix_len(shown, text)
            del self.states[o.rid]
        return StrOut(
            rid=o.rid,
            text=text[start:],
            text_start=start,
            new_ids=o.new_ids,
            prompt_tokens=o.prompt_tokens,
            cached_tokens=o.cached_tokens,
            completion_tokens=o.completion_tokens,
            finish_reason=o.finish_reason,
            forward_passes=o.forward_passes,
            spec=o.spec,
            input_logprobs=self._with_texts(o.input_logprobs, o.return_text_in_logprobs),
            output_logprobs=self._with_texts(o.output_logprobs, o.return_text_in_logprobs),
            embedding=o.embedding,
        )

    def _with_texts(self, lp: TokenLogprobs | None, want: bool) -> TokenLogprobs | None:
        """Each token decoded alone (special tokens shown), for the logprob lists."""
        if lp is None or not want:
            return lp
        flat = list(lp.token_ids) + [t for ids in lp.top_ids if ids for t in ids]
        texts = iter(self.tokenizer.batch_decode([[t] for t in flat], skip_special_tokens=False))
        lp.texts = [next(texts) for _ in lp.token_ids]
        lp.top_texts = [None if ids is None else [next(texts) for _ in ids] for ids in lp.top_ids]
        return lp

    def loop(self) -> None:
        while True:
            msg = self.inbox.recv(IDLE_POLL_MS)
            self.heartbeat.beat()
            if msg is None:
                continue
            if isinstance(msg, BatchTokenIdOut):
                self.fault.tick()
                self.outbox.send(self.handle(msg))
            else:  # control results go back unchanged
                self.outbox.send(msg)


def _common_prefix_len(a: str, b: str) -> int:
    if b.startswith(a):
        return len(a)
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def run_detokenizer_process(args: ServerArgs, ports: PortArgs, link: ChildLink) -> None:
    detokenizer = start_child(link, args, "detokenizer",
                              lambda: DetokenizerManager(args, ports, link.heartbeat))
    run_loop("detokenizer process", detokenizer.loop)
