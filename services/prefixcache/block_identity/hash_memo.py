"""A memo of the hashes of cached prefixes, so a popular prefix is not hashed again per request.

Hashing is most of a cache lookup's cost (about 1 µs a block with sha256: a CBOR encoding and a
digest), and a popular prefix, such as a shared system prompt or a conversation's history, would be
hashed again for every request that sends it. A block's hash is a function of its parent's hash,
its token ids and its extra keys, so it can be remembered under them and recalled with one dict
lookup. The memo changes no hash: every value in it was computed by the `BlockHasher`.

Only blocks that a lookup found in the cache are remembered (`remember`), so a workload without
reuse pays one failed lookup per request and nothing more. Keys hold a block's token ids as raw
32-bit words. Block 0's key also holds the sha256 of its encoded `extra` (LoRA adapter, tenant
salt): a fixed-size digest, so a client's long salt is not kept, nor any salt in clear. A later
block's key is its parent's hash and its tokens only: the one extra that can appear there without
varying by block, the LoRA adapter, is in block 0 too, so the parent's hash already names it, as
surely as a hash names anything in the prefix cache. Requests whose extras vary by block
(multimodal items, prompt embeddings) are neither remembered nor recalled.

It pays where hashing costs more than a dict lookup: with sha256, not with xxhash (about 0.5 µs a
block, as much as a recall). The memo holds two generations of at most `capacity` entries each:
when the newer one fills, it becomes the older one and the previous older one is dropped; an entry
recalled from the older generation is copied into the newer. So a prefix in steady use stays,
without per-entry bookkeeping.
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence

from prefixcache.block_identity import cbor
from prefixcache.block_identity.hashing import NO_EXTRAS, BlockExtras, BlockHash

_NO_EXTRA_DIGEST = hashlib.sha256(cbor.encode(None)).digest()

# Block 0's key is (None, tokens, digest of its extra) and a later block's (parent, tokens): a
# 3-tuple never equals a 2-tuple, so the two kinds cannot meet.
_Key = tuple[None, bytes, bytes] | tuple[bytes, bytes]


class BlockHashMemo:
    """Leading block hashes of prefixes found in the cache, recalled without hashing.

    Not thread-safe: the KV cache manager that owns it is driven by one loop.
    """

    def __init__(self, block_size: int, capacity: int) -> None:
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
            raise ValueError(f"capacity must be a positive integer, got {capacity!r}")
        self.block_size = block_size
        self.capacity = capacity
        self._newer: dict[_Key, BlockHash] = {}
        self._older: dict[_Key, BlockHash] = {}

    def __len__(self) -> int:
        return len(self._newer) + len(self._older)

    def recall(self, token_ids: Sequence[int], extras: BlockExtras = NO_EXTRAS) -> list[BlockHash]:
        """The remembered hashes of the leading full blocks of `token_ids`: blocks 0, 1, … up to
        the first one not remembered (an empty list when block 0 is not)."""
        num_blocks = len(token_ids) // self.block_size
        if not num_blocks or extras.varies_per_block:
            return []
        hashes, in_use = self._walk(token_ids, num_blocks, _first_extra_digest(extras, self.block_size))
        # In steady use: keep them in the newer generation. Only after the walk, so that a turnover
        # this causes cannot drop an entry the walk had still to find.
        for key, block_hash in in_use:
            self._store(key, block_hash)
        return hashes

    def _walk(self, token_ids: Sequence[int], num_blocks: int,
              first_extra: bytes) -> tuple[list[BlockHash], list[tuple[_Key, BlockHash]]]:
        """The remembered leading hashes, and the entries among them found in the older generation."""
        block_size = self.block_size
        newer, older = self._newer, self._older  # the walk stores nothing: both stay as they are
        hashes: list[BlockHash] = []
        in_use: list[tuple[_Key, BlockHash]] = []
        found: BlockHash | None = None
        # Token ids are turned into words a window at a time, doubling, so that a prompt whose
        # first blocks are not remembered costs little more than its first block.
        start, window, stride = 0, 1, 4 * block_size
        while start < num_blocks:
            stop = min(start + window, num_blocks)
            words = _words(token_ids[start * block_size : stop * block_size])
            if words is None:  # not 32-bit unsigned ids: the hasher will say what is wrong
                break
            for offset in range(0, len(words), stride):
                block = words[offset : offset + stride]
                key = (None, block, first_extra) if found is None else (found, block)
                found = newer.get(key)
                if found is None:
                    found = older.get(key)
                    if found is None:
                        return hashes, in_use
                    in_use.append((key, found))
                hashes.append(found)
            start, window = stop, 2 * window
        return hashes, in_use

    def remember(self, token_ids: Sequence[int], extras: BlockExtras, hashes: Sequence[BlockHash],
                 start: int, stop: int) -> None:
        """Remember that blocks [start, stop) of `token_ids` hash to `hashes[start:stop]`.

        `hashes` are the request's leading block hashes from the `BlockHasher` (at least `stop`
        of them), so the token ids have been checked already.
        """
        if start >= stop or extras.varies_per_block:
            return
        block_size = self.block_size
        words = _words(token_ids[start * block_size : stop * block_size])
        if words is None:  # ids of 2**32 and more (valid, but not in 32-bit words) are not remembered
            return
        parent = hashes[start - 1] if start else None
        for index, block in enumerate(_split(words, block_size), start):
            key = (parent, block) if index else (None, block, _first_extra_digest(extras, block_size))
            parent = hashes[index]
            self._store(key, parent)

    def clear(self) -> None:
        self._newer, self._older = {}, {}

    def _store(self, key: _Key, block_hash: BlockHash) -> None:
        newer = self._newer
        newer[key] = block_hash
        if len(newer) >= self.capacity:
            self._older, self._newer = newer, {}


def _first_extra_digest(extras: BlockExtras, block_size: int) -> bytes:
    """sha256 of block 0's encoded `extra`, as it enters the block's hash."""
    if extras is NO_EXTRAS:
        return _NO_EXTRA_DIGEST
    return hashlib.sha256(cbor.encode(extras.items_for_block(0, block_size))).digest()


def _words(token_ids: Sequence[int]) -> bytes | None:
    """The token ids as native 32-bit words, or None if one is not an unsigned 32-bit integer."""
    words = cbor.uint32_words(token_ids)
    return None if words is None else words.tobytes()


def _split(words: bytes, block_size: int) -> list[bytes]:
    stride = 4 * block_size
    return [words[offset : offset + stride] for offset in range(0, len(words), stride)]
