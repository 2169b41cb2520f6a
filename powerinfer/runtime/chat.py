"""Chat prompts: a model's Jinja chat template, rendered in a sandbox.

A GGUF may carry ``tokenizer.chat_template`` (pi-convert copies it from the model's
``tokenizer_config.json``, as llama.cpp's converter does). The template is untrusted
input from whoever published the model, so it is rendered by Jinja's
``ImmutableSandboxedEnvironment``: no attribute access to Python internals, no
mutation of the messages, ``range`` bounded, no underscore names stored on a
``namespace``. The environment and the variables are those transformers'
``apply_chat_template`` (5.x) gives a template, so a template renders to the same string
as it does there:

- environment: ``trim_blocks``, ``lstrip_blocks``, the ``loopcontrols`` extension, a
  ``{% generation %}`` block tag (rendered as its body), ``raise_exception``,
  ``strftime_now`` (local time, as transformers), a ``tojson`` filter that does not
  escape HTML;
- variables: ``messages``, ``tools`` and ``documents`` (None: this runtime does not do
  tool calls or RAG), ``add_generation_prompt``, ``bos_token``, ``eos_token``, then the
  template kwargs (:func:`check_template_kwargs`: ``enable_thinking`` of Qwen3,
  ``date_string`` of Llama 3.x, ...), which override the special tokens as they do there;
- messages: ``role``, ``content`` and a past reply's reasoning as ``reasoning_content``
  (also read from ``thinking`` or ``reasoning``; ``thinking`` is filled too), keys whose
  value is None dropped, as transformers does. Content given as a list of text parts is
  joined into one string (OpenAI's text-only parts), and None content becomes "".

A model without a template gets :data:`DEFAULT_TEMPLATE`, ChatML, as llama.cpp does
(``<|im_start|>role\\ncontent<|im_end|>\\n``). A reply ends at the template's end marker
(:attr:`ChatTemplate.end_marker`: what the template writes after an assistant message,
``<|eot_id|>``, ``<|im_end|>``, ``</s>``...), which is also a stop string.
Templates above :data:`MAX_TEMPLATE_CHARS`, or renders above :data:`MAX_RENDER_CHARS`, are
refused; a template that raises or fails is one :class:`TemplateError` line with Jinja's
message and the template line.
"""
from __future__ import annotations

import json
import math
import traceback
from datetime import datetime
from typing import Any, Iterable, Mapping

from ..errors import PowerInferError

MAX_TEMPLATE_CHARS = 1 << 20  # real templates are 1-20 KB
MAX_RENDER_CHARS = 1 << 24
MAX_KWARGS = 64  # template kwargs: names, nesting, serialized size
MAX_KWARGS_DEPTH = 8
MAX_KWARGS_CHARS = 1 << 16
MAX_END_MARKER_CHARS = 64
ROLES = ("system", "user", "assistant", "tool")
# names the renderer sets itself: a template kwarg may not replace them
RESERVED_KWARGS = ("messages", "add_generation_prompt", "tools", "documents")
# a past reply's reasoning under the names transformers reads it from (the first is the one templates use)
REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")

DEFAULT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
DEFAULT_STOPS = ("<|im_end|>",)
_PROBE_USER, _PROBE_REPLY = "\x00probe-user\x00", "\x00probe-reply\x00"


class TemplateError(PowerInferError):
    """The template failed to render (it raised, or its syntax is wrong)."""


class _Raised(Exception):
    """``raise_exception(message)`` called by a template."""


