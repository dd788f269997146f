"""Gopher-style quality heuristics: cheap per-document attributes, computed a batch at a time.

The attributes are those of the Gopher rules (Rae et al. 2021, "Scaling Language Models", appendix
A: the quality filter and the repetition filter). Each is a column; filter.py's FilterConfig holds
the thresholds, whose defaults are the paper's (given below as "Gopher keeps").

    from keel.data.heuristics import heuristics

    heuristics("the cat sat on the mat")["word_count"]  # 6

Definitions (all counts in Unicode characters):
- token: a run of non-whitespace characters; word: a token with its leading and trailing
  punctuation and symbols (Unicode categories P and S) stripped, if anything is left ("(cat)," ->
  "cat"; "@-@" and "—" are not words).
- line: a line of the text with surrounding whitespace stripped; blank lines are not counted.

| column | meaning | Gopher keeps |
| --- | --- | --- |
| word_count | words | 50 to 100,000 |
| mean_word_length | characters per word | 3 to 10 |
| hash_to_word_ratio | "#" characters per word | at most 0.1 |
| ellipsis_to_word_ratio | "..." and "…" per word | at most 0.1 |
| bullet_line_fraction | lines starting with a bullet (BULLETS) | at most 0.9 |
| ellipsis_line_fraction | lines ending with "..." or "…" | at most 0.3 |
| alpha_word_fraction | words with an alphabetic character | at least 0.8 |
| stop_word_count | distinct STOP_WORDS present (case-insensitive) | at least 2 |
| duplicate_line_fraction | lines equal to an earlier line of the document | at most 0.3 |
| duplicate_line_char_fraction | characters of those lines / characters of all lines | at most 0.2 |
| top_{2,3,4}gram_char_fraction | see below | at most 0.20, 0.18, 0.16 |

top_Ngram_char_fraction: the word N-gram that occurs most often in the document (overlapping
occurrences count; among ties, the longest), its occurrences times its characters, over the
characters of all words; capped at 1, and 0 when no N-gram occurs twice. N-grams compare words as
written (case-sensitive).

Not implemented from the Gopher repetition filter: duplicate paragraphs and duplicate 5- to
10-gram fractions.

Vectorised: a batch is split into tokens and lines with Arrow kernels once; counts per document are
numpy bincounts over the document index of each token or line, and duplicate lines and n-grams
are found by dictionary-encoding (document, line) and (document, n-gram) keys. Measured: 6 to 10
MB of text a second on one core, 3x a per-document Python loop computing only half the columns.
"""

from __future__ import annotations

import functools
import unicodedata

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

STOP_WORDS = ("the", "be", "to", "of", "and", "that", "have", "with")
"""The Gopher stop words: a document must contain at least two of them."""

BULLETS = ("•", "‣", "⁃", "◦", "▪", "▫", "■", "□", "●", "○", "►", "▶", "➤", "-", "*", "·")
"""Characters that start a bullet line."""

NGRAM_SIZES = (2, 3, 4)

COLUMNS: dict[str, pa.DataType] = {
    "word_count": pa.int64(),
    "mean_word_length": pa.float64(),
    "hash_to_word_ratio": pa.float64(),
    "ellipsis_to_word_ratio": pa.float64(),
    "bullet_line_fraction": pa.float64(),
    "ellipsis_line_fraction": pa.float64(),
    "alpha_word_fraction": pa.float64(),
    "stop_word_count": pa.int64(),
    "duplicate_line_fraction": pa.float64(),
    "duplicate_line_char_fraction": pa.float64(),
    **{f"top_{n}gram_char_fraction": pa.float64() for n in NGRAM_SIZES},
}
"""The heuristic attribute columns, in the order they are added, and their types."""

_LETTER = r"\p{L}"
_BULLET_START = "^[" + "".join("\\" + b if b in "-^]\\" else b for b in BULLETS) + "]"
_ELLIPSES = ("...", "…")


def heuristics(text: str) -> dict[str, float | int]:
    """The heuristic attributes of one document (column -> value)."""
    columns = heuristic_columns(pa.array([text], pa.large_string()))
    return {name: column[0].as_py() for name, column in columns.items()}


