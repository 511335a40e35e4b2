"""The hand-written deterministic CBOR encoder produces cbor2's canonical bytes."""
from __future__ import annotations

import cbor2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.services.common import cbor

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
