"""The OpenAI API's request bodies (completions, chat completions) and its error format.

A body is validated as one pydantic model in strict mode (a "5" is not an int, a 1 is not a bool)
and every refusal becomes `OpenAIError`: HTTP 4xx with {"error": {"message", "type", "param",
"code"}}, the shape OpenAI's own clients parse. A parameter this server would have to ignore
(logprobs, penalties, tools, ...) is refused by name, never silently dropped. Beside OpenAI's
fields we take the extensions that vLLM, SGLang and llama.cpp's server share (`top_k`,
`ignore_eos`, `stop_token_ids`): a benchmark sends `ignore_eos` to get exactly `max_tokens` tokens.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ...generation.sampling_params import MAX_SEED
from ..request import SamplingParams

MAX_N = 16          # choices per request (each is its own engine request; prefix caching shares the prompt)
MAX_STOP = 4        # stop strings per request, as OpenAI allows


class OpenAIError(Exception):
    """A refused request: its HTTP status and OpenAI's error object."""

    def __init__(self, message: str, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class _Refusal(ValueError):
    """Raised inside a validator when the refusal names its own parameter."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    include_usage: bool = False      # one more chunk before [DONE]: empty choices, the request's usage


class _Generation(BaseModel):
    """What both endpoints share: the model, sampling, stopping and streaming."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)     # OpenAI's default; 0 = greedy
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)          # extension; -1 or 0 = off
    n: int = Field(1, ge=1, le=MAX_N)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)   # choice i samples with seed + i (checked below)
    stop: Any = Field(None, validate_default=True)  # str or list of str (checked below)
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None   # extension: more tokens that end a choice
    ignore_eos: bool = False                        # extension: do not stop at the model's end tokens
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict | None = None
    user: str | None = None                         # informational only

    @field_validator("stop")
    @classmethod
    def _stop(cls, value):
        if value is None:
            return []
        values = [value] if isinstance(value, str) else value
        if not isinstance(values, list) or not all(isinstance(s, str) and s for s in values) or len(values) > MAX_STOP:
            raise ValueError(f"stop must be a non-empty string or a list of at most {MAX_STOP} of them, "
                             f"got {value!r:.80}")
        return values

    @model_validator(mode="after")
    def _unsupported(self):
        if self.stream_options is not None and not self.stream:
            raise _Refusal("stream_options is only allowed with stream: true", "stream_options")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) != 0:
                raise _Refusal(f"{name} is not supported by this server (send 0 or leave it out)", name)
        if self.logit_bias:
            raise _Refusal("logit_bias is not supported by this server", "logit_bias")
        choices = self.num_choices
        if self.seed is not None and self.seed + choices - 1 > MAX_SEED:
            raise _Refusal(f"seed must be an int in [0, 2**64 - {choices}]: choice i samples with seed + i, and "
                           f"this request has {choices} choices; got {self.seed}", "seed")
        return self

    @property
    def num_choices(self) -> int:
        return self.n

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, max_tokens: int, stop_token_ids: list[int], choice: int) -> SamplingParams:
        """The engine's parameters for choice `choice` (the model's end tokens unless ignore_eos)."""
        stops = list(self.stop_token_ids or []) + ([] if self.ignore_eos else list(stop_token_ids))
        return SamplingParams(
            max_tokens=max_tokens, temperature=self.temperature,
            top_k=self.top_k if self.top_k not in (None, -1, 0) else None,
            top_p=self.top_p if self.top_p < 1 else None, stop_token_ids=tuple(dict.fromkeys(stops)),
            seed=None if self.seed is None else self.seed + choice)


