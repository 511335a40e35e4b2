"""The tokenizer service: `prefixcache tokenizer --port 50053 [--model-dir DIR]`.

Imports no torch and converts no model: the tokenizer image installs only the `tokenizer` extra.
Without --model-dir it serves the default model where `prefixcache model pull` put it.

Tokenizing and decoding run on a small thread pool, never on the event loop that answers every
caller (and health checks), and a text or chat larger than `--max-input-bytes` is refused
(INVALID_ARGUMENT) before any work: one huge input costs its sender an error and nobody else a delay.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import grpc
from grpc import aio

from prefixcache.arg_types import listen_port
from prefixcache.model_store.store import default_model_dir, is_complete_model_dir
from prefixcache.protos.tokenizer.v1 import tokenizer_pb2 as pb
from prefixcache.protos.tokenizer.v1 import tokenizer_pb2_grpc as pb_grpc
from prefixcache.rpc.metrics_http import start_service_metrics
from prefixcache.rpc.server import Servicer, add_health_port_argument, configure_logging, probe_address, run_server
from prefixcache.rpc.tls import add_server_tls_arguments, server_tls
from prefixcache.tokenizer.text import ChatTemplateError, ChatTurn, IncrementalDetokenizer, TextTokenizer

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Tokenizer"].full_name

log = logging.getLogger(__name__)
# The scheduler's own bound on a text or chat prompt (`--max-prompt-bytes`) is the same by default.
DEFAULT_MAX_INPUT_BYTES = 1024 * 1024
# One pool per process, whatever the number of servicers (tests make many); threads start on first use.
# The tokenizer's Rust code runs without the GIL (`TextTokenizer.encode`), so they work in parallel.
_THREADS = ThreadPoolExecutor(4, thread_name_prefix="tokenize")
T = TypeVar("T")


async def _off_loop(function: Callable[..., T], *args: object) -> T:
    return await asyncio.get_running_loop().run_in_executor(_THREADS, function, *args)


class TokenizerServicer(pb_grpc.TokenizerServicer):
    def __init__(self, tokenizer: TextTokenizer, max_input_bytes: int = DEFAULT_MAX_INPUT_BYTES):
        self._tokenizer = tokenizer
        self._max_input_bytes = max_input_bytes

    async def Tokenize(self, request: pb.TokenizeRequest, context: aio.ServicerContext) -> pb.TokenizeResponse:
        kind = request.WhichOneof("input")
        if kind is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "input: set text or chat")
        size = len(request.text.encode()) if kind == "text" else request.chat.ByteSize()
        if size > self._max_input_bytes:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"{kind}: {size} bytes, more than the {self._max_input_bytes} allowed")
        if kind == "text":
            ids = await _off_loop(self._tokenizer.encode, request.text, request.add_special_tokens)
        else:
            turns = [ChatTurn(m.role, m.content) for m in request.chat.messages]
            try:
                ids = await _off_loop(self._tokenizer.encode_chat, turns, request.chat.add_generation_prompt)
            except ChatTemplateError as error:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        return pb.TokenizeResponse(token_ids=ids, tokenizer_id=self._tokenizer.tokenizer_id)

    async def Detokenize(self, request: pb.DetokenizeRequest, context: aio.ServicerContext) -> pb.DetokenizeResponse:
        try:
            text = await _off_loop(self._tokenizer.decode, list(request.token_ids), request.skip_special_tokens)
        except ValueError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        return pb.DetokenizeResponse(text=text)

    async def DetokenizeStream(
        self, requests: AsyncIterator[pb.DetokenizeStreamRequest], context: aio.ServicerContext
    ) -> AsyncIterator[pb.DetokenizeStreamResponse]:
        detokenizer: IncrementalDetokenizer | None = None
        async for request in requests:
            try:
                if detokenizer is None:
                    detokenizer = IncrementalDetokenizer(
                        self._tokenizer, request.prefix_token_ids, request.skip_special_tokens
                    )
                text = detokenizer.push(request.token_ids, last=request.last)
            except ValueError as error:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
            yield pb.DetokenizeStreamResponse(text=text, tokenizer_id=self._tokenizer.tokenizer_id)

    async def GetInfo(self, request: pb.GetInfoRequest, context: aio.ServicerContext) -> pb.TokenizerInfo:
        return pb.TokenizerInfo(
            vocab_size=self._tokenizer.vocab_size,
            bos_token_id=self._tokenizer.bos_token_id,
            eos_token_ids=self._tokenizer.eos_token_ids,
            has_chat_template=self._tokenizer.has_chat_template,
            tokenizer_id=self._tokenizer.tokenizer_id,
        )


def servicer(tokenizer: TextTokenizer, max_input_bytes: int = DEFAULT_MAX_INPUT_BYTES) -> Servicer:
    instance = TokenizerServicer(tokenizer, max_input_bytes)
    return Servicer(SERVICE_NAME, lambda server: pb_grpc.add_TokenizerServicer_to_server(instance, server))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--port", type=listen_port, default=50053, help="port to listen on (0: any free port)")
    parser.add_argument("--host", default="[::]", help="address to bind (default: all interfaces)")
    parser.add_argument("--model-dir", type=Path, help="model directory with tokenizer.json (default: the embedded "
                        "model, as `prefixcache model pull` put it)")
    parser.add_argument("--grace", type=float, default=5.0, help="seconds in-flight calls get on SIGTERM")
    parser.add_argument("--drain-idle", type=float, default=0.0,
                        help="on SIGTERM: keep serving new calls until none has been in flight for this long "
                             "(for a tokenizer with a single scheduler; 0, the default: refuse new calls at once, "
                             "so that a scheduler's next calls go to another replica)")
    parser.add_argument("--max-input-bytes", type=int, default=DEFAULT_MAX_INPUT_BYTES,
                        help="refuse a text or chat larger than this (UTF-8 bytes; a chat as serialized)")
    parser.add_argument("--metrics-port", type=listen_port, default=None,
                        help="serve Prometheus metrics on this port (the chart uses 9092)")
    parser.add_argument("--log-level", default="INFO")
    add_health_port_argument(parser)
    add_server_tls_arguments(parser)


def run(args: argparse.Namespace) -> int:
    configure_logging(args.log_level)
    try:
        tls = server_tls(args)
    except ValueError as error:
        log.error("%s", error)
        return 2
    model_dir = args.model_dir or default_model_dir()
    if args.model_dir is None and not is_complete_model_dir(model_dir):
        # Converting the model needs the worker's packages, which this image does not install.
        log.error("no model in %s: run `prefixcache model pull` first, or give --model-dir", model_dir)
        return 1
    try:
        tokenizer = TextTokenizer(model_dir)
    except Exception as error:  # a missing or malformed file; `tokenizers` raises plain Exceptions
        log.error("cannot load the tokenizer from %s: %s", model_dir, error)
        return 1
    try:  # labelled with the model directory's name: the tokenizer knows no weights
        interceptors = start_service_metrics(args.metrics_port, args.host, lambda: model_dir.name)
    except RuntimeError as error:
        log.error("%s", error)
        return 1
    return asyncio.run(
        run_server("prefixcache-tokenizer", f"{args.host}:{args.port}", [servicer(tokenizer, args.max_input_bytes)],
                   grace_s=args.grace, drain_idle_s=args.drain_idle, interceptors=interceptors, tls=tls,
                   health_address=probe_address(args))
    )
