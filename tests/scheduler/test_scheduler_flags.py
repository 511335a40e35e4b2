"""The scheduler's and `serve`'s command lines: what each flag turns into."""
from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from prefixcache.cli import serve
from prefixcache.scheduler import server


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


def test_serve_passes_queue_length_and_worker_options_on_to_the_services_that_read_them() -> None:
    from prefixcache.worker import server as worker_server

    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    config = serve.platform_config(
        parser.parse_args(["--max-waiting", "3", "--max-model-len", "512", "--device", "cuda", "--attention-backend",
                           "triton"]),
        Path("/models/m"),
    )
    scheduler = scheduler_config(*config.scheduler_args)
    assert (scheduler.max_waiting, scheduler.max_model_len) == (3, 512)
    worker_parser = argparse.ArgumentParser()
    worker_server.add_arguments(worker_parser)
    worker = worker_parser.parse_args(config.worker_args)
    assert (worker.device, worker.attention_backend) == ("cuda", "triton")
    # Unset, the services' own defaults apply.
    defaults = serve.platform_config(parser.parse_args([]), Path("/models/m"))
    assert scheduler_config(*defaults.scheduler_args).max_waiting == scheduler_config().max_waiting
    assert worker_parser.parse_args(defaults.worker_args).attention_backend is None


def test_scheduling_ahead_is_on_unless_turned_off() -> None:
    assert scheduler_config().schedule_ahead
    assert not scheduler_config("--no-schedule-ahead").schedule_ahead
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    for flags, expected in (([], True), (["--device", "cuda"], True), (["--schedule-ahead"], True),
                            (["--no-schedule-ahead"], False), (["--device", "cuda", "--no-schedule-ahead"], False)):
        config = serve.platform_config(parser.parse_args(flags), Path("/models/m"))
        assert scheduler_config(*config.scheduler_args).schedule_ahead is expected, flags
