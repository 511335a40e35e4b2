"""The scheduler's view of the tokenizer service: prompts to ids, and per-request streaming text."""
from __future__ import annotations

import asyncio
from collections.abc import Sequence

from grpc import aio

from prefixcache.model_store.tokenizer_identity import same_tokenizer
from prefixcache.protos.common.v1 import chat_pb2
from prefixcache.protos.tokenizer.v1 import tokenizer_pb2 as pb
from prefixcache.protos.tokenizer.v1 import tokenizer_pb2_grpc as pb_grpc
from prefixcache.rpc.client import is_serving, open_channel
from prefixcache.rpc.tls import ChannelTls

# Prompt ids sent as decoding context with a stream's first message (leading spaces depend on them).
DETOKENIZE_CONTEXT_IDS = 8


class TokenizerMismatch(Exception):
    """The tokenizer service serves another tokenizer than the worker's model was made with."""

    def __init__(self, served: str, expected: str):
        super().__init__(f"the tokenizer service serves tokenizer {served}, but the worker's model has {expected} "
                         "(a model change still rolling out, or a tokenizer address meant for another model)")


def _check(served: str, expected: str) -> None:
    if not same_tokenizer(served, expected):
        raise TokenizerMismatch(served, expected)


class TokenizerClient:
    """Calls raise `grpc.RpcError` unchanged: the servicer passes the tokenizer's status on. Each
    call takes the tokenizer id the worker's model expects and raises TokenizerMismatch if the
    reply came from another tokenizer: behind one Service, replicas of two models may answer."""

    def __init__(self, target: str, timeout_s: float = 30.0, tls: ChannelTls | None = None):
        self.target = target
        self._channel = open_channel(target, tls)
        self._stub = pb_grpc.TokenizerStub(self._channel)
        self._timeout_s = timeout_s

    async def tokenize_text(self, text: str, expected_tokenizer_id: str) -> list[int]:
        return await self._tokenize(pb.TokenizeRequest(text=text), expected_tokenizer_id)

    async def tokenize_chat(self, chat: chat_pb2.ChatConversation, expected_tokenizer_id: str) -> list[int]:
        return await self._tokenize(pb.TokenizeRequest(chat=chat), expected_tokenizer_id)

    async def _tokenize(self, request: pb.TokenizeRequest, expected_tokenizer_id: str) -> list[int]:
        reply = await self._stub.Tokenize(request, timeout=self._timeout_s)
        _check(reply.tokenizer_id, expected_tokenizer_id)
        return list(reply.token_ids)

    async def is_serving(self) -> bool:
        """Whether the tokenizer service answers its health check with SERVING."""
        return await is_serving(self._channel)

    def detokenizer(self, prompt_ids: Sequence[int], expected_tokenizer_id: str) -> StreamingDetokenizer:
        return StreamingDetokenizer(self._stub, list(prompt_ids[-DETOKENIZE_CONTEXT_IDS:]), expected_tokenizer_id)

    async def close(self) -> None:
        await self._channel.close()


class StreamingDetokenizer:
    """One DetokenizeStream call per generation: push the new ids of each output, get their text."""

    def __init__(self, stub: pb_grpc.TokenizerStub, prompt_context: list[int], expected_tokenizer_id: str):
        self._stub = stub
        self._context = prompt_context
        self._expected_tokenizer_id = expected_tokenizer_id
        self._call: aio.StreamStreamCall | None = None

    async def open(self) -> None:
        """Start the stream now, sending only the prompt's context, and check which tokenizer answers
        (a token-id prompt has not been near the tokenizer before its reply)."""
        try:
            await self.push(())
        except BaseException:
            await self.close()
            raise

    async def push(self, token_ids: Sequence[int], last: bool = False) -> str:
        """The text `token_ids` complete; with `last`, also whatever was held back."""
        if self._call is None:
            self._call = self._stub.DetokenizeStream()
            message = pb.DetokenizeStreamRequest(
                token_ids=token_ids, prefix_token_ids=self._context, skip_special_tokens=True, last=last
            )
        else:
            message = pb.DetokenizeStreamRequest(token_ids=token_ids, last=last)
        try:
            await self._call.write(message)
        except asyncio.InvalidStateError:
            pass  # the call has already ended (the tokenizer is gone): reading raises its status
        reply = await self._call.read()
        _check(reply.tokenizer_id, self._expected_tokenizer_id)
        return reply.text

    async def close(self) -> None:
        """End the stream; the tokenizer's stream state goes with it."""
        call, self._call = self._call, None
        if call is not None and not call.done():
            call.cancel()