def heuristic_columns(texts: pa.Array | pa.ChunkedArray) -> dict[str, pa.Array]:
    """The heuristic attributes of a batch of texts: column name -> array of len(texts), in COLUMNS
    order. A null text counts as empty."""
    if isinstance(texts, pa.ChunkedArray):
        texts = texts.combine_chunks()
    texts = pc.fill_null(texts.cast(pa.large_string()), "")
    num_docs = len(texts)
    words, word_doc = _words(texts)
    word_lengths = _lengths(words)
    word_count = np.bincount(word_doc, minlength=num_docs)
    word_chars = np.bincount(word_doc, weights=word_lengths, minlength=num_docs)
    lines, line_doc = _lines(texts)
    line_count = np.bincount(line_doc, minlength=num_docs)
    duplicate_lines, duplicate_chars, line_chars = _duplicate_lines(lines, line_doc, num_docs)
    ellipsis_lines = pc.or_(*(pc.ends_with(lines, ellipsis) for ellipsis in _ELLIPSES))
    values = {
        "word_count": word_count,
        "mean_word_length": _ratio(word_chars, word_count),
        "hash_to_word_ratio": _ratio(_occurrences(texts, ("#",)), word_count),
        "ellipsis_to_word_ratio": _ratio(_occurrences(texts, _ELLIPSES), word_count),
        "bullet_line_fraction": _ratio(
            _count_where(pc.match_substring_regex(lines, _BULLET_START), line_doc, num_docs),
            line_count,
        ),
        "ellipsis_line_fraction": _ratio(
            _count_where(ellipsis_lines, line_doc, num_docs), line_count
        ),
        "alpha_word_fraction": _ratio(
            _count_where(pc.match_substring_regex(words, _LETTER), word_doc, num_docs), word_count
        ),
        "stop_word_count": _stop_word_count(words, word_doc, num_docs),
        "duplicate_line_fraction": _ratio(duplicate_lines, line_count),
        "duplicate_line_char_fraction": _ratio(duplicate_chars, line_chars),
    }
    # word codes per document (the same word in two documents: two codes), so n-gram keys built
    # from them are per document too; n-grams that cross a document boundary are masked out
    codes = _dense(word_doc * (len(words) + 1) + _dense(pc.dictionary_encode(words).indices))
    char_offsets = np.concatenate([[0.0], np.cumsum(word_lengths)])
    ngrams = codes
    for n in range(2, max(NGRAM_SIZES) + 1):
        # keys of the n-grams starting at 0, 1, ...: equal n-grams, equal keys
        ngrams = _dense(ngrams[: len(codes) - n + 1] * (len(codes) + 1) + codes[n - 1 :])
        if n in NGRAM_SIZES:
            ngram_chars = char_offsets[n:] - char_offsets[:-n]
            top = _top_ngram_chars(ngrams, ngram_chars, word_doc, n, num_docs)
            values[f"top_{n}gram_char_fraction"] = np.minimum(_ratio(top, word_chars), 1.0)
    return {name: pa.array(values[name], COLUMNS[name]) for name in COLUMNS}


def _words(texts: pa.Array) -> tuple[pa.Array, np.ndarray]:
    """Every word of the batch, in order, and the index of its document."""
    tokens = pc.utf8_split_whitespace(texts)
    token_doc = _as_numpy(pc.list_parent_indices(tokens))
    stripped = pc.utf8_trim(pc.list_flatten(tokens), _punctuation_and_symbols())
    keep = _as_numpy(pc.greater(pc.utf8_length(stripped), 0))
    return stripped.filter(pa.array(keep)), token_doc[keep]


def _lines(texts: pa.Array) -> tuple[pa.Array, np.ndarray]:
    """Every non-blank line of the batch, stripped, and the index of its document."""
    split = pc.split_pattern(texts, "\n")
    line_doc = _as_numpy(pc.list_parent_indices(split))
    stripped = pc.utf8_trim_whitespace(pc.list_flatten(split))
    keep = _as_numpy(pc.greater(pc.utf8_length(stripped), 0))
    return stripped.filter(pa.array(keep)), line_doc[keep]


