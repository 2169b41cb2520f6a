"""The HTTP API: OpenAI's ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, llama.cpp's
``/completion``, ``/apply-template`` and ``/health``, on FastAPI. A chat is rendered with the model's
template and the request's ``chat_template_kwargs`` (over ``--chat-template-kwargs``); a thinking
model's ``<think>`` text comes back as ``reasoning_content`` unless ``reasoning_format`` is ``none``.

``GET /openapi.json`` describes every route and request body (OpenAPI 3.1). Errors use OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``: 400 for a
malformed body (bad JSON, a wrong type or range, a prompt or ``max_tokens`` that does not
fit the context), 401 for a missing or wrong API key, 404 for an unknown model name, 413
for a body over ``max_body_bytes``, 503 when the queue is full. Streaming responses are
server-sent events (``data: {...}`` lines, then ``data: [DONE]``); a client that goes away
cancels its request at the next token.
"""
from __future__ import annotations

import asyncio
import functools
import json
import logging
import secrets
import time
import uuid
from pathlib import Path
from typing import Any, AsyncIterator

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import PowerInferError
from ..runtime.chat import REASONING_KEYS, ChatTemplate, chat_prompt_ids, check_template_kwargs
from ..runtime.generate import SamplerSettings
from ..runtime.reasoning import ReasoningSplitter, opens_thinking, thinks
from .engine import Job, QueueFull, Result
from .scheduler import Scheduler
from .protocol import (ApplyTemplateRequest, ChatRequest, CompletionRequest, DetokenizeRequest,
                       NativeCompletionRequest, TokenizeRequest)

POLL_S = 0.25  # how often a waiting handler checks that its client is still there


class HTTPError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


