"""The tokenizer service over real loopback gRPC, with the embedded model's tokenizer."""
from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
from grpc import aio

from prefixcache.model_store.tokenizer_identity import tokenizer_id
from prefixcache.protos.common.v1 import chat_pb2
from prefixcache.protos.tokenizer.v1 import tokenizer_pb2 as pb
from prefixcache.protos.tokenizer.v1 import tokenizer_pb2_grpc as pb_grpc
from prefixcache.tokenizer.server import servicer
from prefixcache.tokenizer.text import IncrementalDetokenizer, TextTokenizer

# The chat-templated "What is the capital of France?" with SmolLM2's default system prompt.
CAPITAL_OF_FRANCE_CHAT = [
    1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407,
    19712, 8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198,
]  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> TextTokenizer:
    return TextTokenizer(model_dir)


async def with_stub(tokenizer: TextTokenizer, body) -> None:
    server = aio.server()
    servicer(tokenizer).add_to_server(server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            await body(pb_grpc.TokenizerStub(channel))
    finally:
        await server.stop(0)


def run(tokenizer: TextTokenizer, body) -> None:
    asyncio.run(with_stub(tokenizer, body))


def test_chat_renders_with_the_models_template(tokenizer: TextTokenizer) -> None:
    async def body(stub: pb_grpc.TokenizerStub) -> None:
        chat = chat_pb2.ChatConversation(
            messages=[chat_pb2.ChatMessage(role="user", content="What is the capital of France?")],
            add_generation_prompt=True,
        )
        reply = await stub.Tokenize(pb.TokenizeRequest(chat=chat))
        assert list(reply.token_ids) == CAPITAL_OF_FRANCE_CHAT
        text = await stub.Detokenize(pb.DetokenizeRequest(token_ids=reply.token_ids))
        assert text.text.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")

    run(tokenizer, body)


def test_text_round_trips_and_adds_no_bos(tokenizer: TextTokenizer) -> None:
    async def body(stub: pb_grpc.TokenizerStub) -> None:
        text = "Prefix caching saves prefill, not decode."
        ids = (await stub.Tokenize(pb.TokenizeRequest(text=text))).token_ids
        assert ids[0] != tokenizer.bos_token_id
        assert (await stub.Detokenize(pb.DetokenizeRequest(token_ids=ids))).text == text

    run(tokenizer, body)


@pytest.mark.parametrize(
    ("messages", "field"),
    [
        ([], "chat.messages"),
        ([("robot", "hi")], "chat.messages[0].role"),
        ([("user", "hi"), ("assistant", "")], "chat.messages[1].content"),
    ],
)
def test_malformed_chat_is_invalid_argument_naming_the_field(tokenizer, messages, field) -> None:
    async def body(stub: pb_grpc.TokenizerStub) -> None:
        chat = chat_pb2.ChatConversation(messages=[chat_pb2.ChatMessage(role=r, content=c) for r, c in messages])
        with pytest.raises(grpc.RpcError) as error:
            await stub.Tokenize(pb.TokenizeRequest(chat=chat))
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error.value.details().startswith(field + ":")

    run(tokenizer, body)


def test_out_of_vocabulary_ids_are_rejected(tokenizer: TextTokenizer) -> None:
    async def body(stub: pb_grpc.TokenizerStub) -> None:
        with pytest.raises(grpc.RpcError) as error:
            await stub.Detokenize(pb.DetokenizeRequest(token_ids=[1, tokenizer.vocab_size]))
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "token_ids[1]" in error.value.details()

    run(tokenizer, body)


def test_stream_never_emits_a_broken_character(tokenizer: TextTokenizer) -> None:
    text = "héllo 世界 🎉🎉 done"
    ids = tokenizer.encode(text)
    # Some tokens hold only part of a character's bytes: that is the case under test.
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)

    async def body(stub: pb_grpc.TokenizerStub) -> None:
        async def one_id_at_a_time():
            for token_id in ids:
                yield pb.DetokenizeStreamRequest(token_ids=[token_id])

        pieces = [reply.text async for reply in stub.DetokenizeStream(one_id_at_a_time())]
        assert len(pieces) == len(ids)
        assert all("\ufffd" not in piece for piece in pieces)
        assert "".join(pieces) == text

    run(tokenizer, body)


