"""The OpenAI-compatible HTTP API (FastAPI): routes, authentication, responses and server-sent events.

Routes: ``POST /v1/chat/completions`` and ``POST /v1/completions`` (streaming or not; ``suffix``:
fill-in-the-middle), llama.cpp's ``POST /infill`` (fill-in-the-middle for code editors), ``GET /v1/models``
(and ``/v1/models/{id}``; the model object carries the context length as ``max_model_len`` and
``context_length``), ``GET /health`` (200 once the model is loaded, 503 before and while shutting down),
``GET /metrics`` (Prometheus, :mod:`speculant.serve.metrics`), ``GET /`` (the web page) and ``GET /static/...``
(its files, :mod:`speculant.serve.page`). With an API key, every ``/v1`` route and ``/infill`` need
``Authorization: Bearer KEY`` (401 otherwise); ``/health``, ``/metrics`` and the page's files stay open (``/metrics`` needs the key too with
``--metrics-need-key``). Without one, web pages cannot drive the server (:mod:`speculant.serve.guard`: a foreign
``Host`` is 421, a foreign ``Origin`` 403, ``--allow-origin`` opens CORS); a malformed ``Host`` is 400 either way.
Every response carries ``X-Content-Type-Options: nosniff``, the page ``GET /`` a Content-Security-Policy
(:func:`speculant.serve.guard.page_headers`).

Every error has OpenAI's body ``{"error": {"message", "type", "param", "code"}}``: 400 for a bad request
(:mod:`speculant.serve.protocol`), 401, 403 and 421 (:mod:`speculant.serve.guard`), 404 (unknown model or
route), 405, 413 (a body over ``--max-body-bytes``, :mod:`speculant.serve.limits`), 429 (queue full, at once,
with ``Retry-After``), 503 (model not loaded yet; or the server is shutting down, with ``Retry-After``:
:mod:`speculant.serve.shutdown`), 500 (a request that failed; the server goes on). A client's value quoted in a
message is cut to 80 characters. A client that disconnects cancels its generation at the next step, streaming or
not (a request still queued never starts); one that disconnects while still sending its body is a cancelled
request too (``speculant:requests_cancelled``, one debug line), not a failed one.

Chat with ``tools`` (:mod:`speculant.structured.tool_calls`): the template renders the tools, the reply is read
for tool calls (``message.tool_calls``, ``finish_reason: "tool_calls"``; streamed as ``delta.tool_calls``), and a
forced ``tool_choice`` or a ``response_format`` is a constraint the worker decodes under
(:func:`speculant.structured.compile_response_format`).

Responses carry OpenAI's fields plus ``speculant``: this response's speculative statistics (method, τ =
acceptance_length, target_calls, draft_tokens, accepted_tokens, accepted_per_position, decode_s).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ..core.types import SamplingParams
from .metrics import CONTENT_TYPE_LATEST, ServerMetrics
from .guard import BrowserGuard, page_headers
from .limits import BodyLimit, check_prompt_chars
from .logprobs import LogprobShape
from .page import PAGE, static_file
from .protocol import (APIError, GenerationRequest, clip, error_body, parse_body, parse_chat_request,
                       parse_completion_request, parse_infill_request)
from .settings import ServeSettings
from .shutdown import Drain
from .worker import ABORT, Job, QueueFull, Result, ShuttingDown, Worker

__all__ = ["create_app"]

log = logging.getLogger(__name__)

RETRY_AFTER_S = "1"
"""The ``Retry-After`` of a 429 (queue full) and of a 503 while shutting down: seconds; a queue slot frees when
any request ends, and a load balancer needs about that long to send the retry to another server."""


def create_app(settings: ServeSettings, load: str = "background", on_ready: Callable[[], None] | None = None,
               on_fatal: Callable[[str], None] | None = None) -> FastAPI:
    """The FastAPI app serving ``settings`` (checked by :func:`speculant.serve.settings.check_settings`).

    ``load``: ``"background"`` starts loading the model when the app starts and answers /health 503 until it is
    loaded (``speculant serve``: the server listens at once); ``"startup"`` loads it during the app's startup (a
    Ray Serve replica is ready only once its model is). ``on_ready()`` is called once the model is loaded,
    ``on_fatal(message)`` when loading fails. ``app.state.drain`` is the app's graceful shutdown
    (:class:`speculant.serve.shutdown.Drain`: ``speculant serve`` runs it on SIGTERM)."""
    metrics = ServerMetrics(settings.served_name)
    worker = Worker(settings, metrics)
    server = _Server(settings, worker, metrics, Drain(worker, settings.shutdown_grace), int(time.time()))
    app = FastAPI(title="speculant", lifespan=_lifespan(worker, load, on_ready, on_fatal), docs_url=None,
                  redoc_url=None, openapi_url=None)
    app.state.worker = worker
    app.state.metrics = metrics
    app.state.drain = server.drain
    _add_guards(app, settings)
    _add_error_handlers(app, metrics)
    _add_routes(app, server)
    return app


def _lifespan(worker: Worker, load: str, on_ready: Callable[[], None] | None,
              on_fatal: Callable[[str], None] | None) -> Callable[[FastAPI], contextlib.AbstractAsyncContextManager]:
    """The app's lifespan: start the worker and load the model (in the background, or before the app starts
    with ``load="startup"``, failing the startup when loading fails), and close the worker at the end."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if load == "startup":  # loaded on the worker's own thread, the one that decodes (see Worker.start)
            worker.start(load=True, on_ready=on_ready)
            await asyncio.to_thread(worker.load_ended.wait)
            if worker.load_error is not None:
                raise RuntimeError(f"loading the model failed: {worker.load_error}")
        else:
            worker.start(load=True, on_ready=on_ready, on_fatal=on_fatal)
        yield
        worker.close()

    return lifespan


