"""Template kwargs and reasoning through pi-server and pi-run -cnv: ``chat_template_kwargs`` in a
request over ``--chat-template-kwargs``, checked; a past reply's ``reasoning_content`` reaches the
template; a thinking model's ``<think>`` text comes back as ``reasoning_content`` (llama.cpp's
``--reasoning-format``), whole and streamed. The model is the real stories260K with a chat
template added to its tokenizer_config.json; the server runs in-process (FastAPI's TestClient)."""
from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys

import pytest

from powerinfer.convert.writer import convert
from powerinfer.formats.gguf_file import open_gguf
from powerinfer.runtime.chat import chat_prompt_ids, template_for
from powerinfer.runtime.model import Transformer
from powerinfer.runtime.reasoning import ReasoningSplitter, opens_thinking, split_reasoning, thinks
from powerinfer.runtime.tokenizer import GGUFTokenizer

# a thinking model's template in miniature: past replies with their reasoning in <think> tags, the
# generation prompt opens <think> (as DeepSeek-R1's does) unless enable_thinking is false (as Qwen3's)
TEMPLATE = (
    "{{ bos_token }}{% if refuse is defined and refuse %}{{ raise_exception('refused by request') }}{% endif %}"
    "{% for m in messages %}{{ m.role }}: "
    "{% if m.reasoning_content is defined %}<think>{{ m.reasoning_content }}</think>{% endif %}"
    "{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% if enable_thinking is defined and enable_thinking is false %}"
    "Once upon a time{% else %}<think>\n{% endif %}{% endif %}"
)
MSGS = [{"role": "user", "content": "Tell me a story."}]


def _gguf_with_template(tmp_path_factory, stories_hf, template: str, name: str):
    d = tmp_path_factory.mktemp(name) / "hf"
    shutil.copytree(stories_hf, d)
    for p in d.iterdir():
        p.chmod(0o644)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return convert(d, d.parent / f"{name}.gguf", outtype="f32", progress=False)


@pytest.fixture(scope="module")
def thinking_gguf(tmp_path_factory, stories_hf):
    return _gguf_with_template(tmp_path_factory, stories_hf, TEMPLATE, "think")


@pytest.fixture(scope="module")
def client(thinking_gguf):
    from fastapi.testclient import TestClient

    from powerinfer.server.app import ServerState, create_app
    from powerinfer.server.scheduler import Scheduler

    g = open_gguf(thinking_gguf)
    model, tok = Transformer(g), GGUFTokenizer(g)
    engine = Scheduler(model, tok, 1)
    state = ServerState(engine, str(thinking_gguf), None, None, 1 << 20, template_for(tok, {"enable_thinking": True}))
    with TestClient(create_app(state)) as c:
        c.tok, c.template = tok, state.template
        yield c
    engine.close()


def _chat(client, **body):
    r = client.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 24, "temperature": 0,
                                                  "ignore_eos": True, **body})
    return r.status_code, r.json()


def test_request_kwargs_reach_the_template_over_the_servers(client):
    assert client.template.kwargs == {"enable_thinking": True}  # as --chat-template-kwargs gives it
    tok, t = client.tok, client.template
    for kw in ({}, {"enable_thinking": False}, {"enable_thinking": False, "extra": [1, {"a": None}]}):
        code, out = _chat(client, chat_template_kwargs=kw)
        assert code == 200, out
        want = chat_prompt_ids(tok, t.render(MSGS, add_generation_prompt=True, kwargs=kw))
        assert out["usage"]["prompt_tokens"] == len(want)
    n_think = _chat(client)[1]["usage"]["prompt_tokens"]
    n_plain = _chat(client, chat_template_kwargs={"enable_thinking": False})[1]["usage"]["prompt_tokens"]
    assert n_plain != n_think  # the request's false won over the server's true
    # a past reply's reasoning is given to the template
    past = MSGS + [{"role": "assistant", "content": "Yes.", "reasoning_content": "a dog story"},
                   {"role": "user", "content": "More."}]
    code, out = _chat(client, messages=past)
    with_reasoning = t.render(past, add_generation_prompt=True)
    assert "<think>a dog story</think>Yes." in with_reasoning
    assert code == 200 and out["usage"]["prompt_tokens"] == len(chat_prompt_ids(tok, with_reasoning))


@pytest.mark.parametrize("kw, needle", [
    ([1], "chat_template_kwargs"),
    ({"enable_thinking": "false"}, "chat_template_kwargs.enable_thinking: must be true or false"),
    ({"messages": []}, "chat_template_kwargs.messages: set by the server"),
    ({"refuse": True}, "refused the conversation at template line 1: refused by request"),
])
def test_bad_kwargs_are_400s(client, kw, needle):
    code, out = _chat(client, chat_template_kwargs=kw)
    assert code == 400 and needle in out["error"]["message"], out


