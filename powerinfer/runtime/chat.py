"""Chat prompts: a model's Jinja chat template, rendered in a sandbox.

A GGUF may carry ``tokenizer.chat_template`` (pi-convert copies it from the model's
``tokenizer_config.json``, as llama.cpp's converter does). The template is untrusted
input from whoever published the model, so it is rendered by Jinja's
``ImmutableSandboxedEnvironment``: no attribute access to Python internals, no
mutation of the messages, ``range`` bounded. The environment is set up the way
transformers' ``apply_chat_template`` sets up its own (``trim_blocks``,
``lstrip_blocks``, the ``loopcontrols`` extension, ``raise_exception``,
``strftime_now`` and a ``tojson`` filter), so a template renders to the same string
as it does there; variables: ``messages``, ``add_generation_prompt``,
``bos_token``, ``eos_token``.

A model without a template gets :data:`DEFAULT_TEMPLATE`, ChatML, as llama.cpp does
(``<|im_start|>role\\ncontent<|im_end|>\\n``; the reply ends at ``<|im_end|>``).
Templates above :data:`MAX_TEMPLATE_CHARS`, or renders above
:data:`MAX_RENDER_CHARS`, are refused.
"""
from __future__ import annotations

import json
from datetime import datetime
from typing import Any, Iterable, Mapping

from ..errors import PowerInferError

MAX_TEMPLATE_CHARS = 1 << 20  # real templates are 1-20 KB
MAX_RENDER_CHARS = 1 << 24
ROLES = ("system", "user", "assistant", "tool")

DEFAULT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
DEFAULT_STOPS = ("<|im_end|>",)


class TemplateError(PowerInferError):
    """The template failed to render (it raised, or its syntax is wrong)."""


def _raise(message: str) -> None:
    raise TemplateError(f"the chat template refused the conversation: {message}")


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def normalize_messages(messages: Iterable[Any]) -> list[dict[str, str]]:
    """OpenAI-style messages as plain ``{"role", "content"}`` dicts: ``content`` may be a string or a
    list of ``{"type": "text", "text": ...}`` parts (joined); raises PowerInferError otherwise."""
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise PowerInferError(f"messages[{i}]: must be an object with role and content")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise PowerInferError(f"messages[{i}].role: {role!r} is not one of {', '.join(ROLES)}")
        if content is None:
            content = ""
        if isinstance(content, list):
            parts = []
            for j, p in enumerate(content):
                if not (isinstance(p, Mapping) and p.get("type") == "text" and isinstance(p.get("text"), str)):
                    raise PowerInferError(f"messages[{i}].content[{j}]: only text parts are supported")
                parts.append(p["text"])
            content = "".join(parts)
        if not isinstance(content, str):
            raise PowerInferError(f"messages[{i}].content: must be a string or a list of text parts")
        out.append({"role": role, "content": content})
    return out


class ChatTemplate:
    """A compiled chat template. ``render(messages)`` gives the prompt text, with the special
    tokens written out (tokenize it with ``parse_special=True``).

    ``source``: the template text (None: :data:`DEFAULT_TEMPLATE`); ``bos_token`` / ``eos_token``:
    the vocabulary's strings, passed to the template. Raises PowerInferError for a template that
    is not a string, too long, or not valid Jinja."""

    def __init__(self, source: str | None, bos_token: str = "", eos_token: str = ""):
        from jinja2 import TemplateSyntaxError
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        self.is_default = source is None
        source = DEFAULT_TEMPLATE if source is None else source
        if not isinstance(source, str):
            raise PowerInferError(f"tokenizer.chat_template: a {type(source).__name__}, not a string")
        if len(source) > MAX_TEMPLATE_CHARS:
            raise PowerInferError(f"tokenizer.chat_template: {len(source)} characters, more than a template may "
                                  f"have ({MAX_TEMPLATE_CHARS})")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except TemplateSyntaxError as e:
            raise PowerInferError(f"tokenizer.chat_template: not a valid Jinja template (line {e.lineno}: "
                                  f"{e.message})") from None
        self.source, self.bos_token, self.eos_token = source, bos_token, eos_token
        # Strings that end a reply besides the EOS token: ChatML's end marker for the default template.
        self.stop_strings: tuple[str, ...] = DEFAULT_STOPS if self.is_default else ()

    def render(self, messages: Iterable[Any], add_generation_prompt: bool = True) -> str:
        """The conversation as prompt text. Raises PowerInferError (TemplateError) when the template
        raises or fails, or renders more than :data:`MAX_RENDER_CHARS`."""
        from jinja2 import TemplateError as JinjaError
        from jinja2.sandbox import SecurityError

        msgs = normalize_messages(messages)
        parts: list[str] = []
        n = 0
        try:
            for chunk in self._template.generate(messages=msgs, add_generation_prompt=add_generation_prompt,
                                                 bos_token=self.bos_token, eos_token=self.eos_token):
                n += len(chunk)
                if n > MAX_RENDER_CHARS:
                    raise TemplateError(f"the chat template rendered more than {MAX_RENDER_CHARS} characters")
                parts.append(chunk)
        except PowerInferError:
            raise
        except SecurityError as e:
            raise TemplateError(f"the chat template did something the sandbox forbids ({e})") from None
        except (JinjaError, TypeError, ValueError, KeyError, IndexError, AttributeError, OverflowError,
                RecursionError, ZeroDivisionError) as e:
            raise TemplateError(f"the chat template failed: {type(e).__name__}: {e}") from None
        return "".join(parts)


def template_for(tok) -> ChatTemplate:
    """The chat template of a :class:`~powerinfer.runtime.tokenizer.GGUFTokenizer` (its GGUF's
    ``tokenizer.chat_template``, else the default), with its BOS/EOS strings."""
    return ChatTemplate(getattr(tok, "chat_template", None), tok.token_text(tok.bos_id), tok.token_text(tok.eos_id))


def chat_prompt_ids(tok, text: str) -> list[int]:
    """Token ids of a rendered chat prompt: control-token text parsed as tokens, and BOS first
    when the tokenizer adds one and the template did not already write it."""
    ids = tok.encode(text, add_bos=False, parse_special=True)
    if tok.add_bos and tok.bos_id is not None and (not ids or ids[0] != tok.bos_id):
        ids = [tok.bos_id] + ids
    return ids
