"""Argparse value types: each refuses what the server or the program would refuse, as a usage error.

Kept free of gRPC and protobuf imports, so a subcommand's `--help` stays instant.
"""
from __future__ import annotations

import argparse
import math
import os
import re
from collections.abc import Callable

# A gRPC target in one of gRPC's name syntaxes (dns:///host:port, unix:///path, ipv4:…) is passed on as it is.
_URI_TARGET = re.compile(r"^(dns|unix|unix-abstract|ipv4|ipv6|vsock):.")
_HOST_PORT = re.compile(r"^(?P<host>\[[0-9A-Fa-f:.]+\]|[^\s:/\[\]]+):(?P<port>\d{1,5})$")


def bounded_int(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: an integer in [low, high] (the range of the request field it fills)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be in [{low}, {high}], got {value}")
        return value

    return parse


# A port to listen on: 0 picks any free one. gRPC would take a larger number modulo 65536 and
# listen somewhere else than the one asked for.
listen_port = bounded_int(0, 65535)


def block_size(text: str) -> int:
    """A KV block size, refused before anything starts when the block hasher would refuse it."""
    from prefixcache.block_identity.hashing import MAX_BLOCK_SIZE, is_valid_block_size

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if not is_valid_block_size(value):
        raise argparse.ArgumentTypeError(f"must be a power of two in [1, {MAX_BLOCK_SIZE}], got {value}")
    return value


def bounded_float(low: float, high: float = math.inf, *, low_open: bool = False) -> Callable[[str], float]:
    """An argparse type: a number in [low, high], or (low, high] with `low_open`; never NaN."""
    shown = f"{'(' if low_open else '['}{low:g}, {high:g}]" if high != math.inf else f"{'>' if low_open else '>='} {low:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if math.isnan(value) or not (low < value if low_open else low <= value) or not value <= high:
            raise argparse.ArgumentTypeError(f"must be {'in ' if high != math.inf else ''}{shown}, got {text}")
        return value

    return parse


def decimal_uint(text: str) -> int:
    """An argparse type: an integer written in ASCII digits only (no sign, spaces, `_` or other
    scripts' digits, which `int()` would take)."""
    if not re.fullmatch(r"[0-9]+", text):
        raise argparse.ArgumentTypeError(f"expected a decimal integer, got {text!r}")
    return int(text)


def decoded_utf8(text: str) -> str:
    """The text whose bytes a command line or an environment variable carried, read as UTF-8
    whatever the locale decoded them as (a Latin-1 locale turns the two bytes of `é` into `Ã©`, and
    bytes that are not UTF-8 arrive as lone surrogates, which no message can carry).

    Raises ValueError if the bytes are not UTF-8."""
    try:
        return os.fsencode(text).decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError("not valid UTF-8 text") from None


def utf8_text(text: str) -> str:
    """An argparse type: text sent to the server (see `decoded_utf8`)."""
    try:
        return decoded_utf8(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def non_empty(text: str) -> str:
    """An argparse type: text sent to the server, but not the empty string (which the server
    refuses for these fields)."""
    text = utf8_text(text)
    if not text:
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def text_file(path: str) -> str:
    """An argparse type: the contents of a UTF-8 text file, which must not be empty."""
    try:
        with open(path, encoding="utf-8") as file:
            text = file.read()
    except (OSError, UnicodeDecodeError) as error:
        raise argparse.ArgumentTypeError(f"cannot read {path}: {error}") from None
    if not text:
        raise argparse.ArgumentTypeError(f"{path} is empty")
    return text


def engine_target(text: str) -> str:
    """An argparse type: HOST:PORT with a port in [1, 65535] ([IPv6]:PORT too), or a gRPC URI target."""
    text = utf8_text(text)
    if _URI_TARGET.match(text):
        return text
    match = _HOST_PORT.match(text)
    if match is None:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    if not 1 <= int(match["port"]) <= 65535:
        raise argparse.ArgumentTypeError(f"the port must be in [1, 65535], got {match['port']}")
    return text
