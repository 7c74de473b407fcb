"""The OpenAI-compatible surface: what clients may send, and the responses they get back.

Requests are checked here (a 400 with a clear message for what the proxy cannot serve) and
turned into a tokenize call and a :class:`~kvcompose.proxy.core.GenerationRequest`. Answers
have the shapes of vLLM 0.32's own server (``completion/protocol.py`` and
``chat_completion/protocol.py``: ``CompletionResponse``, ``CompletionStreamResponse``,
``ChatCompletionResponse``, ``ChatCompletionStreamResponse``), with ``stop_reason`` and, when
asked for with ``return_token_ids``, ``token_ids``/``prompt_token_ids``.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, field_validator

from kvcompose.proxy.core import Delta, Finish, GenerationRequest

Kind = Literal["completion", "chat"]

#: Fields the proxy reads or owns (their types and values are checked here, with vLLM's
#: rules); everything else goes to the backends unchanged, and a bad value there is P's 400,
#: passed to the client as it was, before a hand-off exists (docs/proxy.md, "Checked").
_OWN = {
    "model",
    "prompt",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "n",
    "stream",
    "stream_options",
    "stop",
    "include_stop_str_in_output",
    "min_tokens",
    "request_id",
    "return_token_ids",
    "add_generation_prompt",
    "continue_final_message",
    "chat_template",
    "chat_template_kwargs",
    "add_special_tokens",
    "echo",
    "logprobs",
    "top_logprobs",
    "prompt_logprobs",
    "use_beam_search",
    "best_of",
    "suffix",
    "kv_transfer_params",
    "tools",
    "tool_choice",
    "user",
}


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    n: int = 1
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    stop: str | list[str] | None = None
    include_stop_str_in_output: bool = False
    min_tokens: int = 0
    #: passed through, but only to D (P's one token must not stop early): typed here, so
    #: that a bad value is refused before P prepares a hand-off
    stop_token_ids: list[int] | None = None
    return_token_ids: bool = False
    kv_transfer_params: dict[str, Any] | None = None
    use_beam_search: bool = False
    prompt_logprobs: int | None = None

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def check_common(self) -> None:
        if self.n != 1:
            raise BadRequest("n > 1 is not supported by the proxy", "n")
        if self.kv_transfer_params is not None:
            raise BadRequest("kv_transfer_params is set by the proxy, not by clients",
                             "kv_transfer_params")  # fmt: skip
        if self.use_beam_search:
            raise BadRequest("beam search is not supported by the proxy", "use_beam_search")
        if self.prompt_logprobs is not None:
            raise BadRequest("prompt_logprobs is not supported by the proxy", "prompt_logprobs")
        if self.stream_options is not None and not self.stream:
            raise BadRequest("stream_options can only be set when stream is true",
                             "stream_options")  # fmt: skip
        self.max_tokens_for(None, None)

    def max_new(self) -> int | None:
        raise NotImplementedError

    def max_param(self) -> str:
        """The field the client's limit came from, as vLLM names it in its errors."""
        return "max_tokens"

    def max_tokens_for(self, prompt_len: int | None, max_model_len: int | None) -> int | None:
        """The request's token budget as vLLM computes it, and refused where vLLM refuses
        it, with vLLM's messages (``VLLMValidationError.__str__``): a limit above the
        context (``TokenizeParams.__post_init__``); the client's limit capped by what the
        context leaves after the prompt (``get_max_tokens`` in
        ``entrypoints/serve/utils/api_utils.py``; a chat without a limit: the context left,
        i.e. until EOS or ``max_model_len``; a prompt longer than the context is P's to
        refuse); then ``SamplingParams._verify_args``'s checks. ``None`` arguments: not
        known yet."""
        asked = self.max_new()
        if asked is not None and max_model_len is not None and asked > max_model_len:
            name = self.max_param()
            raise BadRequest(f"{name}={asked} cannot be greater than max_model_len="
                             f"{max_model_len}. Please request fewer output tokens. "
                             f"(parameter={name}, value={asked})", name)  # fmt: skip
        context_left = None
        if max_model_len is not None and prompt_len is not None and prompt_len <= max_model_len:
            context_left = max_model_len - prompt_len
        limits = [n for n in (asked, context_left) if n is not None]
        max_tokens = min(limits) if limits else None
        if max_tokens is not None and max_tokens < 1:
            raise BadRequest(f"max_tokens must be at least 1, got {max_tokens}. "
                             f"(parameter=max_tokens, value={max_tokens})",
                             "max_tokens")  # fmt: skip
        if self.min_tokens < 0:
            raise BadRequest(
                f"min_tokens must be greater than or equal to 0, got {self.min_tokens}."
            )
        if max_tokens is not None and self.min_tokens > max_tokens:
            raise BadRequest(f"min_tokens must be less than or equal to "
                             f"max_tokens={max_tokens}, got {self.min_tokens}.")  # fmt: skip
        return max_tokens

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))

    def passthrough(self) -> dict[str, Any]:
        data = self.model_dump(exclude_unset=True)
        return {k: v for k, v in data.items() if k not in _OWN}