def test_the_last_message_flushes_an_unfinished_character(tokenizer: TextTokenizer) -> None:
    ids = tokenizer.encode("ok 🎉")
    cut = next(n for n in range(len(ids), 0, -1) if tokenizer.decode(ids[:n]).endswith("\ufffd"))
    ids = ids[:cut]  # the stream ends inside the emoji, as a generation cut by max_tokens can

    async def body(stub: pb_grpc.TokenizerStub) -> None:
        async def requests():
            for index, token_id in enumerate(ids):
                yield pb.DetokenizeStreamRequest(token_ids=[token_id], last=index == len(ids) - 1)

        pieces = [reply.text async for reply in stub.DetokenizeStream(requests())]
        assert all("\ufffd" not in piece for piece in pieces[:-1])
        assert pieces[-1].endswith("\ufffd")
        detokenized = await stub.Detokenize(pb.DetokenizeRequest(token_ids=ids))
        assert "".join(pieces) == detokenized.text

    run(tokenizer, body)


def test_stream_decodes_in_the_context_of_the_prompt(tokenizer: TextTokenizer) -> None:
    prompt = tokenizer.encode("The answer is")
    generated = tokenizer.encode("The answer is forty-two.")[len(prompt) :]
    assert generated, "the suffix must tokenize separately for this test to mean anything"

    async def body(stub: pb_grpc.TokenizerStub) -> None:
        async def requests():
            yield pb.DetokenizeStreamRequest(prefix_token_ids=prompt, token_ids=generated[:1])
            for token_id in generated[1:]:
                yield pb.DetokenizeStreamRequest(token_ids=[token_id])

        pieces = [reply.text async for reply in stub.DetokenizeStream(requests())]
        assert "".join(pieces) == " forty-two."

    run(tokenizer, body)


def test_a_prompt_ending_inside_a_character_does_not_swallow_the_first_text(tokenizer: TextTokenizer) -> None:
    # A prompt cut inside a character (e.g. token ids sent by a client), then generated ids whose
    # first one is that character's last byte: the stream is the generated ids' own text.
    character = tokenizer.encode("你")
    assert len(character) > 1, "the test needs a character split over several byte tokens"
    prompt = tokenizer.encode("Hi ") + character[:-1]
    generated = character[-1:] + tokenizer.encode("a ok")

    async def body(stub: pb_grpc.TokenizerStub) -> None:
        async def requests():
            yield pb.DetokenizeStreamRequest(prefix_token_ids=prompt, token_ids=generated[:1])
            for index, token_id in enumerate(generated[1:], 2):
                yield pb.DetokenizeStreamRequest(token_ids=[token_id], last=index == len(generated))

        pieces = [reply.text async for reply in stub.DetokenizeStream(requests())]
        detokenized = await stub.Detokenize(pb.DetokenizeRequest(token_ids=generated))
        assert "".join(pieces) == detokenized.text == "\ufffda ok"

    run(tokenizer, body)


def test_an_out_of_vocabulary_prefix_id_is_named_as_such(tokenizer: TextTokenizer) -> None:
    async def body(stub: pb_grpc.TokenizerStub) -> None:
        async def requests():
            yield pb.DetokenizeStreamRequest(prefix_token_ids=[1, tokenizer.vocab_size], token_ids=[1])

        with pytest.raises(grpc.RpcError) as error:
            [reply async for reply in stub.DetokenizeStream(requests())]
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error.value.details().startswith("prefix_token_ids[1]")

    run(tokenizer, body)