def _add_guards(app: FastAPI, settings: ServeSettings) -> None:
    """The middleware every request passes: the browser guard (foreign pages first), then the body size limit."""
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)  # inside the guard: foreign pages first
    app.add_middleware(BrowserGuard, host=settings.host, api_key_set=settings.api_key is not None,
                       allow_origin=settings.allow_origin)


def _add_error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
    """Every error as OpenAI's error body: the API's own (:class:`APIError`), unknown routes and methods (404,
    405), malformed requests (400) and anything unexpected (500, counted as a failed request). A client that went
    away while sending its body is a cancelled request: nobody reads the 499."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers or None)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        message = str(exc.detail)
        if exc.status_code == 404:
            message = (f"no route {request.method} {clip(request.url.path)} (see /v1/chat/completions, "
                       "/v1/completions)")
        return JSONResponse(error_body(message, "invalid_request_error", None, kind), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        param = ".".join(str(p) for p in errors[0].get("loc", ())[1:]) if errors else None
        message = errors[0].get("msg", "invalid request") if errors else "invalid request"
        return JSONResponse(error_body(message, "invalid_request_error", param or None, "invalid_value"), 400)

    @app.exception_handler(ClientDisconnect)
    async def _client_gone(request: Request, exc: ClientDisconnect) -> Response:
        log.debug("client went away while sending its request (%s %s)", request.method, clip(request.url.path))
        metrics.cancelled.inc()
        return Response(status_code=499)  # nginx's "client closed request"

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error")
        metrics.failed.inc()
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}", "server_error", None, None), 500)


def _add_routes(app: FastAPI, server: _Server) -> None:
    """The routes: the playground page and its files, /health, /metrics, the model list and the completion routes."""

    security = page_headers(PAGE)

    @app.get("/")
    async def page() -> HTMLResponse:
        """The chat playground (speculant.serve.page): same origin, so the browser guard lets it call the API."""
        return HTMLResponse(PAGE, headers=security)

    @app.get("/static/{name:path}")
    async def static(name: str) -> Response:
        """The page's script, style and vendored renderer files (speculant.serve.page.STATIC); 404 otherwise."""
        found = static_file(name)
        if found is None:
            raise StarletteHTTPException(404)
        content, media_type = found
        return Response(content, media_type=media_type,
                        headers={"Cache-Control": "no-cache"})  # nosniff: the guard adds it

    @app.get("/health")
    async def health() -> Response:
        return server.health()

    @app.get("/metrics")
    async def prometheus(request: Request) -> Response:
        if server.settings.metrics_need_key:
            server.authorize(request)
        return Response(server.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def list_models(request: Request) -> JSONResponse:
        server.authorize(request)
        return JSONResponse({"object": "list", "data": [server.model_card()]})

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str, request: Request) -> JSONResponse:
        server.authorize(request)
        server.check_model(model)
        return JSONResponse(server.model_card())

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await server.complete(request, await server.read(request, "chat"))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await server.complete(request, await server.read(request, "completion"))

    @app.post("/infill")
    async def infill(request: Request) -> Response:
        """llama.cpp's fill-in-the-middle route (code editors' completion plugins)."""
        return await server.complete(request, await server.read(request, "infill"))


