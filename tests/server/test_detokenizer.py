"""Incremental detokenization (real SmolLM2 tokenizer) and stop-string matching."""

import random

import pytest

from server.detokenizer import IncrementalDetokenizer, StopStringMatcher

TEXTS = [
    "Hello, world! This is a plain ASCII sentence.",
    "🙂👍🏽",
    "Emoji in text: 🙂 ok 👍🏽 done 🎉🎉",
    "日本語のテキスト",
    "naïve café, résumé, Straße, Ελληνικά",
    "mixed: 日本語 and 🙂 and naïve\n\nsecond paragraph",
    "  leading spaces, tabs\tand  double  spaces ,  . ! ?",
    "code: def f(x):\n    return x ** 2  # ok",
]
IM_END = 2


def stream(tokenizer, ids, chunk=1):
    """Push ids `chunk` at a time; the last push is final. Returns the deltas."""
    detok = IncrementalDetokenizer(tokenizer)
    deltas = []
    for i in range(0, len(ids), chunk):
        deltas.append(detok.push(ids[i:i + chunk], final=i + chunk >= len(ids)))
    return deltas


def encode(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", TEXTS)
def test_one_token_at_a_time_matches_full_decode(smollm2_tokenizer, text):
    ids = encode(smollm2_tokenizer, text)
    deltas = stream(smollm2_tokenizer, ids)
    expected = smollm2_tokenizer.decode(ids, skip_special_tokens=True)
    assert "".join(deltas) == expected
    assert expected == text  # the texts round-trip through this tokenizer
    for d in deltas:
        assert "\ufffd" not in d


def test_multibyte_characters_span_several_tokens(smollm2_tokenizer):
    # guards the test above: these characters really are split across byte-level tokens,
    # so a naive per-token decode would emit U+FFFD
    for text in ("🙂👍🏽", "日本語のテキスト"):
        ids = encode(smollm2_tokenizer, text)
        assert any("\ufffd" in smollm2_tokenizer.decode([i]) for i in ids)
        deltas = stream(smollm2_tokenizer, ids)
        assert "" in deltas  # some pushes had to hold an incomplete character back


@pytest.mark.parametrize("chunk", [2, 3, 5])
def test_chunked_pushes_match_full_decode(smollm2_tokenizer, chunk):
    text = TEXTS[5]
    ids = encode(smollm2_tokenizer, text)
    deltas = stream(smollm2_tokenizer, ids, chunk)
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)


def test_special_tokens_are_skipped(smollm2_tokenizer):
    assert smollm2_tokenizer.convert_ids_to_tokens(IM_END) == "<|im_end|>"
    ids = encode(smollm2_tokenizer, "Hi 🙂") + [IM_END] + encode(smollm2_tokenizer, " there") \
        + [IM_END]
    deltas = stream(smollm2_tokenizer, ids)
    assert "".join(deltas) == "Hi 🙂 there"
    assert "".join(deltas) == smollm2_tokenizer.decode(ids, skip_special_tokens=True)
    assert not any("<|im_end|>" in d or "\ufffd" in d for d in deltas)
    assert deltas[-1] == ""  # the trailing special token adds nothing


def test_final_releases_an_incomplete_character(smollm2_tokenizer):
    ids = encode(smollm2_tokenizer, "ok 👍🏽")
    # cut inside a character's bytes
    cut = next(k for k in range(2, len(ids))
               if smollm2_tokenizer.decode(ids[:k]).endswith("\ufffd"))
    ids = ids[:cut]
    detok = IncrementalDetokenizer(smollm2_tokenizer)
    out = "".join(detok.push([i]) for i in ids[:-1])
    assert "\ufffd" not in out
    out += detok.push(ids[-1:], final=True)
    assert out == smollm2_tokenizer.decode(ids, skip_special_tokens=True)
    assert out.endswith("\ufffd")


# ---- stop strings ----

