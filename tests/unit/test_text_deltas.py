"""Output text travels as deltas: the detokenizer process sends each request's new text with
the position it starts at (StrOut.text, text_start), the HTTP process folds them back into the
cumulative text (ReqState), and the OpenAI streams send only what is new (`_new_text`). Checked
on SmolLM2's tokenizer: the folded text equals the incremental detokenizer's, piece sizes add up
to the text's length (no resending), and a final decode that differs from what was shown is
folded exactly."""

from __future__ import annotations

from typing import Any

from srt.managers.detokenize import IncrementalDetokenizer
from srt.managers.detokenizer_manager import DetokenizerManager
from srt.managers.io_struct import StrOut, TokenLogprobs, TokenOut
from srt.managers.openai_api import _new_text
from srt.managers.request_state import LogprobState, ReqState


def _manager(tokenizer: Any) -> DetokenizerManager:
    m = DetokenizerManager.__new__(DetokenizerManager)  # no sockets: only the conversion
    m.tokenizer, m.states = tokenizer, {}
    return m


def _outs(tokenizer: Any, ids: list[int], step: int,
          finish: dict[str, Any] | None = None, **options: Any) -> list[StrOut]:
    m = _manager(tokenizer)
    outs = []
    for i in range(0, len(ids), step):
        chunk = ids[i:i + step]
        last = i + step >= len(ids)
        reason = (finish or {"type": "length", "length": len(ids)}) if last else None
        outs.append(m._one(TokenOut("r", chunk, 5, 0, i + len(chunk), reason, **options)))
    return outs


def test_deltas_fold_to_the_detokenizers_text(smollm2_tokenizer: Any) -> None:
    text = "Héllo wörld! 中文字符 and emoji 😀😀 — a longer sentence, to stream in pieces."
    ids = smollm2_tokenizer.encode(text)
    for step in (1, 3):
        outs = _outs(smollm2_tokenizer, ids, step)
        state = ReqState("r")
        for o in outs:
            state.add(o)
        det = IncrementalDetokenizer(smollm2_tokenizer)
        det.add(ids)
        assert state.text == det.finish(None) == smollm2_tokenizer.decode(ids)
        assert sum(len(o.text) for o in outs) == len(state.text)  # nothing sent twice
        assert [o.text_start for o in outs] == \
            [sum(len(p.text) for p in outs[:k]) for k in range(len(outs))]
        # a stream's deltas rebuild it
        sent: list[str] = []
        for o in outs:
            d = _new_text(sent, sum(map(len, sent)), o.text, o.text_start)
            if d:
                sent.append(d)
        assert "".join(sent) == state.text


def test_held_stop_prefix_then_final(smollm2_tokenizer: Any) -> None:
    """A stop string's prefix is held back while it may still match; the final text (cut at
    the stop string) continues what was shown."""
    ids = smollm2_tokenizer.encode("one two three STOP")
    outs = _outs(smollm2_tokenizer, ids, 1, {"type": "stop", "matched": "STOP"},
                 stop=["STOP"])
    state = ReqState("r")
    for o in outs:
        state.add(o)
    assert state.text == "one two three "
    assert sum(len(o.text) for o in outs) == len(state.text)


def test_final_decode_that_differs_is_folded_exactly() -> None:
    state = ReqState("r", logprobs=LogprobState())
    pieces = [("abc", 0), ("def", 3), ("XY", 4)]  # the final decode differs after "abcd"
    lp = TokenLogprobs([-1.0], [7], [[]], [[]])
    items = []
    for k, (text, start) in enumerate(pieces):
        out = StrOut("r", text, [k], 3, 0, k + 1, {"type": "length"} if k == 2 else None,
                     output_logprobs=lp, text_start=start)
        items.append(ReqState.add_delta(state, out))
    assert state.text == "abcdXY"
    assert [i["meta_info"]["output_token_logprobs"] for i in items] == [[[-1.0, 7, None]]] * 3
    assert state.result_dict(out)["meta_info"]["output_token_logprobs"] == \
        [[-1.0, 7, None]] * 3
    sent: list[str] = []
    for i in items:
        d = _new_text(sent, sum(map(len, sent)), i["text"], i["text_start"])
        if d:
            sent.append(d)
    assert "".join(sent) == "abcdef"  # a stream cannot take back what it sent
