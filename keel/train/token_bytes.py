"""Bytes per token id, for bits per byte: total nats / ln 2 / total UTF-8 bytes of the targets.

The caches use a byte-level BPE (keel/data/tokenize.py): each vocabulary string spells bytes
through GPT-2's byte <-> unicode table (every byte is one printable character), so a token's
byte length is the number of characters of its string. Special added tokens (the EOS
"<|endoftext|>") count 0 bytes: they stand for no text. Non-special added tokens are matched in
the text as written, so they count the UTF-8 bytes of their content. Reads tokenizer.json as
JSON: no tokenizer library and no network needed.
"""

from __future__ import annotations

import json

import numpy as np

from keel.core import paths
from keel.core.errors import UsageError


def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's table: the printable character that stands for each byte -> the byte. Bytes that
    are printable Latin-1 characters stand for themselves; the other 68, in increasing order,
    for chr(256), chr(257), ..."""
    printable = {
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    }
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[chr(byte)] = byte
        else:
            table[chr(256 + extra)] = byte
            extra += 1
    return table


def _decodes_byte_level(decoder: dict | None) -> bool:
    if not decoder:
        return False
    if decoder.get("type") == "ByteLevel":
        return True
    if decoder.get("type") == "Sequence":
        return any(_decodes_byte_level(d) for d in decoder.get("decoders", []))
    return False


def token_byte_lengths(tokenizer_json_path: str, vocab_size: int) -> np.ndarray:
    """The UTF-8 byte length of each token id's text: [vocab_size] int32. Ids the tokenizer does
    not have (a model vocabulary padded past it) count 0. UsageError when the tokenizer is not a
    byte-level BPE or has ids at or past `vocab_size`."""
    path = tokenizer_json_path
    if not paths.exists(path):
        raise UsageError(f"tokenizer {path} does not exist: pass the path of a tokenizer.json")
    data = json.loads(paths.read_text(path))
    model = data.get("model") or {}
    if model.get("type", "BPE") != "BPE" or not _decodes_byte_level(data.get("decoder")):
        raise UsageError(
            f"tokenizer {path} is not a byte-level BPE (model {model.get('type')!r}, decoder "
            f"{(data.get('decoder') or {}).get('type')!r}): bits per byte needs one, as "
            "keel data tokenize --train-tokenizer makes"
        )
    vocab: dict[str, int] = model.get("vocab") or {}
    added = data.get("added_tokens") or []
    largest = max([*vocab.values(), *(token["id"] for token in added)], default=-1)
    if largest >= vocab_size:
        raise UsageError(
            f"tokenizer {path} has token id {largest}, past the model's vocabulary of "
            f"{vocab_size} ids: set model.vocab_size to at least {largest + 1}"
        )
    alphabet = byte_level_alphabet()
    lengths = np.zeros(vocab_size, np.int32)
    added_ids = {token["id"] for token in added}
    for token, index in vocab.items():
        if index in added_ids:
            continue  # a special token in the model's vocabulary too: counted below
        unknown = [char for char in token if char not in alphabet]
        if unknown:
            raise UsageError(
                f"tokenizer {path}: token {token!r} (id {index}) has {unknown[0]!r}, which is "
                "not in the byte-level alphabet: the tokenizer is not a byte-level BPE"
            )
        lengths[index] = len(token)
    for token in added:
        lengths[token["id"]] = 0 if token.get("special") else len(token["content"].encode())
    return lengths
