"""Deterministic CBOR (RFC 8949 §4.2.1) for the few shapes block identity needs.

Only definite-length items in their shortest form: unsigned and negative integers, byte strings,
text strings, arrays, null and booleans. There are no maps and no floats, so the only rule of
"core deterministic encoding" that applies is the shortest-head rule. The output equals
`cbor2.dumps(value, canonical=True)` for every supported value (tests check this with hypothesis).

The block hasher spends much of its time turning token ids into CBOR, so this module also has a
bulk encoder, `encode_uint_arrays`, that encodes a whole prompt with a few C-level byte and numpy
operations instead of one Python call per token.
"""
from __future__ import annotations

import operator
import re
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

_MAJOR_UINT = 0
_MAJOR_NEGINT = 1
_MAJOR_BYTES = 2
_MAJOR_TEXT = 3
_MAJOR_ARRAY = 4

_NULL = b"\xf6"
_FALSE = b"\xf4"
_TRUE = b"\xf5"
_UINT64_LIMIT = 1 << 64


def head(major: int, argument: int) -> bytes:
    """The shortest initial byte(s) for a major type and its argument (a length or a value)."""
    if argument < 24:
        return bytes((major << 5 | argument,))
    if argument < 0x100:
        return bytes((major << 5 | 24, argument))
    if argument < 0x10000:
        return bytes((major << 5 | 25,)) + argument.to_bytes(2, "big")
    if argument < 0x100000000:
        return bytes((major << 5 | 26,)) + argument.to_bytes(4, "big")
    if argument < _UINT64_LIMIT:
        return bytes((major << 5 | 27,)) + argument.to_bytes(8, "big")
    raise ValueError(f"CBOR argument {argument} does not fit in 64 bits")


def encode(value: object) -> bytes:
    """Encode None, bool, int, bytes, str and (nested) lists or tuples as deterministic CBOR."""
    parts: list[bytes] = []
    _encode_into(value, parts)
    return b"".join(parts)


def _encode_into(value: object, parts: list[bytes]) -> None:
    if value is None:
        parts.append(_NULL)
    elif value is True:
        parts.append(_TRUE)
    elif value is False:
        parts.append(_FALSE)
    elif isinstance(value, int):
        if value >= 0:
            parts.append(head(_MAJOR_UINT, value))
        else:
            parts.append(head(_MAJOR_NEGINT, -1 - value))
    elif isinstance(value, (bytes, bytearray, memoryview)):
        data = bytes(value)
        parts.append(head(_MAJOR_BYTES, len(data)))
        parts.append(data)
    elif isinstance(value, str):
        data = value.encode("utf-8")
        parts.append(head(_MAJOR_TEXT, len(data)))
        parts.append(data)
    elif isinstance(value, (list, tuple)):
        parts.append(head(_MAJOR_ARRAY, len(value)))
        for item in value:
            _encode_into(item, parts)
    else:
        raise TypeError(f"cannot encode {type(value).__name__} as block-identity CBOR")


class _UintEncodings(dict):
    """token id -> its CBOR encoding, filled on first use (bounded by the vocabulary size)."""

    def __missing__(self, value: int) -> bytes:
        encoded = head(_MAJOR_UINT, value)
        self[value] = encoded
        return encoded


_UINT_ENCODINGS = _UintEncodings()


def _checked_uint(value: object) -> int:
    try:
        number = operator.index(value)
    except TypeError:
        raise ValueError(f"token ids must be integers, got {value!r}") from None
    if isinstance(value, bool) or not 0 <= number < _UINT64_LIMIT:
        raise ValueError(f"token ids must be unsigned integers below 2**64, got {value!r}")
    return number


def encode_uints(values: Sequence[int]) -> bytes:
    """The concatenated CBOR encodings of unsigned integers (no array head), validating each."""
    table = _UINT_ENCODINGS
    return b"".join([table[_checked_uint(v)] for v in values])


@lru_cache(maxsize=8)
def _fixed_width_pattern(width: int) -> re.Pattern[bytes]:
    return re.compile(b".{%d}" % width, re.DOTALL)


_U32 = next(code for code in "IL" if array(code).itemsize == 4)
_NATIVE_LITTLE_ENDIAN = sys.byteorder == "little"
# Splicing values below 256 into fixed-width arrays beats the vectorized path while they number at most
# one per this many arrays (a splice costs about two arrays' share of the vectorized path).
_SPARSE_SMALL_IDS = 2
_U16_HEAD = bytes((_MAJOR_UINT << 5 | 25,))