def _error_response(e: HTTPError) -> JSONResponse:
    return JSONResponse({"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.code}},
                        status_code=e.status)


class ServerState:
    """What the handlers share: the engine, the model's name and limits, the chat template and how
    a thinking model's reasoning is returned (``reasoning_format``, see :mod:`~powerinfer.runtime.reasoning`)."""

    def __init__(self, engine: Scheduler, model_path: str, alias: str | None, api_key: str | None,
                 max_body_bytes: int, template: ChatTemplate, metrics: bool = False, reasoning_format: str = "auto"):
        self.engine, self.tok, self.model = engine, engine.tok, engine.model
        self.metrics = metrics  # GET /metrics enabled (--metrics)
        self.model_path = str(model_path)
        self.model_id = alias or Path(model_path).name
        self.names = {self.model_id, Path(model_path).name, Path(model_path).stem, str(model_path)}
        self.api_key, self.max_body_bytes, self.template = api_key, max_body_bytes, template
        self.created = int(time.time())
        self.reasoning_format = reasoning_format


BODIES = {"CompletionRequest": CompletionRequest, "ChatRequest": ChatRequest,
          "NativeCompletionRequest": NativeCompletionRequest, "TokenizeRequest": TokenizeRequest,
          "DetokenizeRequest": DetokenizeRequest, "ApplyTemplateRequest": ApplyTemplateRequest}


def _body(name: str) -> dict:
    """The OpenAPI ``requestBody`` of a route whose handler validates ``BODIES[name]`` itself."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{name}"}}}}}


def openapi_schema(app: FastAPI) -> dict:
    """The app's OpenAPI 3.1 document (``GET /openapi.json``), with the request bodies the handlers
    validate with pydantic (:mod:`.protocol`) as components, so a schema-driven client (or fuzzer)
    knows every field, type and range."""
    if app.openapi_schema is None:
        from fastapi.openapi.utils import get_openapi
        from pydantic.json_schema import models_json_schema

        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        _, defs = models_json_schema([(m, "validation") for m in BODIES.values()],
                                     ref_template="#/components/schemas/{model}")
        doc.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
        app.openapi_schema = doc
    return app.openapi_schema


def create_app(state: ServerState) -> FastAPI:
    from .. import __version__

    app = FastAPI(title="powerinfer", version=__version__, docs_url=None, redoc_url=None,
                  openapi_url="/openapi.json", redirect_slashes=False)
    app.openapi = lambda: openapi_schema(app)

    @app.exception_handler(StarletteHTTPException)
    async def _route_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        what = "no such endpoint" if e.status_code == 404 else str(e.detail)
        return _error_response(HTTPError(e.status_code, f"{request.method} {request.url.path}: {what}",
                                         "invalid_request_error" if e.status_code < 500 else "server_error"))

    @app.exception_handler(HTTPError)
    async def _http_error(request: Request, e: HTTPError) -> JSONResponse:
        return _error_response(e)

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception) -> JSONResponse:
        logging.getLogger("powerinfer.server").exception("request failed")
        return _error_response(HTTPError(500, f"internal error: {type(e).__name__}", "server_error"))

    @app.get("/health")
    async def health() -> dict:
        e = state.engine
        return {"status": "ok", "model": state.model_id, "requests_waiting": e.n_waiting,
                "requests_processing": e.n_processing, "requests_served": e.n_served,
                "requests_cancelled": e.n_cancelled}

    # every route but /health needs the API key when the server has one
    def auth(request: Request) -> None:
        _authorize(state, request)

    api = APIRouter(dependencies=[Depends(auth)])

    @api.get("/v1/models")
    async def models() -> dict:
        m = state.model
        return {"object": "list", "data": [{
            "id": state.model_id, "object": "model", "created": state.created, "owned_by": "powerinfer",
            "meta": {"n_ctx": m.n_ctx, "n_ctx_train": m.max_ctx, "n_vocab": state.tok.n_vocab,
                     "n_layer": m.args.n_layer, "n_embd": m.args.n_embd, "n_ff": m.args.n_ff,
                     "family": m.args.family.name, "sparse": not m.dense}}]}

    @api.post("/v1/completions", openapi_extra=_body("CompletionRequest"))
    async def completions(request: Request):
        req = await _parse(request, state, CompletionRequest)
        _check_model(state, req.model)
        ids = await asyncio.to_thread(_prompt_ids, state, req.prompt)
        return await _respond(request, state, req, ids, req.max_tokens, "completion")

    @api.post("/v1/chat/completions", openapi_extra=_body("ChatRequest"))
    async def chat_completions(request: Request):
        req = await _parse(request, state, ChatRequest)
        _check_model(state, req.model)
        text = _render_chat(state, req, add_generation_prompt=True)
        ids = await asyncio.to_thread(chat_prompt_ids, state.tok, text)
        limit = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        req.stop = list(req.stop) + [s for s in state.template.stop_strings if s not in req.stop]
        fmt = req.reasoning_format or state.reasoning_format
        split = None
        if fmt != "none" and thinks(state.template.source):
            split = functools.partial(ReasoningSplitter, opens_thinking(text))
        return await _respond(request, state, req, ids, limit, "chat", split)

    @api.post("/apply-template", openapi_extra=_body("ApplyTemplateRequest"))
    async def apply_template(request: Request) -> dict:
        """llama-server's ``POST /apply-template``: ``{"prompt": text}``, the conversation as the chat
        endpoint renders it (BOS text kept when the template writes it)."""
        req = await _parse(request, state, ApplyTemplateRequest)
        return {"prompt": _render_chat(state, req, req.add_generation_prompt)}

    @api.post("/completion", openapi_extra=_body("NativeCompletionRequest"))
    async def native_completion(request: Request):
        req = await _parse(request, state, NativeCompletionRequest)
        ids = await asyncio.to_thread(_prompt_ids, state, req.prompt)
        if req.penalty_last_n is not None:
            req.repeat_last_n = req.penalty_last_n
        return await _respond(request, state, req, ids, req.limit(), "native")

    @api.post("/tokenize", openapi_extra=_body("TokenizeRequest"))
    async def tokenize(request: Request) -> dict:
        req = await _parse(request, state, TokenizeRequest)
        ids = await asyncio.to_thread(state.tok.encode, req.content, req.add_special, req.parse_special)
        return {"tokens": ids}

    @api.post("/detokenize", openapi_extra=_body("DetokenizeRequest"))
    async def detokenize(request: Request) -> dict:
        req = await _parse(request, state, DetokenizeRequest)
        return {"content": state.tok.decode(_check_ids(state, req.tokens, "tokens"))}

    @api.get("/props")
    async def props() -> dict:
        m = state.model
        return {"model_path": state.model_path, "total_slots": state.engine.n_slots,
                "chat_template": state.template.source,
                "default_generation_settings": {
                    "n_ctx": state.engine.n_ctx, "n_predict": -1, "sparse": not m.dense,
                    **{k: f.default for k, f in NativeCompletionRequest.model_fields.items()
                       if k in ("temperature", "top_k", "top_p", "min_p", "repeat_penalty", "repeat_last_n")}}}

    @api.get("/slots")
    async def slots() -> list:
        """Each slot's state (llama-server's ``GET /slots``): id, state, cached and prompt tokens, tokens decoded."""
        return state.engine.slots_info()

    @api.get("/metrics")
    async def metrics():
        """Prometheus text format (llama-server's ``GET /metrics``); 501 unless started with ``--metrics``."""
        if not state.metrics:
            raise HTTPError(501, "this server does not serve metrics: start it with --metrics", "not_supported_error")
        from .metrics import render

        body, content_type = render(state.engine)
        return Response(body, media_type=content_type)

    # llama.cpp's aliases: unversioned OpenAI routes and /v1/health
    api.add_api_route("/completions", completions, methods=["POST"], openapi_extra=_body("CompletionRequest"))
    api.add_api_route("/chat/completions", chat_completions, methods=["POST"], openapi_extra=_body("ChatRequest"))
    app.add_api_route("/v1/health", health, methods=["GET"])
    app.include_router(api)

    return app


def _authorize(state: ServerState, request: Request) -> None:
    """401 unless the request carries ``Authorization: Bearer <api key>`` (when the server has a key)."""
    if state.api_key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), state.api_key.encode()):
        raise HTTPError(401, "invalid or missing API key (send Authorization: Bearer <key>)",
                        "authentication_error", code="invalid_api_key")


