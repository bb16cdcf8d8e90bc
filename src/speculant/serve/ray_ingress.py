"""The ingress of ``speculant serve --ray`` with prefix routing: one light Ray Serve deployment (no model) that
takes every HTTP request from Ray's proxy, renders its routing key
(:func:`speculant.serve.ray_routing.routing_key`) and forwards it to the model deployment, whose handle routes by
that key (Ray's prefix-aware request router), relaying the answer as it comes (streams stay streams).

Imported only when that deployment is built (it needs Ray Serve and FastAPI). No postponed annotations here:
FastAPI resolves the route's parameter types from this module's globals.
"""

from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve

from .ray_routing import RoutedRequest, routing_key

__all__ = ["PrefixRouterIngress"]

app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)


@serve.ingress(app)
class PrefixRouterIngress:
    """Forwards each request to a replica of ``model`` (a handle of the :class:`~speculant.serve.ray_routing
    .RoutedReplica` deployment); reads at most ``max_body_bytes + 1`` bytes of a body (the replica answers 413
    to a longer one)."""

    def __init__(self, model, max_body_bytes: int) -> None:
        self._model = model.options(stream=True)
        self._max_body = max_body_bytes

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"])
    async def forward(self, request: Request, path: str):
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > self._max_body:
                break
        scope = request.scope
        req = RoutedRequest(
            prompt=routing_key(bytes(body)) if request.method == "POST" else "", method=request.method,
            path="/" + path, query_string=scope.get("query_string", b""), headers=list(scope["headers"]),
            body=bytes(body), client=tuple(request.client) if request.client else None,
            scheme=request.url.scheme, server=scope.get("server"))
        # without a key (GET /health, /v1/models, a bad body) no positional argument: the router balances load
        stream = self._model.remote(req) if req.prompt else self._model.remote(req=req)
        try:
            head = await stream.__anext__()
        except Exception as exc:  # noqa: BLE001: no replica could take it (e.g. one died mid-request)
            stream.cancel()
            return JSONResponse({"error": {"message": f"no replica answered: {type(exc).__name__}",
                                           "type": "server_error", "param": None, "code": None}}, status_code=503)

        async def rest() -> AsyncIterator[bytes]:
            done = False
            try:
                async for chunk in stream:
                    yield chunk
                done = True
            finally:
                if not done:  # the client hung up: stop the replica's work on it
                    stream.cancel()

        response = StreamingResponse(rest(), status_code=head["status"])
        response.raw_headers = list(head["headers"])
        return response
