"""Transcript normalisation and the character vocabulary that maps text to token ids.

Role: ``prepare`` turns each transcript into ``tokens/<id>.npy`` (int32 ids) with
``encode_text``; the vocabulary is stored in the manifest, so a model (and a person) can map
ids back to characters.

Vocabulary ``melfeed-chars/1`` (``VOCABULARY``; index = token id):

======  =====================================================
id 0    ``<pad>``: padding only, never produced by ``encode_text``
id 1    space
2..11   ``! " ' ( ) , - . : ;``  then ``?`` (id 12)
13..38  ``a`` .. ``z``
39..48  ``0`` .. ``9`` (numbers are not expanded: use LJSpeech's normalised column)
======  =====================================================

``vocab_size`` is 49, so ``model.vocab_size`` must be >= 49.

Normalisation (``normalize_text``), in order: Unicode NFKD with combining marks removed
(``é`` -> ``e``); typographic quotes and dashes to ASCII (``“”`` -> ``"``, ``’`` -> ``'``,
``–—`` -> ``-``, ``…`` -> ``...``); lower case; every run of whitespace to one space, stripped.
Characters still outside the vocabulary are dropped and counted (``EncodedText.dropped``).

Invariants: pure functions of their input; the same text always gives the same ids; a change
to the vocabulary or the normaliser must change ``TEXT_VERSION`` (it is part of the cache's
recorded features, so an old cache is then refused instead of silently misread).
Shutdown: nothing to shut down.
"""

from __future__ import annotations

import re
import unicodedata
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

__all__ = [
    "TEXT_VERSION",
    "PAD_SYMBOL",
    "VOCABULARY",
    "VOCAB_SIZE",
    "EncodedText",
    "normalize_text",
    "encode_text",
    "decode_tokens",
]

TEXT_VERSION = "melfeed-chars/1"
PAD_SYMBOL = "<pad>"
_SYMBOLS = " !\"'(),-.:;?" + "abcdefghijklmnopqrstuvwxyz" + "0123456789"
VOCABULARY: tuple[str, ...] = (PAD_SYMBOL, *_SYMBOLS)
VOCAB_SIZE = len(VOCABULARY)  # 49; token ids are 1..VOCAB_SIZE-1
_IDS = {ch: i for i, ch in enumerate(VOCABULARY) if i > 0}
_ASCII_MAP = str.maketrans(
    {
        "\u201c": '"',
        "\u201d": '"',
        "\u201e": '"',
        "\u00ab": '"',
        "\u00bb": '"',
        "\u2018": "'",
        "\u2019": "'",
        "\u201a": "'",
        "\u2032": "'",
        "\u2013": "-",
        "\u2014": "-",
        "\u2212": "-",
        "\u2026": "...",
    }
)
_SPACES = re.compile(r"\s+")


class EncodedText(NamedTuple):
    """Token ids of one transcript and how many characters had no id."""

    ids: npt.NDArray[np.int32]  # [tokens], every id in 1..VOCAB_SIZE-1; may be empty
    dropped: int  # characters outside the vocabulary after normalisation


def normalize_text(text: str) -> str:
    """ASCII-fold, lower-case and collapse whitespace; see the module docstring for the rules."""
    decomposed = unicodedata.normalize("NFKD", text.translate(_ASCII_MAP))
    folded = "".join(ch for ch in decomposed if not unicodedata.combining(ch))
    return _SPACES.sub(" ", folded.lower()).strip()


def encode_text(text: str) -> EncodedText:
    """Normalise ``text`` and map it to token ids, dropping characters outside the vocabulary.

    Returns:
        The ids (int32 [tokens], empty when nothing is left) and the number dropped. Spaces
        left next to each other by dropped characters are collapsed again.
    """
    normal = normalize_text(text)
    kept = [ch for ch in normal if ch in _IDS]
    dropped = len(normal) - len(kept)
    cleaned = _SPACES.sub(" ", "".join(kept)).strip()
    return EncodedText(np.array([_IDS[ch] for ch in cleaned], dtype=np.int32), dropped)


def decode_tokens(ids: npt.ArrayLike) -> str:
    """The characters of token ids (padding ids are skipped); for logs and debugging.

    Raises:
        ValueError: An id outside ``0..VOCAB_SIZE-1``.
    """
    arr = np.asarray(ids)
    if arr.size and (arr.min() < 0 or arr.max() >= VOCAB_SIZE):
        raise ValueError(f"token ids must be in 0..{VOCAB_SIZE - 1}")
    return "".join(VOCABULARY[i] for i in arr.tolist() if i > 0)
