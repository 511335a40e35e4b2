"""Block identity spec v1: golden vectors, an independent re-derivation with cbor2, and bad input."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import cbor2
import pytest
import xxhash

from prefixcache.block_identity.hashing import (
    NO_EXTRAS,
    SPEC_VERSION,
    XXHASH_SEED_DOMAIN,
    BlockExtras,
    BlockHasher,
    MultiModalItem,
    xxhash_seed_from_env,
)

VECTORS = json.loads((Path(__file__).parent / "vectors.json").read_text())["vectors"]


def extras_from_json(spec: dict) -> BlockExtras:
    return BlockExtras(
        lora_name=spec.get("lora_name"),
        lora_digest=bytes.fromhex(spec["lora_digest"]) if "lora_digest" in spec else None,
        mm_items=tuple(MultiModalItem(**item) for item in spec.get("mm_items", [])),
        prompt_embeds_digests=tuple(bytes.fromhex(d) for d in spec.get("prompt_embeds_digests", [])),
        cache_salt=spec.get("cache_salt"),
    )


def digest_prompt_embeds(embeddings: bytes, num_tokens: int, block_size: int) -> tuple[bytes, ...]:
    """The spec's embeds digests: sha256 of each block's rows of a C-order [num_tokens, hidden]
    buffer, the last block's only up to the prompt's end."""
    stride = len(embeddings) // num_tokens * block_size
    return tuple(hashlib.sha256(embeddings[i * stride : (i + 1) * stride]).digest()
                 for i in range(-(-num_tokens // block_size)))


def reference_hashes(vector: dict) -> tuple[bytes, list[bytes]]:
    """The spec, written straight from docs/block-identity.md with cbor2 and the hash libraries."""
    spec, block_size = vector["extras"], vector["block_size"]
    if vector["algo"] == "sha256":
        def digest(data: bytes) -> bytes:
            return hashlib.sha256(data).digest()
    else:
        seed = int.from_bytes(hashlib.sha256(cbor2.dumps(
            [XXHASH_SEED_DOMAIN, int(vector["pythonhashseed"])], canonical=True)).digest()[:8], "big")

        def digest(data: bytes) -> bytes:
            return xxhash.xxh3_128(data, seed=seed).digest()

    root = digest(cbor2.dumps([SPEC_VERSION, vector["model_id"]], canonical=True))
    tokens = vector["tokens"]
    parent, hashes = root, []
    for index in range(len(tokens) // block_size):
        start, end = index * block_size, (index + 1) * block_size
        extra = []
        if "lora_name" in spec:
            extra.append(["lora", spec["lora_name"], bytes.fromhex(spec["lora_digest"])])
        for item in spec.get("mm_items", []):
            if item["offset"] < end and item["offset"] + item["length"] > start:
                extra.append(["mm", item["identifier"], item["offset"] - start])
        if index < len(spec.get("prompt_embeds_digests", [])):
            extra.append(["embeds", bytes.fromhex(spec["prompt_embeds_digests"][index])])
        if index == 0 and "cache_salt" in spec:
            extra.append(["salt", spec["cache_salt"]])
        parent = digest(cbor2.dumps([parent, tokens[start:end], extra or None], canonical=True))
        hashes.append(parent)
    return root, hashes


@pytest.mark.parametrize("vector", VECTORS, ids=[v["name"] for v in VECTORS])
def test_golden_vector(vector):
    seed = xxhash_seed_from_env(vector["pythonhashseed"]) if "pythonhashseed" in vector else None
    assert seed == vector.get("xxhash_seed")
    hasher = BlockHasher(vector["block_size"], vector["algo"], vector["model_id"], seed=seed)
    hashes = hasher.hash_blocks(vector["tokens"], extras_from_json(vector["extras"]))
    assert hasher.root.hex() == vector["root"]
    assert [h.hex() for h in hashes] == vector["hashes"]
    root, expected = reference_hashes(vector)
    assert (hasher.root, hashes) == (root, expected)


def test_vectors_cover_every_extra_item_and_negative_mm_offsets():
    multimodal = next(v for v in VECTORS if v["name"] == "multimodal")
    # The image spans tokens 2..6: block 0 sees it at offset 2, block 1 at -2, block 2 not at all.
    extras = extras_from_json(multimodal["extras"])
    assert extras.items_for_block(0, 4) == [["mm", "img:5f3c", 2]]
    assert extras.items_for_block(1, 4) == [["mm", "img:5f3c", -2]]
    assert extras.items_for_block(2, 4) is None
    # An item ending on a block boundary is not in the next block; a long one reaches offsets that
    # need CBOR's two-byte negative form (-24 is the last one-byte value).
    boundaries = extras_from_json(next(v for v in VECTORS if v["name"] == "mm-boundaries")["extras"])
    assert boundaries.items_for_block(0, 8) == [["mm", "img:edge", 1]]
    assert boundaries.items_for_block(1, 8) == [["mm", "img:long", 0]]
    assert [boundaries.items_for_block(b, 8) for b in (4, 5, 6)] == [
        [["mm", "img:long", -24]], [["mm", "img:long", -32]], None]
    assert cbor2.dumps(-24) == b"\x37" and cbor2.dumps(-32) == b"\x38\x1f"
    # Text is hashed as its UTF-8 bytes, unnormalized: the decomposed spelling is another model.
    unicode = next(v for v in VECTORS if v["name"] == "unicode-text")
    decomposed = unicode["model_id"].replace("\u00e9", "e\u0301")
    assert decomposed != unicode["model_id"]
    assert BlockHasher(4, "sha256", decomposed).root.hex() != unicode["root"]
    everything = extras_from_json(next(v for v in VECTORS if v["name"] == "everything")["extras"])
    assert [item[0] for item in everything.items_for_block(0, 4)] == ["lora", "mm", "embeds", "salt"]
    assert [item[0] for item in everything.items_for_block(1, 4)] == ["lora", "mm"]


def test_chaining_same_tokens_after_different_prefix_differ():
    hasher = BlockHasher(4, "sha256", "m")
    a = hasher.hash_blocks([1, 2, 3, 4, 9, 9, 9, 9])
    b = hasher.hash_blocks([5, 6, 7, 8, 9, 9, 9, 9])
    assert a[0] != b[0] and a[1] != b[1]


def test_seed_004_arrays_share_exactly_their_full_common_blocks():
    hasher = BlockHasher(4, "sha256", "m")
    a = hasher.hash_blocks([11, 12, 13, 14, 15, 16, 17, 18])
    b = hasher.hash_blocks([11, 12, 13, 14, 15, 16, 17, 18, 19, 20])
    c = hasher.hash_blocks([11, 12, 13, 14, 15, 16, 90, 91])
    d = hasher.hash_blocks([11, 12, 13, 99, 15, 16, 17, 18])
    assert b[:2] == a  # LCP 8: both blocks
    assert c[0] == a[0] and c[1] != a[1]  # LCP 6: floor(6/4) = 1 block
    assert d[0] != a[0] and d[1] != a[1]  # LCP 3: nothing, and the identical second block does not match


def test_only_full_blocks_are_hashed():
    hasher = BlockHasher(4, "sha256", "m")
    assert hasher.hash_blocks([]) == []
    assert hasher.hash_blocks([1, 2, 3]) == []
    assert len(hasher.hash_blocks(list(range(11)))) == 2


def test_incremental_hashing_equals_hashing_at_once():
    hasher = BlockHasher(4, "sha256", "m")
    extras = BlockExtras(cache_salt="s", mm_items=(MultiModalItem("x", 3, 6),))
    tokens = list(range(300, 330))
    whole = hasher.hash_blocks(tokens, extras)
    first = hasher.hash_blocks(tokens[:9], extras)
    rest = hasher.hash_blocks(tokens, extras, start_block=len(first), parent=first[-1])
    assert first + rest == whole


def test_root_depends_on_model_and_algo_and_sha256_is_stable_across_processes():
    a = BlockHasher(16, "sha256", "model-a")
    assert a.root != BlockHasher(16, "sha256", "model-b").root
    assert a.root == hashlib.sha256(cbor2.dumps([SPEC_VERSION, "model-a"], canonical=True)).digest()
    code = ("from prefixcache.block_identity.hashing import BlockHasher;"
            "print(BlockHasher(16, 'sha256', 'model-a').hash_blocks(list(range(16)))[0].hex())")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == a.hash_blocks(list(range(16)))[0].hex()


def _xxhash_root_in_subprocess(pythonhashseed: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    if pythonhashseed is not None:
        env["PYTHONHASHSEED"] = pythonhashseed
    code = "from prefixcache.block_identity.hashing import BlockHasher; print(BlockHasher(16, 'xxhash', 'm').root.hex())"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True).stdout.strip()


def test_xxhash_seed_is_random_per_process_unless_pythonhashseed_is_set():
    assert _xxhash_root_in_subprocess(None) != _xxhash_root_in_subprocess(None)
    pinned = _xxhash_root_in_subprocess("42")
    assert pinned == _xxhash_root_in_subprocess("42") != _xxhash_root_in_subprocess("43")
    assert pinned == BlockHasher(16, "xxhash", "m", seed=xxhash_seed_from_env("42")).root.hex()
    assert xxhash_seed_from_env("random") is None and xxhash_seed_from_env(None) is None
    assert xxhash_seed_from_env("4294967295") is not None  # CPython's largest
    for unclear in ("+1", " 1", "1_0", "-1", "\u0661", "0x1", "4294967296"):  # decimal ASCII digits only, as the spec says
        with pytest.raises(ValueError, match="PYTHONHASHSEED"):
            xxhash_seed_from_env(unclear)


def test_extras_change_hashes_and_salt_only_block_zero_items():
    hasher = BlockHasher(4, "sha256", "m")
    tokens = list(range(8))
    plain = hasher.hash_blocks(tokens)
    for extras in (BlockExtras(cache_salt="t"), BlockExtras(lora_name="l"), BlockExtras(lora_name="l", lora_digest=b"\x01"),
                   BlockExtras(mm_items=(MultiModalItem("i", 5, 1),))):
        assert hasher.hash_blocks(tokens, extras) != plain
    salted = BlockExtras(cache_salt="t")
    assert salted.items_for_block(0, 4) == [["salt", "t"]] and salted.items_for_block(1, 4) is None
    # An image only in block 1 leaves block 0's hash alone.
    assert hasher.hash_blocks(tokens, BlockExtras(mm_items=(MultiModalItem("i", 5, 1),)))[0] == plain[0]


@pytest.mark.parametrize("make, field", [
    (lambda: BlockExtras(cache_salt=""), "cache_salt"),
    (lambda: BlockExtras(lora_name=""), "lora_name"),
    (lambda: BlockExtras(lora_name="l", lora_digest=b""), "lora_digest"),
    (lambda: MultiModalItem("", 0, 1), "identifier"),
    (lambda: MultiModalItem("a", 0, 0), "length"),
    (lambda: MultiModalItem("a", -1, 1), "offset"),
    (lambda: BlockExtras(prompt_embeds_digests=(b"",)), r"prompt_embeds_digests\[0\]"),
    (lambda: BlockExtras(mm_items=(MultiModalItem("a", 4, 4), MultiModalItem("b", 6, 1))), r"mm_items\[1\]"),
    (lambda: BlockExtras(mm_items=(MultiModalItem("a", 5, 1), MultiModalItem("b", 1, 1))), r"mm_items\[1\]"),
], ids=["salt", "lora-name", "lora-digest", "mm-identifier", "mm-length", "mm-start", "embeds-digest",
        "mm-overlapping", "mm-out-of-order"])
def test_the_values_the_spec_gives_no_hash_are_refused_naming_the_field(make, field):
    with pytest.raises(ValueError, match=field):
        make()


@pytest.mark.parametrize("block_size", [0, -16, 3, 12, 1.0, True, 1 << 17])
def test_block_size_must_be_a_power_of_two(block_size):
    with pytest.raises(ValueError, match="block_size"):
        BlockHasher(block_size, "sha256", "m")


def test_bad_hasher_arguments_name_the_field():
    with pytest.raises(ValueError, match="hash algo"):
        BlockHasher(16, "md5", "m")
    with pytest.raises(ValueError, match="model_id"):
        BlockHasher(16, "sha256")
    with pytest.raises(ValueError, match="seed"):
        BlockHasher(16, "sha256", "m", seed=1)


@pytest.mark.parametrize("tokens", [[1, 2, 3, -1], [1, 2, 3, 1.5], [1, 2, 3, "4"], [1, 2, 3, 1 << 64]])
def test_bad_token_ids_raise_value_error(tokens):
    with pytest.raises(ValueError, match="token ids"):
        BlockHasher(4, "sha256", "m").hash_blocks(tokens)


def test_parent_rules():
    hasher = BlockHasher(4, "sha256", "m")
    with pytest.raises(ValueError, match="parent"):
        hasher.hash_blocks(list(range(8)), NO_EXTRAS, start_block=1)
    with pytest.raises(ValueError, match="root"):
        hasher.hash_blocks(list(range(8)), NO_EXTRAS, start_block=0, parent=bytes(32))
    with pytest.raises(ValueError, match="32-byte"):
        hasher.hash_blocks(list(range(8)), NO_EXTRAS, start_block=1, parent=bytes(16))


def test_bad_extras_name_the_field():
    with pytest.raises(ValueError, match="lora_digest given without lora_name"):
        BlockExtras(lora_digest=b"\x01")
    with pytest.raises(ValueError, match="prompt_embeds_digests\\[0\\]"):
        BlockExtras(prompt_embeds_digests=("aa",))


def test_a_block_filled_after_an_embeddings_prompt_keeps_the_digest_of_its_prompt_rows():
    # 6 prompt tokens from embeddings, then 2 generated: block 1 holds prompt rows 4-5 and two
    # generated tokens. Embeddings that differ only in rows 4-5 must not share its hash.
    hasher = BlockHasher(4, "sha256", "m")
    first = bytes(range(48))  # 6 rows x 8 bytes
    second = first[:32] + bytes(16)
    tokens = [0] * 6 + [7, 8]
    hashes = [hasher.hash_blocks(tokens, BlockExtras(prompt_embeds_digests=digest_prompt_embeds(rows, 6, 4)))
              for rows in (first, second)]
    assert hashes[0][0] == hashes[1][0]
    assert hashes[0][1] != hashes[1][1]


def test_salt_never_appears_in_repr():
    assert "hunter2" not in repr(BlockExtras(cache_salt="hunter2"))


def test_the_spec_document_lists_every_golden_hash():
    document = (Path(__file__).parents[2] / "docs" / "block-identity.md").read_text()
    for vector in VECTORS:
        for block_hash in vector["hashes"]:
            assert block_hash in document, (vector["name"], block_hash)
