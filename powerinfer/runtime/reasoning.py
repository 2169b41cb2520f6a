"""A thinking model's reply split into its reasoning and its answer (``<think>...</think>``).

Qwen3, QwQ and the DeepSeek-R1 distills write their reasoning between ``<think>`` and
``</think>`` before the answer. llama.cpp's server returns it apart, as the OpenAI field
``reasoning_content``, with ``--reasoning-format deepseek`` (its default, ``auto``, does
the same for these templates); ``none`` leaves the text as generated. This module does
that split, for a whole reply or token by token for a stream:

- the reply is in the reasoning from its start when the prompt ends with an open
  ``<think>`` (DeepSeek-R1's generation prompt writes it; Qwen3's does not), or when the
  reply starts with ``<think>`` (whitespace before it skipped); otherwise it is all answer
  (a ``<think>`` later in the text is answer text);
- the reasoning runs to ``</think>`` (to the end when the reply stops before it, as when
  ``max_tokens`` cuts it); whitespace around it is dropped, and so is the whitespace
  between ``</think>`` and the answer.
"""
from __future__ import annotations

THINK_START, THINK_END = "<think>", "</think>"
REASONING_FORMATS = ("auto", "deepseek", "none")


def thinks(template_source: str) -> bool:
    """Whether a chat template writes ``<think>`` tags (so its model's replies get split)."""
    return THINK_END in template_source


def opens_thinking(prompt_text: str) -> bool:
    """Whether a rendered chat prompt ends inside an open ``<think>`` (the reply starts in the reasoning)."""
    return prompt_text.rstrip().endswith(THINK_START)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper prefix of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ReasoningSplitter:
    """Feed reply text as it is generated; get ``(reasoning, content)`` deltas back. Text that may
    still turn out to be part of a tag, or whitespace that may still turn out to be trailing, is
    held until it is known (:meth:`flush` at the end returns what is left)."""

    def __init__(self, open_at_start: bool = False):
        self.state = "reasoning" if open_at_start else "start"  # start -> reasoning -> content, or start -> content
        self.buf = ""
        self.reasoning_started = False  # leading whitespace of the reasoning is dropped
        self.content_started = False  # and of the answer after </think>
        self.reasoning = self.content = ""  # everything returned so far, joined

    def feed(self, text: str) -> tuple[str, str]:
        self.buf += text
        r, c = self._step(final=False)
        self.reasoning += r
        self.content += c
        return r, c

    def flush(self) -> tuple[str, str]:
        r, c = self._step(final=True)
        self.reasoning += r
        self.content += c
        return r, c

    def _step(self, final: bool) -> tuple[str, str]:
        reasoning, content = "", ""
        while True:
            if self.state == "start":
                stripped = self.buf.lstrip()
                if stripped.startswith(THINK_START):
                    self.buf, self.state = stripped[len(THINK_START):], "reasoning"
                    continue
                if not final and (not stripped or THINK_START.startswith(stripped)):
                    return reasoning, content  # could still be the opening tag
                self.state, self.content_started = "content", True  # all answer, whitespace and all
                continue
            if self.state == "reasoning":
                if not self.reasoning_started:
                    self.buf = self.buf.lstrip()
                    if not self.buf:
                        return reasoning, content
                    self.reasoning_started = True
                at = self.buf.find(THINK_END)
                if at >= 0:
                    reasoning += self.buf[:at].rstrip()
                    self.buf, self.state = self.buf[at + len(THINK_END):], "content"
                    continue
                if final:
                    reasoning += self.buf.rstrip()
                    self.buf = ""
                    return reasoning, content
                keep = _partial_suffix(self.buf, THINK_END)
                body = self.buf[:len(self.buf) - keep]
                out = body.rstrip()  # trailing whitespace waits: it may end the reasoning
                reasoning += out
                self.buf = body[len(out):] + self.buf[len(self.buf) - keep:]
                return reasoning, content
            # content
            if not self.content_started:
                self.buf = self.buf.lstrip()
                if not self.buf:
                    return reasoning, content
                self.content_started = True
            content += self.buf
            self.buf = ""
            return reasoning, content


def split_reasoning(text: str, open_at_start: bool = False) -> tuple[str, str]:
    """``(reasoning, content)`` of a whole reply (see the module notes)."""
    s = ReasoningSplitter(open_at_start)
    s.feed(text)
    s.flush()
    return s.reasoning, s.content
