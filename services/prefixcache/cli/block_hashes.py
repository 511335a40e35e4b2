"""`prefixcache block-hashes`: print the block hashes of token ids read from stdin.

Reads a JSON array of token ids and prints one lowercase hex hash per full block, so a user can
see where two prompts stop sharing blocks and compare against the engine's eviction events.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys

from prefixcache.arg_types import decimal_uint, decoded_utf8
from prefixcache.block_identity.hashing import (
    HASH_ALGOS,
    BlockExtras,
    BlockHasher,
    MultiModalItem,
    xxhash_seed_from_env,
)
from prefixcache.cli.salt_env import CACHE_SALT_ENV, cache_salt


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--block-size", type=decimal_uint, default=16, help="tokens per block (a power of two)")
    parser.add_argument("--hash-algo", choices=HASH_ALGOS, default="sha256")
    parser.add_argument("--model-id", required=True, help="the model id the engine was started with")
    parser.add_argument("--cache-salt", help=f"the request's cache salt (default: ${CACHE_SALT_ENV}, which other "
                        "users' `ps` cannot see)")
    parser.add_argument("--lora", metavar="NAME[:DIGEST]", action="append", default=[],
                        help="LoRA adapter name and, if the deployment has one, its weights digest in hex "
                             "(after the last colon; a name holding a colon and no digest ends with one)")
    parser.add_argument("--mm", metavar="ID:OFFSET:LENGTH", action="append", default=[],
                        help="a multimodal item (repeatable, in prompt order)")


def run(args: argparse.Namespace) -> int:
    try:
        for option in ("model_id", "cache_salt", "lora", "mm"):
            setattr(args, option, _as_utf8(option, getattr(args, option)))
        args.cache_salt = cache_salt(args.cache_salt)  # else $PREFIXCACHE_CACHE_SALT, read as UTF-8 too
        token_ids = _read_token_ids(sys.stdin.read())
        hasher = BlockHasher(args.block_size, args.hash_algo, args.model_id)
        extras = BlockExtras(*_parse_lora(args.lora), mm_items=tuple(map(_parse_mm, args.mm)),
                             cache_salt=args.cache_salt)
        hashes = hasher.hash_blocks(token_ids, extras)
    except ValueError as error:
        print(f"prefixcache block-hashes: error: {error}", file=sys.stderr)
        return 2
    if args.hash_algo == "xxhash" and xxhash_seed_from_env(os.environ.get("PYTHONHASHSEED")) is None:
        print("prefixcache block-hashes: warning: xxhash is seeded randomly per process; set PYTHONHASHSEED "
              "to the engine's value to reproduce its hashes", file=sys.stderr)
    sys.stdout.write("".join(block_hash.hex() + "\n" for block_hash in hashes))
    return 0


def _read_token_ids(text: str) -> list[int]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"stdin is not JSON: {error}") from None
    if not isinstance(value, list):
        raise ValueError("stdin must be a JSON array of token ids")
    # Every id, those of a partial last block too: the spec has no hash for a sequence holding one.
    for index, token in enumerate(value):
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < 1 << 64:
            raise ValueError(f"token_ids[{index}] = {token!r} is not an integer in [0, 2**64)")
    return value


def _as_utf8(option: str, value: str | list[str] | None) -> str | list[str] | None:
    """The argument read as UTF-8 (`decoded_utf8`); not valid UTF-8 is refused, naming the option."""
    if value is None:
        return None
    try:
        texts = [decoded_utf8(text) for text in ([value] if isinstance(value, str) else value)]
    except ValueError:
        raise ValueError(f"--{option.replace('_', '-')} is not valid UTF-8 text") from None
    return texts[0] if isinstance(value, str) else texts


def _parse_lora(specs: list[str]) -> tuple[str | None, bytes | None]:
    if not specs:
        return None, None
    if len(specs) > 1:
        raise ValueError("--lora given more than once: a request uses one adapter")
    [spec] = specs
    name, separator, digest = spec.rpartition(":")
    if not separator:  # a name alone: an adapter without a digest, as the engine hashes it today
        return spec, None
    if not name:
        raise ValueError(f"--lora must be NAME, NAME:DIGEST or NAME: (no digest), got {spec!r}")
    if not digest:  # "NAME:": a name that holds colons itself, without a digest
        return name, None
    if not re.fullmatch(r"(?:[0-9a-fA-F]{2})+", digest):
        raise ValueError(f"--lora digest must be an even number of hex digits, got {digest!r}")
    return name, bytes.fromhex(digest)


def _parse_mm(spec: str) -> MultiModalItem:
    parts = spec.rsplit(":", 2)  # the identifier may hold colons itself ("img:5f3c")
    if len(parts) != 3 or not all(part.isascii() and part.isdigit() for part in parts[1:]):
        raise ValueError(f"--mm {spec!r}: expected ID:OFFSET:LENGTH, OFFSET and LENGTH decimal integers")
    try:
        return MultiModalItem(parts[0], int(parts[1]), int(parts[2]))
    except ValueError as error:
        raise ValueError(f"--mm {spec!r}: {error}") from None
