"""The scheduler's and `serve`'s command lines: what each flag turns into."""
from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from prefixcache.services.cli import serve
from prefixcache.services.scheduler import server


def scheduler_config(*flags: str):
    parser = argparse.ArgumentParser()
    server.add_arguments(parser)
    return server.config_from_args(parser.parse_args(["--tokenizer", "t:1", "--worker", "w:2", *flags]))


@pytest.mark.parametrize("flag", ["--no-prefix-caching", "--no-enable-prefix-caching"])
def test_prefix_caching_is_on_unless_switched_off_under_either_spelling(flag: str) -> None:
    assert scheduler_config().enable_prefix_caching
    assert not scheduler_config(flag).enable_prefix_caching


@pytest.mark.parametrize("flag", ["--no-prefix-caching", "--no-enable-prefix-caching"])
def test_serve_passes_caching_off_on_to_the_scheduler(flag: str) -> None:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    config = serve.platform_config(parser.parse_args([flag]), Path("/models/m"))
    assert "--no-prefix-caching" in config.scheduler_args
    assert "--no-prefix-caching" not in serve.platform_config(parser.parse_args([]), Path("/models/m")).scheduler_args