class CompletionRequest(_Generation):
    prompt: Any                          # str, [str], [int] (token ids) or [[int]]: checked below
    max_tokens: int | None = Field(16, ge=1)    # OpenAI's default for completions
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value):
        """As a list of prompts, each a str or a list of token ids."""
        if isinstance(value, str) or (isinstance(value, list) and value and all(_is_int(t) for t in value)):
            value = [value]
        ok = (isinstance(value, list) and value and all(
            isinstance(p, str) or (isinstance(p, list) and p and all(_is_int(t) for t in p)) for p in value))
        if not ok:
            raise ValueError("prompt must be a string, a list of strings, a non-empty list of token ids, "
                             f"or a list of such lists; got {value!r:.80}")
        return value

    @property
    def num_choices(self) -> int:
        return self.n * len(self.prompt) if isinstance(self.prompt, list) else self.n

    @model_validator(mode="after")
    def _completion_unsupported(self):
        for name in ("logprobs", "echo", "suffix"):
            if getattr(self, name):
                raise _Refusal(f"{name} is not supported by this server", name)
        if self.best_of is not None and self.best_of != self.n:
            raise _Refusal("best_of is not supported by this server (leave it out or set it equal to n)", "best_of")
        return self


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    role: Literal["system", "developer", "user", "assistant"]
    content: Any                        # str, or a list of {"type": "text", "text": str} parts
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _content(cls, value):
        if isinstance(value, str):
            return value
        if isinstance(value, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                           and isinstance(p.get("text"), str) for p in value):
            return "".join(p["text"] for p in value)
        raise ValueError("content must be a string or a list of {'type': 'text', 'text': str} parts "
                         f"(this server reads text only), got {value!r:.80}")


class ChatCompletionRequest(_Generation):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)              # default: the rest of the context
    max_completion_tokens: int | None = Field(None, ge=1)   # OpenAI's newer name for max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list | None = None
    tool_choice: Any = None
    response_format: dict | None = None

    @model_validator(mode="after")
    def _chat_unsupported(self):
        if self.logprobs or self.top_logprobs:
            raise _Refusal("logprobs is not supported by this server", "logprobs")
        if self.tools or self.tool_choice not in (None, "none"):
            raise _Refusal("tools are not supported by this server", "tools")
        if self.response_format not in (None, {"type": "text"}):
            raise _Refusal("response_format other than {'type': 'text'} is not supported", "response_format")
        if self.max_completion_tokens is not None:
            if self.max_tokens is not None and self.max_tokens != self.max_completion_tokens:
                raise _Refusal("give max_tokens or max_completion_tokens, not two different values",
                              "max_completion_tokens")
            self.max_tokens = self.max_completion_tokens
        return self


def param_of(error: Exception) -> str | None:
    """The request field a library refusal names (its messages begin with the argument's name), if any."""
    first = str(error).split(" ", 1)[0].rstrip(":")
    if first == "prompt_token_ids":
        return "prompt"
    return first if first in _Generation.model_fields else None


def parse_body(model: type[BaseModel], body: bytes):
    """The request `model` read from a JSON body, or OpenAIError(400) naming what is wrong."""
    if not body.strip():
        raise OpenAIError("the request body is empty; send a JSON object", param=None)
    try:
        return model.model_validate_json(body)
    except ValidationError as errors:
        first = errors.errors(include_url=False)[0]
        if first["type"] == "json_invalid":
            raise OpenAIError(f"the request body is not valid JSON ({first['msg']})") from None
        refusal = (first.get("ctx") or {}).get("error")
        if isinstance(refusal, _Refusal):
            raise OpenAIError(str(refusal), param=refusal.param) from None
        param = ".".join(str(part) for part in first["loc"]) or None
        message = first["msg"].removeprefix("Value error, ")
        if first["type"] == "missing":
            message = f"{param} is required"
        elif param and not message.startswith(param):
            got = "" if first["type"] == "value_error" else f" (got {first['input']!r:.60})"
            message = f"{param}: {message}{got}"
        raise OpenAIError(message, param=param) from None


__all__ = ["ChatCompletionRequest", "ChatMessage", "CompletionRequest", "OpenAIError", "StreamOptions", "param_of",
           "parse_body"]
