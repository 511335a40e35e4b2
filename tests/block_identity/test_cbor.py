"""The hand-written deterministic CBOR encoder produces cbor2's canonical bytes."""
from __future__ import annotations

import random

import cbor2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.block_identity import cbor

scalars = (st.none() | st.booleans() | st.integers(min_value=-(1 << 64), max_value=(1 << 64) - 1)
           | st.binary(max_size=300) | st.text(max_size=40))
values = st.recursive(scalars, lambda children: st.lists(children, max_size=6), max_leaves=30)
# Token ids around every boundary of the shortest-form rule, plus the fast path's own boundaries.
token_ids = (st.integers(min_value=0, max_value=(1 << 64) - 1)
             | st.sampled_from([0, 23, 24, 255, 256, 65535, 65536, (1 << 32) - 1, 1 << 32])
             | st.integers(min_value=256, max_value=65535))


@settings(max_examples=300, deadline=None)
@given(values)
def test_encode_matches_cbor2_canonical(value):
    assert cbor.encode(value) == cbor2.dumps(value, canonical=True)


u32_token_ids = (st.integers(min_value=0, max_value=(1 << 32) - 1)
                 | st.sampled_from([0, 23, 24, 255, 256, 65535, 65536, (1 << 32) - 1])
                 | st.integers(min_value=0, max_value=300))


suffixes = st.sampled_from([b"", b"\xf6", cbor.encode([["salt", "tenant-a"]])])


def _assert_arrays_match_cbor2(values: list[int], log_length: int, suffix: bytes) -> None:
    length = 1 << log_length
    values = values[: len(values) // length * length]
    arrays = cbor.encode_uint_arrays(values, length, suffix)
    expected = [cbor2.dumps(values[i : i + length], canonical=True) + suffix for i in range(0, len(values), length)]
    assert arrays == expected


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=0, max_value=5), st.lists(token_ids, max_size=64), suffixes)
def test_encode_uint_arrays_matches_cbor2_per_array(log_length, values, suffix):
    _assert_arrays_match_cbor2(values, log_length, suffix)


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=0, max_value=5), st.lists(u32_token_ids, min_size=1, max_size=128), suffixes)
def test_vectorized_path_matches_cbor2_for_every_width(log_length, values, suffix):
    """Dense small ids or ids of 64k and more take the numpy path: every width mixed in an array."""
    _assert_arrays_match_cbor2(values, log_length, suffix)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(min_value=256, max_value=65535), min_size=64, max_size=64),
       st.sets(st.integers(min_value=0, max_value=63)), st.integers(min_value=0, max_value=255))
def test_fixed_width_path_splices_in_small_ids(values, positions, small):
    for position in positions:
        values[position] = small
    arrays = cbor.encode_uint_arrays(values, 16, b"\xf6")
    assert arrays == [cbor2.dumps(values[i : i + 16], canonical=True) + b"\xf6" for i in range(0, 64, 16)]


def test_splicing_several_small_ids_into_one_run():
    values = list(range(1000, 1000 + 16 * 8))  # eight arrays of 3-byte encodings
    values[3], values[9], values[15] = 5, 200, 23  # three short encodings in run 0 (1, 2 and 1 bytes)
    arrays = cbor.encode_uint_arrays(values, 16)
    assert arrays[0] == cbor2.dumps(values[:16], canonical=True)
    assert len(arrays[0]) == 1 + 3 * 16 - 2 - 1 - 2
    assert arrays == [cbor2.dumps(values[i : i + 16], canonical=True) for i in range(0, len(values), 16)]


EVERY_WIDTH = [0, 23, 24, 255, 256, 65535, 65536, (1 << 32) - 1]  # 1, 1, 2, 2, 3, 3, 5, 5 bytes


@pytest.mark.parametrize("suffix", [b"", b"\xf6", cbor.encode([["salt", "x" * 2000]])])
@pytest.mark.parametrize("values", [EVERY_WIDTH * 2, EVERY_WIDTH[::-1] * 2, EVERY_WIDTH[:6] * 4,
                                    [24, 255] * 8, [65536] * 16, [(1 << 32) - 1] + [0] * 15])
def test_every_encoded_width_in_one_array(values, suffix):
    """Table path, one-word slots (all below 65536) and two-word slots, and long suffixes."""
    _assert_arrays_match_cbor2(values, 4, suffix)


def test_ids_of_64_bits_take_the_general_path():
    values = EVERY_WIDTH + [1 << 32, (1 << 64) - 1] + EVERY_WIDTH[:6]
    _assert_arrays_match_cbor2(values, 4, b"\xf6")


@pytest.mark.parametrize("length", [1, 3, 16, 500])
@pytest.mark.parametrize("largest", [300, 1 << 17])
def test_long_prompts_are_encoded_in_chunks(length, largest):
    """More values than one chunk of the table path, also in arrays that do not divide a chunk, and
    arrays of 1,000 bytes and more (whose struct formats are not in the table)."""
    rng = random.Random(length * largest)
    count = (cbor._TABLED_CHUNK_VALUES * 2 // length + 3) * length
    values = [rng.choice(EVERY_WIDTH[:4]) if rng.random() < 0.4 else rng.randrange(largest) for _ in range(count)]
    expected = [cbor2.dumps(values[i : i + length], canonical=True) + b"\xf6" for i in range(0, count, length)]
    assert cbor.encode_uint_arrays(values, length, b"\xf6") == expected


@settings(max_examples=100, deadline=None)
@given(st.integers(min_value=0, max_value=3), st.lists(u32_token_ids, min_size=1, max_size=128), suffixes)
def test_chunks_of_the_table_path_match_cbor2(log_length, values, suffix):
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cbor, "_TABLED_CHUNK_VALUES", 16)
        _assert_arrays_match_cbor2(values, log_length, suffix)


# The most ids below 256 that 64 arrays splice into fixed-width arrays; one more takes the table path.
MOST_SPLICES = (64 + cbor._TABLE_PATH_EXTRA_ARRAYS) // cbor._ARRAYS_PER_SPLICE


@pytest.mark.parametrize("num_small", [0, 1, MOST_SPLICES, MOST_SPLICES + 1, 64 * 8])
def test_sparse_and_dense_ids_below_256(num_small):
    rng = random.Random(num_small)
    values = [rng.randrange(256, 1 << 16) for _ in range(64 * 16)]
    for position in rng.sample(range(len(values)), num_small):
        values[position] = rng.choice(EVERY_WIDTH[:4])
    _assert_arrays_match_cbor2(values, 4, b"\xf6")


def test_head_uses_the_shortest_form():
    assert cbor.head(0, 23) == b"\x17"
    assert cbor.head(0, 24) == b"\x18\x18"
    assert cbor.head(2, 256) == b"\x59\x01\x00"
    assert cbor.head(4, 1 << 32) == b"\x9b\x00\x00\x00\x01\x00\x00\x00\x00"
    with pytest.raises(ValueError):
        cbor.head(0, 1 << 64)


def test_unsupported_types_are_rejected():
    with pytest.raises(TypeError):
        cbor.encode(1.5)
    with pytest.raises(TypeError):
        cbor.encode({"a": 1})


def test_arrays_must_divide_the_values():
    with pytest.raises(ValueError):
        cbor.encode_uint_arrays([1, 2, 3], 2)
