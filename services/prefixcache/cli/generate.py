"""`prefixcache generate "PROMPT"`: stream one completion, then print the usage.

With `--system FILE` the prompt becomes a chat (system message from the file, then the prompt as
the user's message), rendered with the model's chat template; `--chat` does the same without a
system message. `--json` prints one JSON object at the end instead of streaming (with `--logprobs N`,
each token's log-probability and the N most likely tokens at its position).
"""
from __future__ import annotations

import argparse
import json
import sys

from prefixcache.arg_types import bounded_int, text_file, utf8_text
from prefixcache.cli.client_args import add_sampling, add_target, engine_connection, report_rpc_errors, sampling_kwargs
from prefixcache.client import Completion, build_request
from prefixcache.step.messages import MAX_LOGPROBS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", type=utf8_text, help="the prompt text")
    add_target(parser)
    parser.add_argument("--system", type=text_file, metavar="FILE", help="system prompt file (makes the request a chat)")
    parser.add_argument("--chat", action="store_true", help="send the prompt as a user chat message")
    parser.add_argument("--request-id", type=utf8_text, default="", help="client request id (default: server-assigned)")
    parser.add_argument("--json", action="store_true", help="print one JSON object at the end")
    parser.add_argument("--logprobs", type=bounded_int(1, MAX_LOGPROBS), default=0, metavar="N",
                        help=f"with --json: each token's log-probability and the N most likely tokens (1-{MAX_LOGPROBS})")
    add_sampling(parser)


def run(args: argparse.Namespace) -> int:
    if args.logprobs and not args.json:
        print("prefixcache generate: --logprobs needs --json (the streamed text has no room for them)",
              file=sys.stderr)
        return 2
    try:
        options = {"request_id": args.request_id, "logprobs": args.logprobs, **sampling_kwargs(args)}
        connection = engine_connection(args)
    except ValueError as error:  # an empty (or not UTF-8) $PREFIXCACHE_CACHE_SALT, an unreadable key or CA
        print(f"prefixcache generate: {error}", file=sys.stderr)
        return 2
    if args.system is not None:
        request = build_request(messages=[("system", args.system), ("user", args.prompt)], **options)
    elif args.chat:
        request = build_request(messages=[("user", args.prompt)], **options)
    else:
        request = build_request(text=args.prompt, **options)

    async def main() -> int:
        completion = Completion()
        async with connection.client() as engine:
            async for chunk in engine.generate(request):
                completion.add(chunk)
                if not args.json:
                    print(chunk.text, end="", flush=True)
        if args.json:
            print(json.dumps(completion.as_dict()))
        else:
            print()
            print_usage(completion)
        return 0

    return report_rpc_errors(main)


def print_usage(completion: Completion) -> None:
    usage = completion.usage
    account = completion.cache_account
    reason = f", cache: {account.miss_reason}" if account is not None and account.miss_reason else ""
    print(
        f"[{completion.finish_reason}] prompt {usage.prompt_tokens} tokens ({usage.cached_tokens} cached{reason}), "
        f"completion {usage.completion_tokens} tokens",
        file=sys.stderr,
    )
