"""The client subcommands against the running platform, as a user runs them."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def prefixcache(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "prefixcache.cli.main", *args], capture_output=True, text=True, timeout=120,
        env=env,
    )


def test_generate_json_and_stats(target: str, tmp_path: Path) -> None:
    system = tmp_path / "system.txt"
    system.write_text("You are a terse assistant. " * 30)
    args = ["generate", "What is the capital of France?", "--target", target, "--system", str(system),
            "--max-tokens", "6", "--temperature", "0", "--json"]  # fmt: skip
    first = prefixcache(*args)
    assert first.returncode == 0, first.stderr
    second = json.loads(prefixcache(*args).stdout)
    assert set(second) >= {"text", "token_ids", "finish_reason", "usage"}
    assert second["text"] == json.loads(first.stdout)["text"] and len(second["token_ids"]) <= 6
    usage = second["usage"]
    assert usage["completion_tokens"] == len(second["token_ids"])
    assert usage["cached_tokens"] == usage["prompt_tokens"] // 16 * 16 - (16 if usage["prompt_tokens"] % 16 == 0 else 0)
    cache = second["cache"]  # the whole cache account, as the proto defines it
    assert set(cache) == {"queried_tokens", "hit_tokens", "capped_tokens", "partial_tail_tokens", "miss_reason",
                          "queried_blocks", "hit_blocks"}
    assert cache["hit_tokens"] == usage["cached_tokens"] and cache["partial_tail_tokens"] == usage["prompt_tokens"] % 16

    stats = prefixcache("stats", "--target", target, "--json")
    assert stats.returncode == 0, stats.stderr
    counters = json.loads(stats.stdout)
    assert counters["hit_tokens"] >= usage["cached_tokens"] and counters["block_size"] == 16


def test_a_cache_salt_from_the_environment_isolates_like_the_flag(target: str, tmp_path: Path) -> None:
    system = tmp_path / "system.txt"
    system.write_text("You answer in one word, as a cartographer would. " * 12)
    args = ["generate", "Name a river.", "--target", target, "--system", str(system), "--max-tokens", "2",
            "--temperature", "0", "--json"]  # fmt: skip

    def cached_tokens(*extra: str, salt: str | None = None) -> int:
        env = {key: value for key, value in os.environ.items() if key != "PREFIXCACHE_CACHE_SALT"}
        if salt is not None:
            env["PREFIXCACHE_CACHE_SALT"] = salt
        result = prefixcache(*args, *extra, env=env)
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)["usage"]["cached_tokens"]

    cached_tokens(salt="river-salt-7e1")  # fills the cache under that salt
    assert cached_tokens("--cache-salt", "river-salt-7e1") > 0  # the same salt, given as a flag, hits
    assert cached_tokens() == 0  # no salt: another cache namespace


def test_generate_json_with_logprobs(target: str) -> None:
    result = prefixcache("generate", "Hello", "--target", target, "--max-tokens", "3", "--temperature", "0",
                         "--json", "--logprobs", "2")
    assert result.returncode == 0, result.stderr
    completion = json.loads(result.stdout)
    assert len(completion["logprobs"]) == len(completion["token_ids"]) == 3
    for token_id, entry in zip(completion["token_ids"], completion["logprobs"]):
        assert len(entry["top"]) == 2 and entry["top"][0][0] == token_id and entry["logprob"] <= 0


def test_a_reader_that_goes_away_ends_generate_quietly(target: str) -> None:
    """`prefixcache generate … | head -c 5`: the streamed text meets a closed pipe."""
    process = subprocess.Popen(
        [sys.executable, "-m", "prefixcache.cli.main", "generate", "Tell me a long story", "--target", target,
         "--max-tokens", "64", "--ignore-eos", "--temperature", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert process.stdout.read(1)
    process.stdout.close()
    stderr = process.stderr.read()
    assert process.wait(timeout=120) == 1
    assert "Traceback" not in stderr and "BrokenPipeError" not in stderr, stderr


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_ctrl_c_ends_a_streaming_command_quietly_and_frees_the_request(target: str, command: str) -> None:
    prompt = ["Tell me a long story"] if command == "generate" else []
    process = subprocess.Popen(
        [sys.executable, "-m", "prefixcache.cli.main", command, *prompt, "--target", target,
         "--max-tokens", "400", "--ignore-eos", "--temperature", "0"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    if command == "chat":
        process.stdin.write("Tell me a long story\n")
        process.stdin.flush()
    assert process.stdout.read(12)  # streaming has begun
    process.send_signal(signal.SIGINT)
    stdout, stderr = process.communicate(timeout=60)
    assert process.returncode == 128 + signal.SIGINT
    assert "Traceback" not in stderr and "interrupted" in stderr, stderr
    assert "you>" not in stdout  # piped turns are not prompted for
    deadline = time.monotonic() + 30
    while (stats := json.loads(prefixcache("stats", "--target", target, "--json").stdout))["used_blocks"]:
        assert time.monotonic() < deadline, stats
        time.sleep(0.2)


def test_logprobs_without_json_is_refused_before_any_call() -> None:
    result = prefixcache("generate", "Hello", "--target", "127.0.0.1:1", "--logprobs", "2")
    assert result.returncode == 2 and "--logprobs needs --json" in result.stderr


def test_a_failed_call_exits_non_zero_with_the_status(target: str) -> None:
    result = prefixcache("generate", "hi", "--target", target, "--lora-adapter", "sql")
    assert result.returncode == 1
    assert result.stderr.strip() == ("error: UNIMPLEMENTED: lora_adapter: 'sql': LoRA adapters are not served; "
                                     "leave it empty for the base model")


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("--seed", "-1", "--seed: must be in [0, 18446744073709551615], got -1"),
        ("--stop-token-id", "-1", "--stop-token-id: must be in [0, 4294967295], got -1"),
        ("--max-tokens", "99999999999", "--max-tokens: must be in [1, 2147483647], got 99999999999"),
        ("--system", "/nonexistent/system.txt", "--system: cannot read /nonexistent/system.txt"),
        ("--system", "/dev/null", "--system: /dev/null is empty"),
        ("--temperature", "-0.5", "--temperature: must be >= 0, got -0.5"),
        ("--temperature", "nan", "--temperature: must be >= 0, got nan"),
        ("--top-p", "0", "--top-p: must be in (0, 1], got 0"),
        ("--top-p", "1.5", "--top-p: must be in (0, 1], got 1.5"),
        ("--logprobs", "21", "--logprobs: must be in [1, 20], got 21"),
        ("--logprobs", "0", "--logprobs: must be in [1, 20], got 0"),
        ("--stop", "", "--stop: must not be empty"),
        ("--tenant", "", "--tenant: must not be empty"),
        ("--cache-salt", "", "--cache-salt: must not be empty"),
        ("--target", "", "--target: expected HOST:PORT, got ''"),
        ("--target", "localhost:65536", "--target: the port must be in [1, 65535], got 65536"),
    ],
)
def test_out_of_range_options_are_usage_errors_not_tracebacks(option: str, value: str, message: str) -> None:
    result = prefixcache("generate", "Hello", "--target", "127.0.0.1:1", "--json", option, value)
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_chat_goes_on_after_an_empty_reply_and_a_refused_turn(target: str) -> None:
    # Any first token holding a letter, digit, space or newline stops before it: an empty reply.
    stops = [f"--stop={c}" for c in "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 \n"]
    session = subprocess.run(
        [sys.executable, "-m", "prefixcache.cli.main", "chat", "--target", target, "--max-tokens", "4",
         "--temperature", "0", *stops],
        input="Hello\n" + "x" * 40_000 + "\nWhat is 2+2?\n", capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    # Turn 1 is empty and dropped; turn 2 is too long and refused; turn 3 still goes out, with a
    # history the server accepts (an empty assistant message would be refused).
    assert session.stderr.count("(empty reply: turn not kept)") == 2, session.stderr
    assert session.stderr.count("error: INVALID_ARGUMENT") == 1, session.stderr
    assert session.stderr.count("[stop] prompt") == 2
    assert session.returncode == 1


@pytest.mark.parametrize("option", ["prompt", "--stop", "--cache-salt", "--tenant", "--lora-adapter", "--request-id"])
def test_text_that_is_not_utf8_is_a_usage_error_naming_the_argument(option: str) -> None:
    """Bytes that are not UTF-8 reach Python as lone surrogates, which no message can carry."""
    text = [b"x\xff"] if option == "prompt" else [b"Hello", option.encode(), b"x\xff"]
    result = subprocess.run([sys.executable, "-m", "prefixcache.cli.main", "generate", "--target",
                             "127.0.0.1:1", *text], capture_output=True, timeout=120)  # fmt: skip
    stderr = result.stderr.decode()
    assert result.returncode == 2 and "Traceback" not in stderr, stderr
    assert f"argument {option}: not valid UTF-8 text" in stderr


def test_a_salt_variable_that_is_not_utf8_is_refused_without_a_traceback() -> None:
    environment = {**os.environb, b"PREFIXCACHE_CACHE_SALT": b"salt\xff"}
    command = [sys.executable, "-m", "prefixcache.cli.main", "generate", "--target", "127.0.0.1:1", "Hello"]
    result = subprocess.run(command, env=environment, capture_output=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.decode().strip() == "prefixcache generate: $PREFIXCACHE_CACHE_SALT is not valid UTF-8 text"


@pytest.mark.parametrize("stdin_encoding", [None, "utf-8:strict", "latin-1"])
def test_chat_sends_utf8_lines_and_refuses_others_whatever_stdin_decodes_with(stdin_encoding: str | None) -> None:
    """Read as UTF-8 bytes, as the arguments are (a strict UTF-8 stdin would raise on the second line)."""
    environment = {key: value for key, value in os.environ.items() if key != "PYTHONIOENCODING"}
    if stdin_encoding:
        environment["PYTHONIOENCODING"] = stdin_encoding
    chat = subprocess.run([sys.executable, "-m", "prefixcache.cli.main", "chat", "--target", "127.0.0.1:1"],
                          input="héllo\n".encode() + b"hello \xff\n", env=environment, capture_output=True,
                          timeout=120)  # fmt: skip
    stderr = chat.stderr.decode(errors="replace")
    assert chat.returncode == 1 and "Traceback" not in stderr, stderr
    assert stderr.count("(not valid UTF-8 text: turn not sent)") == 1  # the second line
    assert stderr.count("error: UNAVAILABLE") == 1  # the first was sent (nobody listens there)
