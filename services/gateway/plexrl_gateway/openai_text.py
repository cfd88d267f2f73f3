"""Text in and out of the OpenAI API: prompts to token ids, sampled tokens to choices.

The gateway reads the served model's own tokenizer (and its chat template) from the model
directory, once per model. A sampled sequence keeps the token that ended it (the
worker's rule); OpenAI's text does not: an end-of-sequence or stop token is left out of
the text (its logprob is still listed), and the text ends before the first stop string
it holds (the tokens after it are in neither).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from plexrl.messages import SampledSequence, StopReason
from plexrl.models import BaseModelInfo
from plexrl_gateway.openai_errors import invalid, unsupported
from plexrl_gateway.openai_schemas import ChatMessage

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
"""Message roles served, as the chat template reads them (OpenAI's `developer` is the
newer name of `system`)."""


class Tokenizers:
    """Each served model's tokenizer, loaded off the event loop on first use.

    `transformers` is imported then too, not when the gateway starts: a gateway that
    serves no OpenAI call never pays for it (seconds, and its memory)."""

    def __init__(self) -> None:
        self._loaded: dict[Path, PreTrainedTokenizerBase] = {}

    async def get(self, info: BaseModelInfo) -> PreTrainedTokenizerBase:
        tok = self._loaded.get(info.path)
        if tok is None:
            tok = await asyncio.to_thread(_load, info.path)
            self._loaded[info.path] = tok
        return tok


def _load(path: Path) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    tok: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(str(path))
    return tok


def prompts(tok: PreTrainedTokenizerBase, prompt: str | list[Any]) -> list[list[int]]:
    """A completion's `prompt` (a string, strings, token ids, or lists of them) as token
    id lists, one per prompt."""
    if isinstance(prompt, str):
        return [tok.encode(prompt)]
    if not prompt:
        raise invalid("prompt is empty; send a string or token ids", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    if all(isinstance(p, str) for p in prompt):
        return [tok.encode(p) for p in prompt]
    if all(isinstance(p, list) for p in prompt):
        return [list(p) for p in prompt]
    raise invalid("prompt mixes strings and token ids; send one kind", "prompt")


def chat_prompt(tok: PreTrainedTokenizerBase, model: str, messages: list[ChatMessage]) -> list[int]:
    """The messages through the model's chat template, ready for the assistant's turn."""
    if not tok.chat_template:
        raise invalid(
            f"the model {model!r} has no chat template in its tokenizer, so chat messages "
            "cannot be rendered; use /completions with a prompt you format yourself, or "
            "serve the model with a tokenizer that has a chat template",
            "model",
            "no_chat_template",
        )
    rendered = []
    for i, message in enumerate(messages):
        role = _ROLES.get(message.role)
        if role is None:
            raise unsupported(
                f"messages[{i}].role",
                f"the role {message.role!r} is not served (tool calling is not supported); "
                "use system, developer, user or assistant",
            )
        rendered.append({"role": role, "content": _content(message, i)})
    text = tok.apply_chat_template(rendered, add_generation_prompt=True, tokenize=False)
    # The template wrote any special tokens (a BOS) itself.
    return list(tok.encode(str(text), add_special_tokens=False))


def _content(message: ChatMessage, i: int) -> str:
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    texts = []
    for j, part in enumerate(message.content):
        if part.type != "text" or part.text is None:
            raise unsupported(
                f"messages[{i}].content[{j}]",
                f"a {part.type!r} part is not supported: PlexRL serves text models only; "
                "send text parts",
            )
        texts.append(part.text)
    return "".join(texts)


@dataclass(frozen=True)
class Choice:
    """One sampled sequence as OpenAI shows it."""

    text: str
    finish_reason: str
    tokens: list[int]
    """What `logprobs` describes: the text's tokens, and the end-of-sequence token that
    ended it (sampled and counted, though not text): an evaluation client reading an
    echoed prompt + one sampled token counts on that last token being there."""
    logprobs: list[float]


def _text(tok: PreTrainedTokenizerBase, tokens: list[int]) -> str:
    return str(tok.decode(tokens, skip_special_tokens=True))


def choice(tok: PreTrainedTokenizerBase, seq: SampledSequence, stop_strings: list[str]) -> Choice:
    tokens, logprobs = list(seq.tokens), list(seq.logprobs)
    if seq.stop_reason == StopReason.LENGTH:
        text = _text(tok, tokens)
        return Choice(text, "length", tokens, logprobs)
    text = _text(tok, tokens)
    cut = min((i for s in stop_strings if (i := text.find(s)) >= 0), default=None)
    if cut is None:
        # Ended by an end-of-sequence (or stop) token: not part of the text, but sampled.
        return Choice(text, "stop", tokens, logprobs)
    # The shortest run of tokens whose text reaches the stop string's start.
    kept = len(tokens)
    for n in range(len(tokens) + 1):
        if len(_text(tok, tokens[:n])) >= cut:
            kept = n
            break
    return Choice(text[:cut], "stop", tokens[:kept], logprobs[:kept])


@dataclass(frozen=True)
class Scores:
    """The logprobs a choice shows: of its tokens (the prompt's first, with echo)."""

    tokens: list[int]
    logprobs: list[float | None]
    """None only for a text's first token, which nothing precedes."""
    top: list[list[tuple[int, float]] | None] | None
    """The most likely (token, logprob) at each position, best first; None where no
    alternatives were asked for (and at the first token)."""


def echoed(
    tok: PreTrainedTokenizerBase, prompt: str | list[Any], tokens: list[list[int]]
) -> list[str]:
    """Each prompt's text as `echo` shows it: a string as sent, token ids decoded."""
    if isinstance(prompt, str):
        return [prompt]
    if all(isinstance(p, str) for p in prompt):
        return [str(p) for p in prompt]
    return [str(tok.decode(t, skip_special_tokens=False)) for t in tokens]


def token_texts(tok: PreTrainedTokenizerBase, tokens: list[int]) -> list[str]:
    return [str(tok.decode([t], skip_special_tokens=False)) for t in tokens]


def _alternatives(
    tok: PreTrainedTokenizerBase, chosen: int, logprob: float | None, top: list[tuple[int, float]]
) -> dict[str, float]:
    """OpenAI's `{token text: logprob}`, best first, with the chosen token too (so up to
    k + 1 entries). Tokens that decode alike keep the likeliest one's logprob."""
    texts = token_texts(tok, [t for t, _ in top])
    out: dict[str, float] = {}
    for text, (_, lp) in zip(texts, top, strict=True):
        out.setdefault(text, lp)
    if logprob is not None and chosen not in {t for t, _ in top}:
        out.setdefault(token_texts(tok, [chosen])[0], logprob)
    return out


def completion_logprobs(tok: PreTrainedTokenizerBase, scores: Scores) -> dict[str, Any]:
    """`logprobs` of a completion choice: each token, its logprob, its offset in the text,
    and (when asked for) the alternatives."""
    texts = token_texts(tok, scores.tokens)
    offsets, at = [], 0
    for t in texts:
        offsets.append(at)
        at += len(t)
    top: list[dict[str, float] | None] | None = None
    if scores.top is not None:
        top = [
            None if alts is None else _alternatives(tok, t, lp, alts)
            for t, lp, alts in zip(scores.tokens, scores.logprobs, scores.top, strict=True)
        ]
    return {
        "tokens": texts,
        "token_logprobs": scores.logprobs,
        "top_logprobs": top,
        "text_offset": offsets,
    }


def _bytes(text: str) -> list[int]:
    return list(text.encode())


def chat_logprobs(tok: PreTrainedTokenizerBase, scores: Scores) -> dict[str, Any]:
    """`logprobs` of a chat choice: each token, its logprob and bytes, and the
    alternatives (`[]` when none were asked for)."""
    content = []
    tops = scores.top or [None] * len(scores.tokens)
    for text, lp, alts in zip(token_texts(tok, scores.tokens), scores.logprobs, tops, strict=True):
        top = []
        if alts is not None:
            for t, alt_lp in zip(token_texts(tok, [a for a, _ in alts]), alts, strict=True):
                top.append({"token": t, "logprob": alt_lp[1], "bytes": _bytes(t)})
        content.append({"token": text, "logprob": lp, "bytes": _bytes(text), "top_logprobs": top})
    return {"content": content, "refusal": None}