def _shutting_down() -> APIError:
    """The 503 of a request that comes while the server shuts down."""
    return APIError(503, "the server is shutting down: retry (on another server, or once this one is back)",
                    type="service_unavailable", code="server_shutting_down", headers={"Retry-After": RETRY_AFTER_S})


@dataclass(frozen=True)
class _Server:
    """What the routes share (the settings, the worker that decodes, the metrics, the graceful shutdown and the
    time the app was made) and the steps a request goes through: authorization, admission, the model's name,
    its tokens and their budget, then the job submitted and its response."""

    settings: ServeSettings
    worker: Worker
    metrics: ServerMetrics
    drain: Drain
    created: int

    # ------------------------------------------------------------------------------------------ checks

    def authorize(self, request: Request) -> None:
        """401 unless the request carries the API key (when the server has one)."""
        if self.settings.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        if not header:
            raise APIError(401, "no API key provided: send 'Authorization: Bearer KEY'", param=None,
                           code="invalid_api_key")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(),
                                                                 self.settings.api_key.encode()):
            raise APIError(401, "incorrect API key provided", param=None, code="invalid_api_key")

    def require_admitting(self) -> None:
        """503 once the graceful shutdown has begun."""
        if self.drain.draining:
            raise _shutting_down()

    def require_ready(self) -> None:
        """503 until the model is loaded (or when loading failed)."""
        if not self.worker.ready.is_set():
            message = (f"the model failed to load: {self.worker.load_error}" if self.worker.load_error
                       else "the model is loading; retry when GET /health answers 200")
            raise APIError(503, message, type="service_unavailable", code="model_not_ready")

    def check_model(self, model: str) -> None:
        """404 unless ``model`` is the served model's name."""
        if model != self.settings.served_name:
            raise APIError(404, f"the model '{clip(model)}' does not exist; this server serves "
                                f"'{self.settings.served_name}'",
                           param="model", code="model_not_found")

    # ------------------------------------------------------------------------------------------ answers

    def health(self) -> Response:
        """200 once the model is loaded; 503 while it loads, when loading failed and while shutting down."""
        name = self.settings.served_name
        if self.drain.draining:
            return JSONResponse({"status": "shutting_down", "model": name}, 503)
        if self.worker.ready.is_set():
            return JSONResponse({"status": "ok", "model": name})
        status = "failed" if self.worker.load_error else "loading"
        return JSONResponse({"status": status, "model": name, "error": self.worker.load_error}, 503)

    def model_card(self) -> dict:
        """OpenAI's model object plus the context length in tokens (None until the model is loaded) under the
        names clients read: ``max_model_len`` (vLLM) and ``context_length`` (OpenRouter, LiteLLM)."""
        ctx = self.worker.context_length
        return {"id": self.settings.served_name, "object": "model", "created": self.created,
                "owned_by": "speculant", "max_model_len": ctx, "context_length": ctx}

    # ------------------------------------------------------------------------------------------ a generation

    async def read(self, request: Request, kind: str) -> GenerationRequest:
        """The request of a completion route (``kind``: ``"chat"`` or ``"completion"``), parsed and checked in
        the order a client learns the most from: key, admission, body, model, readiness."""
        self.authorize(request)
        self.require_admitting()  # before reading the body: it would be for nothing
        body = parse_body(await request.body())
        if kind == "infill":
            req = parse_infill_request(body, self.settings.served_name)
        else:
            req = parse_chat_request(body) if kind == "chat" else parse_completion_request(body)
        self.check_model(req.model)
        self.require_ready()
        return req

    def image_prompt(self, req: GenerationRequest) -> tuple[list[int], Any]:
        """``(ids, prompt embeddings [1, T, H])`` of a chat with image parts, for a vision-language target (400
        otherwise)."""
        from ..models.vlm import vision_parts

        worker = self.worker
        if vision_parts(worker.target) is None:
            raise APIError(400, "this model reads text only: drop the image parts", param="messages",
                           code="unsupported_value")
        if worker.session.plan.kv_policy is not None:
            raise APIError(400, "this server evicts its KV cache (--kv-policy), which prefills from token ids: it "
                                "takes no image prompts", param="messages", code="unsupported_value")
        images = [p["data"] for m in req.messages if isinstance(m["content"], list) for p in m["content"]
                  if p["type"] == "image"]
        messages = [m if isinstance(m["content"], str) else
                    {"role": m["role"], "content": [p if p["type"] == "text" else {"type": "image"}
                                                    for p in m["content"]]} for m in req.messages]
        try:
            with worker.tokenizer_lock:
                ids, _, embeds = worker.session.encode_images(messages, images)
        except ValueError as exc:
            raise APIError(400, " ".join(str(exc).split()), param="messages") from None
        except Exception as exc:  # noqa: BLE001: the template's or the processor's own errors (e.g. role order)
            raise APIError(400, f"the processor rejected the messages: {' '.join(str(exc).split())}"[:500],
                           param="messages") from None
        return ids, embeds

    def prompt_ids(self, req: GenerationRequest) -> list[int]:
        """Token ids of the request, with 400s for what the model cannot take (a text too long to fit is refused
        before it is tokenised). Blocking: called in a thread (tokenising a long prompt takes seconds)."""
        from ..models.chat import chat_ids, has_chat_template
        from ..core.checks import vocab_size

        worker = self.worker
        check_prompt_chars(req, worker.context_length, worker.token_chars)
        if req.suffix is not None:
            return self.fim_prompt_ids(req)
        tok = worker.tokenizer
        with worker.tokenizer_lock:
            if req.kind == "chat":
                if not has_chat_template(tok):
                    raise APIError(400, "this model's tokenizer has no chat template: use /v1/completions",
                                   param="messages", code="no_chat_template")
                try:
                    ids = chat_ids(tok, req.messages, tools=req.tools if self.tool_format(req) else None)
                except APIError:
                    raise
                except Exception as exc:  # noqa: BLE001: the template's own errors (e.g. role order)
                    raise APIError(400, f"the chat template rejected the messages: {' '.join(str(exc).split())}",
                                   param="messages") from None
            elif isinstance(req.prompt, str):
                ids = list(tok(req.prompt)["input_ids"])
            else:
                ids = list(req.prompt)
                vocab = vocab_size(worker.target)
                bad = next((t for t in ids if not 0 <= t < vocab), None)
                if bad is not None:
                    raise APIError(400, f"token id {bad} in 'prompt' is outside the vocabulary [0, {vocab})",
                                   param="prompt")
        field = "messages" if req.kind == "chat" else "prompt"
        if not ids:
            raise APIError(400, f"'{field}' is empty after tokenization", param=field)
        return ids

    def tool_format(self, req: GenerationRequest):
        """The model's tool-call format (:class:`speculant.structured.tool_calls.ToolFormat`) when the request
        offers tools it may call (``tool_choice`` other than ``none``: with ``none`` the tools are not rendered),
        else None; 400 when the model's chat template has no tool format. Call with the tokenizer lock held."""
        from ..structured.tool_calls import tool_format

        if not req.tools or req.tool_choice == "none":
            return None
        try:
            return tool_format(self.worker.tokenizer)
        except ValueError as exc:
            raise APIError(400, f"'tools' cannot be used with this model: {exc}", param="tools",
                           code="tools_not_supported") from None

    def constraint(self, req: GenerationRequest) -> Any:
        """The compiled constraint of the request (``speculant.structured.CompiledFormat``: its ``response_format``,
        or the grammar its ``tool_choice`` forces), or None when the reply is free. 400 for a schema, pattern or
        grammar that does not compile. Blocking (compiling takes a while): called in a thread."""
        from ..structured.tool_calls import tool_constraint

        with self.worker.tokenizer_lock:
            fmt = self.tool_format(req)
        spec, param = req.response_format, "response_format"
        if fmt is not None:
            answer = None
            if spec is not None:
                if spec["type"] not in ("json_object", "json_schema"):
                    raise APIError(400, f"'response_format' of type {spec['type']} cannot be combined with tools "
                                        "(json_object and json_schema can)", param="response_format",
                                   code="unsupported_value")
                answer = ({"type": "object"} if spec["type"] == "json_object"
                          else spec["json_schema"].get("schema", {}))
            forced = tool_constraint(fmt, req.tools, req.tool_choice, req.parallel_tool_calls, answer)
            if forced is not None:
                spec, param = forced, "tools" if answer is None else "response_format"
        if spec is None:
            return None
        try:
            from ..structured import compile_response_format
        except ImportError:
            raise APIError(400, "constrained decoding (response_format, tool_choice 'required' or a named "
                                "function) is not available in this build", param=param,
                           code="unsupported_value") from None
        try:
            with self.worker.tokenizer_lock:
                return compile_response_format(spec, self.worker.tokenizer)
        except ValueError as exc:
            raise APIError(400, clip(f"'{param}' cannot be followed: {' '.join(str(exc).split())}", 500),
                           param=param, code="invalid_value") from None

    def fim_prompt_ids(self, req: GenerationRequest) -> list[int]:
        """Token ids of a fill-in-the-middle request (``/infill``, or ``/v1/completions`` with ``suffix``) in the
        model's own FIM tokens (:mod:`speculant.models.fim`): a 400 for a model without them, or for a text too long
        to fit. Blocking, as :meth:`prompt_ids`."""
        from ..models.fim import fim_ids

        worker, extra = self.worker, req.extra or []
        ctx = worker.context_length
        chars = len(req.prompt) + len(req.suffix) + sum(len(f["filename"]) + len(f["text"]) for f in extra)
        if ctx is not None and chars > ctx * worker.token_chars:
            raise APIError(400, f"this model's maximum context length is {ctx} tokens; the prefix, suffix and files "
                                f"have {chars} characters, more than {ctx} tokens of this tokenizer can hold",
                           param="prompt", code="context_length_exceeded")
        param = "input_prefix" if req.kind == "infill" else "suffix"
        caps = INFILL_TAKE if req.kind == "infill" else (None, None)  # llama.cpp's /infill keeps the text near the cursor
        with worker.tokenizer_lock:
            try:
                return fim_ids(worker.tokenizer, req.prompt, req.suffix, extra, max_prefix_tokens=caps[0],
                               max_suffix_tokens=caps[1])
            except ValueError as exc:
                raise APIError(400, " ".join(str(exc).split()), param=param, code="fim_not_supported") from None

    def fim_stops(self) -> list[int]:
        """The stop tokens of a fill-in-the-middle request: the model's FIM end tokens and its EOS."""
        from ..models.fim import fim_stop_ids

        with self.worker.tokenizer_lock:
            return fim_stop_ids(self.worker.tokenizer, self.worker.target)

    def max_tokens(self, req: GenerationRequest, n_prompt: int) -> int:
        """The tokens the request may generate after its ``n_prompt``-token prompt: its own limit, else what the
        context leaves (400 when the prompt or the limit does not fit)."""
        from ..core.checks import check_fits_context
        from ..core.engine import generate

        ctx = self.worker.context_length
        field = "messages" if req.kind == "chat" else "prompt"
        if ctx is not None and n_prompt >= ctx:
            raise APIError(400, f"this model's maximum context length is {ctx} tokens; the prompt has {n_prompt}",
                           param=field, code="context_length_exceeded")
        n = req.max_tokens
        if n is None:
            n = ctx - n_prompt if ctx is not None else _default_max_new_tokens(generate)
        elif ctx is not None and n_prompt + n > ctx:
            raise APIError(400, f"{req.max_tokens_param} = {clip(str(n), 40)} is more than the {ctx - n_prompt} "
                                f"tokens this model's context ({ctx}) leaves after the {n_prompt}-token prompt: "
                                f"lower {req.max_tokens_param}", param=req.max_tokens_param,
                           code="context_length_exceeded")
        try:
            check_fits_context(self.worker.target, n_prompt, n)
        except ValueError as exc:
            raise APIError(400, f"{exc}: lower {req.max_tokens_param}", param=req.max_tokens_param,
                           code="context_length_exceeded") from None
        return n

    def top_k(self, req: GenerationRequest) -> int | None:
        """The request's ``top_k`` for sampling: None (no filter) when it keeps the whole vocabulary, so any size a
        client sends (``2**70``) means what it says and never reaches torch."""
        from ..core.checks import vocab_size

        return req.top_k if req.top_k is None or req.top_k < vocab_size(self.worker.target) else None

    async def complete(self, request: Request, req: GenerationRequest) -> Response:
        """Tokenise the request (off the event loop), submit its job (429 when the queue is full) and answer: an
        event stream, or the whole response once it is done."""
        worker = self.worker
        # off the event loop: /health, /metrics and every stream go on while a long prompt is tokenised
        embeds = None
        if req.kind == "chat" and any(not isinstance(m["content"], str) for m in req.messages):
            if req.tools or req.response_format:
                raise APIError(400, "image prompts take no 'tools' or 'response_format'", param="messages",
                               code="unsupported_value")
            ids, embeds = await asyncio.wrap_future(worker.call(self.image_prompt, req))  # the vision tower: torch
        else:
            ids = await asyncio.to_thread(self.prompt_ids, req)
        tools = None
        constraint = None
        if req.kind == "chat" and (req.tools or req.response_format):
            constraint = await asyncio.to_thread(self.constraint, req)
            with worker.tokenizer_lock:
                fmt = self.tool_format(req)
            tools = (fmt, {t["function"]["name"] for t in req.tools}) if fmt is not None else None
        sampling = SamplingParams(temperature=req.temperature, top_k=self.top_k(req), top_p=req.top_p, seed=req.seed)
        job = Job(ids=ids, max_tokens=self.max_tokens(req, len(ids)), chat=req.kind == "chat", sampling=sampling,
                  stop=req.stop, ignore_eos=req.ignore_eos, logprobs=req.logprobs,
                  sources=req.sources and req.stream, speculation=req.speculation, prompt_embeds=embeds,
                  eos=self.fim_stops() if req.suffix is not None else None, constraint=constraint)
        try:
            worker.submit(job)
        except QueueFull as exc:
            raise APIError(429, f"{exc}: retry later", type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": RETRY_AFTER_S}) from None
        except ShuttingDown:  # the drain began while this request was tokenised
            raise _shutting_down() from None
        shape = _InfillShape(req, self.settings.served_name, job.eos) if req.kind == "infill" else _Shape(
            req, self.settings.served_name, tools)
        if req.stream:
            events = _infill_sse(worker, job, shape) if req.kind == "infill" else _sse(worker, job, shape)
            return StreamingResponse(events, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        response = await _collect(request, worker, job, shape)
        if response is None:  # aborted by the shutdown: no partial answer
            raise _shutting_down()
        return response


def _default_max_new_tokens(generate) -> int:
    import inspect

    return inspect.signature(generate).parameters["max_new_tokens"].default


class _Shape:
    """The OpenAI objects of one response: ids, chunks and the final body, for chat or completions."""

    def __init__(self, req: GenerationRequest, model: str, tools: tuple[Any, set[str]] | None = None) -> None:
        self.chat = req.kind == "chat"
        self.tools = tools  # (ToolFormat, the tools' names): the reply is read for tool calls
        self.forced = req.tool_choice not in ("none", "auto")  # a grammar makes the reply calls
        self.include_usage = req.include_usage
        self.token_ids = req.return_token_ids
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.model = model
        self.logprobs = LogprobShape(self.chat) if req.logprobs is not None else None  # None: "logprobs": null

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": None}

    @staticmethod
    def usage(result: Result) -> dict:
        """OpenAI's usage field; ``prompt_tokens_details.cached_tokens``: the prompt tokens reused from the prefix
        cache (their keys/values were not computed again)."""
        return {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens,
                "total_tokens": result.prompt_tokens + result.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": result.cached_tokens}}

    def body(self, text: str, result: Result, prompt_ids: list[int]) -> dict:
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            finish = result.finish_reason
            if self.tools is not None:
                from ..structured.tool_calls import parse_tool_calls

                parsed = parse_tool_calls(text, *self.tools)
                if parsed.tool_calls:
                    message = {"role": "assistant", "content": parsed.content, "tool_calls": parsed.tool_calls}
                    finish = "tool_calls" if finish == "stop" else finish
            choice = {"index": 0, "message": message, "logprobs": self.logprobs and self.logprobs(result.logprobs),
                      "finish_reason": finish}
            head = self._head("chat.completion")
        else:
            choice = {"index": 0, "text": text, "logprobs": self.logprobs and self.logprobs(result.logprobs),
                      "finish_reason": result.finish_reason}
            head = self._head("text_completion")
        out = {**head, "choices": [choice], "usage": self.usage(result), "speculant": result.stats}
        if self.token_ids:
            choice["token_ids"] = result.token_ids
            out["prompt_token_ids"] = prompt_ids
        return out

    def last_chunk(self, result: Result, prompt_ids: list[int], logprobs: list[dict] | None = None) -> dict:
        """The chunk with ``finish_reason`` and the ``speculant`` statistics (and the token ids if asked)."""
        out = self.chunk(None, finish=result.finish_reason, logprobs=logprobs)
        out["speculant"] = result.stats
        if self.token_ids:
            out["choices"][0]["token_ids"] = result.token_ids
            out["prompt_token_ids"] = prompt_ids
        return out

    def chunk(self, text: str | None = None, role: bool = False, finish: str | None = None,
              logprobs: list[dict] | None = None, tool_call: dict | None = None) -> dict:
        shaped = self.logprobs(logprobs or []) if self.logprobs is not None and not role else None
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
            if role and self.tools is not None:
                delta["content"] = None  # the reply may be calls only: no content yet
            if tool_call is not None:
                delta = {"tool_calls": [tool_call]}
            choice = {"index": 0, "delta": delta, "logprobs": shaped, "finish_reason": finish}
            head = self._head("chat.completion.chunk")
        else:
            choice = {"index": 0, "text": text or "", "logprobs": shaped, "finish_reason": finish}
            head = self._head("text_completion")
        out = {**head, "choices": [choice]}
        if self.include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, result: Result) -> dict:
        head = self._head("chat.completion.chunk" if self.chat else "text_completion")
        return {**head, "choices": [], "usage": self.usage(result)}


class _InfillShape:
    """llama.cpp's ``/infill`` (``/completion``) objects of one response: ``content``, ``stop``, ``stop_type``
    (``eos``, ``word``: a stop string, ``limit``), ``tokens_predicted``, ``tokens_evaluated``, ``tokens_cached`` (the
    prompt tokens reused from the prefix cache), ``timings`` (``cache_n`` reused and ``prompt_n`` computed prompt
    tokens, as llama.cpp counts them; the generation's time: a prompt joins a running batch, so no separate prompt
    time) and ``speculant``."""

    def __init__(self, req: GenerationRequest, model: str, eos: list[int] | None) -> None:
        self.model = model
        self.eos = frozenset(eos or ())
        self.params = {"n_predict": -1 if req.max_tokens is None else req.max_tokens,
                       "temperature": req.temperature, "top_k": req.top_k or 0, "top_p": req.top_p or 1.0,
                       "seed": -1 if req.seed is None else req.seed, "stop": req.stop, "stream": req.stream}

    def chunk(self, text: str) -> dict:
        return {"index": 0, "content": text, "stop": False}

    def body(self, text: str, result: Result, prompt_ids: list[int]) -> dict:
        n, s = result.completion_tokens, result.stats.get("decode_s", 0.0)
        ended_on_eos = bool(result.token_ids) and result.token_ids[-1] in self.eos
        stop_type = {"length": "limit", "stop": "eos" if ended_on_eos else "word"}.get(result.finish_reason, "none")
        cached = result.cached_tokens  # prompt tokens reused from the prefix cache, not computed again
        return {"index": 0, "content": text, "stop": True, "model": self.model, "stop_type": stop_type,
                "tokens_predicted": n, "tokens_evaluated": result.prompt_tokens, "tokens_cached": cached,
                "truncated": False, "has_new_line": "\n" in text, "generation_settings": self.params,
                "timings": {"cache_n": cached, "prompt_n": result.prompt_tokens - cached, "predicted_n": n,
                            "predicted_ms": round(1000 * s, 3),
                            "predicted_per_token_ms": round(1000 * s / n, 3) if n else None,
                            "predicted_per_second": round(n / s, 3) if n and s else None},
                "speculant": result.stats}


INFILL_TAKE = (1536, 510)
"""Tokens of an ``/infill`` request's prefix (its last) and suffix (its first) that enter the prompt: llama.cpp's
server keeps 3/4 of its default batch of 2,048 tokens for the prefix and the rest, less two FIM tokens, for the
suffix, so an editor plug-in that sends a large window gets the same prompt from both servers. ``/v1/completions``
with ``suffix`` keeps all of both (OpenAI's semantics)."""


def _event(obj: dict | str) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


async def _sse(worker: Worker, job: Job, shape: _Shape) -> AsyncIterator[bytes]:
    """The event stream of one job: a role chunk (chat), one chunk per step that committed text, a last chunk
    with ``finish_reason`` (and ``speculant``), the usage chunk if asked, then ``[DONE]``. Closed early (the
    client went away), it cancels the job."""
    done = False
    pending: list[dict] = []  # logprob entries not sent yet: they go with the next text chunk (or the last)
    sources = None  # the next text chunk's "speculant" annotation (speculant_sources)
    parser = None
    if shape.tools is not None:
        from ..structured.tool_calls import ToolCallParser

        # the text read for tool calls as it comes; a forced call's arguments go out as they come
        parser = ToolCallParser(*shape.tools, incremental=shape.forced)
    held = None  # the "speculant" counts of text the parser holds back (speculant_sources)
    try:
        if shape.chat:
            yield _event(shape.chunk(role=True))
        while True:
            kind, payload = await job.events.get()
            if kind == "logprobs":
                pending.extend(payload)
            elif kind == "sources":
                sources = payload
            elif kind == "text" and parser is not None:
                parts = parser.feed(payload)
                if sources is not None and parts != [("content", payload)]:
                    sources = {**sources, "sources": []}  # its spans are of the text as generated, not as sent
                if not parts:  # all held: its step's counts go with the next chunk
                    held = _add_steps(held, sources)
                    sources = None
                    continue
                sources = _add_steps(held, sources)
                held = None
                for chunk in _tool_chunks(shape, parts, pending, sources):
                    yield _event(chunk)
                    pending, sources = [], None
            elif kind == "text":
                chunk = shape.chunk(payload, logprobs=pending)
                if sources is not None:
                    chunk["speculant"] = sources
                yield _event(chunk)
                pending, sources = [], None
            elif kind == "done":
                done = True
                if parser is not None:
                    for chunk in _tool_chunks(shape, parser.finish(), pending, held):
                        yield _event(chunk)
                        pending = []
                    if parser.calls and payload.finish_reason == "stop":
                        payload = dataclasses.replace(payload, finish_reason="tool_calls")
                yield _event(shape.last_chunk(payload, job.ids, logprobs=pending))
                if shape.include_usage:
                    yield _event(shape.usage_chunk(payload))
                yield _event("[DONE]")
                return
            else:
                done = True
                yield _event(error_body(f"the generation failed: {payload}", "server_error"))
                yield _event("[DONE]")
                return
    finally:
        if not done:
            worker.cancel(job)


def _add_steps(a: dict | None, b: dict | None) -> dict | None:
    """Two chunks' ``speculant`` annotations (``speculant_sources``) as one: tokens and accepted summed, spans in
    order."""
    if a is None or b is None:
        return a if b is None else b
    return {"sources": a["sources"] + b["sources"], "tokens": a["tokens"] + b["tokens"],
            "accepted": a["accepted"] + b["accepted"]}


def _tool_chunks(shape: _Shape, parts: list[tuple[str, Any]], logprobs: list[dict],
                 sources: dict | None) -> list[dict]:
    """The chunks of what a :class:`~speculant.structured.tool_calls.ToolCallParser` made ready: content deltas and
    ``delta.tool_calls`` entries (each call whole: its ``index``, ``id``, ``type``, ``function.name`` and
    ``function.arguments``); the first carries the pending logprob entries and ``sources``."""
    out = []
    for kind, value in parts:
        chunk = (shape.chunk(value, logprobs=logprobs) if kind == "content"
                 else shape.chunk(logprobs=logprobs, tool_call=value))
        if sources is not None:
            chunk["speculant"] = sources
        out.append(chunk)
        logprobs, sources = [], None
    return out


async def _infill_sse(worker: Worker, job: Job, shape: _InfillShape) -> AsyncIterator[bytes]:
    """llama.cpp's event stream of one ``/infill`` job: ``{"content", "stop": false}`` per step that committed
    text, then the whole body with ``"stop": true`` and empty ``content`` (no ``[DONE]``, as llama.cpp). Closed
    early (the client went away), it cancels the job."""
    done = False
    try:
        while True:
            kind, payload = await job.events.get()
            if kind == "text":
                yield _event(shape.chunk(payload))
            elif kind == "done":
                done = True
                yield _event(shape.body("", payload, job.ids))
                return
            elif kind == "error":
                done = True
                yield _event(error_body(f"the generation failed: {payload}", "server_error"))
                return
    finally:
        if not done:
            worker.cancel(job)


async def _collect(request: Request, worker: Worker, job: Job, shape: _Shape | _InfillShape) -> Response | None:
    """The whole response of a non-streaming request (None: the server's shutdown aborted it). The client going
    away (ASGI ``http.disconnect``, seen at once: the disconnect is awaited beside the job's events, not polled
    between them, since a running job emits text every step) cancels the job: at its next step, or before it
    starts when it is still queued."""
    pieces: list[str] = []
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        while True:
            event = asyncio.ensure_future(job.events.get())
            await asyncio.wait({event, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not event.done():
                event.cancel()
                worker.cancel(job)
                return Response(status_code=499)  # nobody reads it: nginx's "client closed request"
            kind, payload = event.result()
            if kind == "text":
                pieces.append(payload)
            elif kind in ("logprobs", "sources"):
                continue  # the whole response's are in the result (sources: streams only)
            elif kind == "done":
                if payload.finish_reason == ABORT:
                    return None
                return JSONResponse(shape.body("".join(pieces), payload, job.ids))
            else:
                raise APIError(500, f"the generation failed: {payload}", type="server_error")
    except asyncio.CancelledError:
        worker.cancel(job)
        raise
    finally:
        gone.cancel()


async def _disconnected(request: Request) -> None:
    """Return once the client has gone away. The body was read already, so the next ASGI message is
    ``http.disconnect`` (uvicorn sends it when the connection closes, TestClient once the response is done)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
