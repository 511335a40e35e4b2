"""Block identity, spec v1: the hash that names the KV of one full block of tokens.

The normative text, with golden vectors, is `docs/block-identity.md`; this module is its only
implementation, shared by every service. In short:

    root          = H(cbor(["prefixcache/block/v1", model_id]))
    hash(block i) = H(cbor([parent, tokens, extra]))    parent = hash(block i-1), or root for i = 0

`tokens` are the block's token ids as CBOR unsigned integers; `extra` is null or an array of
`["lora", name, adapter_digest]`, one `["mm", identifier, offset]` per multimodal item overlapping
the block (offset relative to the block start, may be negative), `["embeds", digest]`, and on
block 0 only `["salt", salt]`, in that order. `H` is sha256 (32 bytes) or seeded XXH3-128
(16 bytes, big-endian). Only full blocks have a hash.
"""
from __future__ import annotations

import hashlib
import os
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import NewType

import xxhash

from prefixcache.block_identity import cbor

SPEC_VERSION = "prefixcache/block/v1"
XXHASH_SEED_DOMAIN = "prefixcache/block/v1/xxhash-seed"
HASH_ALGOS = ("sha256", "xxhash")
DIGEST_SIZES = {"sha256": 32, "xxhash": 16}
MAX_BLOCK_SIZE = 1 << 16
MAX_PYTHONHASHSEED = 4_294_967_295  # CPython's own limit: it refuses to start with a larger value

BlockHash = NewType("BlockHash", bytes)


def is_valid_block_size(block_size: object) -> bool:
    """A power of two in [1, MAX_BLOCK_SIZE]."""
    return _is_int(block_size) and 1 <= block_size <= MAX_BLOCK_SIZE and not block_size & (block_size - 1)


@dataclass(frozen=True)
class MultiModalItem:
    """A multimodal input occupying prompt tokens [offset, offset + length)."""

    identifier: str  # content hash of the item (e.g. of the image bytes), not a file name
    offset: int  # token index of the item's first placeholder token in the prompt
    length: int  # number of placeholder tokens

    def __post_init__(self) -> None:
        if not isinstance(self.identifier, str) or not self.identifier:
            raise ValueError(f"mm item identifier must be a non-empty string, got {self.identifier!r}")
        if not _is_int(self.offset) or self.offset < 0:
            raise ValueError(f"mm item offset must be an integer >= 0, got {self.offset!r}")
        if not _is_int(self.length) or self.length < 1:
            raise ValueError(f"mm item length must be an integer >= 1, got {self.length!r}")


@dataclass(frozen=True)
class BlockExtras:
    """Everything besides the token ids that changes a block's KV.

    `prompt_embeds_digests[i]` is the digest of block i's rows of the prompt embeddings (see
    docs/block-identity.md; the block holding the prompt's end has one for its prompt rows, so that
    once generated tokens fill it, it still differs from a block of other embeddings); blocks past
    the end of the tuple hold generated tokens only and have none.
    `lora_digest` names the adapter's exact weights; without it an adapter updated in place
    under the same name could be served stale KV. The salt is a tenant secret: it is kept out
    of `repr` and must never be logged.
    """

    lora_name: str | None = None
    lora_digest: bytes | None = None
    mm_items: tuple[MultiModalItem, ...] = ()
    prompt_embeds_digests: tuple[bytes, ...] = ()
    cache_salt: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.lora_name is not None and (not isinstance(self.lora_name, str) or not self.lora_name):
            raise ValueError(f"lora_name must be a non-empty string or None, got {self.lora_name!r}")
        if self.lora_digest is not None:
            if self.lora_name is None:
                raise ValueError("lora_digest given without lora_name")
            if not isinstance(self.lora_digest, bytes) or not self.lora_digest:
                raise ValueError("lora_digest must be non-empty bytes or None")
        object.__setattr__(self, "mm_items", tuple(self.mm_items))
        object.__setattr__(self, "prompt_embeds_digests", tuple(self.prompt_embeds_digests))
        previous_end = 0
        for index, item in enumerate(self.mm_items):
            if not isinstance(item, MultiModalItem):
                raise ValueError(f"mm_items[{index}] must be a MultiModalItem, got {type(item).__name__}")
            if item.offset < previous_end:
                raise ValueError(f"mm_items[{index}] starts at token {item.offset}, inside or before the "
                                 "previous item: items must be sorted by offset and must not overlap")
            previous_end = item.offset + item.length
        for index, digest in enumerate(self.prompt_embeds_digests):
            if not isinstance(digest, bytes) or not digest:
                raise ValueError(f"prompt_embeds_digests[{index}] must be non-empty bytes")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt):
            raise ValueError("cache_salt must be a non-empty string or None")

    @property
    def varies_per_block(self) -> bool:
        """True if blocks after block 0 can carry different extra items."""
        return bool(self.mm_items or self.prompt_embeds_digests)

    def items_for_block(self, block_index: int, block_size: int) -> list[list] | None:
        """The spec's `extra` value of block `block_index`: a list of items, or None."""
        items: list[list] = []
        if self.lora_name is not None:
            items.append(["lora", self.lora_name, self.lora_digest])
        start = block_index * block_size
        end = start + block_size
        for item in self.mm_items:
            if item.offset >= end:
                break
            if item.offset + item.length > start:
                items.append(["mm", item.identifier, item.offset - start])
        if block_index < len(self.prompt_embeds_digests):
            items.append(["embeds", self.prompt_embeds_digests[block_index]])
        if block_index == 0 and self.cache_salt is not None:
            items.append(["salt", self.cache_salt])
        return items or None


