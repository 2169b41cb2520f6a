"""Chat templates (rendered as transformers renders them, in a sandbox), control tokens in chat
prompts, KV-cache reuse between turns, and pi-run -cnv / -i."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import TEXT, TOKENIZERS, need
from powerinfer.convert.writer import convert
from powerinfer.errors import PowerInferError
from powerinfer.formats.gguf_file import open_gguf
from powerinfer.runtime.chat import DEFAULT_TEMPLATE, ChatTemplate, chat_prompt_ids, template_for
from powerinfer.runtime.generate import SamplerSettings, generate
from powerinfer.runtime.interactive import chat_loop, interactive_loop
from powerinfer.runtime.model import Transformer
from powerinfer.runtime.session import Session, StopMatcher
from powerinfer.runtime.tokenizer import GGUFTokenizer

TEMPLATES = json.loads((Path(__file__).parent / "data" / "chat_templates.json").read_text())
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "  Hello there! "},
    {"role": "assistant", "content": "Hi. What do you need?"},
    {"role": "user", "content": "A story about a dog, please."},
]


@pytest.fixture(scope="module")
def hf_llama_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(need(TOKENIZERS / "llama2")))


@pytest.mark.parametrize("name", sorted(TEMPLATES))
@pytest.mark.parametrize("gen", [True, False])
@pytest.mark.parametrize("n_msgs", [2, 4])
def test_template_renders_as_transformers_does(hf_llama_tokenizer, name, gen, n_msgs):
    src = TEMPLATES[name]["chat_template"]
    msgs = CONVERSATION[:n_msgs]
    want = hf_llama_tokenizer.apply_chat_template(msgs, chat_template=src, tokenize=False,
                                                  add_generation_prompt=gen)
    got = ChatTemplate(src, "<s>", "</s>").render(msgs, add_generation_prompt=gen)
    assert got == want


def test_llama2_template_rendered_text_by_hand():
    t = ChatTemplate(TEMPLATES["llama-2-chat"]["chat_template"], "<s>", "</s>")
    # content.strip() applies to the system block plus the message: the message keeps its leading spaces
    assert t.render(CONVERSATION[:2]) == "<s>[INST] <<SYS>>\nYou are terse.\n<</SYS>>\n\n  Hello there! [/INST]"
    assert t.render(CONVERSATION[1:3]) == "<s>[INST] Hello there! [/INST] Hi. What do you need? </s>"
    with pytest.raises(PowerInferError, match="must alternate"):  # the template's raise_exception
        t.render([{"role": "assistant", "content": "x"}])


def test_default_template_is_chatml():
    t = ChatTemplate(None)
    assert t.is_default and t.stop_strings == ("<|im_end|>",)
    assert t.render(CONVERSATION[1:2]) == "<|im_start|>user\n  Hello there! <|im_end|>\n<|im_start|>assistant\n"
    assert t.render(CONVERSATION[1:2], add_generation_prompt=False).endswith("<|im_end|>\n")
    # a template's own end marker is its stop string (what it writes after an assistant message)
    assert ChatTemplate(DEFAULT_TEMPLATE).stop_strings == ("<|im_end|>",)
    assert ChatTemplate(TEMPLATES["zephyr"]["chat_template"], "<s>", "</s>").stop_strings == ("</s>",)
    assert ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}").stop_strings == ()


@pytest.mark.parametrize("src, needle", [
    ("{{ messages.__class__.__mro__[1].__subclasses__() }}", "sandbox"),
    ("{{ messages.append(1) }}", "sandbox"),
    ("{{ ''.__class__.__base__ }}", "sandbox"),
    ("{% for i in range(10**9) %}x{% endfor %}", "range"),
    ("{{ cycler.__init__.__globals__ }}", "sandbox"),
    ("{% if %}", "not a valid Jinja template"),
    ("{{ 1 / 0 }}", "ZeroDivisionError"),
])
def test_hostile_templates_are_contained(src, needle):
    try:
        out = ChatTemplate(src).render(CONVERSATION[:2])
    except PowerInferError as e:
        assert needle is not None and needle in str(e), str(e)
    else:
        assert needle is None and "class" not in out and "function" not in out, out


def test_template_limits_and_types():
    with pytest.raises(PowerInferError, match="not a string"):
        ChatTemplate(["x"])  # type: ignore[arg-type]
    with pytest.raises(PowerInferError, match="more than a template may"):
        ChatTemplate("x" * ((1 << 20) + 1))
    with pytest.raises(PowerInferError, match="rendered more than"):
        ChatTemplate("{% for i in range(99999) %}{% for j in range(99999) %}xxxxxxxxxx{% endfor %}{% endfor %}").render([])
    with pytest.raises(PowerInferError, match="role"):
        ChatTemplate(None).render([{"role": "wizard", "content": "x"}])
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert "ab<|im_end|>" in ChatTemplate(None).render(parts)


def test_stop_matcher_holds_back_partial_stop_strings():
    m = StopMatcher(["<|im_end|>", "END"])
    assert m.feed("Hello <|im") == "Hello "
    assert m.feed("_e") == ""
    assert m.feed("x") == "<|im_ex"  # not a stop after all: released
    assert m.feed(" E") == " "
    assert m.feed("ND and more") == "" and m.matched == "END"
    assert m.feed("later") == "" and m.flush() == ""
    m = StopMatcher(["abc"])
    assert m.feed("xab") == "x" and m.flush() == "ab"


# ------------------------------------------------------------------ model-backed
@pytest.fixture(scope="module")
def stories(tmp_path_factory, stories_hf):
    path = convert(stories_hf, tmp_path_factory.mktemp("chat") / "s.gguf", outtype="f32", progress=False)
    g = open_gguf(path)
    return path, Transformer(g), GGUFTokenizer(g)


def test_control_token_text_becomes_the_token_only_when_asked(stories):
    _, _, tok = stories
    plain = tok.encode("<s>Hi</s>", add_bos=False)
    special = tok.encode("<s>Hi</s>", add_bos=False, parse_special=True)
    assert tok.bos_id not in plain and tok.eos_id not in plain
    assert special[0] == tok.bos_id and special[-1] == tok.eos_id
    assert special[1:-1] == tok.encode("Hi", add_bos=False)  # the piece between gets its dummy space, as llama.cpp
    assert chat_prompt_ids(tok, "<s>Hi") == special[:-1]  # no second BOS when the template wrote one
    assert chat_prompt_ids(tok, "Hi") == [tok.bos_id] + tok.encode("Hi", add_bos=False)


def test_session_reuses_the_cached_prefix_with_the_same_tokens(stories):
    _, model, tok = stories
    ids = tok.encode("Once upon a time there was a")
    fresh = generate(model, ids + tok.encode(" big dog", add_bos=False), 12, SamplerSettings(temp=0.0))
    s = Session(model, tok)
    first = s.generate(ids, 5, SamplerSettings(temp=0.0), ignore_eos=True)
    assert first.n_reused == 0 and first.n_prompt == len(ids)
    assert s.cached == ids + first.token_ids[:-1]  # the last token is sampled, not yet evaluated
    second = s.generate(ids + tok.encode(" big dog", add_bos=False), 12, SamplerSettings(temp=0.0))
    assert second.n_reused == len(ids) and second.n_prompt == len(tok.encode(" big dog", add_bos=False))
    assert second.token_ids == fresh.token_ids


def _lines(*lines):
    it = iter(lines)

    def read(prompt: str) -> str:
        try:
            return next(it)
        except StopIteration:
            raise EOFError from None
    return read


def test_chat_keeps_the_kv_cache_between_turns(stories, capsys):
    _, model, tok = stories
    s = Session(model, tok)
    template = template_for(tok)
    log = chat_loop(s, template, SamplerSettings(temp=0.0), 10, _lines("Hello there", "", "Tell me more"),
                    sys.stdout, sys.stderr, system="You tell stories.")
    t1, t2 = log.turns
    assert t1.n_reused == 0
    # turn 2 evaluates only what follows turn 1's prompt and reply: the end of the reply, the new
    # message and the assistant header, never the history
    text1 = template.render([{"role": "system", "content": "You tell stories."},
                             {"role": "user", "content": "Hello there"}])
    ids1 = chat_prompt_ids(tok, text1)
    ids2 = s.cached[:t2.n_reused + t2.n_prompt]
    assert t2.n_reused == len(ids1) + t1.n_eval  # everything cached was reused
    assert ids2[:len(ids1) + t1.n_gen] == ids1 + t1.token_ids  # the reply's own tokens, not a re-tokenization
    assert capsys.readouterr().out.count("\n") >= 2
    # the reply of turn 2 is what a fresh model gives for the same tokens
    fresh = generate(Transformer(open_gguf(stories[0])), ids2, 10,
                     SamplerSettings(temp=0.0), tok.eos_id, stop_after_first=(tok.bos_id,))
    assert fresh.token_ids == t2.token_ids


def test_interactive_appends_lines_without_re_evaluating(stories, capsys):
    _, model, tok = stories
    ids = tok.encode("Once upon a time")
    log = interactive_loop(Session(model, tok), ids, SamplerSettings(temp=0.0), 8, _lines("The dog ran."),
                           sys.stdout, sys.stderr, ignore_eos=True)
    t1, t2 = log.turns
    assert t2.n_reused == len(ids) + t1.n_eval
    assert t2.n_prompt == 1 + len(tok.encode("The dog ran.\n", continuation=True))
    # the appended line tokenizes as inside the whole transcript: no extra dummy space
    assert tok.encode("Once upon a time. The dog") == (tok.encode("Once upon a time.")
                                                      + tok.encode(" The dog", continuation=True))


# The chat runs in a child process and Ctrl-C goes to the child, never to the test runner; it is
# sent once the first reply has started printing (an event, not a timer).
_CTRL_C_CHILD = r"""
import json, sys
from powerinfer.formats.gguf_file import open_gguf
from powerinfer.runtime.chat import template_for
from powerinfer.runtime.generate import SamplerSettings
from powerinfer.runtime.interactive import chat_loop
from powerinfer.runtime.model import Transformer
from powerinfer.runtime.session import Session
from powerinfer.runtime.tokenizer import GGUFTokenizer

