"""`prefixcache events --target HOST:PORT [--from SEQ] [--json]`: tail a scheduler's KV events stream.

One line per batch (with `--json`, one JSON object per line: hashes as hex), and a line for each gap
(batches the stream dropped before this reader got them: resync with a snapshot). Runs until Ctrl-C.
"""
from __future__ import annotations

import argparse
import json

from prefixcache.arg_types import bounded_int
from prefixcache.cli.client_args import UINT64_MAX, add_target, run_on_engine
from prefixcache.client import EngineClient
from prefixcache.protos.engine.v1 import kv_cache_pb2 as pb


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_target(parser)
    parser.add_argument("--from", dest="from_seq", type=bounded_int(0, UINT64_MAX), metavar="SEQ",
                        help="the first batch to print (default: the next one published)")
    parser.add_argument("--json", action="store_true", help="one JSON object per line")


def run(args: argparse.Namespace) -> int:
    async def main(engine: EngineClient) -> int:
        async for message in engine.kv_events(args.from_seq):
            print(json.dumps(message_to_json(message)) if args.json else describe(message), flush=True)
        return 0

    return run_on_engine(args, "events", main)


def message_to_json(message: pb.KvEventsMessage) -> dict[str, object]:
    if message.HasField("gap"):
        return {"type": "gap", "first_missed_seq": message.gap.first_missed_seq, "resume_seq": message.gap.resume_seq}
    batch = message.batch
    return {"type": "batch", "seq": batch.seq, "epoch": batch.epoch, "published_at_unix_nano": batch.published_at_unix_nano,
            "events": [_event_to_json(event) for event in batch.events]}


def _event_to_json(event: pb.KvEvent) -> dict[str, object]:
    kind = event.WhichOneof("event")
    if kind == "stored":
        stored = event.stored
        return {"type": "stored", "block_hashes": [h.hex() for h in stored.block_hashes],
                "parent_block_hash": stored.parent_block_hash.hex() or None, "block_size": stored.block_size,
                "token_count": stored.token_count, "lora": stored.lora, "multimodal": stored.multimodal}
    if kind == "removed":
        return {"type": "removed", "block_hashes": [h.hex() for h in event.removed.block_hashes]}
    return {"type": "cleared"}


def describe(message: pb.KvEventsMessage) -> str:
    if message.HasField("gap"):
        return (f"gap: batches {message.gap.first_missed_seq} to {message.gap.resume_seq - 1} were dropped "
                "before this reader got them (resync from a GetCachedBlocks snapshot)")
    batch = message.batch
    parts = []
    for event in batch.events:
        kind = event.WhichOneof("event")
        if kind == "stored":
            parts.append(f"stored {len(event.stored.block_hashes)} ({event.stored.block_hashes[0].hex()[:12]}..)")
        elif kind == "removed":
            parts.append(f"removed {len(event.removed.block_hashes)}")
        else:
            parts.append("cleared")
    return f"seq {batch.seq} epoch {batch.epoch:016x}: {', '.join(parts)}"
