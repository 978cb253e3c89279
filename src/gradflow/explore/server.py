"""The explorer's web server: a Starlette app over :class:`ExploreService`, served by uvicorn.

Routes: ``GET /`` (the page), ``GET /static/plotly.min.js`` (from the plotly wheel),
``GET /api/models``, ``POST /api/view`` (JSON request -> view JSON), ``GET /api/export`` (query
string -> PNG, PDF or CSV file). Every error is answered as ``{"error": "<one sentence>"}`` with a
4xx status (503 when busy); an unexpected failure is logged and answered as a sentence too, and
the server keeps serving.
"""

from __future__ import annotations

import json
import logging
import socket
import sys
from collections.abc import Callable

from gradflow.errors import ExploreError
from gradflow.explore.page import INSTALL_HINT, live_page, plotly_js_path
from gradflow.explore.service import EXPORT_FORMATS, ExploreService
from gradflow.explore.view import LOSSES

log = logging.getLogger("gradflow.explore")
MAX_BODY_BYTES = 16_384
"""The largest view request accepted; a longer one is answered 413 without being kept in memory."""
MAX_DRAIN_BYTES = 64 * 2**20
"""An over-long body up to this size is read and dropped so that the client gets to read its 413; a longer one
(declared or sent) is answered at once and its connection closed."""


def _starlette():
    try:
        import starlette  # noqa: F401
    except ModuleNotFoundError:
        raise ExploreError(f"gradflow explore needs starlette and uvicorn: {INSTALL_HINT}.") from None


def create_app(service: ExploreService):
    """The Starlette application answering the explorer page for ``service``."""
    _starlette()
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import FileResponse, HTMLResponse, JSONResponse, Response
    from starlette.routing import Route

    page = live_page(service.models(), LOSSES, service.config.max_tokens, service.config.max_chars,
                     service.examples())
    plotly_js = plotly_js_path()

    def guarded(handler: Callable) -> Callable:
        async def endpoint(request: Request) -> Response:
            try:
                return await handler(request)
            except ExploreError as err:
                return JSONResponse({"error": str(err)}, status_code=err.status)
            except Exception as err:  # the server must survive anything a request triggers
                log.exception("explorer request failed")
                return JSONResponse({"error": f"the explorer could not answer this request ({type(err).__name__}: "
                                              f"{err}); the server is still running."}, status_code=500)
        return endpoint

    async def index(request: Request) -> Response:
        return HTMLResponse(page)

    async def plotly(request: Request) -> Response:
        return FileResponse(plotly_js, media_type="application/javascript")

    async def models(request: Request) -> Response:
        return JSONResponse({"models": service.models(), "losses": LOSSES})

    async def view(request: Request) -> Response:
        body = await read_body(request)
        try:
            data = json.loads(body or b"null")
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ExploreError(f"the request is not valid JSON ({err.msg if hasattr(err, 'msg') else err}); send "
                               "an object such as {\"model\": ..., \"text\": ..., \"mask\": [3]}.") from None
        from starlette.concurrency import run_in_threadpool

        result = await run_in_threadpool(service.view, data)
        return JSONResponse(result.payload())

    async def export(request: Request) -> Response:
        q = request.query_params
        fmt = q.get("format", "png")
        data = {"model": q.get("model", service.models()[0]), "text": q.get("text"), "loss": q.get("loss", "mlm"),
                "seed": _int(q.get("seed", "0"), "seed"), "mask": _query_mask(q.get("mask", ""))}
        from starlette.concurrency import run_in_threadpool

        content = await run_in_threadpool(service.export, data, fmt)
        media = EXPORT_FORMATS[fmt]
        return Response(content, media_type=media,
                        headers={"Content-Disposition": f'attachment; filename="channel_view.{fmt}"'})

    routes = [Route("/", guarded(index)), Route("/static/plotly.min.js", guarded(plotly)),
              Route("/api/models", guarded(models)), Route("/api/view", guarded(view), methods=["POST"]),
              Route("/api/export", guarded(export))]

    async def not_found(request: Request, exc: Exception) -> Response:
        status = getattr(exc, "status_code", 404)
        if status == 405:
            return JSONResponse({"error": f"{request.method} is not allowed on {request.url.path}: send the view "
                                          "request as POST with a JSON body."}, status_code=405)
        return JSONResponse({"error": f"{request.url.path} is not part of the explorer; open / for the page."},
                            status_code=status)

    return Starlette(routes=routes, exception_handlers={404: not_found, 405: not_found})


async def read_body(request) -> bytes:
    """The body of a Starlette ``request``, streamed: at most :data:`MAX_BODY_BYTES` are kept, an
    :class:`ExploreError` (413) for a longer one once it has been drained (up to :data:`MAX_DRAIN_BYTES`)."""
    declared = request.headers.get("content-length", "")
    declared_size = int(declared) if declared.isdigit() else None
    kept, size, complete = bytearray(), 0, True
    if declared_size is None or declared_size <= MAX_DRAIN_BYTES:
        async for chunk in request.stream():
            size += len(chunk)
            if size <= MAX_BODY_BYTES:
                kept += chunk
            elif size > MAX_DRAIN_BYTES:
                complete = False
                break
    if declared_size is not None and declared_size > MAX_BODY_BYTES:
        size, complete = declared_size, True
    if size > MAX_BODY_BYTES:
        told = f"{size}" if complete else f"more than {MAX_DRAIN_BYTES}"
        raise ExploreError(f"the request has {told} bytes; at most {MAX_BODY_BYTES} are accepted.", 413)
    return bytes(kept)


def _int(value: str, name: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ExploreError(f"{name} must be a whole number, got {value!r}.") from None


def _query_mask(value: str) -> list[int] | str:
    if value == "random":
        return "random"
    return [_int(v, "each mask position") for v in value.split(",") if v.strip()]


def serve(service: ExploreService, host: str = "127.0.0.1", port: int = 8765) -> None:
    """Serve the explorer until interrupted (Ctrl-C)."""
    _starlette()
    import uvicorn

    app = create_app(service)
    sock = listening_socket(host, port)
    print(f"gradflow explore: http://{host}:{port}/  (models: {', '.join(service.models())}; Ctrl-C stops)",
          file=sys.stderr)
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port``; an :class:`ExploreError` saying what to do when that fails
    (port in use, address not on this machine)."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError as err:
        raise ExploreError(f"cannot listen on {host}:{port} ({err.strerror or err}): check --host.") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise ExploreError(f"cannot listen on {host}:{port} ({err.strerror or err}): pass another --port, or stop "
                           "the program that uses it.") from None
    return sock


__all__ = ["MAX_BODY_BYTES", "MAX_DRAIN_BYTES", "create_app", "listening_socket", "read_body", "serve"]