def feed_all(matcher, pieces, final_last=True):
    out = []
    for i, p in enumerate(pieces):
        out.append(matcher.feed(p, final=final_last and i == len(pieces) - 1))
    return out


def split_randomly(text, rng, max_piece=3):
    pieces, i = [], 0
    while i < len(text):
        n = rng.randint(1, max_piece)
        pieces.append(text[i:i + n])
        i += n
    return pieces


@pytest.mark.parametrize("seed", range(20))
def test_stop_split_across_many_feeds(seed):
    rng = random.Random(seed)
    stop = "<STOP>"
    text = "some text before < ST <STO and then <STOP> and after <STOP> more"
    expected = text[:text.index(stop)]
    m = StopStringMatcher([stop])
    emitted = ""
    for piece in split_randomly(text, rng):
        emitted += m.feed(piece)
        # never ahead of the stop, never any part of it
        assert expected.startswith(emitted)
    assert m.stopped
    assert emitted == expected
    assert emitted + m.feed("x", final=True) == expected


def test_stop_in_one_feed():
    m = StopStringMatcher(["\n\n"])
    assert m.feed("para one\n\npara two") == "para one"
    assert m.stopped
    assert m.feed("more", final=True) == ""


def test_earliest_of_several_stops_wins():
    text = "alpha END beta STOP gamma"
    for stops in (["STOP", "END"], ["END", "STOP"], ["STOP", "END", "gamma"]):
        m = StopStringMatcher(stops)
        assert "".join(feed_all(m, list(text))) == "alpha "
        assert m.stopped
        m = StopStringMatcher(stops)
        assert m.feed(text) == "alpha "  # both present at once: the earlier one
    m = StopStringMatcher(["a very long stop", "x"])
    assert "".join(feed_all(m, list("hello x world"))) == "hello "


def test_lookalike_prefix_is_released_once_disambiguated():
    m = StopStringMatcher(["STOP"])
    first = m.feed("STO")
    assert first == ""  # could still become STOP
    second = m.feed("RM")
    assert not m.stopped
    assert "STORM".startswith(first + second) and first + second != ""
    rest = m.feed(" is over", final=True)
    assert first + second + rest == "STORM is over"
    assert not m.stopped


def test_no_stop_strings_release_everything_immediately():
    for stops in ([], [""]):
        m = StopStringMatcher(stops)
        assert m.feed("a") == "a"
        assert m.feed("bc") == "bc"
        assert m.feed("") == ""
        assert m.feed("d", final=True) == "d"
        assert not m.stopped


def test_final_releases_the_held_back_tail():
    m = StopStringMatcher(["STOP"])
    out = m.feed("the end ST")
    assert out == "the end"[:len("the end ST") - 3]
    assert m.feed("", final=True) == "the end ST"[len(out):]
    assert not m.stopped


def test_nothing_after_a_stop():
    m = StopStringMatcher(["##"])
    assert "".join(feed_all(m, ["ab", "#", "#cd"], final_last=False)) == "ab"
    assert m.stopped
    assert m.feed("more text") == ""
    assert m.feed("## again", final=True) == ""


# ---- both together ----

def test_detokenize_through_stop_matcher(smollm2_tokenizer):
    full_text = ("First paragraph with naïve café and 🙂.\n\n"
                 "Second paragraph 日本語.\n\nThird.")
    ids = encode(smollm2_tokenizer, full_text)
    assert smollm2_tokenizer.decode(ids) == full_text
    detok = IncrementalDetokenizer(smollm2_tokenizer)
    m = StopStringMatcher(["\n\n"])
    out = ""
    for i, tid in enumerate(ids):
        final = i == len(ids) - 1
        delta = detok.push([tid], final=final)
        assert "\ufffd" not in delta
        out += m.feed(delta, final=final)
        if m.stopped:
            break
    assert m.stopped
    assert out == full_text.split("\n\n")[0]
