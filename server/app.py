"""The FastAPI gateway: OpenAI routes, errors, auth, health and metrics."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from scheduler.global_scheduler import GlobalScheduler, NoWorkerAvailable, QueueFull
from scheduler.protocol import LogprobEntry
from server.engine_client import EngineClient, RequestError
from server.generation import ChoiceEvent, ChoiceSpec, merge_choices, run_choice
from server.metrics import Metrics
from server.openai_api import APIError, ChatCompletionRequest, CompletionRequest

log = logging.getLogger("splitserve.gateway")
VERSION = "0.1.0"
DISCONNECT_POLL_S = 0.2
MAX_BODY_BYTES = 32 * 2**20


@dataclass
class GatewayState:
    model_name: str
    tokenizer: object
    client: EngineClient
    scheduler: GlobalScheduler
    metrics: Metrics
    api_key: str | None = None
    max_model_len: int | None = None  # cap from the CLI; workers' own limit also applies
    created: int = 0


def _error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def _usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class ApiKeyMiddleware:
    """Bearer-key check on /v1/*. A plain ASGI middleware: Starlette's BaseHTTPMiddleware
    would hide client disconnects from the routes, and disconnects must abort requests."""

    def __init__(self, app, state: GatewayState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send):
        key = self.state.api_key
        if key and scope["type"] == "http" and scope["path"].startswith("/v1/"):
            headers = dict(scope["headers"])
            given = headers.get(b"authorization", b"").decode("latin-1")
            if given != f"Bearer {key}":
                m = self.state.metrics
                m.errors.labels(m.model_name, "authentication_error").inc()
                msg = "missing API key" if not given else "incorrect API key provided"
                resp = _error_response(APIError(401, msg, "authentication_error",
                                                code="invalid_api_key"))
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(state: GatewayState, lifespan=None) -> FastAPI:
    app = FastAPI(title="splitserve", version=VERSION, lifespan=lifespan)
    app.state.gw = state
    tok = state.tokenizer
    metrics = state.metrics

    def token_text(tid: int) -> str:
        return tok.decode([tid])

    # ---------- errors ----------
    @app.exception_handler(APIError)
    async def _api_error(_req, e: APIError):
        metrics.errors.labels(metrics.model_name, e.type).inc()
        return _error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _validation(_req, e: RequestValidationError):
        return _error_response(APIError(400, str(e)))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_req, e: StarletteHTTPException):
        t = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return _error_response(APIError(e.status_code, str(e.detail), t))

    @app.exception_handler(Exception)
    async def _internal(_req, e: Exception):
        log.exception("unhandled error")
        metrics.errors.labels(metrics.model_name, "internal_error").inc()
        return _error_response(APIError(500, f"internal error: {e}", "internal_error"))

    app.add_middleware(ApiKeyMiddleware, state=state)

    # ---------- helpers ----------
    async def parse(request: Request, model_cls):
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > MAX_BODY_BYTES:
            raise APIError(413, f"request body of {size} bytes is over the {MAX_BODY_BYTES} "
                           "byte limit")
        try:
            raw = await request.body()
            if len(raw) > MAX_BODY_BYTES:
                raise APIError(413, f"request body is over the {MAX_BODY_BYTES} byte limit")
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"malformed JSON body: {e}") from e
        if not isinstance(data, dict):
            raise APIError(400, "the request body must be a JSON object")
        try:
            req = model_cls.model_validate(data)
        except ValidationError as e:
            err = e.errors()[0]
            param = ".".join(str(x) for x in err["loc"]) or None
            raise APIError(400, f"{param}: {err['msg']}", param=param) from e
        if req.model is not None and req.model != state.model_name:
            raise APIError(404, f"the model '{req.model}' does not exist; this server serves "
                           f"'{state.model_name}'", "not_found_error", param="model",
                           code="model_not_found")
        req.check_unsupported()
        return req

    def context_limit() -> int:
        limit = state.scheduler.max_model_len
        if limit is None:
            raise APIError(503, "no worker is available to serve requests",
                           "service_unavailable")
        return min(limit, state.max_model_len or limit)

    def check_length(n_prompt: int, max_tokens: int | None, limit: int, what: str) -> int:
        """The max_tokens to use; 400 naming both numbers when it does not fit."""
        if max_tokens is None:
            max_tokens = limit - n_prompt
        if n_prompt + max_tokens > limit or max_tokens < 1:
            raise APIError(
                400, f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {n_prompt + max(max_tokens, 1)} tokens ({n_prompt} in the {what}, "
                f"{max(max_tokens, 1)} in the completion). Please reduce the length of the "
                f"{what} or of max_tokens.", param="max_tokens", code="context_length_exceeded")
        return max_tokens

    def admit(n: int) -> None:
        try:
            state.scheduler.admit(n)
        except NoWorkerAvailable as e:
            raise APIError(503, str(e), "service_unavailable") from e
        except QueueFull as e:
            raise APIError(429, str(e), "rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(e.retry_after_s)}) from e

    def specs_for(prompts: list[list[int]], req, max_tokens_list: list[int],
                  logprobs: int | None) -> list[ChoiceSpec]:
        base = uuid.uuid4().hex
        specs = []
        for pi, (prompt, mt) in enumerate(zip(prompts, max_tokens_list)):
            for j in range(req.n):
                params = req.sampling_params(mt, logprobs, choice=j)
                try:
                    params.validate()
                except ValueError as e:
                    raise APIError(400, str(e), param=getattr(e, "param", None)) from e
                idx = pi * req.n + j
                specs.append(ChoiceSpec(idx, f"{base}-{idx}", prompt, params))
        return specs

    async def collect(request: Request, gen) -> list[ChoiceEvent]:
        """Gather a non-streamed answer; abort it if the client disconnects meanwhile."""
        async def consume():
            return [ev async for ev in gen]

        task = asyncio.create_task(consume())
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
                if done:
                    return task.result()
                if await request.is_disconnected():
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await task
                    with contextlib.suppress(Exception):
                        await gen.aclose()
                    raise APIError(499, "client disconnected", "client_closed_request")
        except RequestError as e:
            raise APIError(e.status, e.message, e.type) from e

    async def collect_choices(request: Request, gen, specs) -> list[ChoiceEvent]:
        """One merged event per choice: all its text and logprobs, its finish reason."""
        events = await collect(request, gen)
        out = []
        for spec in specs:
            evs = [e for e in events if e.index == spec.index]
            out.append(ChoiceEvent(
                spec.index, "".join(e.text for e in evs), [t for e in evs for t in e.token_ids],
                [x for e in evs for x in (e.logprobs or [])], evs[-1].finish_reason,
                evs[-1].num_prompt_tokens, evs[-1].num_output_tokens))
        return out

    def streaming_response(gen, chunks, usage, req) -> StreamingResponse:
        inc = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(sse_stream(gen, chunks, usage, inc),
                                 media_type="text/event-stream")

    def start_generation(specs, stops, skip_special):
        return merge_choices([run_choice(state.client, tok, s, stops, skip_special)
                              for s in specs])

    async def sse_stream(gen, make_chunks, usage_chunk, include_usage):
        try:
            async for ev in gen:
                for chunk in make_chunks(ev):
                    yield _sse(chunk)
            if include_usage:
                yield _sse(usage_chunk())
        except RequestError as e:
            yield _sse(APIError(e.status, e.message, e.type).body())
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - reported in-band, the stream then ends
            log.exception("error in stream")
            yield _sse(APIError(500, f"internal error: {e}", "internal_error").body())
        finally:
            await gen.aclose()
        yield "data: [DONE]\n\n"

    # ---------- logprobs formatting ----------
    def completion_logprobs(entries: list[LogprobEntry], offset: int) -> dict:
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for e in entries:
            t = token_text(e.token_id)
            out["tokens"].append(t)
            out["token_logprobs"].append(e.logprob)
            out["top_logprobs"].append({token_text(i): lp for i, lp in e.top})
            out["text_offset"].append(offset)
            offset += len(t)
        return out

    def chat_logprobs(entries: list[LogprobEntry]) -> dict:
        def item(tid, lp):
            t = token_text(tid)
            return {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))}
        return {"content": [{**item(e.token_id, e.logprob),
                             "top_logprobs": [item(i, lp) for i, lp in e.top]}
                            for e in entries]}

    # ---------- routes ----------
    @app.get("/health")
    async def health():
        workers = [{"worker": w.worker_id, "role": w.role, "pid": w.pid,
                    "running": w.stats.num_running, "waiting": w.stats.num_waiting,
                    "kv_blocks_used": w.stats.num_blocks_used,
                    "kv_blocks_reserved": w.stats.num_reserved_blocks,
                    "kv_blocks_total": w.num_blocks, "steps": w.stats.num_steps,
                    "kv_endpoint": w.kv_endpoint or None}
                   for w in state.scheduler.live_workers()]
        body = {"status": "ok" if workers else "no_workers", "workers": workers,
                "refused_workers": state.scheduler.refused}
        return JSONResponse(body, status_code=200 if workers else 503)

    @app.get("/version")
    async def version():
        return {"version": VERSION}

    @app.get("/metrics")
    async def prom():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": state.model_name, "object": "model", "created": state.created,
            "owned_by": "splitserve", "max_model_len": state.scheduler.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        req: CompletionRequest = await parse(request, CompletionRequest)
        p = req.prompt
        if isinstance(p, str):
            prompts = [tok(p)["input_ids"]]
        elif p and all(isinstance(x, int) for x in p):
            prompts = [list(p)]
        elif p and all(isinstance(x, str) for x in p):
            prompts = [tok(x)["input_ids"] for x in p]
        elif p and all(isinstance(x, list) for x in p):
            prompts = [list(x) for x in p]
        else:
            raise APIError(400, "prompt must be a non-empty string, list of strings, "
                           "list of token ids or list of token id lists", param="prompt")
        vocab = len(tok)
        for ids in prompts:
            if not ids:
                raise APIError(400, "prompt is empty", param="prompt")
            if any(not 0 <= t < vocab for t in ids):
                raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
        limit = context_limit()
        mts = [check_length(len(ids), req.max_tokens, limit, "prompt") for ids in prompts]
        admit(len(prompts) * req.n)
        specs = specs_for(prompts, req, mts, req.logprobs)
        gen = start_generation(specs, req.stop_list(), req.skip_special_tokens)
        cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        base = {"id": cid, "object": "text_completion", "created": created,
                "model": state.model_name}
        n_prompt = sum(len(x) for x in prompts)
        counts: dict[int, int] = {}
        offsets: dict[int, int] = {}

        if req.stream:
            def chunks(ev: ChoiceEvent):
                counts[ev.index] = ev.num_output_tokens
                lp = None
                if ev.logprobs is not None:
                    lp = completion_logprobs(ev.logprobs, offsets.get(ev.index, 0))
                offsets[ev.index] = offsets.get(ev.index, 0) + len(ev.text)
                return [{**base, "choices": [{"index": ev.index, "text": ev.text,
                                             "logprobs": lp,
                                             "finish_reason": ev.finish_reason}]}]

            def usage():
                return {**base, "choices": [], "usage": _usage(n_prompt, sum(counts.values()))}

            return streaming_response(gen, chunks, usage, req)

        choices = []
        for c in await collect_choices(request, gen, specs):
            choices.append({"index": c.index, "text": c.text,
                            "logprobs": completion_logprobs(c.logprobs, 0)
                            if req.logprobs is not None else None,
                            "finish_reason": c.finish_reason})
            counts[c.index] = c.num_output_tokens
        return {**base, "choices": choices, "usage": _usage(n_prompt, sum(counts.values()))}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        req: ChatCompletionRequest = await parse(request, ChatCompletionRequest)
        try:
            rendered = tok.apply_chat_template(req.template_messages(),
                                               add_generation_prompt=True, tokenize=True)
        except APIError:
            raise
        except Exception as e:
            raise APIError(400, f"messages could not be rendered with the chat template: {e}",
                           param="messages") from e
        prompt = list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
        limit = context_limit()
        mt = check_length(len(prompt), req.max_completion_tokens or req.max_tokens, limit,
                          "messages")
        admit(req.n)
        top = req.top_logprobs or 0
        specs = specs_for([prompt], req, [mt], top if req.logprobs else None)
        gen = start_generation(specs, req.stop_list(), req.skip_special_tokens)
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        base = {"id": cid, "object": "chat.completion", "created": created,
                "model": state.model_name}
        counts: dict[int, int] = {}

        if req.stream:
            chunk_base = {**base, "object": "chat.completion.chunk"}
            started: set[int] = set()

            def chunks(ev: ChoiceEvent):
                counts[ev.index] = ev.num_output_tokens
                out = []
                if ev.index not in started:
                    started.add(ev.index)
                    out.append({**chunk_base, "choices": [{
                        "index": ev.index, "delta": {"role": "assistant", "content": ""},
                        "logprobs": None, "finish_reason": None}]})
                if ev.text or ev.logprobs:
                    out.append({**chunk_base, "choices": [{
                        "index": ev.index, "delta": {"content": ev.text},
                        "logprobs": chat_logprobs(ev.logprobs) if ev.logprobs else None,
                        "finish_reason": None}]})
                if ev.finish_reason is not None:
                    out.append({**chunk_base, "choices": [{
                        "index": ev.index, "delta": {}, "logprobs": None,
                        "finish_reason": ev.finish_reason}]})
                return out

            def usage():
                return {**chunk_base, "choices": [],
                        "usage": _usage(len(prompt), sum(counts.values()))}

            return streaming_response(gen, chunks, usage, req)

        choices = []
        for c in await collect_choices(request, gen, specs):
            choices.append({
                "index": c.index, "message": {"role": "assistant", "content": c.text},
                "logprobs": chat_logprobs(c.logprobs) if req.logprobs else None,
                "finish_reason": c.finish_reason})
            counts[c.index] = c.num_output_tokens
        return {**base, "choices": choices, "usage": _usage(len(prompt), sum(counts.values()))}

    return app

