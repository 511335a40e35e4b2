"""`prefixcache stats [--json]`: the engine's prefix-cache counters and KV pool occupancy."""
from __future__ import annotations

import argparse
import json

from google.protobuf.json_format import MessageToDict

from prefixcache.services.cli.client_args import add_target, report_rpc_errors
from prefixcache.services.common.engine_client import EngineClient


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_target(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    async def main() -> int:
        async with EngineClient(args.target) as engine:
            stats = await engine.cache_stats()
        fields = MessageToDict(stats, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
        for name in ("query_tokens", "hit_tokens", "evictions"):  # uint64 comes out as a string in proto JSON
            fields[name] = int(fields[name])
        queried = stats.query_tokens
        fields["hit_rate"] = stats.hit_tokens / queried if queried else 0.0
        if args.json:
            print(json.dumps(fields))
        else:
            width = max(map(len, fields))
            for name, value in fields.items():
                shown = f"{value:.3f}" if isinstance(value, float) else value
                print(f"{name:<{width}}  {shown}")
        return 0

    return report_rpc_errors(main)