def _raise(message: Any) -> None:
    raise _Raised(str(message))


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _template_line(e: BaseException) -> int | None:
    """The template line that was running when ``e`` was raised (Jinja rewrites its frames so that
    the template's own lines show in the traceback, under the file name ``<template>``)."""
    line = None
    for fr in traceback.extract_tb(e.__traceback__):
        if fr.filename == "<template>":
            line = fr.lineno
    return line


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def check_template_kwargs(value: Any, where: str = "chat_template_kwargs") -> dict[str, Any]:
    """Template kwargs as given on a command line (``--chat-template-kwargs``, a JSON object) or in a
    request (``chat_template_kwargs``), checked: a JSON object (a str is parsed) of at most
    :data:`MAX_KWARGS` names that are identifiers not starting with ``_`` nor one of
    :data:`RESERVED_KWARGS`, JSON values nested at most :data:`MAX_KWARGS_DEPTH` deep and
    :data:`MAX_KWARGS_CHARS` long as JSON; ``enable_thinking`` must be a boolean (llama.cpp's
    server refuses a string there too). Raises PowerInferError naming ``where`` and the key."""
    if isinstance(value, str):
        try:
            value = json.loads(value, parse_constant=_no_constant)
        except (ValueError, RecursionError) as e:
            raise PowerInferError(f"{where}: not a JSON object ({e})") from None
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise PowerInferError(f"{where}: must be a JSON object of template variables, e.g. "
                              f'{{"enable_thinking": false}}, not {type(value).__name__}')
    if len(value) > MAX_KWARGS:
        raise PowerInferError(f"{where}: {len(value)} names, more than {MAX_KWARGS}")

    def check(v: Any, path: str, depth: int) -> None:
        if depth > MAX_KWARGS_DEPTH:
            raise PowerInferError(f"{where}.{path}: nested more than {MAX_KWARGS_DEPTH} deep")
        if v is None or isinstance(v, (bool, int, str)):
            return
        if isinstance(v, float):
            if not math.isfinite(v):
                raise PowerInferError(f"{where}.{path}: {v} is not a JSON number")
            return
        if isinstance(v, (list, tuple)):
            for i, x in enumerate(v):
                check(x, f"{path}[{i}]", depth + 1)
            return
        if isinstance(v, Mapping):
            for k, x in v.items():
                if not isinstance(k, str):
                    raise PowerInferError(f"{where}.{path}: keys must be strings")
                check(x, f"{path}.{k}", depth + 1)
            return
        raise PowerInferError(f"{where}.{path}: a {type(v).__name__} is not a JSON value")

    out = {}
    for k, v in value.items():
        if not (isinstance(k, str) and k.isidentifier()) or k.startswith("_"):
            raise PowerInferError(f"{where}: {k!r} is not a template variable name (an identifier not starting "
                                  f"with '_')")
        if k in RESERVED_KWARGS:
            raise PowerInferError(f"{where}.{k}: set by the server itself, not a template kwarg"
                                  if k != "tools" else f"{where}.tools: tool calls are not supported")
        if k == "enable_thinking" and not isinstance(v, bool):
            raise PowerInferError(f"{where}.enable_thinking: must be true or false, not {json.dumps(v)}")
        check(v, k, 1)
        out[k] = v
    try:
        n = len(json.dumps(out, ensure_ascii=False))
    except (TypeError, ValueError) as e:
        raise PowerInferError(f"{where}: not JSON ({e})") from None
    if n > MAX_KWARGS_CHARS:
        raise PowerInferError(f"{where}: {n} characters of JSON, more than {MAX_KWARGS_CHARS}")
    return out


def normalize_messages(messages: Iterable[Any]) -> list[dict[str, str]]:
    """OpenAI-style messages as plain dicts for a template: ``role``, ``content`` (a string, or a
    list of ``{"type": "text", "text": ...}`` parts, joined; None: ""), and a past reply's reasoning
    (``reasoning_content``, or ``thinking`` / ``reasoning``, strings) under both names transformers
    gives it, ``reasoning_content`` and ``thinking``. Raises PowerInferError otherwise."""
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
        msg = {"role": role, "content": content}
        reasoning = next((m[k] for k in REASONING_KEYS if m.get(k) is not None), None)
        if reasoning is not None:
            if not isinstance(reasoning, str):
                raise PowerInferError(f"messages[{i}].reasoning_content: must be a string")
            msg["thinking"] = msg["reasoning_content"] = reasoning
        out.append(msg)
    return out


