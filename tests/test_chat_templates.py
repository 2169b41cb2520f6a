"""The real chat templates of today's families (Llama 3.1/3.2/3.3 Instruct, Qwen2.5, Qwen3 with its
thinking tags, Mistral-Nemo, Mistral-Small-3.2, Devstral, DeepSeek-R1-Distill-Llama) render byte for
byte what transformers' ``apply_chat_template`` renders for the same messages, template kwargs and
special tokens; conversations a template refuses (Mistral's alternation rule) are refused with the
template's own message and line. The templates are llama.cpp's copies (tests/data/chat_templates,
MIT); the reference is computed here, by transformers itself, on a tokenizer built in memory."""
from __future__ import annotations

import jinja2
import pytest

from helpers import DATA, need
from powerinfer.errors import PowerInferError
from powerinfer.runtime.chat import ChatTemplate, TemplateError, check_template_kwargs

TEMPLATES = DATA / "chat_templates"
LLAMA3 = ("<|begin_of_text|>", "<|eot_id|>")
QWEN = (None, "<|im_end|>")  # transformers' Qwen tokenizers have no BOS token
MISTRAL = ("<s>", "</s>")
DEEPSEEK = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>")
# template file, the model's (bos, eos) strings, the template kwargs to render with, its end marker.
# Llama 3.3-70B-Instruct's template is byte-identical to 3.1's (same sha256): one file serves both.
CASES = {
    "llama-3.1": ("meta-llama-Llama-3.1-8B-Instruct.jinja", LLAMA3,
                  [{}, {"date_string": "03 Dec 2026"}, {"tools_in_user_message": False}], "<|eot_id|>"),
    "llama-3.2": ("meta-llama-Llama-3.2-3B-Instruct.jinja", LLAMA3, [{}, {"date_string": "01 Jan 2025"}], "<|eot_id|>"),
    "qwen2.5": ("Qwen-Qwen2.5-7B-Instruct.jinja", QWEN, [{}], "<|im_end|>"),
    "qwen3": ("Qwen-Qwen3-0.6B.jinja", QWEN, [{}, {"enable_thinking": True}, {"enable_thinking": False}], "<|im_end|>"),
    "mistral-nemo": ("mistralai-Mistral-Nemo-Instruct-2407.jinja", MISTRAL, [{}], "</s>"),
    "mistral-small-3.2": ("Mistral-Small-3.2-24B-Instruct-2506.jinja", MISTRAL, [{}], "</s>"),
    "devstral": ("unsloth-mistral-Devstral-Small-2507.jinja", MISTRAL, [{}], "</s>"),
    "deepseek-r1-distill-llama": ("deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja", DEEPSEEK, [{}],
                                  "<｜end▁of▁sentence｜>"),
}

SYSTEM = {"role": "system", "content": "You are terse.\n"}
CONVERSATIONS = {
    "user": [{"role": "user", "content": "Hello"}],
    "system+user": [SYSTEM, {"role": "user", "content": "  Hello there! "}],
    "multi-turn": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello. What do you need?"},
                   {"role": "user", "content": "A story about a dog, please."}],
    "system+multi-turn": [SYSTEM, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": " Hello. "},
                          {"role": "user", "content": "More."}],
    "ends-with-reply": [SYSTEM, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}],
    "unicode": [{"role": "user", "content": "héllo wörld 😀 中文\n\tend  "}],
    # a past reply that thought aloud: Qwen3 and DeepSeek-R1 drop the thinking of past turns
    "past-think-tags": [{"role": "user", "content": "2+2?"},
                        {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
                        {"role": "user", "content": "And 3+3?"}],
    "last-reply-think-tags": [{"role": "user", "content": "2+2?"},
                              {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"}],
    # the reasoning as a field of the message (OpenAI's reasoning_content, and the older names)
    "reasoning-content": [{"role": "user", "content": "2+2?"},
                          {"role": "assistant", "content": "4", "reasoning_content": "add them"}],
    "reasoning-content-past": [{"role": "user", "content": "2+2?"},
                               {"role": "assistant", "content": "4", "reasoning_content": "add them"},
                               {"role": "user", "content": "And 3+3?"}],
    "thinking-field": [{"role": "user", "content": "2+2?"},
                       {"role": "assistant", "content": "4", "thinking": "add them"}],
    "reasoning-field": [{"role": "user", "content": "2+2?"},
                        {"role": "assistant", "content": "4", "reasoning": "add them"}],
    # conversations the Mistral templates refuse (roles must alternate after the system message)
    "two-users": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
    "assistant-first": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}],
    "system-after-user": [{"role": "user", "content": "a"}, SYSTEM, {"role": "user", "content": "b"}],
}