NO_EXTRAS = BlockExtras()
_NO_EXTRA = cbor.encode(None)  # a block's `extra` when it has none


def xxhash_seed_from_env(pythonhashseed: str | None) -> int | None:
    """The xxhash seed derived from a PYTHONHASHSEED value, or None if it asks for randomness.

    seed = first 8 bytes, big-endian, of sha256(cbor([XXHASH_SEED_DOMAIN, N])) with N the
    PYTHONHASHSEED value as an unsigned integer. Unset, empty or "random" means a random seed.
    """
    if pythonhashseed is None or pythonhashseed in ("", "random"):
        return None
    # ASCII digits only: int() would also take signs, spaces, underscores and other scripts' digits,
    # which another implementation of the spec need not parse alike.
    if not re.fullmatch(r"[0-9]+", pythonhashseed):
        raise ValueError(f"PYTHONHASHSEED must be 'random' or a decimal integer >= 0, got {pythonhashseed!r}")
    value = int(pythonhashseed)
    if value > MAX_PYTHONHASHSEED:
        raise ValueError(f"PYTHONHASHSEED must be at most {MAX_PYTHONHASHSEED}, got {pythonhashseed!r}")
    digest = hashlib.sha256(cbor.encode([XXHASH_SEED_DOMAIN, value])).digest()
    return int.from_bytes(digest[:8], "big")


@lru_cache(maxsize=1)
def process_xxhash_seed() -> int:
    """This process's xxhash seed: derived from PYTHONHASHSEED if set, else random.

    A predictable seed would let an attacker precompute colliding blocks offline, so the seed is
    random unless the operator pins it (to share hashes across processes, e.g. with a router).
    """
    seed = xxhash_seed_from_env(os.environ.get("PYTHONHASHSEED"))
    return secrets.randbits(64) if seed is None else seed