def test_info_describes_the_vocabulary(tokenizer: TextTokenizer, model_dir: Path) -> None:
    async def body(stub: pb_grpc.TokenizerStub) -> None:
        info = await stub.GetInfo(pb.GetInfoRequest())
        assert info.vocab_size == 49152
        assert list(info.eos_token_ids) == [2] and info.bos_token_id == 1
        assert info.has_chat_template
        assert info.tokenizer_id == tokenizer_id(model_dir) and info.tokenizer_id.startswith("sha256:")
        assert (await stub.Tokenize(pb.TokenizeRequest(text="hi"))).tokenizer_id == info.tokenizer_id

    run(tokenizer, body)


def test_skipped_special_tokens_cost_nothing_and_change_no_text(tokenizer: TextTokenizer,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A model that keeps emitting <|im_end|> under ignore_eos: each skipped token must not widen the
    window every later push decodes (the work grew with the square of the stream), and an unfinished
    character still flushes when the stream ends on a skipped token."""
    im_end = tokenizer.eos_token_ids[0]
    assert im_end in tokenizer.special_ids
    emoji = tokenizer.encode("ok 🎉")
    cut = next(n for n in range(len(emoji), 0, -1) if tokenizer.decode(emoji[:n]).endswith("\ufffd"))
    stream = tokenizer.encode(" héllo") + [im_end] * 1000 + tokenizer.encode(" 世界") + [im_end] * 3 + emoji[:cut]
    decoded_ids = 0
    decode = tokenizer.decode_checked

    def counting_decode(token_ids, skip_special_tokens=False):
        nonlocal decoded_ids
        decoded_ids += len(token_ids)
        return decode(token_ids, skip_special_tokens)

    monkeypatch.setattr(tokenizer, "decode_checked", counting_decode)
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode("Say:"), skip_special_tokens=True)
    pieces = [detokenizer.push([token_id]) for token_id in stream] + [detokenizer.push([im_end], last=True)]
    assert "".join(pieces) == decode(stream, skip_special_tokens=True)
    assert pieces[-1].endswith("\ufffd")
    assert decoded_ids < 40 * len(stream)


@pytest.mark.parametrize("kind", ["text", "chat"])
def test_an_input_over_the_byte_limit_is_refused_before_any_work(tokenizer: TextTokenizer, kind: str) -> None:
    from prefixcache.tokenizer.server import DEFAULT_MAX_INPUT_BYTES

    big = "word " * (DEFAULT_MAX_INPUT_BYTES // 5 + 1)
    request = (pb.TokenizeRequest(text=big) if kind == "text" else
               pb.TokenizeRequest(chat=chat_pb2.ChatConversation(messages=[chat_pb2.ChatMessage(role="user", content=big)])))

    async def body(stub: pb_grpc.TokenizerStub) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.Tokenize(request)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        size = len(big.encode()) if kind == "text" else request.chat.ByteSize()
        assert refused.value.details() == f"{kind}: {size} bytes, more than the {DEFAULT_MAX_INPUT_BYTES} allowed"

    run(tokenizer, body)


def test_tokenizing_runs_off_the_event_loop(tokenizer: TextTokenizer) -> None:
    """Small calls sent while inputs near the limit are tokenized are answered too: the loop that
    serves every caller is not the one tokenizing."""
    near_limit = "a quick brown fox " * 50_000  # 900 kB of text

    async def body(stub: pb_grpc.TokenizerStub) -> None:
        big = [asyncio.ensure_future(stub.Tokenize(pb.TokenizeRequest(text=near_limit))) for _ in range(3)]
        small = await asyncio.wait_for(stub.Tokenize(pb.TokenizeRequest(text="hello")), 30)
        assert list(small.token_ids) == tokenizer.encode("hello")
        finished_big = sum(task.done() for task in big)
        replies = await asyncio.gather(*big)
        assert all(len(reply.token_ids) > 100_000 for reply in replies)
        assert finished_big == 0  # the small call waited for none of the big ones

    run(tokenizer, body)
