"""Deterministic CBOR (RFC 8949 §4.2.1) for the few shapes block identity needs.

Only definite-length items in their shortest form: unsigned and negative integers, byte strings,
text strings, arrays, null and booleans. There are no maps and no floats, so the only rule of
"core deterministic encoding" that applies is the shortest-head rule. The output equals
`cbor2.dumps(value, canonical=True)` for every supported value (tests check this with hypothesis).

The block hasher spends much of its time turning token ids into CBOR, so this module also has a
bulk encoder, `encode_uint_arrays`, that encodes a whole prompt with a few C-level byte and numpy
operations instead of one Python call per token: a fixed-width grid when nearly every id has a
3-byte encoding (random ids), else look-ups in precomputed tables of every encoding below 65536
(real text).
"""
from __future__ import annotations

import operator
import struct
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, replace
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


UINT32_TYPECODE = next(code for code in "IL" if array(code).itemsize == 4)  # array's 32-bit unsigned
_NATIVE_LITTLE_ENDIAN = sys.byteorder == "little"
_U16_LIMIT = 0x10000
# Splicing values below 256 into fixed-width arrays beats the table path while there are at most
# (arrays + _TABLE_PATH_EXTRA_ARRAYS) / _ARRAYS_PER_SPLICE of them: per array, the table path costs
# about an eighth of a splice more than the fixed-width one, plus a fixed extra of about 64 arrays'
# worth per call (measured from 1k to 32k values in arrays of 16).
_ARRAYS_PER_SPLICE = 8
_TABLE_PATH_EXTRA_ARRAYS = 64
_U16_HEAD = bytes((_MAJOR_UINT << 5 | 25,))
# The table path encodes at most this many values at a time, which keeps every numpy temporary
# (compress's index of kept bytes above all, 8 bytes each) small enough for the allocator to
# recycle rather than map, fault in and unmap on each call.
_TABLED_CHUNK_VALUES = 8192


def uint32_words(values: Sequence[int]) -> array | None:
    """`values` packed as native 32-bit unsigned words, or None if one is not an integer in [0, 2**32)."""
    words = array(UINT32_TYPECODE)
    try:
        words.fromlist(values if isinstance(values, list) else list(values))
    except (TypeError, OverflowError):
        return None
    return words