def _hf_tokenizer(bos: str | None, eos: str):
    """A transformers fast tokenizer with the model's special tokens and nothing else: its
    apply_chat_template is transformers' own code path, with no download."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel({"<unk>": 0}, unk_token="<unk>")),
                                   bos_token=bos, eos_token=eos)


def _reference(tok, src, msgs, gen, kwargs):
    """transformers' rendering, or ("raises", message) when the template refuses the conversation."""
    try:
        return tok.apply_chat_template(msgs, chat_template=src, tokenize=False, add_generation_prompt=gen, **kwargs)
    except jinja2.TemplateError as e:
        return ("raises", str(e))


def _ours(src, bos, eos, msgs, gen, kwargs):
    try:
        return ChatTemplate(src, bos or "", eos).render(msgs, add_generation_prompt=gen, kwargs=kwargs)
    except TemplateError as e:
        return ("raises", str(e))


def _same(got, want) -> bool:
    if isinstance(want, tuple) or isinstance(got, tuple):  # both refuse, ours names the template's message
        return isinstance(want, tuple) and isinstance(got, tuple) and want[1] in got[1]
    return got == want


def _cases():
    for name, (_, _, kw_sets, _) in CASES.items():
        for i, kw in enumerate(kw_sets):
            yield pytest.param(name, kw, id=f"{name}-{i}-{'-'.join(f'{k}={v}' for k, v in kw.items()) or 'plain'}")


@pytest.mark.parametrize("name, kwargs", list(_cases()))
def test_real_templates_render_as_transformers_does(name, kwargs):
    file, (bos, eos), _, _ = CASES[name]
    src = need(TEMPLATES / file).read_text(encoding="utf-8")
    tok = _hf_tokenizer(bos, eos)
    compared, refused, wrong = 0, 0, []
    for conv_name, msgs in CONVERSATIONS.items():
        for gen in (True, False):
            want = _reference(tok, src, msgs, gen, kwargs)
            got = _ours(src, bos, eos, msgs, gen, kwargs)
            if not _same(got, want):  # a template that prints today's date may have crossed midnight
                want = _reference(tok, src, msgs, gen, kwargs)
            compared += 1
            refused += isinstance(want, tuple)
            if not _same(got, want):
                wrong.append((conv_name, gen, want, got))
    assert not wrong, wrong[:3]
    assert compared == 2 * len(CONVERSATIONS)
    # the cases that matter were rendered, not refused: only the Mistral alternation cases raise
    assert refused <= 6 if name.startswith(("mistral", "devstral")) else refused == 0


def _render(name, msgs, gen=True, **kwargs):
    file, (bos, eos), _, _ = CASES[name]
    return ChatTemplate(need(TEMPLATES / file).read_text(encoding="utf-8"), bos or "", eos).render(
        msgs, add_generation_prompt=gen, kwargs=kwargs)


