"""Tests for srt.managers.detokenize (incremental detokenization + stop strings).

Core tests use a tiny byte-level BPE trained in-memory (always runs); a few also
run on the real SmolLM2 tokenizer when it is available.
"""

from __future__ import annotations

import random

import pytest

from srt.managers.detokenize import IncrementalDetokenizer

FFFD = "\ufffd"

# Multi-byte material: 2-byte (accents), 3-byte (CJK), 4-byte (emoji), and a
# skin-tone modifier sequence.
MULTIBYTE_TEXTS = [
    "héllo wörld, ça va? naïve façade",
    "中文测试：你好，世界！日本語もテスト",
    "emoji 😀🎉 and 👍🏽 then 🇫🇷 flags",
    "mixé 中 😀 a\nb\n\nc ñ 한국어 Ελληνικά",
]
CHAR_POOL = list("ab xyz.,\n") + list("éüçñ") + list("中文字") + ["😀", "🎉", "👍🏽", "𝔘"]


# ----------------------------------------------------------------- tokenizers


def _train_byte_level(corpus: list[str], vocab_size: int = 300):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
    )


@pytest.fixture(scope="module")
def tiny_tokenizer():
    # ASCII-only corpus: every non-ASCII character stays split into byte tokens,
    # so multi-byte characters are guaranteed to span several ids.
    corpus = [
        "Hello world, this is a small test corpus.",
        "Stop here.\n\nNext paragraph follows the blank line.",
        "The quick brown fox jumps over the lazy dog.",
        "assistant user system hello again and again",
    ]
    return _train_byte_level(corpus)


@pytest.fixture(scope="module")
def tokenizer(smollm2_tokenizer):
    return smollm2_tokenizer


