"""Request bodies of the OpenAI-compatible API, and the parameters PlexRL refuses.

Fields PlexRL honours are declared; fields that would change what is generated but that
the sampler cannot do are refused by name (`refused`), each with what to send instead, so
a client never gets output that silently ignored a request. Fields that change nothing
generated (`user`, `metadata`, `store`, ...) are accepted and ignored.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from plexrl_gateway.openai_errors import invalid, unsupported


class OpenAIBody(BaseModel):
    model_config = ConfigDict(extra="allow", protected_namespaces=())


class StreamOptions(OpenAIBody):
    include_usage: bool = False
    """One last chunk before `[DONE]` carries the call's `usage` (empty `choices`)."""


class SamplingFields(OpenAIBody):
    """What both endpoints share."""

    model: str
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None


class CompletionBody(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    """OpenAI's default for completions is 16 tokens; null lets the prompt's room decide."""
    logprobs: int | None = None
    """0: each chosen token's logprob; k (up to `MAX_COMPLETION_TOP`): the k most likely
    alternatives at each position too."""
    echo: bool = False
    """The prompt comes first in the text (and, with `logprobs`, in the logprobs)."""
    best_of: int | None = None


class TextPart(OpenAIBody):
    type: str
    text: str | None = None


class ChatMessage(OpenAIBody):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatBody(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    """The most likely alternatives at each position, up to `MAX_CHAT_TOP`."""


MAX_COMPLETION_TOP = 5
"""OpenAI's largest completions `logprobs`."""
MAX_CHAT_TOP = 20
"""OpenAI's largest chat `top_logprobs`."""


# Each refused parameter and what to send instead.
_REFUSED_COMMON: dict[str, str] = {
    "frequency_penalty": "penalties are not supported by the sampler; send 0 or leave it out",
    "presence_penalty": "penalties are not supported by the sampler; send 0 or leave it out",
    "logit_bias": "logit bias is not supported by the sampler; leave it out",
}
_REFUSED_CHAT: dict[str, str] = {
    "tools": "tool calling is not supported; describe tools in the messages and parse the "
    "reply yourself",
    "tool_choice": "tool calling is not supported; leave it out",
    "functions": "function calling is not supported; leave it out",
    "function_call": "function calling is not supported; leave it out",
    "parallel_tool_calls": "tool calling is not supported; leave it out",
    "response_format": "structured output (JSON mode, JSON schema) is not supported; send "
    '{"type": "text"} or leave it out',
    "audio": "PlexRL serves text models only; leave it out",
    "modalities": 'PlexRL serves text models only; send ["text"] or leave it out',
    "prediction": "predicted outputs are not supported; leave it out",
    "web_search_options": "web search is not supported; leave it out",
    "reasoning_effort": "reasoning effort is not supported; leave it out",
}
_REFUSED_COMPLETION: dict[str, str] = {
    "suffix": "insertion (a suffix) is not supported; leave it out",
}


def _neutral(name: str, value: Any) -> bool:
    """A refused parameter sent with the value that asks for nothing (a client's default)."""
    if value is None:
        return True
    if name in ("frequency_penalty", "presence_penalty"):
        return value == 0
    if name in ("logit_bias", "tools", "functions"):
        return not value
    if name == "response_format":
        return isinstance(value, dict) and value.get("type") == "text"
    if name == "modalities":
        return value == ["text"]
    if name == "tool_choice":
        return value == "none"
    # parallel_tool_calls means nothing without tools, which are refused themselves.
    return name == "parallel_tool_calls"


def refused(body: SamplingFields, chat: bool) -> None:
    """400 naming the first parameter the request sets that PlexRL cannot honour."""
    extra = body.model_extra or {}
    table = {**_REFUSED_COMMON, **(_REFUSED_CHAT if chat else _REFUSED_COMPLETION)}
    for name, reason in table.items():
        if name in extra and not _neutral(name, extra[name]):
            raise unsupported(name, reason)
    if body.stream_options is not None and not body.stream:
        raise invalid("stream_options is only allowed when stream is true", "stream_options")
    if isinstance(body, CompletionBody):
        if body.best_of is not None and body.best_of != body.n:
            raise unsupported(
                "best_of", "ranking candidates server-side is not supported; send n instead"
            )
        if body.logprobs is not None and not 0 <= body.logprobs <= MAX_COMPLETION_TOP:
            raise invalid(
                f"logprobs is {body.logprobs}; it must be between 0 and {MAX_COMPLETION_TOP}",
                "logprobs",
            )
    if isinstance(body, ChatBody) and body.top_logprobs is not None:
        if not 0 <= body.top_logprobs <= MAX_CHAT_TOP:
            raise invalid(
                f"top_logprobs is {body.top_logprobs}; it must be between 0 and {MAX_CHAT_TOP}",
                "top_logprobs",
            )
        if not body.logprobs:
            raise invalid("top_logprobs needs logprobs=true", "top_logprobs")
