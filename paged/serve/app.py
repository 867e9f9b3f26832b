"""The HTTP side: a Starlette app with OpenAI's endpoints over an `EngineLoop`.

Starlette rather than FastAPI: the request bodies are checked by `paged.serve.protocol`, in this
project's one-line errors naming the field, which FastAPI's pydantic models would answer with their
own 422 bodies instead of OpenAI's 400; what FastAPI adds on top of Starlette (validation, OpenAPI
pages) would go unused. Uvicorn serves it.

A client that goes away aborts its requests (their blocks are freed at once): a task per call
waits for the ASGI disconnect message while the engine works, so a client that leaves before its
first token is noticed too.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from paged.engine.runner import to_request
from paged.request import Request
from paged.serve.engine_loop import EngineLoop, Rejected, ServerClosed, Submission
from paged.serve.protocol import BadRequest, GenerateCall, Limits, parse_call
from paged.serve.responses import ResponseWriter, error_body
from paged.workload import WorkloadItem

PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


def build_app(engine_loop: EngineLoop, limits: Limits) -> Starlette:
    """The server's routes; `limits` says what the engine accepts and which model name it answers to."""
    tokenizer = engine_loop.tokenizer
    created = int(time.time())

    async def models(_: HTTPRequest) -> Response:
        card = {"id": limits.model_name, "object": "model", "created": created, "owned_by": "paged",
                "max_model_len": limits.max_model_len}
        return JSONResponse({"object": "list", "data": [card]})

    async def health(_: HTTPRequest) -> Response:
        if engine_loop.alive and engine_loop.accepting:
            return JSONResponse({"status": "ok"})
        return _error("the server is shutting down" if engine_loop.alive else "the engine failed", None, 503)

    async def metrics(_: HTTPRequest) -> Response:
        return PlainTextResponse(engine_loop.metrics.render(), media_type=PROMETHEUS_TEXT)

    async def completions(http: HTTPRequest) -> Response:
        return await _generate(http, chat=False)

    async def chat_completions(http: HTTPRequest) -> Response:
        return await _generate(http, chat=True)

    async def _generate(http: HTTPRequest, chat: bool) -> Response:
        try:
            body = json.loads(await http.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            return _error(f"the body is not valid JSON: {err}", None, 400)
        try:
            call = parse_call(body, chat=chat, limits=limits, tokenizer=tokenizer)
        except BadRequest as err:
            return _error(str(err), err.param, 400)
        writer = ResponseWriter(call, limits.model_name, tokenizer)
        try:
            submission = engine_loop.submit(_requests(writer.id, call), call.stream)
        except ServerClosed as err:
            return _error(str(err), None, 503)
        watcher = asyncio.create_task(_abort_on_disconnect(http, engine_loop, submission))
        try:
            await submission.admitted()
        except Rejected as err:
            watcher.cancel()
            return _error(str(err), "messages" if chat else "prompt", 400)
        except ServerClosed as err:
            watcher.cancel()
            return _error(str(err), None, 503)
        if call.stream:
            return StreamingResponse(_sse(engine_loop, submission, writer, watcher), media_type="text/event-stream")
        try:
            async for update in submission.updates():
                for delta in update.deltas:
                    writer.add(update.prompt_index, delta)
        except ServerClosed as err:
            return _error(str(err), None, 503)
        finally:
            watcher.cancel()
        return JSONResponse(writer.response())

    async def http_error(_: HTTPRequest, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return _error(exc.detail, None, exc.status_code)

    routes = [
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    ]
    return Starlette(routes=routes, exception_handlers={HTTPException: http_error})


def _requests(call_id: str, call: GenerateCall) -> list[Request]:
    """One engine request per prompt, made as `LLM.generate` makes them (its arrival is set on admission)."""
    requests = []
    for i, prompt in enumerate(call.prompts):
        request = to_request(WorkloadItem(f"{call_id}-{i}", prompt.token_ids, call.params, prompt=prompt.text))
        request.cache_salt = prompt.cache_salt
        requests.append(request)
    return requests


async def _sse(
    engine_loop: EngineLoop, submission: Submission, writer: ResponseWriter, watcher: asyncio.Task
) -> AsyncIterator[str]:
    """The streamed chunks as server-sent events, ending with `data: [DONE]`; a usage-only chunk
    before it only when asked (SGLang's client fails on a chunk without choices)."""
    done = False
    try:
        async for update in submission.updates():
            for delta in update.deltas:
                if (chunk := writer.chunk(update.prompt_index, delta)) is not None:
                    yield _event(chunk)
        done = True
        if writer.call.include_usage:
            yield _event(writer.usage_chunk())
    except ServerClosed as err:
        done = True
        yield _event(error_body(str(err), None, 503))
    finally:
        watcher.cancel()
        if not done:  # the response was cut short (the client left): its requests must not run on
            engine_loop.abort(submission)
    yield "data: [DONE]\n\n"


async def _abort_on_disconnect(http: HTTPRequest, engine_loop: EngineLoop, submission: Submission) -> None:
    while (await http.receive())["type"] != "http.disconnect":
        pass
    engine_loop.abort(submission)


def _event(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


def _error(message: str, param: str | None, status: int) -> JSONResponse:
    return JSONResponse(error_body(message, param, status), status_code=status)