class CompletionBody(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # vLLM's and OpenAI's default; null is 16 as well
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool = True

    def check(self) -> None:
        self.check_common()
        p = self.prompt
        if isinstance(p, list) and p and not isinstance(p[0], int):
            if len(p) != 1:
                raise BadRequest("a batch of prompts is not supported by the proxy; send one "
                                 "request per prompt", "prompt")  # fmt: skip
            self.prompt = p[0]
        if self.prompt in ("", []):
            raise BadRequest("prompt is empty", "prompt")
        for name in ("echo", "logprobs", "suffix"):
            if getattr(self, name) not in (None, False):
                raise BadRequest(f"{name} is not supported by the proxy", name)
        if self.best_of not in (None, 1):
            raise BadRequest("best_of is not supported by the proxy", "best_of")

    def tokenize_body(self, model: str) -> dict[str, Any] | None:
        """The ``/tokenize`` request, or ``None`` when the prompt is token ids already."""
        if isinstance(self.prompt, str):
            return {"model": model, "prompt": self.prompt,
                    "add_special_tokens": self.add_special_tokens}  # fmt: skip
        return None

    def max_new(self) -> int | None:
        # ``CompletionRequest.normalize_null_max_tokens``: an explicit null is the default
        return 16 if self.max_tokens is None else self.max_tokens


class ChatBody(_Common):
    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = False

    @field_validator("messages")
    @classmethod
    def _not_empty(cls, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if not messages:
            raise ValueError("messages must hold at least one message")
        return messages

    def check(self) -> None:
        self.check_common()
        if self.logprobs or self.top_logprobs:
            raise BadRequest("logprobs are not supported by the proxy", "logprobs")
        if self.tools:
            raise BadRequest("tools are not supported by the proxy (tool-call parsing is not "
                             "done on the token stream)", "tools")  # fmt: skip

    def tokenize_body(self, model: str) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": model, "messages": self.messages,
            "add_generation_prompt": self.add_generation_prompt,
            "continue_final_message": self.continue_final_message,
            "add_special_tokens": self.add_special_tokens,
        }  # fmt: skip
        if self.chat_template is not None:
            body["chat_template"] = self.chat_template
        if self.chat_template_kwargs is not None:
            body["chat_template_kwargs"] = self.chat_template_kwargs
        return body

    def max_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def max_new(self) -> int | None:
        """``None``: no limit of the client's (``OpenAIServingChat.create_chat_completion``
        passes ``max_completion_tokens``, else ``max_tokens``, to ``get_max_tokens``)."""
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )


def generation_request(
    body: CompletionBody | ChatBody, request_id: str, model: str, prompt_ids: list[int],
    max_model_len: int | None,
) -> GenerationRequest:  # fmt: skip
    """``max_model_len``: the model's context length, as the backends report it."""
    return GenerationRequest(
        request_id=request_id, model=model, prompt_ids=prompt_ids,
        max_tokens=body.max_tokens_for(len(prompt_ids), max_model_len),
        min_tokens=body.min_tokens, stop=body.stops(),
        include_stop_str_in_output=body.include_stop_str_in_output,
        sampling=body.passthrough(),
    )  # fmt: skip


