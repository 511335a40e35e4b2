"""`prefixcache stats [--json]`: the engine's prefix-cache counters and KV pool occupancy."""
from __future__ import annotations

import argparse
import json
import sys

from prefixcache.cli.client_args import add_target, engine_connection, report_rpc_errors


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_target(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    try:
        connection = engine_connection(args)
    except ValueError as error:  # an unreadable key or CA, an empty $PREFIXCACHE_API_KEY
        print(f"prefixcache stats: {error}", file=sys.stderr)
        return 2

    async def main() -> int:
        async with connection.client() as engine:
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

    return report_rpc_errors(main)