async def _parse(request: Request, state: ServerState, model: type):
    """The body as ``model``: 413 when larger than allowed, 400 for bad JSON or values."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > state.max_body_bytes:
        raise HTTPError(413, f"the request body is {declared} bytes, more than {state.max_body_bytes}")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > state.max_body_bytes:
            raise HTTPError(413, f"the request body is more than {state.max_body_bytes} bytes")
    try:
        data = json.loads(body, parse_constant=_no_constant)
    except (UnicodeDecodeError, json.JSONDecodeError, ValueError) as e:
        raise HTTPError(400, f"the request body is not valid JSON ({e})") from None
    except RecursionError:
        raise HTTPError(400, "the request body is nested too deeply") from None
    if not isinstance(data, dict):
        raise HTTPError(400, "the request body must be a JSON object")
    try:
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise HTTPError(400, "the request body has an unpaired UTF-16 surrogate (\\ud800-\\udfff) in a string: "
                             "not valid Unicode text") from None
    try:
        req = model.model_validate_json(body)
    except ValidationError as e:
        err = e.errors()[0]
        where = _field_path(err["loc"])
        raise HTTPError(400, f"{where}: {err['msg']}", param=where) from None
    bad = req.unsupported()
    if bad is not None:
        raise HTTPError(400, f"{bad}: not supported by this server", param=bad)
    return req


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _field_path(loc) -> str:
    """``messages.0.content`` from pydantic's location, without the union-member tags it adds
    (``str``, ``list[int]``, ``function-after[...]``)."""
    parts = []
    for p in loc:
        if isinstance(p, int) or (isinstance(p, str) and p.isidentifier() and p not in _TYPE_TAGS):
            parts.append(str(p))
        else:
            break
    return ".".join(parts) or "body"


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _check_model(state: ServerState, name: str | None) -> None:
    if name is not None and name not in state.names:
        raise HTTPError(404, f"the model '{name}' does not exist here; this server has '{state.model_id}' "
                             f"(GET /v1/models)", param="model", code="model_not_found")


def _render_chat(state: ServerState, req, add_generation_prompt: bool) -> str:
    """The request's ``messages`` (``developer`` read as ``system``, a past reply's reasoning kept)
    rendered with the chat template and its ``chat_template_kwargs``; 400 for bad kwargs or a
    conversation the template refuses."""
    try:
        kwargs = check_template_kwargs(req.chat_template_kwargs, "chat_template_kwargs")
    except PowerInferError as e:
        raise HTTPError(400, str(e), param="chat_template_kwargs") from None
    messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.content,
                 **{k: v for k, v in (m.model_extra or {}).items() if k in REASONING_KEYS}}
                for m in req.messages]
    try:
        return state.template.render(messages, add_generation_prompt=add_generation_prompt, kwargs=kwargs)
    except PowerInferError as e:
        raise HTTPError(400, str(e), param="messages") from None


def _prompt_ids(state: ServerState, prompt: Any) -> list[int]:
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        if len(prompt) != 1:
            raise HTTPError(400, "prompt: one prompt per request (a list of several is not supported)", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        try:
            return state.tok.encode(prompt)
        except PowerInferError as e:
            raise HTTPError(400, f"prompt: {e}", param="prompt") from None
    return _check_ids(state, list(prompt), "prompt")


def _check_ids(state: ServerState, ids: list[int], field: str) -> list[int]:
    n = state.tok.n_vocab
    if any(not 0 <= t < n for t in ids):
        raise HTTPError(400, f"{field}: token ids must be in [0, {n})", param=field)
    return ids


def _job(request_loop: asyncio.AbstractEventLoop, state: ServerState, req, ids: list[int],
         max_tokens: int | None) -> Job:
    e = state.engine
    n_ctx = e.n_ctx
    where = f" (a slot's share of the {state.model.n_ctx}-token context across -np {e.n_slots})" if e.n_slots > 1 else ""
    if not ids:
        raise HTTPError(400, "prompt: empty (no tokens to start from)", param="prompt")
    if len(ids) >= n_ctx:
        raise HTTPError(400, f"prompt: {len(ids)} tokens do not fit the context of {n_ctx} tokens{where} "
                             f"(at least one must be left to generate)", param="prompt",
                        code="context_length_exceeded")
    if max_tokens is not None and len(ids) + max_tokens > n_ctx:
        raise HTTPError(400, f"max_tokens: {max_tokens} more tokens after a {len(ids)}-token prompt exceed the "
                             f"context of {n_ctx} tokens{where} (at most {n_ctx - len(ids)})", param="max_tokens",
                        code="context_length_exceeded")
    sampler = SamplerSettings(temp=req.temperature, top_k=req.top_k, top_p=req.top_p,
                              seed=-1 if req.seed is None else req.seed, repeat_penalty=req.repeat_penalty,
                              repeat_last_n=req.repeat_last_n, min_p=req.min_p)
    return Job(ids=ids, n_predict=-1 if max_tokens is None else max_tokens, sampler=sampler, stop=list(req.stop),
               ignore_eos=req.ignore_eos, loop=request_loop)


async def _events(request: Request, job: Job) -> AsyncIterator[tuple[str, Any]]:
    """The job's events, text that arrived together merged into one; sets ``job.cancel`` and stops
    when the client disconnects (checked every ``POLL_S`` while the job runs)."""
    loop = asyncio.get_running_loop()
    next_check = loop.time() + POLL_S
    try:
        while True:
            if loop.time() >= next_check:
                if await request.is_disconnected():
                    return
                next_check = loop.time() + POLL_S
            if not job.events:
                job.wake.clear()
                if not job.events:
                    try:
                        await asyncio.wait_for(job.wake.wait(), POLL_S)
                    except asyncio.TimeoutError:
                        pass
                    continue
            text: list[str] = []
            while job.events and job.events[0][0] == "text":
                text.append(job.events.popleft()[1])
            if text:
                yield "text", "".join(text)
                continue
            kind, value = job.events.popleft()
            yield kind, value
            if kind in ("done", "error"):
                return
    finally:
        job.cancel.set()  # no-op once done; stops the generation if the client left


def _usage(res: Result) -> dict:
    st = res.stats
    n_prompt = st.n_prompt + st.n_reused
    return {"prompt_tokens": n_prompt, "completion_tokens": st.n_gen, "total_tokens": n_prompt + st.n_gen}


def _timings(res: Result) -> dict:
    st = res.stats
    return {"prompt_n": st.n_prompt, "prompt_ms": st.t_prompt * 1e3, "cache_n": st.n_reused,
            "prompt_per_second": st.prompt_tps, "predicted_n": st.n_gen, "predicted_ms": st.t_gen * 1e3,
            "predicted_per_second": st.n_gen / st.t_gen if st.t_gen > 0 else None}


def _sse(obj: Any) -> bytes:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()


async def _respond(request: Request, state: ServerState, req, ids: list[int], max_tokens: int | None, kind: str,
                   split=None):
    """Submit the job and answer: one JSON body, or server-sent events when ``req.stream``. ``split``:
    for a chat of a thinking model, makes the :class:`ReasoningSplitter` that moves the reply's
    ``<think>`` text to ``reasoning_content``."""
    job = _job(asyncio.get_running_loop(), state, req, ids, max_tokens)
    try:
        state.engine.submit(job)
    except QueueFull as e:
        raise HTTPError(503, f"the server is busy: {e}; retry later", "server_error", code="queue_full") from None
    rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
    created = int(time.time())
    shape = _Shape(kind, rid, created, state.model_id)
    if req.stream:
        include_usage = bool(getattr(req, "stream_options", None) and req.stream_options.include_usage)
        return StreamingResponse(_stream(request, job, shape, include_usage, split() if split else None),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    parts: list[str] = []
    async for ev, value in _events(request, job):
        if ev == "text":
            parts.append(value)
        elif ev == "error":
            raise HTTPError(500, value, "server_error")
        elif ev == "done":
            text, reasoning = "".join(parts), None
            if split is not None:
                s = split()
                s.feed(text)
                s.flush()
                text, reasoning = s.content, s.reasoning
            return JSONResponse(shape.whole(text, value, reasoning))
    return JSONResponse({"error": {"message": "cancelled", "type": "server_error", "param": None, "code": None}},
                        status_code=499)


async def _stream(request: Request, job: Job, shape: "_Shape", include_usage: bool,
                  splitter: ReasoningSplitter | None = None) -> AsyncIterator[bytes]:
    def deltas(parts: tuple[str, str]):
        reasoning, content = parts
        if reasoning:
            yield _sse(shape.chunk({"reasoning_content": reasoning}, None))
        if content:
            yield _sse(shape.chunk(content, None))

    if shape.kind == "chat":
        yield _sse(shape.chunk({"role": "assistant", "content": ""}, None))
    async for ev, value in _events(request, job):
        if ev == "text":
            if splitter is None:
                yield _sse(shape.chunk(value, None))
            else:
                for b in deltas(splitter.feed(value)):
                    yield b
        elif ev == "error":
            yield _sse({"error": {"message": value, "type": "server_error", "param": None, "code": None}})
            return
        elif ev == "done":
            if splitter is not None:
                for b in deltas(splitter.flush()):
                    yield b
            yield _sse(shape.final(value))
            if include_usage and shape.kind != "native":
                yield _sse(shape.usage_chunk(value))
            if shape.kind != "native":
                yield b"data: [DONE]\n\n"
            return


class _Shape:
    """The JSON shapes of one endpoint's responses (OpenAI completion, chat, or llama.cpp native)."""

    def __init__(self, kind: str, rid: str, created: int, model: str):
        self.kind, self.rid, self.created, self.model = kind, rid, created, model

    def _head(self, obj: str) -> dict:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model}

    def chunk(self, delta, finish: str | None) -> dict:
        if self.kind == "native":
            return {"content": delta, "stop": False}
        if self.kind == "chat":
            d = delta if isinstance(delta, dict) else {"content": delta}
            return {**self._head("chat.completion.chunk"),
                    "choices": [{"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}]}
        return {**self._head("text_completion"),
                "choices": [{"index": 0, "text": delta, "logprobs": None, "finish_reason": finish}]}

    def final(self, res: Result) -> dict:
        if self.kind == "native":
            return {**self._native(res), "content": ""}
        return self.chunk({} if self.kind == "chat" else "", res.finish_reason)

    def usage_chunk(self, res: Result) -> dict:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._head(obj), "choices": [], "usage": _usage(res)}

    def _native(self, res: Result) -> dict:
        return {"stop": True, "model": self.model, "tokens_predicted": res.stats.n_gen,
                "tokens_evaluated": res.stats.n_prompt + res.stats.n_reused, "tokens_cached": res.stats.n_reused,
                "stop_type": res.stop_type, "stopping_word": res.stopping_word, "timings": _timings(res)}

    def whole(self, text: str, res: Result, reasoning: str | None = None) -> dict:
        if self.kind == "native":
            return {**self._native(res), "content": text}
        if self.kind == "chat":
            message = {"role": "assistant", "content": text}
            if reasoning:
                message["reasoning_content"] = reasoning
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": res.finish_reason}
            return {**self._head("chat.completion"), "choices": [choice], "usage": _usage(res)}
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": res.finish_reason}
        return {**self._head("text_completion"), "choices": [choice], "usage": _usage(res)}