g = open_gguf(sys.argv[1])
model, tok = Transformer(g), GGUFTokenizer(g)
lines = iter(["Tell me a very long story", "And another"])

def read(prompt):
    try:
        return next(lines)
    except StopIteration:
        raise EOFError from None

log = chat_loop(Session(model, tok), template_for(tok), SamplerSettings(temp=0.0), -1, read, sys.stdout,
                sys.stderr, ignore_eos=True)
with open(sys.argv[2], "w") as f:
    json.dump({"n_ctx": model.n_ctx, "turns": [[t.stop, t.n_gen] for t in log.turns]}, f)
"""


def test_ctrl_c_stops_a_reply_and_the_chat_goes_on(stories, tmp_path):
    path = stories[0]
    proc = subprocess.Popen([sys.executable, "-u", "-c", _CTRL_C_CHILD, str(path), str(tmp_path / "log.json")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout.read(1)  # the first reply is printing: only replies write to stdout
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, err.decode()
    log = json.loads((tmp_path / "log.json").read_text())
    (stop1, n1), (stop2, n2) = log["turns"]
    assert stop1 == "interrupted" and 0 < n1 < log["n_ctx"]
    assert stop2 != "interrupted" and n2 > 0  # the chat went on to the second line


def test_pi_run_cnv_in_a_terminal_session(stories):
    path = stories[0]
    r = subprocess.run([sys.executable, "-m", "powerinfer.runtime.cli", "-m", str(path), "-cnv", "-n", "8",
                        "--temp", "0", "-sys", "Be brief."], input="Hello\nWhat next?\n", capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("> ") == 3  # two turns, then end of input
    assert "no chat template" in r.stderr and "2 turns" in r.stderr
    bad = subprocess.run([sys.executable, "-m", "powerinfer.runtime.cli", "-m", str(path), "-cnv", "-i"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "choose one" in bad.stderr


@pytest.mark.parametrize("vocab", ["ggml-vocab-llama.gguf", "ggml-vocab-falcon.gguf"])
def test_text_stream_pieces_add_up_to_the_whole_decode(vocab):
    """The sliding window of TextStream: every delta joined gives decode(all), multi-byte characters
    split across tokens included, over a text long enough for the window to slide many times."""
    from powerinfer.runtime.tokenizer import TextStream

    tok = GGUFTokenizer(open_gguf(need(TOKENIZERS / "gguf-vocab" / vocab)))
    text = (Path(need(TEXT / "tinystories_val.txt")).read_text()[:3000]
            + " héllo wörld 😀🦙 中文字符 ünïcödé\n\tend" * 8)
    ids = tok.encode(text)
    for n_prompt in (0, 1, 5):
        ts = TextStream(tok, ids[:n_prompt])
        pieces = [ts.push(i) for i in ids[n_prompt:]]
        assert tok.decode(ids[:n_prompt]) + "".join(pieces) == tok.decode(ids)
        assert len(ts.ids) < 2 * TextStream.CONTEXT  # only a window is kept


def test_chat_drops_the_oldest_turns_when_the_context_fills(stories, capsys):
    path, _, tok = stories
    model = Transformer(open_gguf(path), n_ctx=160)
    s = Session(model, tok)
    template = template_for(tok)
    log = chat_loop(s, template, SamplerSettings(temp=0.0), 16, _lines(*[f"Turn {i}: and then?" for i in range(6)]),
                    sys.stdout, sys.stderr, system="Be brief.", ignore_eos=True)
    assert len(log.turns) == 6  # every turn answered, none refused
    assert "oldest turn" in capsys.readouterr().err
    assert all(t.n_reused + t.n_prompt + t.n_gen <= 160 for t in log.turns)
    system_ids = chat_prompt_ids(tok, template.render([{"role": "system", "content": "Be brief."}],
                                                      add_generation_prompt=False))
    assert s.cached[:len(system_ids) - 1] == system_ids[:-1]  # the system prompt stays first
    assert log.turns[-1].n_reused >= len(system_ids) - 1  # and is not evaluated again


def test_pi_run_cnv_refuses_two_system_prompts(stories):
    r = subprocess.run([sys.executable, "-m", "powerinfer.runtime.cli", "-m", str(stories[0]), "-cnv", "-p", "A",
                        "-sys", "B"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "give one" in r.stderr