def _duplicate_lines(
    lines: pa.Array, line_doc: np.ndarray, num_docs: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per document: lines equal to an earlier line of it, their characters, all line characters."""
    lengths = _lengths(lines)
    codes = _dense(pc.dictionary_encode(lines).indices)
    keys = _dense(line_doc * (len(codes) + 1) + codes)
    repeated = np.ones(len(keys), dtype=bool)
    repeated[_first_occurrences(keys)] = False
    return (
        np.bincount(line_doc[repeated], minlength=num_docs),
        np.bincount(line_doc[repeated], weights=lengths[repeated], minlength=num_docs),
        np.bincount(line_doc, weights=lengths, minlength=num_docs),
    )


def _stop_word_count(words: pa.Array, word_doc: np.ndarray, num_docs: int) -> np.ndarray:
    """Per document: how many distinct STOP_WORDS occur (case-insensitive)."""
    index = pc.index_in(pc.utf8_lower(words), value_set=pa.array(STOP_WORDS, pa.large_string()))
    index = _as_numpy(pc.fill_null(index, -1))
    found = index >= 0
    present = np.zeros((num_docs, len(STOP_WORDS)), dtype=bool)
    present[word_doc[found], index[found]] = True
    return present.sum(axis=1)


def _top_ngram_chars(
    keys: np.ndarray, chars: np.ndarray, word_doc: np.ndarray, n: int, num_docs: int
) -> np.ndarray:
    """Per document: occurrences x characters of its most frequent word n-gram (the longest among
    ties), or 0 when no n-gram occurs twice. `keys[i]` (dense, per document) identifies the n-gram
    starting at word i, and `chars[i]` is its length in characters."""
    top = np.zeros(num_docs)
    within = word_doc[: len(keys)] == word_doc[n - 1 :]  # n-grams inside one document
    counts = np.bincount(keys[within], minlength=len(keys))
    first = _first_occurrences(keys)  # a key's first position; inside a document if its key is
    first = first[within[first]]
    key_doc = word_doc[first]
    counts = counts[keys[first]]
    most = np.zeros(num_docs, dtype=np.int64)
    np.maximum.at(most, key_doc, counts)
    best = (counts == most[key_doc]) & (counts >= 2)
    np.maximum.at(top, key_doc[best], counts[best] * chars[first[best]])
    return top


def _dense(keys: pa.Array | np.ndarray) -> np.ndarray:
    """Relabel keys 0, 1, 2, ... in order of first occurrence (a hash table, not a sort): equal
    keys, equal labels; int64."""
    if isinstance(keys, np.ndarray):
        keys = pc.dictionary_encode(pa.array(keys, pa.int64())).indices
    return _as_numpy(keys).astype(np.int64)


def _first_occurrences(labels: np.ndarray) -> np.ndarray:
    """Positions where each label of a _dense labelling first occurs (labels appear in increasing
    order, so a first occurrence is a new running maximum)."""
    previous_max = np.maximum.accumulate(np.concatenate([[-1], labels[:-1]]))
    return np.flatnonzero(labels > previous_max)


@functools.cache
def _punctuation_and_symbols() -> str:
    """Every character of Unicode categories P and S in planes 0 and 1 (BMP, emoji): what
    _words strips from the ends of tokens."""
    return "".join(
        chr(code) for code in range(0x20000) if unicodedata.category(chr(code))[0] in "PS"
    )


def _occurrences(texts: pa.Array, needles: tuple[str, ...]) -> np.ndarray:
    """Per text: non-overlapping occurrences of the needles, summed."""
    return sum(_as_numpy(pc.count_substring(texts, needle)) for needle in needles)


def _lengths(strings: pa.Array) -> np.ndarray:
    """Characters per string, float64."""
    return _as_numpy(pc.utf8_length(strings)).astype(np.float64)


def _count_where(mask: pa.Array, doc: np.ndarray, num_docs: int) -> np.ndarray:
    """Per document: how many of its items `mask` selects."""
    return np.bincount(doc[_as_numpy(mask)], minlength=num_docs)


def _ratio(numerator: np.ndarray, denominator: np.ndarray) -> np.ndarray:
    """numerator / denominator, 0 where the denominator is 0."""
    numerator = np.asarray(numerator, dtype=np.float64)
    return np.divide(numerator, denominator, out=np.zeros_like(numerator), where=denominator > 0)


def _as_numpy(array: pa.Array) -> np.ndarray:
    return array.to_numpy(zero_copy_only=False)