@pytest.fixture(scope="module")
def metaspace_tokenizer():
    """SentencePiece-style tokenizer: the decoder drops the leading space of the
    first token, so the first output token needs prompt context."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "</s>"], show_progress=False)
    tok.train_from_iterator(["hello world hello there world peace"] * 3, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>")


# -------------------------------------------------------------------- helpers


def _stream(tok, ids, chunk_sizes=None, **kwargs):
    """Feed ids (one at a time, or in the given chunk sizes); return (outputs, detok)."""
    d = IncrementalDetokenizer(tok, **kwargs)
    outs = []
    i = 0
    sizes = iter(chunk_sizes or [])
    while i < len(ids):
        n = next(sizes, 1)
        outs.append(d.add(ids[i : i + n]))
        i += n
    return outs, d


def _assert_prefix_chain(outs, final):
    prev = ""
    for out in outs:
        assert out.startswith(prev), (prev, out)
        assert final.startswith(out), (out, final)
        prev = out


def _random_chunks(rng, n):
    sizes = []
    while sum(sizes) < n:
        sizes.append(rng.choice([1, 1, 1, 2, 3, 5]))
    return sizes


def _encode(tok, text):
    return tok.encode(text, add_special_tokens=False)


# ------------------------------------------------------------- UTF-8 safety


def _check_multibyte_streaming(tok):
    split_seen = False
    for text in MULTIBYTE_TEXTS:
        ids = _encode(tok, text)
        assert tok.decode(ids) == text
        split_seen |= any(FFFD in tok.decode([i]) for i in ids)
        outs, d = _stream(tok, ids)
        for out in outs:
            assert FFFD not in out
        _assert_prefix_chain(outs, text)
        assert outs[-1] == text
        assert d.finish(None) == text
    # Guard against a vacuous test: some character really was split across ids.
    assert split_seen


def test_multibyte_split_never_shows_replacement_tiny(tiny_tokenizer):
    _check_multibyte_streaming(tiny_tokenizer)


def test_multibyte_split_never_shows_replacement_smollm2(tokenizer):
    _check_multibyte_streaming(tokenizer)


def test_partial_character_is_held_back(tiny_tokenizer):
    tok = tiny_tokenizer
    ids = _encode(tok, "a😀")
    assert len(ids) >= 3  # 'a' + the 4 bytes of the emoji in >= 2 ids
    d = IncrementalDetokenizer(tok)
    assert d.add(ids[:1]) == "a"
    for i in range(1, len(ids) - 1):
        assert d.add([ids[i]]) == "a"  # emoji incomplete: nothing new shown
    assert d.add([ids[-1]]) == "a😀"
    assert d.output_ids == ids


def test_random_strings_streamed_in_random_chunks(tiny_tokenizer):
    tok = tiny_tokenizer
    rng = random.Random(1234)
    for _ in range(150):
        text = "".join(rng.choice(CHAR_POOL) for _ in range(rng.randint(1, 25)))
        ids = _encode(tok, text)
        outs, d = _stream(tok, ids, _random_chunks(rng, len(ids)))
        assert all(FFFD not in o for o in outs)
        _assert_prefix_chain(outs, text)
        assert outs[-1] == text
        assert d.finish(None) == tok.decode(ids, skip_special_tokens=True) == text


def _check_random_ids(tok, vocab, seed, n_seq):
    rng = random.Random(seed)
    special = list(tok.all_special_ids)
    byte_like = [i for i in range(min(vocab, 400)) if FFFD in tok.decode([i])]
    assert byte_like  # lone lead/continuation bytes exist in the vocab
    for _ in range(n_seq):
        ids = []
        for _ in range(rng.randint(1, 40)):
            r = rng.random()
            if r < 0.3:
                ids.append(rng.choice(byte_like))  # likely-invalid UTF-8 pieces
            elif r < 0.35:
                ids.append(rng.choice(special))
            else:
                ids.append(rng.randrange(vocab))
        for skip in (True, False):
            outs, d = _stream(tok, ids, _random_chunks(rng, len(ids)), skip_special_tokens=skip)
            final = d.finish(None)
            assert final == tok.decode(ids, skip_special_tokens=skip)
            _assert_prefix_chain(outs, final)


def test_random_id_sequences_prefix_of_final_tiny(tiny_tokenizer):
    _check_random_ids(tiny_tokenizer, len(tiny_tokenizer), seed=7, n_seq=200)


def test_random_id_sequences_prefix_of_final_smollm2(tokenizer):
    _check_random_ids(tokenizer, len(tokenizer), seed=11, n_seq=100)


# --------------------------------------------------------------- stop strings


def test_stop_prefix_held_back_then_released(tiny_tokenizer):
    tok = tiny_tokenizer
    d = IncrementalDetokenizer(tok, stop_strings=("\n\n",))
    assert d.add(_encode(tok, "Hello")) == "Hello"
    assert d.add(_encode(tok, "\n")) == "Hello"  # might become "\n\n"
    assert d.add(_encode(tok, "World")) == "Hello\nWorld"  # it did not
    assert d.finish(None) == "Hello\nWorld"


def test_stop_string_trims_and_freezes(tiny_tokenizer):
    tok = tiny_tokenizer
    d = IncrementalDetokenizer(tok, stop_strings=("\n\n",))
    assert d.add(_encode(tok, "Hello\n")) == "Hello"
    assert d.add(_encode(tok, "\n")) == "Hello"
    # Ids after the stop are recorded but never shown.
    extra = _encode(tok, "Next")
    assert d.add(extra) == "Hello"
    assert d.output_ids == _encode(tok, "Hello\n") + _encode(tok, "\n") + extra
    assert d.finish("\n\n") == "Hello"


def test_stop_string_inside_one_add_and_across_tokens(tiny_tokenizer):
    tok = tiny_tokenizer
    ids = _encode(tok, "the quick brown fox jumps")
    # "brown f" spans several tokens; everything arrives in one add.
    d = IncrementalDetokenizer(tok, stop_strings=("brown f",))
    assert d.add(ids) == "the quick "
    assert d.finish("brown f") == "the quick "
    # One id at a time: the growing match is held back, never shown.
    outs, d = _stream(tok, ids, stop_strings=("brown f",))
    assert all("the quick ".startswith(o) for o in outs)
    assert outs[-1] == "the quick "


def test_stop_earliest_occurrence_wins(tiny_tokenizer):
    tok = tiny_tokenizer
    d = IncrementalDetokenizer(tok, stop_strings=("fox", "quick"))
    assert d.add(_encode(tok, "the quick brown fox")) == "the "
    # finish cuts at the stop the scheduler reports.
    assert d.finish("fox") == "the quick brown "


def test_no_stop_trim_keeps_stop_and_cuts_after_it(tiny_tokenizer):
    tok = tiny_tokenizer
    d = IncrementalDetokenizer(tok, stop_strings=("\n\n",), no_stop_trim=True)
    assert d.add(_encode(tok, "Hello")) == "Hello"
    assert d.add(_encode(tok, "\n")) == "Hello\n"  # no hold-back needed
    assert d.add(_encode(tok, "\nNext")) == "Hello\n\n"
    assert d.add(_encode(tok, " more")) == "Hello\n\n"
    assert d.finish("\n\n") == "Hello\n\nNext more"


def test_finish_trims_at_first_occurrence_only_for_strings(tiny_tokenizer):
    tok = tiny_tokenizer
    ids = _encode(tok, "a.b.c")
    d = IncrementalDetokenizer(tok)
    d.add(ids)
    assert d.finish(".") == "a"
    assert d.finish(None) == "a.b.c"
    assert d.finish("zzz") == "a.b.c"  # not present: nothing cut


def test_stop_with_multibyte_and_random_prefix_property(tiny_tokenizer):
    tok = tiny_tokenizer
    rng = random.Random(99)
    stops = ("中文", "\n\n", "😀!")
    for _ in range(100):
        text = "".join(rng.choice(CHAR_POOL + ["!"]) for _ in range(rng.randint(1, 30)))
        ids = _encode(tok, text)
        outs, d = _stream(tok, ids, _random_chunks(rng, len(ids)), stop_strings=stops)
        hits = [(text.find(s), s) for s in stops if s in text]
        cut = min(hits)[0] if hits else len(text)
        expected_final = text[:cut]
        for o in outs:
            assert FFFD not in o
            assert expected_final.startswith(o)
            assert not any(s in o for s in stops)
        matched = min(hits)[1] if hits else None
        assert d.finish(matched) == expected_final
        if hits:
            assert outs[-1] == expected_final


# ------------------------------------------------------------ special tokens


@pytest.mark.parametrize("fixture_name", ["tiny_tokenizer", "tokenizer"])
def test_skip_special_tokens(request, fixture_name):
    tok = request.getfixturevalue(fixture_name)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    ids = _encode(tok, "Hi there") + [im_end]

    outs, d = _stream(tok, ids, skip_special_tokens=True)
    assert outs[-1] == "Hi there"
    assert d.finish(None) == tok.decode(ids, skip_special_tokens=True) == "Hi there"

    outs, d = _stream(tok, ids, skip_special_tokens=False)
    assert outs[-1] == "Hi there<|im_end|>"
    assert d.finish(None) == tok.decode(ids, skip_special_tokens=False) == "Hi there<|im_end|>"


def test_special_token_as_stop_string(tiny_tokenizer):
    tok = tiny_tokenizer
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    ids = _encode(tok, "Hello") + [im_end] + _encode(tok, "junk")
    outs, d = _stream(tok, ids, skip_special_tokens=False, stop_strings=("<|im_end|>",))
    assert outs[-1] == "Hello"
    assert d.finish("<|im_end|>") == "Hello"


@pytest.mark.parametrize("n_special", [1, 12])
def test_special_tokens_inside_split_character(tiny_tokenizer, n_special):
    # Skipped specials between the bytes of one character: the final decode joins
    # the bytes, so the incremental text must too (12 > the pending-id limit, so
    # the bounded-window fallback must not split the character either).
    tok = tiny_tokenizer
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    emoji_ids = _encode(tok, "😀")
    assert len(emoji_ids) >= 2
    ids = _encode(tok, "x") + emoji_ids[:1] + [im_end] * n_special + emoji_ids[1:]
    outs, d = _stream(tok, ids)
    assert all(FFFD not in o for o in outs)
    assert outs[-1] == d.finish(None) == tok.decode(ids, skip_special_tokens=True) == "x😀"


# --------------------------------------------------------------- prompt tail


def test_prompt_tail_is_context_not_output(tiny_tokenizer):
    tok = tiny_tokenizer
    prompt = _encode(tok, "<|im_start|>assistant\n")
    ids = _encode(tok, " Hello 中文 world")
    outs, d = _stream(tok, ids, prompt_ids_tail=prompt[-5:])
    _assert_prefix_chain(outs, d.finish(None))
    assert outs[-1] == d.finish(None) == tok.decode(ids) == " Hello 中文 world"
    assert d.output_ids == ids


def test_prompt_tail_ending_mid_character_is_ignored(tiny_tokenizer):
    tok = tiny_tokenizer
    emoji_ids = _encode(tok, "😀")
    ids = _encode(tok, "ok")
    outs, d = _stream(tok, ids, prompt_ids_tail=emoji_ids[:1])
    assert outs[-1] == d.finish(None) == "ok"


def test_prompt_tail_gives_sentencepiece_leading_space(metaspace_tokenizer):
    tok = metaspace_tokenizer
    full = _encode(tok, "hello world")
    prompt, out = full[:1], full[1:]
    assert tok.decode(out) == "world"  # decoded alone, the leading space is lost

    outs, d = _stream(tok, out, prompt_ids_tail=prompt)
    assert outs[-1] == " world"
    assert d.finish(None) == " world"  # finish is consistent with add()

    outs, d = _stream(tok, out)
    assert outs[-1] == d.finish(None) == "world"


def test_sentencepiece_streaming_keeps_inner_spaces(metaspace_tokenizer):
    tok = metaspace_tokenizer
    ids = _encode(tok, "hello world hello there")
    outs, d = _stream(tok, ids)
    _assert_prefix_chain(outs, d.finish(None))
    assert outs[-1] == tok.decode(ids) == "hello world hello there"


# ---------------------------------------------------------------------- cost


class _CountingTokenizer:
    def __init__(self, tok):
        self.tok = tok
        self.max_len = 0
        self.calls = 0

    def decode(self, ids, **kwargs):
        self.calls += 1
        self.max_len = max(self.max_len, len(ids))
        return self.tok.decode(ids, **kwargs)


def test_decode_window_does_not_grow_with_output(tiny_tokenizer):
    text = "".join(random.Random(5).choice(CHAR_POOL) for _ in range(1500))
    ids = _encode(tiny_tokenizer, text)
    counting = _CountingTokenizer(tiny_tokenizer)
    outs, d = _stream(counting, ids)
    assert len(ids) > 1000
    assert outs[-1] == text
    assert counting.max_len <= 12
    assert counting.calls <= 3 * len(ids)


@pytest.mark.parametrize("kind", ["lone_lead_bytes", "skipped_specials"])
def test_pathological_runs_keep_window_bounded(tiny_tokenizer, kind):
    tok = tiny_tokenizer
    if kind == "lone_lead_bytes":
        lead = next(i for i in range(len(tok)) if tok.decode([i]) == FFFD and tok.decode([i, i]) == FFFD * 2)
        junk = [lead] * 300
    else:
        junk = [tok.convert_tokens_to_ids("<|im_end|>")] * 300
    ids = _encode(tok, "ab") + junk + _encode(tok, "c😀")
    counting = _CountingTokenizer(tok)
    outs, d = _stream(counting, ids)
    final = d.finish(None)
    assert final == tok.decode(ids, skip_special_tokens=True)
    _assert_prefix_chain(outs, final)
    assert outs[-1] == final
    # Streaming decodes stayed small (finish's full decode is the one exception).
    counting.max_len = 0
    _stream(counting, ids)
    assert counting.max_len <= 24