def encode_uint_arrays(values: Sequence[int], length: int, suffix: bytes = b"") -> list[bytes]:
    """Encode `values` as consecutive arrays of `length` items, each followed by `suffix`.

    Item i of the result is `encode(values[i*length : (i+1)*length]) + suffix`; `len(values)`
    must be a multiple of `length`. (The block hasher's suffix is the encoded `extra` value, so
    each item is everything of a block's hash input after its parent.) The values are packed once
    into 32-bit big-endian words, then one of three paths runs, by what the values are:

    - all in [256, 65536) (random ids of a vocabulary under 64k): each encodes as `0x19` plus two
      bytes, so every array has one width and is laid out at once in a numpy grid;
    - the same, but a few below 256 (shorter encodings): their 1- or 2-byte encodings are spliced
      into the fixed-width arrays afterwards;
    - anything else, such as real text, where about a third of the tokens of a byte-level BPE
      vocabulary (punctuation, spaces, newlines) lie below 256, or ids of 64k and more: every value's
      encoding is built at once with numpy as a head byte plus the last 0-4 of its big-endian bytes.

    Values that are not integers in [0, 2**32) take the general path, which validates each one.
    """
    count = len(values)
    if count % length:
        raise ValueError(f"{count} values do not split into arrays of {length}")
    array_head = head(_MAJOR_ARRAY, length)
    try:
        words = array(_U32)
        words.fromlist(values if isinstance(values, list) else list(values))
    except (TypeError, OverflowError):
        return [b"".join((array_head, encode_uints(values[i : i + length]), suffix))
                for i in range(0, count, length)]
    if _NATIVE_LITTLE_ENDIAN:
        words.byteswap()
    raw = words.tobytes()
    layout = _ArrayLayout(array_head, length, suffix, count // length)
    if raw[0::4].count(0) != count or raw[1::4].count(0) != count:  # some value >= 65536
        return _encode_arrays_vectorized(raw, layout)
    high_bytes = raw[2::4]
    num_small = high_bytes.count(0)  # a zero high byte marks a value below 256
    if num_small * _SPARSE_SMALL_IDS > layout.num_arrays:
        return _encode_arrays_vectorized(raw, layout)
    packed = bytearray(3 * count)  # byte-strided slicing is several times faster than numpy's here
    packed[0::3] = _U16_HEAD * count
    packed[1::3] = high_bytes
    packed[2::3] = raw[3::4]
    grid = layout.grid(3)
    layout.items(grid, 3)[:] = np.frombuffer(packed, dtype=np.uint8).reshape(layout.num_arrays, length, 3)
    # Every array is now exactly one row of the grid; a regex splits them in one C loop (about a
    # third faster than a comprehension of slices).
    arrays = _fixed_width_pattern(grid.shape[1]).findall(grid.tobytes())
    # Splice the shorter encodings of values below 256 into their arrays, right to left within an
    # array so the offsets still to visit do not move.
    position = high_bytes.find(0)
    while position != -1:
        index = position // length
        first = index * length
        positions = [position]
        position = high_bytes.find(0, position + 1)
        while position != -1 and position < first + length:
            positions.append(position)
            position = high_bytes.find(0, position + 1)
        encoded = arrays[index]
        for small in reversed(positions):
            offset = len(array_head) + 3 * (small - first)
            encoded = encoded[:offset] + _UINT_ENCODINGS[raw[4 * small + 3]] + encoded[offset + 3 :]
        arrays[index] = encoded
    return arrays


@dataclass(frozen=True)
class _ArrayLayout:
    """One row per array: `head`, then `length` items of a fixed width, then `suffix`."""

    head: bytes
    length: int
    suffix: bytes
    num_arrays: int

    def grid(self, item_width: int) -> np.ndarray:
        """A grid with every row's head and suffix filled in; the items are left to the caller."""
        width = len(self.head) + item_width * self.length + len(self.suffix)
        grid = np.empty((self.num_arrays, width), dtype=np.uint8)
        grid[:, : len(self.head)] = np.frombuffer(self.head, dtype=np.uint8)
        if self.suffix:
            grid[:, width - len(self.suffix) :] = np.frombuffer(self.suffix, dtype=np.uint8)
        return grid

    def items(self, grid: np.ndarray, item_width: int) -> np.ndarray:
        """The item columns of `grid` seen as [array, item, byte]."""
        start = len(self.head)
        return grid[:, start : start + item_width * self.length].reshape(self.num_arrays, self.length, item_width)


def _encode_arrays_vectorized(big_endian_words: bytes, layout: _ArrayLayout) -> list[bytes]:
    """`encode_uint_arrays` for 32-bit big-endian words, any mix of encoded widths.

    A value's shortest encoding is a head byte followed by the last 0, 1, 2 or 4 of its four
    big-endian bytes: lay out the head and the last two bytes of every value (all four when some
    value is 65536 or more), then keep the bytes each one needs.
    """
    shape = (layout.num_arrays, layout.length)
    values = np.frombuffer(big_endian_words, dtype=">u4").reshape(shape)
    tiny = values < 24
    wide = values >= 256
    widest = values >= 65536
    byte_columns = 4 if widest.any() else 2
    grid = layout.grid(1 + byte_columns)
    items = layout.items(grid, 1 + byte_columns)
    items[:, :, 0] = np.where(tiny, values, 0x18 + wide + widest)  # the value itself, or 0x18/0x19/0x1a
    items[:, :, 1:] = np.frombuffer(big_endian_words, dtype=np.uint8).reshape(*shape, 4)[:, :, 4 - byte_columns :]
    keep = np.ones(grid.shape, dtype=bool)
    kept_items = layout.items(keep, 1 + byte_columns)
    if byte_columns == 4:
        kept_items[:, :, 1] = kept_items[:, :, 2] = widest
    kept_items[:, :, -2] = wide
    np.logical_not(tiny, out=kept_items[:, :, -1])
    flat = grid[keep].tobytes()
    ends = keep.sum(axis=1).cumsum().tolist()
    return [flat[start:end] for start, end in zip([0, *ends], ends)]
