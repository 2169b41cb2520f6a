"""``pi-run -cnv`` (chat with the model's template) and ``pi-run -i`` (plain text, turn by turn).

Both keep the KV cache between turns: each turn appends only the new tokens to what the
cache holds, so the history is never evaluated again (llama.cpp's ``main`` does the same).
Appended text is tokenized as a continuation (no SentencePiece dummy space before it), so the
tokens are those of the whole transcript; a chat that fills the context drops its oldest
turns and keeps the system prompt.
In a chat, the new tokens are the part of the re-rendered conversation that follows the
previous prompt and the reply as generated: for the usual templates the reply's end
marker, the user's message and the assistant header. Ctrl-C stops a reply and returns
to the prompt; Ctrl-C or Ctrl-D (end of input) at the prompt ends the session.
"""
from __future__ import annotations

import signal
import threading
from dataclasses import dataclass, field
from typing import Callable, TextIO

from ..cli_params import plural
from ..errors import PowerInferError, Terminated
from .chat import ChatTemplate, chat_prompt_ids
from .generate import GenStats, SamplerSettings
from .session import Session


@dataclass
class TurnLog:
    """What each turn evaluated: prompt tokens computed, tokens reused from the cache, generated."""

    turns: list[GenStats] = field(default_factory=list)


class _Interrupt:
    """While active, Ctrl-C sets a flag (the reply stops at the next token) instead of raising."""

    def __init__(self) -> None:
        self.hit = False
        self._old = None

    def __enter__(self) -> "_Interrupt":
        self.hit = False
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def _on_sigint(self, signum, frame) -> None:
        self.hit = True

    def __exit__(self, *exc) -> None:
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)
            self._old = None


def _reply(session: Session, ids: list[int], n_predict: int, sampler: SamplerSettings, stops: tuple[str, ...],
           out: TextIO, ignore_eos: bool) -> tuple[str, list[int], GenStats]:
    """Generate and print one reply; returns ``(text shown, token ids generated, stats)``."""
    shown: list[str] = []

    def on_text(piece: str) -> None:
        shown.append(piece)
        out.write(piece)
        out.flush()

    with _Interrupt() as intr:
        st, _ = session.generate_text(ids, n_predict, sampler, on_text, stops=stops, ignore_eos=ignore_eos,
                                      should_stop=lambda: intr.hit)
    out.write("\n")
    out.flush()
    if intr.hit:
        st.stop = "interrupted"
    return "".join(shown), st.token_ids, st


def _prompt(read_line: Callable[[str], str], out: TextIO) -> str | None:
    """The user's next line; None at the end of input or Ctrl-C at the prompt (SIGTERM propagates)."""
    try:
        return read_line("> ")
    except Terminated:  # SIGTERM ends the program, not just this prompt
        raise
    except (EOFError, KeyboardInterrupt):
        out.write("\n")
        return None


def _fit(template: ChatTemplate, tok, messages: list[dict[str, str]], n_keep: int, n_ctx: int,
         reserve: int) -> tuple[list[dict[str, str]], str, list[int], int]:
    """Drop the oldest turns after the first ``n_keep`` messages (the system prompt) until the
    rendered conversation leaves ``reserve`` tokens of the context free, as llama.cpp's context
    shift keeps ``--keep`` tokens. Returns ``(messages, text, ids, turns dropped)``; the last
    message is always kept."""
    dropped = 0
    while True:
        text = template.render(messages, add_generation_prompt=True)
        ids = chat_prompt_ids(tok, text)
        if len(ids) + reserve <= n_ctx or len(messages) <= n_keep + 1:
            return messages, text, ids, dropped
        cut = n_keep + 1
        while cut < len(messages) - 1 and messages[cut]["role"] != "user":  # drop a whole user+assistant turn
            cut += 1
        messages = messages[:n_keep] + messages[cut:]
        dropped += 1


def chat_loop(session: Session, template: ChatTemplate, sampler: SamplerSettings, n_predict: int,
              read_line: Callable[[str], str], out: TextIO, err: TextIO, system: str | None = None,
              ignore_eos: bool = False) -> TurnLog:
    """A multi-turn chat: read a user line, render the conversation with ``template``, generate the
    reply. When the context fills up, the oldest turns are dropped (the system prompt stays).
    Returns the per-turn stats."""
    log = TurnLog()
    n_ctx = session.model.n_ctx
    n_keep = 1 if system else 0
    messages: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    # room kept free for the reply when older turns must go
    reserve = min(n_predict, n_ctx // 2) if n_predict > 0 else n_ctx // 4
    history_ids: list[int] = []  # the prompt so far plus the generated reply tokens
    history_text = ""  # the rendered prompt so far plus the reply as shown
    stops = tuple(template.stop_strings)
    while True:
        line = _prompt(read_line, out)
        if line is None:
            return log
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        try:
            text = template.render(messages, add_generation_prompt=True)
        except PowerInferError as e:
            err.write(f"error: {e}\n")
            messages.pop()
            continue
        if history_ids and text.startswith(history_text):
            ids = history_ids + session.tok.encode(text[len(history_text):], parse_special=True, continuation=True)
        else:  # the template rewrote earlier turns: tokenize it all (the cache still reuses a common prefix)
            ids = chat_prompt_ids(session.tok, text)
        if len(ids) + reserve > n_ctx:
            messages, text, ids, dropped = _fit(template, session.tok, messages, n_keep, n_ctx, reserve)
            if dropped:
                err.write(f"note: the context ({n_ctx} tokens) is full: the {dropped} oldest turn"
                          f"{'s were' if dropped > 1 else ' was'} dropped{' (the system prompt stays)' if n_keep else ''}\n")
            if len(ids) >= n_ctx:
                err.write(f"error: this message is {plural(len(ids), 'token')} with the system prompt, more than the context "
                          f"({n_ctx}); shorten it or raise -c\n")
                messages = messages[:n_keep]
                history_ids, history_text = [], ""
                continue
        reply, reply_ids, st = _reply(session, ids, n_predict, sampler, stops, out, ignore_eos)
        log.turns.append(st)
        messages.append({"role": "assistant", "content": reply})
        history_ids, history_text = ids + reply_ids, text + reply
        if st.stop == "context":
            err.write(f"note: the reply filled the context ({n_ctx} tokens); older turns go at the next message\n")


def interactive_loop(session: Session, prompt_ids: list[int], sampler: SamplerSettings, n_predict: int,
                     read_line: Callable[[str], str], out: TextIO, err: TextIO,
                     ignore_eos: bool = False) -> TurnLog:
    """Plain text turn by turn: the model continues the prompt, then each line typed is appended as
    typed (with its newline; start it with a space to continue a sentence) to everything so far
    and the model continues again."""
    log = TurnLog()
    ids = list(prompt_ids)
    while True:
        if len(ids) >= session.model.n_ctx:
            err.write(f"note: the context is full ({session.model.n_ctx} tokens); stopping\n")
            return log
        _, gen_ids, st = _reply(session, ids, n_predict, sampler, (), out, ignore_eos)
        log.turns.append(st)
        ids = ids + gen_ids
        line = _prompt(read_line, out)
        if line is None:
            return log
        ids = ids + session.tok.encode(line + "\n", continuation=True)