def test_renders_checked_by_hand():
    """What the kwargs and message fields do, spelled out (so the comparison above is not vacuous)."""
    hi = CONVERSATIONS["user"]
    assert _render("llama-3.1", hi) == ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
                                        "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n<|eot_id|>"
                                        "<|start_header_id|>user<|end_header_id|>\n\nHello<|eot_id|>"
                                        "<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert "Today Date: 03 Dec 2026\n" in _render("llama-3.1", hi, date_string="03 Dec 2026")
    assert _render("qwen2.5", hi).startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. "
                                             "You are a helpful assistant.<|im_end|>\n")
    assert _render("qwen3", hi) == "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"
    assert _render("qwen3", hi, enable_thinking=False).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert _render("qwen3", CONVERSATIONS["reasoning-content"], gen=False).endswith(
        "<|im_start|>assistant\n<think>\nadd them\n</think>\n\n4<|im_end|>\n")
    assert "add them" not in _render("qwen3", CONVERSATIONS["past-think-tags"])  # a past turn's thinking goes
    assert _render("deepseek-r1-distill-llama", hi) == "<｜begin▁of▁sentence｜><｜User｜>Hello<｜Assistant｜><think>\n"
    with pytest.raises(TemplateError, match=r"at template line 18: After the optional system message, "
                                            r"conversation roles must alternate"):
        _render("mistral-nemo", CONVERSATIONS["two-users"])


@pytest.mark.parametrize("name", sorted(CASES))
def test_end_marker_is_the_templates_end_token(name):
    file, (bos, eos), _, marker = CASES[name]
    t = ChatTemplate(need(TEMPLATES / file).read_text(encoding="utf-8"), bos or "", eos)
    assert t.end_marker == marker and t.stop_strings == (marker,)


def test_template_kwargs_are_checked():
    assert check_template_kwargs('{"enable_thinking": false, "date_string": "1 Jan"}') == {
        "enable_thinking": False, "date_string": "1 Jan"}
    assert check_template_kwargs(None) == {}
    for bad, needle in [("[1]", "must be a JSON object"), ("{bad", "not a JSON object"),
                        ('{"enable_thinking": "false"}', "must be true or false"),
                        ('{"messages": []}', "set by the server"), ('{"tools": [{}]}', "tool calls"),
                        ('{"_x": 1}', "not a template variable name"), ('{"a-b": 1}', "not a template variable name"),
                        ('{"x": NaN}', "not a JSON object"), ('{"x": ' + "[" * 9 + "]" * 9 + "}", "nested more than"),
                        ('{"x": "' + "y" * 70000 + '"}', "more than 65536")]:
        with pytest.raises(PowerInferError, match=needle):
            check_template_kwargs(bad, "--chat-template-kwargs")
    with pytest.raises(PowerInferError, match="--chat-template-kwargs.enable_thinking"):
        ChatTemplate(None, kwargs={"enable_thinking": 1})


def test_kwargs_override_the_special_tokens_as_in_transformers():
    src = "{{ bos_token }}|{{ eos_token }}|{{ flag }}|{{ tools }}|{{ documents }}"
    tok = _hf_tokenizer("<s>", "</s>")
    for kw in ({"flag": 3}, {"flag": [1, "a"], "bos_token": "B"}):
        want = tok.apply_chat_template(CONVERSATIONS["user"], chat_template=src, tokenize=False, **kw)
        t = ChatTemplate(src, "<s>", "</s>", kwargs={"flag": 0})
        got = t.render(CONVERSATIONS["user"], add_generation_prompt=False, kwargs=kw)
        assert got == want
    assert ChatTemplate(src, "<s>", "</s>", kwargs={"flag": 7}).render([]) == "<s>|</s>|7|None|None"


def test_generation_blocks_and_namespaces_as_in_transformers():
    src = ("{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
           "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}{% else %}"
           "[{{ m.content }}]{% endif %}{% endfor %}{{ ns.n }}")
    msgs = CONVERSATIONS["multi-turn"]
    want = _hf_tokenizer("<s>", "</s>").apply_chat_template(msgs, chat_template=src, tokenize=False)
    assert ChatTemplate(src).render(msgs, add_generation_prompt=False) == want == \
        "[Hi]Hello. What do you need?[A story about a dog, please.]3"
    with pytest.raises(TemplateError, match="sandbox forbids at template line 2"):
        ChatTemplate("x\n{% set ns = namespace(_y=1) %}").render([])
    with pytest.raises(TemplateError, match="sandbox forbids"):
        ChatTemplate("{% set ns = namespace() %}{% set ns.__class__ = 1 %}").render([])