class BlockHasher:
    """Hashes full blocks for one (block_size, algo, model_id); the root is computed once.

    `seed` only applies to xxhash and defaults to `process_xxhash_seed()`.
    """

    def __init__(self, block_size: int = 16, algo: str = "sha256", model_id: str | None = None,
                 *, seed: int | None = None) -> None:
        if not is_valid_block_size(block_size):
            raise ValueError(f"block_size must be a power of two in [1, {MAX_BLOCK_SIZE}], got {block_size!r}")
        if algo not in HASH_ALGOS:
            raise ValueError(f"hash algo must be one of {', '.join(HASH_ALGOS)}; got {algo!r}")
        if not isinstance(model_id, str) or not model_id:
            raise ValueError("model_id is required: a non-empty string naming the exact weights")
        if seed is not None and (algo != "xxhash" or not _is_int(seed) or not 0 <= seed < 1 << 64):
            raise ValueError("seed must be an unsigned 64-bit integer, and only applies to xxhash")
        self.block_size = block_size
        self.algo = algo
        self.model_id = model_id
        self.digest_size = DIGEST_SIZES[algo]
        self.seed = (process_xxhash_seed() if seed is None else seed) if algo == "xxhash" else None
        # The constant start of every block's encoding: array(3), then the parent's byte-string head.
        self._block_head = cbor.head(4, 3) + cbor.head(2, self.digest_size)
        self.root = BlockHash(self.digest(cbor.encode([SPEC_VERSION, model_id])))

    def __repr__(self) -> str:
        return f"BlockHasher(block_size={self.block_size}, algo={self.algo!r}, model_id={self.model_id!r})"

    def digest(self, data: bytes) -> bytes:
        """H(data)."""
        if self.seed is None:
            return hashlib.sha256(data).digest()
        return xxhash.xxh3_128_digest(data, self.seed)

    def hash_blocks(self, token_ids: Sequence[int], extras: BlockExtras = NO_EXTRAS, start_block: int = 0,
                    parent: bytes | None = None) -> list[BlockHash]:
        """Hashes of full blocks start_block, start_block+1, … of `token_ids` (the whole sequence).

        To extend a request's hashes as it grows, pass `start_block=len(hashes)` and
        `parent=hashes[-1]`; block 0's parent is always the root. Tokens after the last full block
        are not read (nor validated): they are hashed, and checked, once their block fills.
        """
        if not isinstance(extras, BlockExtras):
            raise ValueError(f"extras must be a BlockExtras, got {type(extras).__name__}")
        if not _is_int(start_block) or start_block < 0:
            raise ValueError(f"start_block must be an integer >= 0, got {start_block!r}")
        if start_block == 0:
            if parent is not None:
                raise ValueError("block 0's parent is the root: pass parent only with start_block > 0")
            parent = self.root
        elif not isinstance(parent, bytes) or len(parent) != self.digest_size:
            raise ValueError(f"parent must be the {self.digest_size}-byte hash of block {start_block - 1}")
        block_size = self.block_size
        end_block = len(token_ids) // block_size
        if end_block <= start_block:
            return []
        start, end = start_block * block_size, end_block * block_size
        full = token_ids if start == 0 and end == len(token_ids) else token_ids[start:end]
        bodies = self._block_bodies(full, extras, start_block)
        block_head = self._block_head
        hashes: list[BlockHash] = []
        append = hashes.append
        if self.seed is None:
            # Copying a hasher that has seen the constant head skips OpenSSL's per-call digest
            # set-up, about a fifth of the loop's time.
            after_head = hashlib.sha256(block_head)
            for body in bodies:
                state = after_head.copy()
                state.update(parent)
                state.update(body)
                parent = state.digest()
                append(parent)
        else:
            xxh3, seed, join = xxhash.xxh3_128_digest, self.seed, b"".join
            for body in bodies:
                parent = xxh3(join((block_head, parent, body)), seed)
                append(parent)
        return hashes

    def _block_bodies(self, token_ids: Sequence[int], extras: BlockExtras, start_block: int) -> list[bytes]:
        """cbor(tokens) + cbor(extra) of each full block in `token_ids` (block `start_block` first):
        every block's hash input after its parent."""
        block_size = self.block_size
        if extras.varies_per_block:
            arrays = cbor.encode_uint_arrays(token_ids, block_size)
            return [array + cbor.encode(extras.items_for_block(index, block_size))
                    for index, array in enumerate(arrays, start_block)]
        # Only block 0 can differ (the salt): encode the common value once.
        common = _NO_EXTRA if extras is NO_EXTRAS else cbor.encode(extras.items_for_block(1, block_size))
        bodies = cbor.encode_uint_arrays(token_ids, block_size, suffix=common)
        if start_block == 0 and extras.cache_salt is not None:
            first = bodies[0]
            bodies[0] = first[: len(first) - len(common)] + cbor.encode(extras.items_for_block(0, block_size))
        return bodies


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