class Formatter:
    """Builds one response's chunks, or its whole body; one id, one creation time."""

    def __init__(self, kind: Kind, request_id: str, model: str, token_ids: bool,
                 prompt_ids: list[int]) -> None:  # fmt: skip
        self.kind = kind
        self.id = request_id
        self.model = model
        self.created = int(time.time())
        self.token_ids = token_ids
        self.prompt_ids = prompt_ids
        self._first = True

    def _envelope(self, choices: list[dict[str, Any]], chunk: bool) -> dict[str, Any]:
        obj = (
            ("chat.completion.chunk" if chunk else "chat.completion")
            if self.kind == "chat"
            else "text_completion"
        )
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}  # fmt: skip

    def role_chunk(self) -> dict[str, Any] | None:
        """Chat streams open with the assistant's role (vLLM sends it before any token)."""
        if self.kind != "chat":
            return None
        choice: dict[str, Any] = {"index": 0, "delta": {"role": "assistant", "content": ""},
                                  "logprobs": None, "finish_reason": None}  # fmt: skip
        out = self._envelope([choice], chunk=True)
        if self.token_ids:
            out["prompt_token_ids"] = self.prompt_ids
            self._first = False
        return out

    def chunk(self, delta: Delta | None, finish: Finish | None = None) -> dict[str, Any]:
        text = delta.text if delta else ""
        choice: dict[str, Any] = {"index": 0}
        if self.kind == "chat":
            choice["delta"] = {"content": text} if text or not finish else {}
        else:
            choice["text"] = text
        choice["logprobs"] = None
        choice["finish_reason"] = finish.finish_reason if finish else None
        choice["stop_reason"] = finish.stop_reason if finish else None
        out = self._envelope([choice], chunk=True)
        if self.token_ids:
            choice["token_ids"] = list(delta.token_ids) if delta else []
            if self._first:
                self._prompt_ids_into(out, choice)
                self._first = False
        return out

    def usage_chunk(self, finish: Finish) -> dict[str, Any]:
        out = self._envelope([], chunk=True)
        out["usage"] = usage(finish)
        return out

    def response(self, text: str, token_ids: list[int], finish: Finish) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0}
        if self.kind == "chat":
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice.update(logprobs=None, finish_reason=finish.finish_reason,
                      stop_reason=finish.stop_reason)  # fmt: skip
        out = self._envelope([choice], chunk=False)
        if self.token_ids:
            choice["token_ids"] = token_ids
            self._prompt_ids_into(out, choice)
        out["usage"] = usage(finish)
        return out

    def _prompt_ids_into(self, response: dict[str, Any], choice: dict[str, Any]) -> None:
        """Where vLLM puts ``prompt_token_ids``: on a chat response (or the first chunk),
        on a completion's choice (``chat_completion/protocol.py`` ChatCompletionResponse,
        ChatCompletionStreamResponse; ``completion/protocol.py`` CompletionResponseChoice,
        CompletionResponseStreamChoice)."""
        (response if self.kind == "chat" else choice)["prompt_token_ids"] = self.prompt_ids


def usage(finish: Finish) -> dict[str, int]:
    return {"prompt_tokens": finish.prompt_tokens, "completion_tokens": finish.completion_tokens,
            "total_tokens": finish.prompt_tokens + finish.completion_tokens}  # fmt: skip


def error_body(message: str, status: int, err_type: str | None = None,
               param: str | None = None) -> dict[str, Any]:  # fmt: skip
    """vLLM's ``ErrorResponse`` (``serve/engine/protocol.py``)."""
    kinds = {400: "BadRequestError", 404: "NotFoundError", 503: "ServiceUnavailableError"}
    kind = err_type or kinds.get(status, "InternalServerError")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}
