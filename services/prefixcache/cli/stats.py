"""`prefixcache stats [--json]`: the engine's prefix-cache counters and KV pool occupancy."""
from __future__ import annotations

import argparse
import json

from prefixcache.cli.client_args import add_target, run_on_engine
from prefixcache.client import EngineClient


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_target(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    async def main(engine: EngineClient) -> int:
        stats = await engine.cache_stats()
        fields: dict[str, object] = {field.name: getattr(stats, field.name) for field in stats.DESCRIPTOR.fields}
        fields["missed_tokens_by_reason"] = dict(sorted(stats.missed_tokens_by_reason.items()))
        fields["hit_rate"] = stats.hit_tokens / stats.query_tokens if stats.query_tokens else 0.0
        if args.json:
            print(json.dumps(fields))
        else:
            width = max(map(len, fields))
            for name, value in fields.items():
                shown = f"{value:.3f}" if isinstance(value, float) else value
                print(f"{name:<{width}}  {shown}")
        return 0

    return run_on_engine(args, "stats", main)
