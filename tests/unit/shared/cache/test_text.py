"""Tests for melfeed.shared.cache.text: the documented vocabulary, the normaliser's rules, ids and what is dropped."""

from __future__ import annotations

import numpy as np
import pytest

from melfeed.shared.cache.text import PAD_SYMBOL, VOCAB_SIZE, VOCABULARY, decode_tokens, encode_text, normalize_text
from melfeed.shared.config import ModelConfig


def test_vocabulary_is_the_documented_table() -> None:
    assert VOCAB_SIZE == len(VOCABULARY) == 49
    assert VOCABULARY[0] == PAD_SYMBOL and VOCABULARY[1] == " "
    assert "".join(VOCABULARY[2:13]) == "!\"'(),-.:;?"
    assert VOCABULARY[13] == "a" and VOCABULARY[38] == "z"
    assert VOCABULARY[39] == "0" and VOCABULARY[48] == "9"
    assert len(set(VOCABULARY)) == VOCAB_SIZE
    assert VOCAB_SIZE <= ModelConfig().vocab_size  # the default model fits


@pytest.mark.parametrize(
    ("text", "normal"),
    [
        ("Hello,   World!", "hello, world!"),
        ("  Café déjà vu\t\n", "cafe deja vu"),
        ("\u201cQuoted\u201d \u2018single\u2019 it\u2019s", "\"quoted\" 'single' it's"),
        ("dash \u2013 and \u2014 minus \u2212", "dash - and - minus -"),
        ("wait\u2026", "wait..."),
        ("ﬁne", "fine"),  # NFKD splits the ligature
    ],
)
def test_normalize_text(text: str, normal: str) -> None:
    assert normalize_text(text) == normal


def test_encode_maps_characters_to_their_ids() -> None:
    encoded = encode_text("Abc, 19?")
    assert encoded.ids.dtype == np.int32
    assert encoded.ids.tolist() == [13, 14, 15, 7, 1, 40, 48, 12]
    assert encoded.dropped == 0
    assert decode_tokens(encoded.ids) == "abc, 19?"


def test_characters_outside_the_vocabulary_are_dropped_and_counted() -> None:
    encoded = encode_text("a [b] & c")
    assert decode_tokens(encoded.ids) == "a b c"  # the space left by "&" is collapsed
    assert encoded.dropped == 3
    assert 0 not in encoded.ids.tolist()


@pytest.mark.parametrize("text", ["", "   ", "[ ]", "\u3042\u3044"])
def test_nothing_left_gives_no_ids(text: str) -> None:
    assert encode_text(text).ids.size == 0


def test_decode_skips_padding_and_rejects_unknown_ids() -> None:
    assert decode_tokens([13, 0, 0]) == "a"
    with pytest.raises(ValueError, match="0..48"):
        decode_tokens([49])
