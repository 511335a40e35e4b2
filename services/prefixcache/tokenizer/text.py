"""The served model's tokenizer: HF `tokenizers` on tokenizer.json, chat templates with jinja2.

No torch and no transformers: the tokenizer image carries only `tokenizers` and `jinja2`.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from prefixcache.model_store.tokenizer_identity import tokenizer_id
from prefixcache.rpc.quoting import quoted

CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})


@dataclass(frozen=True)
class ChatTurn:
    role: str
    content: str


class ChatTemplateError(ValueError):
    """The conversation cannot be rendered (bad message, or the template rejected it)."""


class TextTokenizer:
    """Tokenize, detokenize and render chat for one model directory."""

    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        tokenizer_file = model_dir / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {model_dir}")
        self._tokenizer = Tokenizer.from_file(str(tokenizer_file))
        self.tokenizer_id = tokenizer_id(model_dir)
        config_file = model_dir / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.bos_token_id = self._id_of(self.bos_token)
        eos_id = self._id_of(self.eos_token)
        self.eos_token_ids: tuple[int, ...] = () if eos_id is None else (eos_id,)
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        self.special_ids = frozenset(i for i, token in self._tokenizer.get_added_tokens_decoder().items()
                                     if token.special)
        template = config.get("chat_template")
        self._chat_template = _compile_template(template) if isinstance(template, str) else None

    @property
    def has_chat_template(self) -> bool:
        return self._chat_template is not None

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._tokenizer.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        # `encode_batch` lets go of the GIL while it works (`encode` holds it): a long text tokenized on
        # another thread then leaves the service's event loop free to answer everyone else.
        return self._tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        self.check_ids(token_ids)
        return self.decode_checked(token_ids, skip_special_tokens)

    def decode_checked(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """`decode` for ids already known to be inside the vocabulary."""
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def check_ids(self, token_ids: Sequence[int], field: str = "token_ids") -> None:
        for position, token_id in enumerate(token_ids):
            if not 0 <= token_id < self.vocab_size:
                raise ValueError(
                    f"{field}[{position}] = {token_id} is outside the vocabulary (0..{self.vocab_size - 1})"
                )

    def render_chat(self, turns: Sequence[ChatTurn], add_generation_prompt: bool = True) -> str:
        if self._chat_template is None:
            raise ChatTemplateError("chat: this model has no chat template")
        validate_chat(turns)
        messages = [{"role": t.role, "content": t.content} for t in turns]
        try:
            return self._chat_template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except jinja2.TemplateError as error:
            raise ChatTemplateError(f"chat: the chat template rejected the messages: {error}") from error

    def encode_chat(self, turns: Sequence[ChatTurn], add_generation_prompt: bool = True) -> list[int]:
        # The template writes the special tokens itself; adding them again would double the BOS.
        return self.encode(self.render_chat(turns, add_generation_prompt), add_special_tokens=False)


def validate_chat(turns: Sequence[ChatTurn]) -> None:
    """Reject conversations no chat template should see, naming the offending message."""
    if not turns:
        raise ChatTemplateError("chat.messages: at least one message is required")
    for index, turn in enumerate(turns):
        if turn.role not in CHAT_ROLES:
            raise ChatTemplateError(
                f"chat.messages[{index}].role: {quoted(turn.role)} is not one of {', '.join(sorted(CHAT_ROLES))}"
            )
        if not turn.content:
            raise ChatTemplateError(f"chat.messages[{index}].content: must not be empty")


def _token_text(value: object) -> str | None:
    """tokenizer_config.json gives special tokens as strings or as {"content": ...} objects."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _compile_template(source: str) -> jinja2.Template:
    # The conventions of Hugging Face chat templates: trimmed blocks, loop controls, raise_exception.
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    environment.globals["raise_exception"] = _raise_exception
    return environment.from_string(source)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas, never splitting a UTF-8 character.

    Byte-level BPE tokens can end in the middle of a multi-byte character; decoding such a prefix
    yields U+FFFD. Each delta is the text of a small window of recent ids, taken only once it no
    longer ends in U+FFFD, so the work per token stays constant however long the stream runs.

    The deltas add up to the decode of the new ids, with one exception: a byte-fallback decoder
    (Llama 2, Mistral) turns a whole run of byte tokens into U+FFFD when the run ends inside a
    character, including bytes whose character was already sent. A stream never takes back text,
    so it keeps that character and adds one U+FFFD per dangling byte.
    """

    # Ids before the first new one kept as decoding context: leading spaces and merges depend on them.
    CONTEXT_TOKENS = 5

    def __init__(self, tokenizer: TextTokenizer, prefix_ids: Sequence[int] = (), skip_special_tokens: bool = False):
        tokenizer.check_ids(prefix_ids, "prefix_token_ids")
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        context = list(prefix_ids[-self.CONTEXT_TOKENS :])
        # A prefix that ends inside a character decodes to U+FFFD, which the first new bytes would
        # rewrite: leave those ids out, so the new ids' text is theirs alone.
        while context and tokenizer.decode_checked(context, skip_special_tokens).endswith("\ufffd"):
            context.pop()
        self._ids: list[int] = context
        self._read_offset = len(context)  # ids before this have been emitted (or were context)
        self._prefix_offset = 0

    def push(self, new_ids: Sequence[int], last: bool = False) -> str:
        """Add ids; return the text they complete (possibly empty). With `last`, also the text still
        held back, an unfinished character decoded as U+FFFD, as a full decode would show it."""
        self._tokenizer.check_ids(new_ids)
        if self._skip_special and self._tokenizer.special_ids.issuperset(new_ids):
            new_ids = ()  # skipped: kept out of the window, which would otherwise grow with every one
        self._ids.extend(new_ids)
        if len(self._ids) == self._read_offset:
            return ""
        decode = self._tokenizer.decode_checked
        already = decode(self._ids[self._prefix_offset : self._read_offset], self._skip_special)
        text = decode(self._ids[self._prefix_offset :], self._skip_special)
        if text.endswith("\ufffd") and not last:
            return ""
        if text.startswith(already):
            delta = text[len(already) :]
        else:  # the decoder rewrote text already sent (see the class docstring): keep it
            delta = decode(self._ids[self._read_offset :], self._skip_special)
        if not delta:  # e.g. a skipped special token: wait for text
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return delta