@pytest.mark.parametrize("src, needle", [
    ("line 1\n{{ messages[0].x.y }}", r"failed at template line 2: UndefinedError: 'dict object' has no attribute 'x'"),
    ("\n\n{{ raise_exception('no system message here') }}", r"refused the conversation at template line 3: no system"),
    ("{{ 1 / 0 }}", r"failed at template line 1: ZeroDivisionError"),
])
def test_a_template_that_fails_names_its_error_and_line(src, needle):
    with pytest.raises(TemplateError, match=needle) as e:
        ChatTemplate(src).render(CONVERSATIONS["user"])
    assert "\n" not in str(e.value)


# ------------------------------------------------------------------ llama.cpp's rendering, when its engine is here
def _llama_server():
    import os

    d = os.environ.get("POWERINFER_LLAMA_CPP_BIN")  # a folder with llama-server (built outside the repository)
    if not d or not os.path.isfile(os.path.join(d, "llama-server")):
        pytest.skip("llama.cpp's llama-server is not here (set POWERINFER_LLAMA_CPP_BIN to its folder)")
    return d


@pytest.mark.parametrize("name", sorted(CASES))
def test_real_templates_render_as_llama_cpp_does(name, tmp_path):
    """The same templates through llama-server's ``POST /apply-template`` (its own Jinja engine, on the
    stories260K GGUF, BOS ``<s>``): equal to ours but for what llama.cpp does on purpose: it drops the
    BOS text the template writes (its tokenizer adds BOS), it gives ``date_string`` today's date (a
    template's own default is used by transformers), a conversation that ends with a reply is continued
    rather than closed (prefill), and (Devstral) it drops a reply's content when the reply has reasoning."""
    import os
    import socket
    import subprocess
    import time

    import httpx

    bindir = _llama_server()
    file, _, kw_sets, _ = CASES[name]
    src_path = need(TEMPLATES / file)
    src = src_path.read_text(encoding="utf-8")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "LD_LIBRARY_PATH": bindir}
    proc = subprocess.Popen([os.path.join(bindir, "llama-server"), "-m", str(need(DATA / "stories260K" /
                             "stories260K.ggml-org.gguf")), "--port", str(port), "-t", "1", "--jinja",
                             "--chat-template-file", str(src_path)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        compared = 0
        for kw in kw_sets:
            for conv_name, msgs in CONVERSATIONS.items():
                refused = conv_name in ("two-users", "assistant-first", "system-after-user")
                reasons = any(k in m for m in msgs for k in ("reasoning_content", "thinking", "reasoning"))
                if msgs[-1]["role"] == "assistant" or refused or (name == "devstral" and reasons):
                    continue
                for gen in (True, False):
                    for _ in range(2):  # today's date may change between the two renders
                        body = {"messages": msgs, "add_generation_prompt": gen, "chat_template_kwargs": kw}
                        theirs = httpx.post(url + "/apply-template", timeout=30, json=body).json()["prompt"]
                        today = {"date_string": time.strftime("%d %b %Y")} if "date_string" in src else {}
                        ours = ChatTemplate(src, "<s>", "</s>").render(msgs, add_generation_prompt=gen,
                                                                      kwargs={**today, **kw})
                        ours = ours.removeprefix("<s>")
                        if ours == theirs:
                            break
                    assert ours == theirs, (conv_name, gen, kw)
                    compared += 1
        assert compared >= 12  # 6 to 9 conversations, with and without the generation prompt
    finally:
        proc.terminate()
        proc.wait(10)