def _environment():
    """The sandboxed Jinja environment, with what transformers adds to its own."""
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError
    from jinja2.utils import Namespace

    class GenerationBlock(Extension):
        """``{% generation %}...{% endgeneration %}``: transformers marks the assistant's tokens with it
        (for training masks); here it renders its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    class SafeNamespace(Namespace):
        """``namespace(...)`` that refuses names starting with ``_`` (no reaching internals through it)."""

        def __init__(*args, **kwargs):  # noqa: N805 (the signature of Jinja's Namespace)
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for k in attrs:
                SafeNamespace._check(k)
            Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            SafeNamespace._check(name)
            Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise SecurityError(f"a namespace may not hold the name {name!r}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = SafeNamespace
    return env


class ChatTemplate:
    """A compiled chat template. ``render(messages)`` gives the prompt text, with the special
    tokens written out (tokenize it with ``parse_special=True``).

    ``source``: the template text (None: :data:`DEFAULT_TEMPLATE`); ``bos_token`` / ``eos_token``:
    the vocabulary's strings, passed to the template; ``kwargs``: template variables for every
    render (``--chat-template-kwargs``), checked by :func:`check_template_kwargs`. Raises
    PowerInferError for a template that is not a string, too long, or not valid Jinja.

    ``end_marker``: what the template writes right after an assistant message's content (found by
    rendering a probe conversation; whitespace around it dropped; "" when the probe fails or the
    template writes nothing there); ``stop_strings``: ``(end_marker,)`` when there is one, so a
    reply also stops where the marker comes out as plain text (a control token ends it as a token)."""

    def __init__(self, source: str | None, bos_token: str = "", eos_token: str = "",
                 kwargs: Mapping[str, Any] | None = None):
        from jinja2 import TemplateSyntaxError

        self.is_default = source is None
        source = DEFAULT_TEMPLATE if source is None else source
        if not isinstance(source, str):
            raise PowerInferError(f"tokenizer.chat_template: a {type(source).__name__}, not a string")
        if len(source) > MAX_TEMPLATE_CHARS:
            raise PowerInferError(f"tokenizer.chat_template: {len(source)} characters, more than a template may "
                                  f"have ({MAX_TEMPLATE_CHARS})")
        try:
            self._template = _environment().from_string(source)
        except TemplateSyntaxError as e:
            raise PowerInferError(f"tokenizer.chat_template: not a valid Jinja template (line {e.lineno}: "
                                  f"{e.message})") from None
        self.source, self.bos_token, self.eos_token = source, bos_token, eos_token
        self.kwargs = check_template_kwargs(dict(kwargs or {}), "--chat-template-kwargs")
        self.end_marker = self._find_end_marker()
        self.stop_strings: tuple[str, ...] = (self.end_marker,) if self.end_marker else ()
        if self.is_default:
            self.stop_strings = DEFAULT_STOPS

    def _find_end_marker(self) -> str:
        try:
            probe = [{"role": "user", "content": _PROBE_USER}, {"role": "assistant", "content": _PROBE_REPLY}]
            text = self.render(probe, add_generation_prompt=False)
        except PowerInferError:
            return ""
        at = text.find(_PROBE_REPLY)
        if at < 0:
            return ""
        tail = text[at + len(_PROBE_REPLY):].strip()
        marker = tail.split(None, 1)[0] if tail else ""
        return marker if len(marker) <= MAX_END_MARKER_CHARS else ""

    def render(self, messages: Iterable[Any], add_generation_prompt: bool = True,
               kwargs: Mapping[str, Any] | None = None) -> str:
        """The conversation as prompt text. ``kwargs``: template variables for this render (a
        request's ``chat_template_kwargs``, already checked), over the template's own. Raises
        PowerInferError (TemplateError) when the template raises or fails, or renders more than
        :data:`MAX_RENDER_CHARS`."""
        from jinja2 import TemplateError as JinjaError
        from jinja2.sandbox import SecurityError

        msgs = normalize_messages(messages)
        context = {"bos_token": self.bos_token, "eos_token": self.eos_token, **self.kwargs, **(kwargs or {}),
                   "messages": msgs, "tools": None, "documents": None, "add_generation_prompt": add_generation_prompt}
        parts: list[str] = []
        n = 0
        try:
            for chunk in self._template.generate(**context):
                n += len(chunk)
                if n > MAX_RENDER_CHARS:
                    raise TemplateError(f"the chat template rendered more than {MAX_RENDER_CHARS} characters")
                parts.append(chunk)
        except PowerInferError:
            raise
        except _Raised as e:
            raise TemplateError(f"the chat template refused the conversation{_at_line(e)}: {e}") from None
        except SecurityError as e:
            raise TemplateError(f"the chat template did something the sandbox forbids{_at_line(e)} ({e})") from None
        except (JinjaError, TypeError, ValueError, KeyError, IndexError, AttributeError, OverflowError,
                RecursionError, ZeroDivisionError) as e:
            raise TemplateError(f"the chat template failed{_at_line(e)}: {type(e).__name__}: {e}") from None
        return "".join(parts)


def _at_line(e: BaseException) -> str:
    line = _template_line(e)
    return f" at template line {line}" if line is not None else ""


def template_for(tok, kwargs: Mapping[str, Any] | None = None) -> ChatTemplate:
    """The chat template of a :class:`~powerinfer.runtime.tokenizer.GGUFTokenizer` (its GGUF's
    ``tokenizer.chat_template``, else the default), with its BOS/EOS strings and the template
    kwargs given for every render (``--chat-template-kwargs``)."""
    return ChatTemplate(getattr(tok, "chat_template", None), tok.token_text(tok.bos_id), tok.token_text(tok.eos_id),
                        kwargs)


def check_file_template(path, kwargs: Mapping[str, Any] | None = None) -> None:
    """Compile the chat template of the GGUF at ``path`` (its header only, nothing mapped), so that a
    front end refuses a broken one before loading the model. Raises PowerInferError naming the file
    and the template's error (its line)."""
    from ..formats.gguf_file import check_gguf

    source = check_gguf(path).scalar("tokenizer.chat_template")
    try:
        ChatTemplate(source, kwargs=kwargs)
    except PowerInferError as e:
        raise PowerInferError(f"{path}: {e}") from None


def chat_prompt_ids(tok, text: str) -> list[int]:
    """Token ids of a rendered chat prompt: control-token text parsed as tokens, and BOS first
    when the tokenizer adds one and the template did not already write it."""
    ids = tok.encode(text, add_bos=False, parse_special=True)
    if tok.add_bos and tok.bos_id is not None and (not ids or ids[0] != tok.bos_id):
        ids = [tok.bos_id] + ids
    return ids