def test_thinking_text_comes_back_as_reasoning_content(client):
    code, raw = _chat(client, reasoning_format="none")
    text = raw["choices"][0]["message"]["content"]
    assert code == 200 and text.strip() and "reasoning_content" not in raw["choices"][0]["message"]
    # the prompt ended in an open <think> and the reply never closed it: all of it is reasoning
    code, out = _chat(client)
    msg = out["choices"][0]["message"]
    assert code == 200 and msg["reasoning_content"] == text.strip() and msg["content"] == ""
    with client.stream("POST", "/v1/chat/completions", json={"messages": MSGS, "max_tokens": 24, "temperature": 0,
                                                             "ignore_eos": True, "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == text.strip()
    assert "".join(d.get("content", "") for d in deltas) == ""
    # thinking off: no open tag in the prompt, the reply is all content
    code, out = _chat(client, chat_template_kwargs={"enable_thinking": False})
    msg = out["choices"][0]["message"]
    assert code == 200 and msg["content"] and "reasoning_content" not in msg
    code, out = _chat(client, reasoning_format="sideways")
    assert code == 400 and "reasoning_format" in out["error"]["message"]


@pytest.mark.parametrize("text, open_at_start, want", [
    ("<think>\nadd them\n</think>\n\n4", False, ("add them", "4")),  # Qwen3: the reply opens the tag
    ("add them\n</think>\n\n4", True, ("add them", "4")),  # DeepSeek-R1: the prompt opened it
    ("\n\n</think>\n\nHi", True, ("", "Hi")),
    ("<think>\nstill thinking", False, ("still thinking", "")),  # cut by max_tokens
    ("  4 <think>x</think>", False, ("", "  4 <think>x</think>")),  # a tag later on is answer text
    ("Hi", False, ("", "Hi")),
    ("<thi", False, ("", "<thi")),
])
def test_reasoning_split_whole_and_in_any_pieces(text, open_at_start, want):
    assert split_reasoning(text, open_at_start) == want
    for seed in range(100):  # streamed in random pieces, the deltas add up to the same split
        rnd, s, cuts = random.Random(seed), ReasoningSplitter(open_at_start), [0]
        while cuts[-1] < len(text):
            cuts.append(min(len(text), cuts[-1] + rnd.randint(1, 4)))
        parts = [s.feed(text[a:b]) for a, b in zip(cuts, cuts[1:])] + [s.flush()]
        assert ("".join(r for r, _ in parts), "".join(c for _, c in parts)) == want, seed


def test_which_templates_think():
    assert thinks(TEMPLATE) and not thinks("{{ messages[0].content }}")
    assert opens_thinking("x<|Assistant|><think>\n") and not opens_thinking("x<think>\n\n</think>\n\n")


def test_pi_run_cnv_passes_template_kwargs(thinking_gguf):
    def run(*extra, stdin="Hello\n"):
        return subprocess.run([sys.executable, "-m", "powerinfer.runtime.cli", "-m", str(thinking_gguf), "-cnv",
                               "-n", "4", "--temp", "0", *extra], input=stdin, capture_output=True, text=True,
                              timeout=120)

    r = run("--chat-template-kwargs", '{"refuse": true}')
    assert r.returncode == 0 and "refused the conversation at template line 1: refused by request" in r.stderr
    assert "0 turns" in r.stderr
    r = run("--chat-template-kwargs", '{"refuse": false}')
    assert r.returncode == 0 and "refused" not in r.stderr and "1 turn" in r.stderr
    for bad, needle in [('{"enable_thinking": 0}', "--chat-template-kwargs.enable_thinking: must be true or false"),
                        ("{oops", "--chat-template-kwargs: not a JSON object")]:
        r = run("--chat-template-kwargs", bad)
        assert r.returncode == 1 and needle in r.stderr and r.stderr.strip().count("\n") == 0, r.stderr
    r = subprocess.run([sys.executable, "-m", "powerinfer.runtime.cli", "-m", str(thinking_gguf), "-p", "x",
                        "--chat-template-kwargs", "{}"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "for chat mode (-cnv)" in r.stderr


@pytest.mark.parametrize("bad, needle", [('{"enable_thinking": "yes"}', "--chat-template-kwargs.enable_thinking"),
                                         ("[]", "--chat-template-kwargs: must be a JSON object")])
def test_pi_server_refuses_bad_template_kwargs_before_loading(thinking_gguf, bad, needle):
    r = subprocess.run([sys.executable, "-m", "powerinfer.server.cli", "-m", str(thinking_gguf), "--port", "0",
                        "--chat-template-kwargs", bad], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and needle in r.stderr and r.stderr.strip().count("\n") == 0, r.stderr


def test_a_broken_template_is_named_before_the_model_loads(tmp_path_factory, stories_hf):
    path = _gguf_with_template(tmp_path_factory, stories_hf, "{% for m in messages %}\n{{ m.content }\n{% endfor %}",
                               "broken")
    for cmd in (["powerinfer.runtime.cli", "-m", str(path), "-cnv"],
                ["powerinfer.server.cli", "-m", str(path), "--port", "0"]):
        r = subprocess.run([sys.executable, "-m", *cmd], input="Hi\n", capture_output=True, text=True, timeout=120)
        assert r.returncode == 1 and r.stderr.strip().count("\n") == 0, r.stderr
        assert f"{path}: tokenizer.chat_template: not a valid Jinja template (line 2: " in r.stderr, r.stderr
    # plain completion does not need the template
    r = subprocess.run([sys.executable, "-m", "powerinfer.runtime.cli", "-m", str(path), "-p", "Once", "-n", "2"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_apply_template_returns_the_rendered_prompt(client):
    past = MSGS + [{"role": "assistant", "content": "Yes.", "reasoning_content": "a dog story"}]
    off = {"enable_thinking": False}
    for body, kw, gen in [({}, {}, True), ({"chat_template_kwargs": off}, off, True),
                          ({"add_generation_prompt": False}, {}, False)]:
        r = client.post("/apply-template", json={"messages": past, **body})
        assert r.status_code == 200
        assert r.json() == {"prompt": client.template.render(past, add_generation_prompt=gen, kwargs=kw)}
    assert client.post("/apply-template", json={"messages": past}).json()["prompt"] == (
        "<s>user: Tell me a story.\nassistant: <think>a dog story</think>Yes.\nassistant: <think>\n")
    r = client.post("/apply-template", json={"messages": MSGS, "chat_template_kwargs": {"refuse": True}})
    assert r.status_code == 400 and "refused by request" in r.json()["error"]["message"]
