"""The OpenAI-compatible HTTP gateway: a FastAPI app that is one more NATS producer.

`build_app(settings)` makes the app; its lifespan connects to NATS, loads the tokenizer and
listens to admission and engine status. `orca serve` runs it as a Ray Serve deployment
(`start_on_ray_serve`); `python -m services.gateway` runs the same app under uvicorn.

Routes: POST /v1/completions, /v1/chat/completions (whole or SSE), GET /v1/models[/{id}],
GET /health, GET /metrics, GET /version, POST /tokenize, /detokenize, /v1/abort/{id}.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.metadata
import inspect
import logging
from collections import Counter
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse, PlainTextResponse, Response

from services.gateway import openai_types as t
from services.gateway.completions import create_chat_completion, create_completion
from services.gateway.engine_client import EngineClient
from services.gateway.errors import APIError, error_body
from services.gateway.metrics import render_metrics
from services.gateway.middleware import CountResponses, LimitBody, OpenRequests, RequireBearer
from services.gateway.state import GatewaySettings, GatewayState
from services.gateway.tracing import TraceRequests
from services.ports import PortReservation
from shared.telemetry import setup_tracing

log = logging.getLogger("orca.gateway")

ERRORS = {code: {"model": t.ErrorResponse} for code in (400, 401, 404, 413, 429, 503)}
# FastAPI >= 0.16x traces natively (a span per call, per dependency, per /metrics scrape); the HTTP span
# is TraceRequests' on every version, so turn the native one off where it exists.
NO_NATIVE_TELEMETRY = ({"telemetry": {"tracing": False, "metrics": False, "logs": False}}
                       if "telemetry" in inspect.signature(FastAPI.__init__).parameters else {})


def sse_schema(chunk: str) -> dict:
    """One server-sent event (when `stream` is true): `data: <chunk JSON>`, an error object if the
    generation fails mid-stream, and `data: [DONE]` last."""
    refs = [{"$ref": f"#/components/schemas/{name}"} for name in (chunk, "ErrorResponse")]
    data = {"anyOf": [{"const": "[DONE]"},
                      {"type": "string", "contentMediaType": "application/json", "contentSchema": {"anyOf": refs}}]}
    return {"text/event-stream": {"schema": {"type": "object", "required": ["data"], "properties": {"data": data}}}}


def build_app(settings: GatewaySettings) -> FastAPI:
    counts: Counter = Counter()
    app = FastAPI(title="orca-serve", version="0.1.0", lifespan=lifespan(settings, counts),
                  description="OpenAI-compatible HTTP API of orca-serve", **NO_NATIVE_TELEMETRY)
    app.add_exception_handler(APIError, lambda request, exc: exc.response())
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)
    add_routes(app)
    app.openapi = lambda: _openapi_without_422(app)
    app.add_middleware(LimitBody, limit=settings.max_body_bytes)
    app.add_middleware(RequireBearer, api_key=settings.api_key)
    app.state.open_requests = OpenRequests()
    app.add_middleware(CountResponses, counts=counts, open_requests=app.state.open_requests)
    if setup_tracing("gateway"):
        app.add_middleware(TraceRequests)
    if settings.allowed_origins:  # outermost: a browser's preflight (OPTIONS, no key) is answered before auth
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"])
    return app


def lifespan(settings: GatewaySettings, http_requests: Counter):
    @asynccontextmanager
    async def run(app: FastAPI):
        from engine.tokenizer import load_tokenizer
        from model.arch import load_arch_config, resolve_max_model_len
        from services.bus import connect_unless_stopped, drain_quietly, redact_url

        tokenizer = await asyncio.to_thread(load_tokenizer, settings.model, settings.chat_template,
                                           control_plane=True)
        if tokenizer is None:
            raise RuntimeError(f"{settings.model} has no tokenizer files")
        arch = load_arch_config(settings.model)
        stop, watch = _stop_event(app)
        try:
            nc = await connect_unless_stopped(settings.nats_url, "orca-gateway", stop)
        finally:
            if watch is not None:
                watch.cancel()
        if nc is None:  # a signal while NATS did not answer: start serving nothing, and stop at once
            log.info("gateway: stopped before NATS at %s answered", redact_url(settings.nats_url))
            yield
            return
        client = EngineClient(nc)
        await client.start()
        state = GatewayState(settings, client, tokenizer, arch.vocab_size,
                             resolve_max_model_len(settings.model, None), http_requests)
        app.state.gateway = state
        if not await client.wait_for_status(timeout_s=3.0):
            log.warning("gateway: no admission status yet on %s", redact_url(settings.nats_url))
        log.info("gateway: serving %s (model %s)", settings.model_name, settings.model)
        try:
            yield
        finally:
            await drain_quietly(nc)
    return run


def _stop_event(app: FastAPI) -> tuple[asyncio.Event, asyncio.Task | None]:
    """An event set once the server is stopping (`app.state.stopping()`, set by `python -m services.gateway`:
    uvicorn's exit flag, which a signal raises while the lifespan still waits for NATS), and the task that
    watches for it; never set under Ray Serve, which stops a replica itself."""
    stop, stopping = asyncio.Event(), getattr(app.state, "stopping", None)
    if stopping is None:
        return stop, None

    async def watch() -> None:
        while not stopping():
            await asyncio.sleep(0.1)
        stop.set()

    return stop, asyncio.get_running_loop().create_task(watch())


def _version() -> str:
    try:
        return importlib.metadata.version("orca-serve")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"


ORCA_VERSION = _version()


def state_of(request: Request) -> GatewayState:
    return request.app.state.gateway


def add_routes(app: FastAPI) -> None:
    @app.post("/v1/completions", response_model=t.CompletionResponse,
              responses={**ERRORS, 200: {"content": sse_schema("CompletionResponse")}})
    async def completions(body: t.CompletionRequest, request: Request) -> Response:
        return await create_completion(state_of(request), body, request)

    @app.post("/v1/chat/completions", response_model=t.ChatCompletionResponse,
              responses={**ERRORS, 200: {"content": sse_schema("ChatCompletionChunk")}})
    async def chat_completions(body: t.ChatCompletionRequest, request: Request) -> Response:
        return await create_chat_completion(state_of(request), body, request)

    @app.get("/v1/models", response_model=t.ModelList, responses={401: ERRORS[401]})
    async def models(request: Request) -> dict:
        return {"object": "list", "data": [state_of(request).model_card()]}

    @app.get("/v1/models/{model_id:path}", response_model=t.ModelCard, responses={401: ERRORS[401], 404: ERRORS[404]})
    async def model(model_id: str, request: Request) -> dict:
        state = state_of(request)
        state.check_model(model_id)
        return state.model_card()

    @app.get("/version", response_model=t.Version, responses={401: ERRORS[401]})
    async def version() -> dict:
        return {"version": ORCA_VERSION}

    @app.get("/health", response_model=t.Health, responses={503: {"model": t.Health}})
    async def health(request: Request) -> Response:
        """200 while a request sent now could be served: admission, a ready engine and a tokenizer
        have all been heard from within STATUS_EXPIRY_S; else 503 and the reason."""
        code, body = state_of(request).client.status.health()
        return JSONResponse(body, status_code=code)

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics(request: Request) -> PlainTextResponse:
        return PlainTextResponse(render_metrics(state_of(request)), media_type="text/plain; version=0.0.4")

    @app.post("/tokenize", response_model=t.TokenizeResponse, responses=ERRORS)
    async def tokenize(body: t.TokenizeRequest, request: Request) -> dict:
        state = state_of(request)
        state.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", param="prompt")
        if body.messages is not None:
            if body.add_special_tokens:
                raise APIError(400, t.NOT_SUPPORTED["add_special_tokens"], param="add_special_tokens")
            rendered = await state.prompts.for_chat(body.messages, template_kwargs=body.chat_template_kwargs)
            tokens = rendered.token_ids
        else:
            tokens = await state.prompts.tokens(body.prompt, add_special_tokens=body.add_special_tokens is not False)
        return {"count": len(tokens), "max_model_len": state.context_len(), "tokens": tokens}

    @app.post("/detokenize", response_model=t.DetokenizeResponse, responses=ERRORS)
    async def detokenize(body: t.DetokenizeRequest, request: Request) -> dict:
        state = state_of(request)
        state.check_model(body.model)
        tokens = state.prompts.checked(body.tokens, "tokens")
        # special tokens kept, as vLLM's /detokenize (transformers' default): what a template rendered is seen
        return {"prompt": await state.prompts.run(functools.partial(state.tokenizer.decode, skip_special_tokens=False),
                                                  tokens)}

    @app.post("/v1/abort/{request_id}", response_model=t.AbortResponse, responses={401: ERRORS[401], 404: ERRORS[404]})
    async def abort(request_id: str, request: Request) -> dict:
        """Abort a running or queued completion by the `id` of its response (all its choices)."""
        generation = state_of(request).client.by_public_id.get(request_id)
        if generation is None:
            raise APIError(404, f"no running request with id {request_id!r} on this gateway", param="request_id")
        return {"id": request_id, "object": "abort", "aborted": generation.abort()}


def _openapi_without_422(app: FastAPI) -> dict:
    """FastAPI documents a 422 for every body; this app answers bad bodies with 400 (ErrorResponse)."""
    if app.openapi_schema is None:
        from fastapi.openapi.utils import get_openapi

        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        for path in schema["paths"].values():
            for operation in path.values():
                responses = operation.get("responses", {})
                if responses.pop("422", None) is not None:
                    responses.setdefault("400", {"description": "Bad Request", "content": {"application/json": {
                        "schema": {"$ref": "#/components/schemas/ErrorResponse"}}}})
        components = schema.get("components", {}).get("schemas", {})
        components.pop("HTTPValidationError", None)
        components.pop("ValidationError", None)
        _, extra = models_json_schema([(t.ChatCompletionChunk, "serialization")],
                                      ref_template="#/components/schemas/{model}")
        for name, definition in extra.get("$defs", {}).items():
            components.setdefault(name, definition)
        app.openapi_schema = schema
    return app.openapi_schema


async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
    errors = exc.errors()
    first = errors[0] if errors else {}
    whole_body = _whole_body_error(first)
    if whole_body is not None:
        return APIError(400, whole_body).response()
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    messages = dict.fromkeys(_field_error(e) for e in errors[:8])  # a union's branches say the same: once
    return APIError(400, "; ".join(list(messages)[:5]) or "invalid request", param=loc[0] if loc else None).response()


UNION_FIELDS = {
    "prompt": "a string, a list of strings, a list of token ids or a list of lists of token ids "
              f"(token ids >= 0, at most {t.MAX_PROMPTS} prompts)",
    "stop": f"a string or a list of at most {t.MAX_STOP} non-empty strings",
}
"""Top-level fields of several forms: pydantic reports one error per form; the client needs the forms."""


def _field_error(error: dict) -> str:
    """One validation error as `field: what is wrong`."""
    loc = [str(part) for part in error.get("loc", ()) if part != "body"]
    field = ".".join(loc) or "body"
    if error.get("type") == "extra_forbidden":
        name = loc[-1] if loc else field
        if len(loc) == 1 and name in t.NOT_SUPPORTED:
            return t.NOT_SUPPORTED[name]
        return f"{field}: unknown field (the fields this server takes are in /openapi.json)"
    if len(loc) > 1 and loc[0] in UNION_FIELDS:
        return f"{loc[0]}: must be {UNION_FIELDS[loc[0]]}"
    return f"{field}: {error.get('msg')}"


def _whole_body_error(error: dict) -> str | None:
    """What is wrong with the body as a whole (not JSON, not an object, absent), in words a client can act
    on; None for an error in one of its fields. FastAPI reports these at the loc ("body",) or, for JSON it
    cannot parse, ("body", <character offset>)."""
    kind, loc = error.get("type"), tuple(error.get("loc", ()))
    if kind == "json_invalid":
        return f"malformed JSON body at character {loc[-1]}: {error.get('ctx', {}).get('error', 'not JSON')}"
    if loc != ("body",):
        return None
    if kind == "missing":
        return "the request has no body: send a JSON object with Content-Type: application/json"
    if isinstance(error.get("input"), bytes):  # a body FastAPI did not read as JSON: its content type said otherwise
        return "the body was not read as JSON: send it with Content-Type: application/json"
    return f"the body must be a JSON object, not {type(error.get('input')).__name__}"


async def _http_error(request: Request, exc: HTTPException) -> Response:
    return JSONResponse(error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code,
                        headers=exc.headers)


async def _unexpected(request: Request, exc: Exception) -> Response:
    log.exception("gateway: unexpected error on %s", request.url.path)
    return JSONResponse(error_body(500, f"internal error: {type(exc).__name__}"), status_code=500)


# ---- Ray Serve ---------------------------------------------------------------------------------

SERVE_ENV = {
    "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0",
    "RAY_SERVE_PORT_QUARANTINE_S": "0",
}
"""Ray Serve's lightest ingress: the gateway replica listens itself (direct ingress), so no proxy actor
hop per streamed chunk, and runs the app on its own event loop (no thread hop per ASGI message).
Measured with benchmarks/serve_cpu.py (tiny Llama, rate inf, 2 cores), CPU per streamed token of
proxy + replica: 380-410 us through Serve's proxy, 340-360 with the user code and router on the main
loops, 210-240 with the proxy also on gRPC, 60 with direct ingress. `orca serve` lets the gateway's open responses finish
before it stops Serve, so no extra drain period; and a replica that Serve restarts takes the one port
back at once (no quarantine: no other load balancer holds a stale entry for it)."""


def serve_env(port: int) -> dict[str, str]:
    """SERVE_ENV, with the replica's direct-ingress port range narrowed to `port` alone."""
    return {**SERVE_ENV, "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(port),
            "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(port + 1)}


def start_on_ray_serve(settings: GatewaySettings, host: str, http_port: PortReservation) -> None:
    """Serve the app from a Ray Serve deployment (one replica, one NATS connection, many
    concurrent requests) that listens on host:port itself (Serve's direct ingress). Ray must be
    initialised; Serve must not be running yet (its ingress mode is fixed when it starts). The
    reservation is released once the replica listens (or before it binds, on a Ray whose replica
    cannot share the port)."""
    from ray import serve

    env = serve_env(http_port.port)  # for the controller (proxy placement, the replica's port) and the replica
    if not replica_binds_with_reuse_port():
        http_port.release()

    # Serve still starts its HTTP proxy on the head node in this mode, unused; it binds with SO_REUSEPORT.
    with PortReservation(host, 0) as proxy_port:
        # Serve's controller and proxy log to their files only: their INFO lines, in the terminal `orca serve`
        # forwards actor output to, name the unused proxy's port and every endpoint update
        serve.start(http_options={"host": host, "port": proxy_port.port}, proxy_location="HeadOnly",
                    controller_options={"runtime_env": {"env_vars": {**env, "RAY_SERVE_LOG_TO_STDERR": "0"}}})
        deployment = serve.deployment(serve.ingress()(RayGateway), name="orca-gateway", num_replicas=1,
                                      max_ongoing_requests=4096, graceful_shutdown_timeout_s=5,
                                      # `orca serve` has waited for the open requests itself (_stop_gateway):
                                      # Serve's default 2 s between its own checks only delays the stop
                                      graceful_shutdown_wait_loop_s=0.2,
                                      # its stderr stays its own (quiet_serve_stderr): with RAY_SERVE_LOG_TO_STDERR=0
                                      # Serve would send the gateway's own warnings into its file too
                                      ray_actor_options={"num_cpus": 0, "runtime_env": {"env_vars": {
                                          **env, "RAY_SERVE_LOG_TO_STDERR": "1"}}})
        try:
            serve.run(deployment.bind(settings), name="orca-gateway", route_prefix="/")
        except RuntimeError:
            raise ValueError(f"the gateway did not start on {host}:{http_port.port}: {_replica_error(serve)}") from None
    http_port.release()


def _replica_error(serve) -> str:
    """The replica's own error, the last line of the traceback Serve keeps (its RuntimeError leaves it out)."""
    try:
        message = serve.status().applications["orca-gateway"].deployments["orca-gateway"].message
    except Exception as exc:  # noqa: BLE001 - the failure itself is what matters
        return f"Serve failed to deploy it and gave no details ({exc})"
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    last = lines[-1] if lines else "Serve gave no details"
    if "NoAvailablePortError" in last:
        return "the port was taken by another process before the gateway could listen there"
    return last


def replica_binds_with_reuse_port() -> bool:
    """Whether this Ray has the hook that `rebindable_direct_ingress` patches (in the replica process)."""
    from ray.serve._private import replica

    return getattr(replica, "start_asgi_http_server", None) is not None


def rebindable_direct_ingress() -> bool:
    """Make the replica bind its direct-ingress port with SO_REUSEADDR (and SO_REUSEPORT), as Serve's
    own `start_asgi_http_server(enable_so_reuseport=True)` does for its proxies. Ray 2.60 binds it with
    neither: a replica that Serve restarts after a crash then fails to bind while the dead one's
    connections sit in TIME_WAIT, and Serve blocks the port for good (HTTP never comes back). Call
    in the replica process before its server starts (the replica's constructor); False when this
    Ray has no such hook (its own binding then applies)."""
    from ray.serve._private import replica

    start = getattr(replica, "start_asgi_http_server", None)
    if start is None:
        return False
    if getattr(start, "rebindable", False):
        return True

    async def start_rebindable(app, http_options, *, event_loop, enable_so_reuseport=False):
        return await start(app, http_options, event_loop=event_loop, enable_so_reuseport=True)

    start_rebindable.rebindable = True
    replica.start_asgi_http_server = start_rebindable
    return True


def quiet_serve_stderr() -> None:
    """In the replica: Serve's log lines on stderr (which Ray forwards to the terminal of `orca serve`)
    from WARNING up; its log file keeps every line, the access log too (one line per request, which on
    the terminal would cost the serving path a write, a read and a print each)."""
    for handler in logging.getLogger("ray.serve").handlers:
        if type(handler) is logging.StreamHandler:
            handler.setLevel(logging.WARNING)


class RayGateway:
    """The Ray Serve replica: builds the same FastAPI app at replica start."""

    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        quiet_serve_stderr()
        if not rebindable_direct_ingress():
            log.warning("gateway: this Ray Serve binds its port without SO_REUSEADDR; a restarted replica "
                        "may not get it back")

    def __serve_build_asgi_app__(self) -> FastAPI:
        self.fastapi_app = build_app(self.settings)  # `app` is Serve's own property on an ingress
        return self.fastapi_app

    def open_requests(self) -> int:
        """HTTP requests still being answered; `orca serve` waits for zero before it stops Serve."""
        return self.fastapi_app.state.open_requests.count
