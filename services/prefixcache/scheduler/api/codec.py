"""Between the Engine API's protobuf messages and the engine's types: what a GenerateRequest's
fields may hold, the EngineRequest it becomes, and the messages the engine's results become.

A field that cannot be accepted raises `InvalidRequest` (INVALID_ARGUMENT); one the API carries but
no served request can use raises `Unimplemented` (UNIMPLEMENTED); one the caller's credentials do
not allow raises `PermissionDenied` (PERMISSION_DENIED). Each message starts with the field's name.
"""
from __future__ import annotations

from prefixcache.block_identity.hashing import BlockExtras
from prefixcache.protos.engine.v1 import engine_pb2 as pb
from prefixcache.rpc.quoting import quoted
from prefixcache.scheduler.kv_cache import CacheAccount
from prefixcache.scheduler.request import EngineRequest
from prefixcache.step.messages import SamplingParams

FINISH_REASONS = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
}
# EngineCore's field names → the public API's.
PUBLIC_FIELDS = {
    "max_tokens": "sampling.max_tokens",
    "temperature": "sampling.temperature",
    "top_p": "sampling.top_p",
    "top_k": "sampling.top_k",
    "stop_token_ids": "sampling.stop_token_ids",
    "logprobs": "sampling.logprobs",
}

# A request id is echoed in every response and recorded in spans and eviction events.
MAX_REQUEST_ID_BYTES = 256
# Stop strings are matched on the event loop that serves every request, at a cost per token that
# grows with their number: a bound keeps one request from slowing all the others.
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
# Text and chat prompts are tokenized by the tokenizer service before any token count is known: a
# byte bound keeps one request from occupying it (and its memory) for everyone. 1 MiB is over 100
# bytes for each token of an 8,192-token context.
DEFAULT_MAX_PROMPT_BYTES = 1024 * 1024


class InvalidRequest(ValueError):
    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")


class Unimplemented(Exception):
    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")


class PermissionDenied(Exception):
    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")


def check_served(request: pb.GenerateRequest) -> None:
    """Refuse what the API carries but no served request can use: the worker applies no LoRA
    adapter and embeds no multimodal input (block identity hashes both, for the day it does)."""
    if request.lora_adapter:
        raise Unimplemented("lora_adapter", f"{quoted(request.lora_adapter)}: LoRA adapters are not served; "
                                            "leave it empty for the base model")
    if request.multimodal_items:
        raise Unimplemented("multimodal_items", "multimodal inputs are not served; the engine takes text and "
                                                "token ids only")


def check_prompt_bytes(request: pb.GenerateRequest, max_bytes: int) -> None:
    """Refuse a text or chat prompt larger than `max_bytes` (UTF-8 text; a chat as serialized)
    before it is sent to be tokenized."""
    kind = request.WhichOneof("prompt")
    if kind == "text":
        size = len(request.text.encode())
    elif kind == "chat":
        size = request.chat.ByteSize()
    else:
        return
    if size > max_bytes:
        raise InvalidRequest(kind, f"{size} bytes, more than the {max_bytes} allowed")


def check_stop_strings(stops: list[str]) -> None:
    if len(stops) > MAX_STOP_STRINGS:
        raise InvalidRequest("sampling.stop", f"{len(stops)} stop strings, more than the {MAX_STOP_STRINGS} allowed")
    for index, stop in enumerate(stops):
        if not stop:
            raise InvalidRequest(f"sampling.stop[{index}]", "must not be empty")
        if len(stop) > MAX_STOP_STRING_CHARS:
            raise InvalidRequest(f"sampling.stop[{index}]", f"{len(stop)} characters, more than the "
                                                           f"{MAX_STOP_STRING_CHARS} allowed")


def engine_request(request_id: str, request: pb.GenerateRequest, prompt_ids: list[int], *,
                   capacity_tokens: int, cache_salt: str | None, tenant: str = "",
                   trace_context: object | None = None, arrival_ns: int | None = None) -> EngineRequest:
    """The engine's request. Without max_tokens it generates as many tokens as `capacity_tokens`
    (what both the model's length and the KV cache hold) leaves room for after the prompt.
    `trace_context` and `arrival_ns`: its span's context and when its call arrived."""
    options = request.sampling
    sampling = SamplingParams(
        temperature=options.temperature if options.HasField("temperature") else 1.0,
        top_p=options.top_p if options.HasField("top_p") else 1.0,
        top_k=options.top_k,
        seed=options.seed if options.HasField("seed") else None,
        logprobs=options.logprobs,
    )
    max_tokens = options.max_tokens if options.HasField("max_tokens") else max(1, capacity_tokens - len(prompt_ids))
    return EngineRequest(
        request_id=request_id,
        prompt_token_ids=prompt_ids,
        sampling=sampling,
        max_tokens=max_tokens,
        stop_token_ids=tuple(options.stop_token_ids),
        ignore_eos=options.ignore_eos,
        extras=BlockExtras(cache_salt=cache_salt),
        tenant=tenant,
        trace_context=trace_context,
        arrival_ns=arrival_ns,
    )


def public_field(engine_field: str, request: pb.GenerateRequest) -> str:
    """The GenerateRequest field an EngineCore rejection is about."""
    if engine_field == "prompt_token_ids":  # the prompt, in whichever form the client sent it
        return request.WhichOneof("prompt") or "prompt"
    return PUBLIC_FIELDS.get(engine_field, engine_field)


def account_to_proto(account: CacheAccount) -> pb.CacheAccount:
    return pb.CacheAccount(
        queried_tokens=account.queried_tokens,
        hit_tokens=account.hit_tokens,
        capped_tokens=account.capped_tokens,
        partial_tail_tokens=account.partial_tail_tokens,
        miss_reason=account.miss_reason,
        queried_blocks=account.queried_blocks,
        hit_blocks=account.hit_blocks,
    )
