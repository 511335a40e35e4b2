"""`prefixcache block-hashes`, run as a real process."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from prefixcache.block_identity.hashing import BlockExtras, BlockHasher, MultiModalItem

VECTORS = {v["name"]: v for v in json.loads((Path(__file__).parents[1] / "block_identity" / "vectors.json").read_text())["vectors"]}


def block_hashes(*args: str, stdin: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "prefixcache.cli.main", "block-hashes", *args],
                          input=stdin, capture_output=True, text=True, timeout=60, env=env)


def test_prints_one_hex_hash_per_full_block_matching_the_golden_vector():
    vector = VECTORS["plain-sha256"]
    result = block_hashes("--block-size", "4", "--model-id", vector["model_id"], stdin=json.dumps(vector["tokens"]))
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == vector["hashes"]


def test_salt_lora_and_mm_options():
    lora = VECTORS["lora"]
    result = block_hashes("--block-size", "4", "--model-id", lora["model_id"],
                          "--lora", f"{lora['extras']['lora_name']}:{lora['extras']['lora_digest']}",
                          stdin=json.dumps(lora["tokens"]))
    assert result.stdout.splitlines() == lora["hashes"]
    salted = VECTORS["salted"]
    result = block_hashes("--block-size", "4", "--model-id", salted["model_id"],
                          "--cache-salt", salted["extras"]["cache_salt"], stdin=json.dumps(salted["tokens"]))
    assert result.stdout.splitlines() == salted["hashes"]
    from_environment = block_hashes("--block-size", "4", "--model-id", salted["model_id"], stdin=json.dumps(salted["tokens"]),
                                    env={**os.environ, "PREFIXCACHE_CACHE_SALT": salted["extras"]["cache_salt"]})
    assert from_environment.stdout.splitlines() == salted["hashes"]  # a salt other users' `ps` cannot see
    # A name alone is an adapter without a digest (null in the spec), as the engine hashes it.
    result = block_hashes("--block-size", "4", "--model-id", "m", "--lora", "adapter", stdin="[1,2,3,4]")
    expected = BlockHasher(4, "sha256", "m").hash_blocks([1, 2, 3, 4], BlockExtras(lora_name="adapter"))
    assert result.stdout.splitlines() == [h.hex() for h in expected]
    result = block_hashes("--block-size", "4", "--model-id", "m", "--mm", "img:5f3c:2:5", stdin="[1,2,3,4,5,6,7,8]")
    expected = BlockHasher(4, "sha256", "m").hash_blocks(list(range(1, 9)),
                                                          BlockExtras(mm_items=(MultiModalItem("img:5f3c", 2, 5),)))
    assert result.stdout.splitlines() == [h.hex() for h in expected]


def test_xxhash_reproduces_a_pinned_pythonhashseed():
    vector = VECTORS["xxhash-pythonhashseed-0"]
    env = dict(os.environ, PYTHONHASHSEED=vector["pythonhashseed"])
    result = block_hashes("--block-size", "4", "--hash-algo", "xxhash", "--model-id", vector["model_id"],
                          stdin=json.dumps(vector["tokens"]), env=env)
    assert result.stdout.splitlines() == vector["hashes"]
    assert result.stderr == ""


def test_xxhash_warns_whenever_the_seed_is_random():
    for seed in (None, "", "random"):
        env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
        if seed is not None:
            env["PYTHONHASHSEED"] = seed
        result = block_hashes("--block-size", "4", "--hash-algo", "xxhash", "--model-id", "m", stdin="[1,2,3,4]",
                              env=env)
        assert result.returncode == 0 and len(result.stdout.splitlines()) == 1, result.stderr
        assert "seeded randomly" in result.stderr, seed


def test_bad_input_exits_2_with_a_message_naming_the_problem():
    cases = [
        (("--block-size", "12", "--model-id", "m"), "[1]", "block_size"),
        (("--model-id", "m"), "[1, -2]", "token_ids[1]"),
        (("--model-id", "m"), "{\"a\": 1}", "JSON array"),
        (("--model-id", "m"), "not json", "not JSON"),
        (("--model-id", "m", "--lora", ":ab"), "[1]", "NAME, NAME:DIGEST or NAME:"),
        (("--model-id", "m", "--lora", "adapter:xyz"), "[1]", "hex"),
        (("--model-id", "m", "--lora", "adapter:00 11"), "[1]", "even number of hex digits"),
        (("--model-id", "m", "--lora", "adapter:00\n"), "[1]", "even number of hex digits"),
        (("--model-id", "m", "--lora", "adapter:abc"), "[1]", "even number of hex digits"),
        # int() would take these; the spec's integers are ASCII digits.
        (("--block-size", " 4", "--model-id", "m"), "[1]", "expected a decimal integer"),
        (("--block-size", "+16", "--model-id", "m"), "[1]", "expected a decimal integer"),
        (("--block-size", "1_6", "--model-id", "m"), "[1]", "expected a decimal integer"),
        (("--block-size", "\u0664", "--model-id", "m"), "[1]", "expected a decimal integer"),
        (("--model-id", "m", "--mm", "img:x:3"), "[1]", "--mm"),
        (("--model-id", "m", "--mm", "img:1"), "[1]", "expected ID:OFFSET:LENGTH"),
        (("--model-id", "m", "--lora", "a", "--lora", "b"), "[1]", "--lora given more than once"),
        # An id of a partial last block is checked too, though no hash covers it.
        (("--block-size", "2", "--model-id", "m"), "[1, 2, 18446744073709551616]", "token_ids[2]"),
        # Raw bytes from the shell that are not UTF-8 (Python hands them over as surrogates).
        (("--model-id", "m\udcff"), "[1]", "--model-id is not valid UTF-8"),
        (("--model-id", "m", "--cache-salt", "\udcff"), "[1]", "--cache-salt is not valid UTF-8"),
    ]
    for args, stdin, message in cases:
        result = block_hashes(*args, stdin=stdin)
        assert result.returncode == 2, (args, result.stderr)
        assert message in result.stderr
        assert result.stdout == ""


def test_the_salt_is_never_echoed():
    result = block_hashes("--model-id", "m", "--cache-salt", "hunter2", stdin="[1, -1]")
    assert result.returncode == 2
    assert "hunter2" not in result.stderr + result.stdout


def test_a_colon_ended_lora_name_has_no_digest():
    result = block_hashes("--block-size", "4", "--model-id", "m", "--lora", "team:adapter:", stdin="[1,2,3,4]")
    expected = BlockHasher(4, "sha256", "m").hash_blocks([1, 2, 3, 4], BlockExtras(lora_name="team:adapter"))
    assert result.stdout.splitlines() == [h.hex() for h in expected], result.stderr


def test_an_empty_salt_variable_is_refused_not_taken_as_no_salt():
    env = {**os.environ, "PREFIXCACHE_CACHE_SALT": ""}
    result = block_hashes("--block-size", "4", "--model-id", "m", stdin="[1,2,3,4]", env=env)
    assert result.returncode == 2 and result.stdout == ""
    assert "$PREFIXCACHE_CACHE_SALT is set but empty" in result.stderr


def test_arguments_are_read_as_utf8_whatever_the_locale():
    """Under the C locale without UTF-8 mode, Python decodes arguments as ASCII: their bytes are
    still the UTF-8 text the spec hashes."""
    vector = VECTORS["unicode-text"]
    env = {**os.environ, "LC_ALL": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0"}
    result = block_hashes("--block-size", "4", "--model-id", vector["model_id"],
                          "--cache-salt", vector["extras"]["cache_salt"], stdin=json.dumps(vector["tokens"]), env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == vector["hashes"]
