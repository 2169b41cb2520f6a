"""Request bodies of the OpenAI-compatible and llama.cpp endpoints, validated by pydantic.

Defaults follow ``pi-run`` and llama.cpp's server (temperature 0.8, top_k 40, top_p 0.95,
no repetition penalty; generate until the end of text or the context when ``max_tokens`` is
absent), not OpenAI's cloud defaults. Fields that would change the output in ways this
server does not implement (``n`` > 1, ``logprobs``, ``echo``, penalties, ``logit_bias``,
tools, JSON mode) are refused with a 400 rather than ignored; other unknown fields are
ignored, as OpenAI clients send many.
"""
from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_STOPS = 16
MAX_STOP_CHARS = 256
MAX_MESSAGES = 4096


class Unsupported(ValueError):
    """A field asks for something this server does not do."""


class _Base(BaseModel):
    # strict: "10" or true is not an integer, 2.0 is not a token count (an int is still a float)
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, strict=True)

    def unsupported(self) -> str | None:
        """The name of a field asking for something not implemented, else None."""
        return None


class StreamOptions(_Base):
    include_usage: bool = False


class _Sampling(_Base):
    temperature: float = Field(0.8, ge=0.0, le=100.0)
    top_p: float = Field(0.95, gt=0.0, le=1.0)
    top_k: int = Field(40, ge=0)
    seed: int | None = Field(None, ge=-1, le=2**63 - 1)
    stop: Union[str, list[str], None] = Field(None, validate_default=True)
    stream: bool = False
    repeat_penalty: float = Field(1.0, gt=0.0, le=100.0)
    repeat_last_n: int = Field(64, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    ignore_eos: bool = False

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: Any) -> list[str]:
        stops = [] if v is None else [v] if isinstance(v, str) else list(v)
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop strings")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"a stop string may have at most {MAX_STOP_CHARS} characters")
        return [s for s in stops if s]

    def unsupported(self) -> str | None:
        """The name of a field asking for something not implemented, else None."""
        extra = self.model_extra or {}
        checks = (("n", lambda v: v not in (None, 1)), ("best_of", lambda v: v not in (None, 1)),
                  ("logprobs", lambda v: v not in (None, False, 0)), ("top_logprobs", lambda v: v not in (None, 0)),
                  ("echo", lambda v: bool(v)), ("presence_penalty", lambda v: v not in (None, 0, 0.0)),
                  ("frequency_penalty", lambda v: v not in (None, 0, 0.0)), ("logit_bias", lambda v: bool(v)),
                  ("tools", lambda v: bool(v)), ("functions", lambda v: bool(v)), ("suffix", lambda v: bool(v)),
                  ("response_format", lambda v: isinstance(v, dict) and v.get("type") not in (None, "text")))
        checks += (("grammar", lambda v: bool(v)), ("json_schema", lambda v: bool(v)),
                   ("n_probs", lambda v: v not in (None, 0)), ("mirostat", lambda v: v not in (None, 0)),
                   ("typical_p", lambda v: v not in (None, 1, 1.0)), ("dynatemp_range", lambda v: v not in (None, 0)),
                   ("xtc_probability", lambda v: v not in (None, 0)), ("dry_multiplier", lambda v: v not in (None, 0)),
                   ("tfs_z", lambda v: v not in (None, 1, 1.0)), ("samplers", lambda v: bool(v)),
                   ("lora", lambda v: bool(v)), ("image_data", lambda v: bool(v)))
        for name, bad in checks:
            if name in extra and bad(extra[name]):
                return name
        return None


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: ``prompt`` is a string, a list of one string, or token ids."""

    model: str | None = None
    prompt: Union[str, list[str], list[int]]
    max_tokens: int | None = Field(None, ge=0)
    stream_options: StreamOptions | None = None


class ChatMessage(_Base):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Union[str, list[dict[str, Any]], None] = None


class ChatRequest(_Sampling):
    """``POST /v1/chat/completions``: ``messages`` rendered with the model's chat template, with
    llama.cpp's ``chat_template_kwargs`` (template variables over the server's
    ``--chat-template-kwargs``, e.g. ``{"enable_thinking": false}``) and ``reasoning_format``
    (``none``: ``<think>`` text left in ``content``; ``auto``/``deepseek``: returned as
    ``reasoning_content``; default the server's ``--reasoning-format``)."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_format: Literal["auto", "deepseek", "none"] | None = None
    max_tokens: int | None = Field(None, ge=0)
    max_completion_tokens: int | None = Field(None, ge=0)
    stream_options: StreamOptions | None = None


class ApplyTemplateRequest(_Base):
    """llama.cpp's ``POST /apply-template``: the chat prompt text, rendered and not generated from."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True


class NativeCompletionRequest(_Sampling):
    """llama.cpp's ``POST /completion``: ``n_predict`` (or its alias ``max_tokens``) -1 generates
    until the end of text; ``penalty_last_n`` is an alias of ``repeat_last_n``."""

    prompt: Union[str, list[int]]
    n_predict: int | None = Field(None, ge=-1)
    max_tokens: int | None = Field(None, ge=-1)
    penalty_last_n: int | None = Field(None, ge=-1)

    def limit(self) -> int | None:
        n = self.n_predict if self.n_predict is not None else self.max_tokens
        return None if n is None or n < 0 else n


class TokenizeRequest(_Base):
    """llama.cpp's ``POST /tokenize``."""

    content: str
    add_special: bool = False
    parse_special: bool = True


class DetokenizeRequest(_Base):
    """llama.cpp's ``POST /detokenize``."""

    tokens: list[int] = Field(max_length=1 << 20)
