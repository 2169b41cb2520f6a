"""pi-server, started on a free port on 127.0.0.1 and called with the real ``openai`` client:
completion, chat, streaming, the same greedy text as pi-run (sparse and dense), 16 concurrent
streams, a client killed mid-stream, a full queue (503), Ctrl-C, seeds, stop strings, API keys, and 4xx errors."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai  # a test dependency (pyproject's test extra): missing, the tests fail rather than skip
import pytest
from click.testing import CliRunner

from powerinfer.convert.writer import convert
from powerinfer.runtime.cli import main as run_main

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def sparse_gguf(relu_sparse_gguf):
    return relu_sparse_gguf


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model, *args):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        # f32, not --dtype auto (bf16 on a CPU with AVX512_BF16): the tests compare texts token for
        # token across different evaluation splits (a prompt reused from a slot's cache has only its
        # last token evaluated, alone), and bf16 sums in another order round 1-2 ulps apart, which flips
        # this untrained model's near-tied choices; f32 keeps them ~1e-6 apart
        self.proc = subprocess.Popen([sys.executable, "-m", "powerinfer.server.cli", "-m", str(model), "--port",
                                      str(self.port), "-t", "1", "--log-level", "warning", "--dtype", "f32",
                                      *map(str, args)],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        deadline = time.time() + 90
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"pi-server exited: {self.proc.stdout.read()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        raise RuntimeError("pi-server did not start")

    def client(self, **kw):
        return openai.OpenAI(base_url=self.url + "/v1", api_key=kw.pop("api_key", "none"), max_retries=0, **kw)

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=5).json()

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture(scope="module")
def sparse_server(sparse_gguf):
    s = Server(sparse_gguf)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def dense_server(sparse_gguf):
    s = Server(sparse_gguf, "--dense", "--api-key", "sekrit")
    yield s
    s.stop()


def _pi_run_text(path, n, *extra) -> str:
    r = CliRunner().invoke(run_main, ["-m", str(path), "-p", PROMPT, "-n", str(n), "--temp", "0", "-t", "1",
                                   "--dtype", "f32", *extra])  # as the servers
    assert r.exit_code == 0, r.output
    assert r.stdout.startswith(PROMPT) and r.stdout.endswith("\n")
    return r.stdout[len(PROMPT):-1]


# ------------------------------------------------------------------ the same text as pi-run
@pytest.mark.parametrize("mode", ["sparse", "dense"])
def test_greedy_completion_equals_pi_run(sparse_gguf, sparse_server, dense_server, mode):
    server, extra, key = (sparse_server, (), "none") if mode == "sparse" else (dense_server, ("--dense",), "sekrit")
    want = _pi_run_text(sparse_gguf, 40, *extra)
    r = server.client(api_key=key).completions.create(model=sparse_gguf.name, prompt=PROMPT, max_tokens=40,
                                                      temperature=0)
    assert r.choices[0].text == want
    assert r.usage.completion_tokens <= 40 and r.usage.prompt_tokens == 5  # BOS + 4 pieces
    if r.usage.completion_tokens < 40:
        assert r.choices[0].finish_reason == "stop"  # the model ended its story
    else:
        assert r.choices[0].finish_reason == "length"


def test_streamed_completion_equals_the_whole_one(sparse_server):
    c = sparse_server.client()
    whole = c.completions.create(prompt=PROMPT, max_tokens=30, temperature=0, model="m.powerinfer.gguf",
                                 extra_body={"ignore_eos": True})
    chunks = list(c.completions.create(prompt=PROMPT, max_tokens=30, temperature=0, model="m.powerinfer.gguf",
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True}))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == whole.choices[0].text and len(text) > 0
    assert chunks[-1].usage.completion_tokens == 30 == whole.usage.completion_tokens
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"


def test_chat_and_streamed_chat(sparse_server):
    c = sparse_server.client()
    msgs = [{"role": "system", "content": "You tell stories."}, {"role": "user", "content": "Tell me about a dog."}]
    whole = c.chat.completions.create(model="m.powerinfer.gguf", messages=msgs, max_tokens=20, temperature=0,
                                      extra_body={"ignore_eos": True})
    msg = whole.choices[0].message
    assert msg.role == "assistant" and whole.object == "chat.completion"
    # the prompt is the ChatML rendering (the file has no template): 3 blocks of text plus BOS
    assert whole.usage.prompt_tokens > 20 and whole.usage.completion_tokens <= 20
    stream = c.chat.completions.create(model="m.powerinfer.gguf", messages=msgs, max_tokens=20, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == msg.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_seed_reproduces_text(sparse_server):
    c = sparse_server.client()

    def go(seed):
        return c.completions.create(model="m.powerinfer.gguf", prompt=PROMPT, max_tokens=40, temperature=1.0,
                                    top_p=1.0, seed=seed, extra_body={"top_k": 0, "ignore_eos": True}).choices[0].text

    a, b, other = go(7), go(7), go(8)
    assert a == b
    assert a != other


def test_stop_string_cuts_the_text(sparse_server):
    c = sparse_server.client()
    full = c.completions.create(model="m.powerinfer.gguf", prompt=PROMPT, max_tokens=40, temperature=0,
                                extra_body={"ignore_eos": True}).choices[0].text
    word = full.split()[3]
    r = c.completions.create(model="m.powerinfer.gguf", prompt=PROMPT, max_tokens=40, temperature=0, stop=[word],
                             extra_body={"ignore_eos": True})
    assert r.choices[0].text == full[:full.index(word)]
    assert r.choices[0].finish_reason == "stop"
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model="m.powerinfer.gguf", prompt=PROMPT, max_tokens=40, temperature=0, stop=[word], stream=True,
        extra_body={"ignore_eos": True}) if ch.choices)
    assert streamed == r.choices[0].text  # no part of the stop string leaks into the stream


# ------------------------------------------------------------------ concurrency and disconnects
def test_sixteen_concurrent_streams_all_complete(sparse_server):
    c = sparse_server.client(timeout=120)
    n_tok = 12
    results: dict[int, tuple[str, int]] = {}
    errors: list[BaseException] = []

    def client(i: int) -> None:
        try:
            chunks = list(c.completions.create(model="m.powerinfer.gguf", prompt=PROMPT, max_tokens=n_tok,
                                               temperature=0, stream=True, stream_options={"include_usage": True},
                                               extra_body={"ignore_eos": True}))
            results[i] = ("".join(ch.choices[0].text for ch in chunks if ch.choices), chunks[-1].usage.completion_tokens)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert not errors, errors
    assert len(results) == 16
    texts = {t for t, _ in results.values()}
    assert len(texts) == 1  # greedy: every client gets the same text
    assert all(n == n_tok for _, n in results.values())


def _assert_one_more_cancelled(server: Server, before: dict) -> None:
    deadline = time.time() + 20
    while time.time() < deadline:
        h = server.health()
        if h["requests_cancelled"] > before["requests_cancelled"] and not h["requests_processing"]:
            break
        time.sleep(0.1)
    assert h["requests_cancelled"] == before["requests_cancelled"] + 1, h
    assert h["requests_served"] == before["requests_served"]


def test_client_killed_mid_stream_is_cancelled_and_server_goes_on(sparse_server):
    before = sparse_server.health()
    body = {"model": "m.powerinfer.gguf", "prompt": PROMPT, "max_tokens": 500, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.Client(timeout=30) as h:
        with h.stream("POST", sparse_server.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]
            assert any(ln.startswith("data: ") for ln in got)
    # the connection is closed: the server stops generating for it at its next token
    _assert_one_more_cancelled(sparse_server, before)
    r = sparse_server.client().completions.create(model="m.powerinfer.gguf", prompt=PROMPT, max_tokens=5,
                                                  temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 5


# ------------------------------------------------------------------ errors
def test_bad_requests_get_4xx_json_and_the_server_keeps_serving(sparse_server):
    url = sparse_server.url
    cases = [
        (b"{not json", 400, "not valid JSON"),
        (b"[1, 2]", 400, "JSON object"),
        (json.dumps({"prompt": PROMPT, "temperature": -1}).encode(), 400, "temperature"),
        (json.dumps({"prompt": PROMPT, "top_p": 0}).encode(), 400, "top_p"),
        (json.dumps({"prompt": PROMPT, "n": 3}).encode(), 400, "n: not supported"),
        (json.dumps({"prompt": [10**9]}).encode(), 400, "token ids"),
        (json.dumps({"prompt": []}).encode(), 400, "prompt"),
        (b'{"prompt": "x", "temperature": NaN}', 400, "NaN is not JSON"),
        (b'{"prompt": "\\ud800 lone", "max_tokens": 2}', 400, "surrogate"),
        (json.dumps({"prompt": PROMPT, "max_tokens": "10"}).encode(), 400, "max_tokens"),
        (json.dumps({"prompt": PROMPT, "max_tokens": True}).encode(), 400, "max_tokens"),
        (json.dumps({"prompt": PROMPT, "max_tokens": 2.0}).encode(), 400, "max_tokens"),
        (json.dumps({"prompt": {"a": 1}}).encode(), 400, "prompt:"),
        (json.dumps({"prompt": "x" * (5 << 20)}).encode(), 413, "bytes"),
    ]
    for body, status, needle in cases:
        r = httpx.post(url + "/v1/completions", content=body, headers={"Content-Type": "application/json"}, timeout=30)
        assert r.status_code == status, (body[:40], r.text)
        assert needle in r.json()["error"]["message"], r.text
    c = sparse_server.client()
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        c.completions.create(model="gpt-4", prompt=PROMPT, max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="exceed the context"):
        c.completions.create(model="m.powerinfer.gguf", prompt=PROMPT, max_tokens=100_000)
    with pytest.raises(openai.BadRequestError, match="do not fit the context"):
        c.completions.create(model="m.powerinfer.gguf", prompt="the cat " * 600, max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="role"):
        c.chat.completions.create(model="m.powerinfer.gguf", messages=[{"role": "wizard", "content": "hi"}])
    for route, body in (("/completion", {"prompt": PROMPT, "grammar": "root ::= [a]"}),
                        ("/completion", {"prompt": PROMPT, "n_probs": 5}),
                        ("/completion", {"prompt": PROMPT, "mirostat": 2})):
        r = httpx.post(url + route, json=body, timeout=30)
        assert r.status_code == 400 and "not supported" in r.json()["error"]["message"], r.text
    r = httpx.get(url + "/v1/nothing-here")
    assert r.status_code == 404 and "no such endpoint" in r.json()["error"]["message"]
    r = httpx.get(url + "/v1/completions")
    assert r.status_code == 405 and "error" in r.json()
    assert sparse_server.proc.poll() is None
    assert c.completions.create(model="m.powerinfer.gguf", prompt=PROMPT, max_tokens=3, temperature=0,
                                extra_body={"ignore_eos": True}).usage.completion_tokens == 3


def test_api_key_is_required_when_set(dense_server):
    assert httpx.get(dense_server.url + "/health").status_code == 200  # health needs no key
    with pytest.raises(openai.AuthenticationError):
        dense_server.client(api_key="wrong").models.list()
    r = httpx.post(dense_server.url + "/v1/completions", json={"prompt": PROMPT})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    models = dense_server.client(api_key="sekrit").models.list().data
    assert [m.id for m in models] == ["m.powerinfer.gguf"]


def test_tokenize_detokenize_and_aliases(sparse_server):
    url = sparse_server.url
    ids = httpx.post(url + "/tokenize", json={"content": "Once upon a time"}).json()["tokens"]
    assert len(ids) == 4  # no BOS unless add_special
    assert httpx.post(url + "/tokenize", json={"content": "Hi", "add_special": True}).json()["tokens"][0] == 1
    assert httpx.post(url + "/detokenize", json={"tokens": ids}).json()["content"] == "Once upon a time"
    r = httpx.post(url + "/completion", json={"prompt": PROMPT, "max_tokens": 3, "temperature": 0,
                                             "ignore_eos": True}).json()  # max_tokens: n_predict's alias
    assert r["tokens_predicted"] == 3
    r = httpx.post(url + "/completions", json={"prompt": PROMPT, "max_tokens": 2, "temperature": 0,
                                              "ignore_eos": True}).json()
    assert r["usage"]["completion_tokens"] == 2
    assert httpx.get(url + "/props").json()["total_slots"] == 1


def test_native_completion_endpoint(sparse_gguf, sparse_server):
    want = _pi_run_text(sparse_gguf, 16)
    r = httpx.post(sparse_server.url + "/completion",
                   json={"prompt": PROMPT, "n_predict": 16, "temperature": 0}, timeout=30).json()
    assert r["content"] == want and r["stop"] is True
    assert r["tokens_predicted"] <= 16 and r["stop_type"] in ("eos", "limit")
    lines = []
    with httpx.stream("POST", sparse_server.url + "/completion",
                      json={"prompt": PROMPT, "n_predict": 16, "temperature": 0, "stream": True}, timeout=30) as s:
        lines = [json.loads(ln[6:]) for ln in s.iter_lines() if ln.startswith("data: ")]
    assert "".join(x["content"] for x in lines) == want and lines[-1]["stop"] is True


def test_server_refuses_a_busy_port_before_loading_the_model(tmp_path, sparse_server, sparse_gguf):
    # the file's header is checked first (a bad model is named, not the port), the model is not loaded
    r = subprocess.run([sys.executable, "-m", "powerinfer.server.cli", "-m", str(sparse_gguf), "--port",
                        str(sparse_server.port), "--log-level", "error"], capture_output=True, text=True, timeout=90)
    assert r.returncode == 1
    assert "cannot listen on" in r.stderr and "Traceback" not in r.stderr
    not_a_model = tmp_path / "missing.gguf"
    r = subprocess.run([sys.executable, "-m", "powerinfer.server.cli", "-m", str(not_a_model), "--port",
                        str(sparse_server.port), "--log-level", "error"], capture_output=True, text=True, timeout=90)
    assert r.returncode == 1 and f"{not_a_model}: file not found" in r.stderr and "listen" not in r.stderr


@pytest.fixture(scope="module")
def long_gguf(tmp_path_factory, relu_hf):
    """The demo weights with an 8192-token context (a server without -c takes 4096 of it, as
    llama.cpp's does): a 4000-token request cannot end on its own while a test waits for the
    server to report it running (on any machine); -np 2 -c 8192 gives two such slots."""
    d = tmp_path_factory.mktemp("long") / "m"
    shutil.copytree(relu_hf, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["max_position_embeddings"] = 8192
    (d / "config.json").write_text(json.dumps(cfg))
    return convert(d, d.parent / "long.gguf", outtype="f32", progress=False)


def _wait_for(server: Server, what, **want) -> dict:
    """Poll /health until its counters equal ``want`` (an event, not a sleep of a guessed length)."""
    deadline = time.time() + 60
    while time.time() < deadline:
        h = server.health()
        if all(h[k] == v for k, v in want.items()):
            return h
        time.sleep(0.02)
    raise AssertionError(f"the server never reported {what} ({want}): {h}")


def test_cancelled_client_full_queue_and_ctrl_c(long_gguf):
    """One server (--max-queue 2), in order: a non-streamed request whose client leaves while it
    runs is cancelled; with one request running and two queued a fourth gets 503 queue_full;
    Ctrl-C (to the server process) then ends the running and the queued streams at once."""
    s = Server(long_gguf, "--max-queue", 2)
    body = {"prompt": PROMPT, "max_tokens": 4000, "temperature": 0, "ignore_eos": True}
    try:
        # a non-streamed request: the client leaves once the server reports it running
        before = s.health()
        raw = json.dumps(body).encode()
        with socket.create_connection(("127.0.0.1", s.port)) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(raw), raw))
            _wait_for(s, "the request running", requests_processing=1, requests_waiting=0)
        _assert_one_more_cancelled(s, before)

        got: dict[int, list[str]] = {i: [] for i in range(3)}

        def client(i: int) -> None:
            with httpx.stream("POST", s.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
                got[i].extend(r.iter_lines())

        threads = [threading.Thread(target=client, args=(i,)) for i in range(3)]
        threads[0].start()
        _wait_for(s, "one request running", requests_processing=1, requests_waiting=0)
        threads[1].start()
        _wait_for(s, "one request queued", requests_processing=1, requests_waiting=1)
        threads[2].start()
        _wait_for(s, "two requests queued", requests_processing=1, requests_waiting=2)
        r = httpx.post(s.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "queue_full" and "--max-queue 2" in r.json()["error"]["message"]

        s.proc.send_signal(signal.SIGINT)
        rc = s.proc.wait(60)
        for t in threads:
            t.join(60)
        assert rc == 0
        for i in range(3):  # each stream ends with the shutdown error, the queued ones without any text
            assert any("shutting down" in ln for ln in got[i]), got[i][-3:]
        texts = [[ln for ln in got[i] if ln.startswith("data: ") and '"text"' in ln] for i in range(3)]
        assert 0 < len(texts[0]) < 4000 and texts[1] == texts[2] == []  # not the rest of three generations
        assert "Traceback" not in s.proc.stdout.read()
    finally:
        s.stop()
