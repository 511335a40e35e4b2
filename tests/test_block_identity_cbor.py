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


def _assert_runs_match_cbor2(values: list[int], log_run: int) -> None:
    run_length = 1 << log_run
    values = values[: len(values) // run_length * run_length]
    runs = cbor.encode_uint_runs(values, run_length)
    expected = [cbor2.dumps(values[i : i + run_length], canonical=True)[len(cbor.head(4, run_length)):]
                for i in range(0, len(values), run_length)]
    assert runs == expected


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=0, max_value=5), st.lists(token_ids, max_size=64))
def test_encode_uint_runs_matches_cbor2_per_run(log_run, values):
    _assert_runs_match_cbor2(values, log_run)


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=0, max_value=5), st.lists(u32_token_ids, min_size=1, max_size=128))
def test_vectorized_path_matches_cbor2_for_every_width(log_run, values):
    """Dense small ids or ids of 64k and more take the numpy path: every width mixed in a run."""
    _assert_runs_match_cbor2(values, log_run)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(min_value=256, max_value=65535), min_size=64, max_size=64),
       st.sets(st.integers(min_value=0, max_value=63)), st.integers(min_value=0, max_value=255))
def test_fixed_width_path_splices_in_small_ids(values, positions, small):
    for position in positions:
        values[position] = small
    runs = cbor.encode_uint_runs(values, 16)
    assert b"".join(runs) == cbor2.dumps(values, canonical=True)[2:]  # 0x98 0x40: array(64)


def test_splicing_several_small_ids_into_one_run():
    values = list(range(1000, 1000 + 16 * 8))  # eight runs of 3-byte encodings
    values[3], values[9], values[15] = 5, 200, 23  # three short encodings in run 0 (1, 2 and 1 bytes)
    runs = cbor.encode_uint_runs(values, 16)
    assert runs[0] == cbor2.dumps(values[:16], canonical=True)[1:]
    assert len(runs[0]) == 3 * 16 - 2 - 1 - 2
    assert b"".join(runs) == cbor2.dumps(values, canonical=True)[2:]


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


def test_runs_must_divide_the_values():
    with pytest.raises(ValueError):
        cbor.encode_uint_runs([1, 2, 3], 2)