def encode_uint_arrays(values: Sequence[int], length: int, suffix: bytes = b"") -> list[bytes]:
    """Encode `values` as consecutive arrays of `length` items, each followed by `suffix`.

    Item i of the result is `encode(values[i*length : (i+1)*length]) + suffix`; `len(values)`
    must be a multiple of `length`. (The block hasher's suffix is the encoded `extra` value, so
    each item is everything of a block's hash input after its parent.) The values are packed once
    into 32-bit little-endian words, then one of three paths runs, by what the values are:

    - all in [256, 65536) (random ids of a vocabulary under 64k): each encodes as `0x19` plus two
      bytes, so every array has one width and is laid out at once in a numpy grid;
    - the same, but a few below 256 (shorter encodings): their 1- or 2-byte encodings are spliced
      into the fixed-width arrays afterwards;
    - anything else, such as real text, where about a third of the tokens of a byte-level BPE
      vocabulary (punctuation, spaces, newlines) lie below 256, or ids of 64k and more: every
      value's encoding and width are looked up in tables of all encodings below 65536 (see
      `_encode_arrays_tabled`).

    Values that are not integers in [0, 2**32) take the general path, which validates each one.
    """
    count = len(values)
    if count % length:
        raise ValueError(f"{count} values do not split into arrays of {length}")
    array_head = head(_MAJOR_ARRAY, length)
    words = uint32_words(values)
    if words is None:
        return [b"".join((array_head, encode_uints(values[i : i + length]), suffix))
                for i in range(0, count, length)]
    if not count:
        return []
    if not _NATIVE_LITTLE_ENDIAN:
        words.byteswap()
    layout = _ArrayLayout(array_head, length, suffix, count // length)
    # A value of 65536 or more has a nonzero high half (faster to count than numpy's max).
    if np.count_nonzero(np.frombuffer(words, dtype="<u2")[1::2]):
        return _encode_arrays_tabled(np.frombuffer(words, dtype="<u4"), layout, wide=True)
    raw = words.tobytes()
    high_bytes = raw[1::4]
    num_small = high_bytes.count(0)  # a zero high byte: a value below 256
    if num_small * _ARRAYS_PER_SPLICE > layout.num_arrays + _TABLE_PATH_EXTRA_ARRAYS:
        return _encode_arrays_tabled(np.frombuffer(words, dtype="<u4"), layout, wide=False)
    return _encode_arrays_fixed_width(raw, high_bytes, layout)


def _encode_arrays_fixed_width(raw: bytes, high_bytes: bytes, layout: _ArrayLayout) -> list[bytes]:
    """`encode_uint_arrays` for 32-bit little-endian words `raw`, all below 65536 and few of them
    below 256 (`high_bytes`: byte 1 of every word)."""
    count = len(high_bytes)
    length = layout.length
    packed = bytearray(3 * count)  # byte-strided slicing is several times faster than numpy's here
    packed[0::3] = _U16_HEAD * count
    packed[1::3] = high_bytes
    packed[2::3] = raw[0::4]
    grid = layout.grid(3)
    layout.items(grid, 3)[:] = np.frombuffer(packed, dtype=np.uint8).reshape(layout.num_arrays, length, 3)
    # Every array is now exactly one row of the grid; one struct.unpack splits them in a C loop.
    arrays = list(struct.Struct(b"%ds" % grid.shape[1] * layout.num_arrays).unpack(grid.tobytes()))
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
            offset = len(layout.head) + 3 * (small - first)
            encoded = encoded[:offset] + _UINT_ENCODINGS[raw[4 * small]] + encoded[offset + 3 :]
        arrays[index] = encoded
    return arrays


@dataclass(frozen=True)
class _ArrayLayout:
    """One row per array: `head`, then `length` items of a fixed width, then `suffix` (in `grid`),
    or the same padded to whole 32-bit words (in `masked_grid`)."""

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

    def masked_grid(self, slot_words: int) -> np.ndarray:
        """Two grids of 32-bit words, [0] the bytes and [1] a mask of the bytes to keep (1 or 0).

        A row is the head zero-padded to whole words, a slot of `slot_words` words per item, then
        the suffix zero-padded to whole words. Head and suffix are filled in, with their masks; the
        item slots are left to the caller.
        """
        head_words = _masked_words(self.head)
        suffix_words = _masked_words(self.suffix)
        width = head_words.shape[1] + slot_words * self.length + suffix_words.shape[1]
        grid = np.empty((2, self.num_arrays, width), dtype=np.uint32)
        grid[:, :, : head_words.shape[1]] = head_words[:, None]
        if self.suffix:
            grid[:, :, width - suffix_words.shape[1] :] = suffix_words[:, None]
        return grid

    def item_slots(self, masked_grid: np.ndarray, slot_words: int) -> np.ndarray:
        """The item slots of a `masked_grid` seen as [bytes or mask, array, item, word]."""
        start = _masked_words(self.head).shape[1]
        slots = masked_grid[:, :, start : start + slot_words * self.length]
        return slots.reshape(2, self.num_arrays, self.length, slot_words)


@lru_cache(maxsize=64)
def _masked_words(data: bytes) -> np.ndarray:
    """`data` zero-padded to whole 32-bit words, and below it the mask of those words (1 per byte of `data`)."""
    padding = bytes(-len(data) % 4)
    return np.frombuffer(data + padding + b"\x01" * len(data) + padding, dtype=np.uint32).reshape(2, -1)


@dataclass(frozen=True)
class _UintTables:
    """Look-up tables indexed by a value below 65536, or by 65536 for every larger 32-bit value."""

    encodings: np.ndarray  # uint32: the value's encoding from the word's first byte on (at 65536: its head)
    widths: np.ndarray  # uint8: the encoding's length in bytes: 1, 2, 3, or 5 at 65536
    one_word_masks: np.ndarray  # uint32 by width: the first `width` bytes of a word
    two_word_masks: np.ndarray  # uint64 by width: the same, but a 5-byte encoding keeps bytes 0 and 4-7


@lru_cache(maxsize=1)
def _uint_tables() -> _UintTables:
    """Built on first use (a few ms); 320 KB."""
    values = np.arange(_U16_LIMIT + 1)
    one_byte, two_bytes = values < 24, (values >= 24) & (values < 0x100)
    three_bytes = (values >= 0x100) & (values < _U16_LIMIT)  # 65536 stands for 5-byte encodings
    encodings = np.zeros((len(values), 4), dtype=np.uint8)
    encodings[:, 0] = np.where(one_byte, values, 0x18 + (values >= 0x100) + (values >= _U16_LIMIT))
    encodings[two_bytes, 1] = values[two_bytes]
    encodings[three_bytes, 1] = values[three_bytes] >> 8
    encodings[three_bytes, 2] = values[three_bytes] & 0xFF
    widths = (1 + (values >= 24) + (values >= 0x100) + 2 * (values >= _U16_LIMIT)).astype(np.uint8)
    one_word_masks = np.arange(4) < np.arange(6)[:, None]
    two_word_masks = np.arange(8) < np.arange(6)[:, None]
    two_word_masks[5] = [True, False, False, False, True, True, True, True]
    return _UintTables(encodings.view(np.uint32).ravel(), widths,
                       one_word_masks.view(np.uint32).ravel(), two_word_masks.view(np.uint64).ravel())


def _encode_arrays_tabled(values: np.ndarray, layout: _ArrayLayout, wide: bool) -> list[bytes]:
    """`_encode_rows_tabled`, at most `_TABLED_CHUNK_VALUES` values (but one array or more) at a time."""
    rows = max(1, _TABLED_CHUNK_VALUES // layout.length)
    if layout.num_arrays <= rows:
        return _encode_rows_tabled(values, layout, wide)
    arrays: list[bytes] = []
    for first in range(0, layout.num_arrays, rows):
        part = replace(layout, num_arrays=min(rows, layout.num_arrays - first))
        arrays += _encode_rows_tabled(values[first * layout.length : (first + rows) * layout.length], part, wide)
    return arrays


def _encode_rows_tabled(values: np.ndarray, layout: _ArrayLayout, wide: bool) -> list[bytes]:
    """`encode_uint_arrays` for 32-bit values, any mix of encoded widths, by table look-ups.

    Every item gets a slot of one 32-bit word that holds its 1- to 3-byte encoding from the table,
    or, when some value is 65536 or more (`wide`), of two words: the table's encoding (for such a
    value, its head alone), then the value's four big-endian bytes. A mask grid of the same shape,
    also from a table (by encoded width), marks the bytes to keep; one numpy `compress` joins them,
    and one `struct.unpack` cuts the result into arrays. (The values stay little-endian, the
    common hosts' own order: numpy byte-swaps values of the other order on every operation.)
    """
    tables = _uint_tables()
    index = np.minimum(values, _U16_LIMIT) if wide else values
    widths = tables.widths.take(index)
    slot_words = 2 if wide else 1
    shape = (layout.num_arrays, layout.length)
    grid = layout.masked_grid(slot_words)
    slots = layout.item_slots(grid, slot_words)
    slots[0, :, :, 0] = tables.encodings.take(index).reshape(shape)
    if wide:
        slots[0, :, :, 1] = values.astype(">u4").view(np.uint32).reshape(shape)
    masks = (tables.two_word_masks if wide else tables.one_word_masks).take(widths)
    slots[1] = masks.view(np.uint32).reshape(*shape, slot_words)
    flat = grid[0].view(np.uint8).ravel().compress(grid[1].view(bool).ravel())
    # intp: numpy before 2.1 takes no uint64 indices (the sum of uint8 widths would be uint64).
    lengths = widths.reshape(shape).sum(axis=1, dtype=np.intp) + (len(layout.head) + len(layout.suffix))
    longest = len(layout.head) + (5 if wide else 3) * layout.length + len(layout.suffix)
    return _split(flat, lengths, longest)


@lru_cache(maxsize=1)
def _three_digit_formats() -> np.ndarray:
    """The struct format items b"000s" to b"999s", one 32-bit word each."""
    return np.frombuffer(b"".join(b"%03ds" % n for n in range(1000)), dtype=np.uint32)


def _split(flat: np.ndarray, lengths: np.ndarray, longest: int) -> list[bytes]:
    """`flat` cut into consecutive pieces of `lengths` bytes (none longer than `longest`).

    One `struct.unpack` of "<n>s<n>s…" cuts them in a C loop, several times faster than slicing in
    Python; its format is looked up for pieces under 1,000 bytes. (A `Struct` of its own, as
    `struct.unpack` would keep these one-off formats in its cache.)
    """
    if longest < 1000:
        format_ = _three_digit_formats().take(lengths).tobytes()
    else:
        format_ = "".join(map("{}s".format, lengths.tolist()))
    return list(struct.Struct(format_).unpack(flat))
