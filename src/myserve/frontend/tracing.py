"""OpenTelemetry traces: one span per completions, chat, responses or embeddings request.

A span starts when a route has submitted the request's prompts (its start time is the request's
arrival, ``ResponseContext.t0``) as the child of the ``traceparent`` the client sent (W3C Trace
Context), and ends where the request is counted and logged (``CompletionResponse._finished``),
with the GenAI semantic conventions' attributes (``gen_ai.*``) and vLLM's latency ones
(``gen_ai.latency.*``). No prompt or generated text is recorded.

This module is imported only when ``server.otlp_traces_endpoint`` is set (or a test installs an
exporter): a server without tracing never loads the OpenTelemetry SDK (``pip install
'myserve[otel]'``), and pays one ``if`` per request.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

if TYPE_CHECKING:
    from myserve.frontend.request_log import RequestLog
    from myserve.wire.outputs import Usage
    from myserve.wire.params import SamplingParams

OPERATIONS = {
    "chat": "chat",
    "responses": "chat",
    "completion": "text_completion",
    "embedding": "embeddings",
    "score": "embeddings",
    "rerank": "embeddings",
}
"""``gen_ai.operation.name`` of each ``ResponseContext.kind``."""

PROTOCOLS = ("grpc", "http/protobuf")
"""``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` values (the OTLP exporters'; grpc unless set, as vLLM)."""

_PROPAGATOR = TraceContextTextMapPropagator()


class TracedRequest(Protocol):
    """What a span says about its request: ``responses.ResponseContext`` (named by its fields, so
    that the per-model context, which holds the tracer, and the responses import no circle)."""

    @property
    def kind(self) -> str: ...
    @property
    def model(self) -> str: ...
    @property
    def request_id(self) -> str: ...
    @property
    def params(self) -> SamplingParams: ...
    @property
    def t0(self) -> float: ...


class RequestTracer:
    """Makes each request's span; its spans go to the exporter(s) of ``provider``."""

    def __init__(self, provider: TracerProvider):
        self.provider = provider
        self._tracer = provider.get_tracer("myserve")

    def start(self, headers: Mapping[str, str], ctx: TracedRequest) -> RequestSpan:
        """The span of the request ``ctx`` describes, child of the ``traceparent`` in ``headers`` (if any)."""
        parent = _PROPAGATOR.extract(headers)
        # The span covers the request from its arrival at the route, before tokenizing.
        start_ns = time.time_ns() - int((time.perf_counter() - ctx.t0) * 1e9)
        operation = OPERATIONS[ctx.kind]
        span = self._tracer.start_span(
            f"{operation} {ctx.model}", context=parent, kind=trace.SpanKind.SERVER, start_time=start_ns
        )
        attributes: dict[str, str | int | float] = {
            "gen_ai.operation.name": operation,
            "gen_ai.provider.name": "myserve",
            "gen_ai.request.model": ctx.model,
            "gen_ai.response.model": ctx.model,
            "gen_ai.response.id": ctx.request_id,
        }
        if ctx.kind not in ("embedding", "score", "rerank"):  # embeddings do not sample
            params = ctx.params
            attributes.update({"gen_ai.request.temperature": params.temperature, "gen_ai.request.top_p": params.top_p})
            if params.max_tokens is not None:
                attributes["gen_ai.request.max_tokens"] = params.max_tokens
            if params.n != 1:  # the convention's default
                attributes["gen_ai.request.choice.count"] = params.n
            if params.seed is not None:
                attributes["gen_ai.request.seed"] = params.seed
        span.set_attributes(attributes)
        return RequestSpan(span, ctx.t0)

    def shutdown(self) -> None:
        """Export the spans still batched, then stop the exporters."""
        self.provider.shutdown()


class RequestSpan:
    """One request's span, ended once by ``end``."""

    def __init__(self, span: trace.Span, t0: float):
        self.span, self.t0 = span, t0

    def end(self, status: str, usage: Usage, log: RequestLog) -> None:
        """Record the outcome (``CompletionResponse._finished``'s status: ok, error, timeout,
        disconnected, or cancelled: a background response), the tokens and latencies, and end the span."""
        attributes: dict[str, str | int | float | list[str]] = {
            "gen_ai.usage.input_tokens": usage.prompt_tokens,
            "gen_ai.usage.output_tokens": usage.completion_tokens,
            "gen_ai.latency.e2e": time.perf_counter() - self.t0,
        }
        if log.finish_reasons:
            attributes["gen_ai.response.finish_reasons"] = list(log.finish_reasons)
        if log.first_token is not None:
            attributes["gen_ai.latency.time_to_first_token"] = log.first_token - self.t0
        if status != "ok":
            attributes["error.type"] = status
            self.span.set_status(trace.StatusCode.ERROR, status)
        self.span.set_attributes(attributes)
        self.span.end()


def install(exporter: SpanExporter, *, batch: bool = False) -> RequestTracer:
    """A tracer whose spans go to ``exporter``: one at a time as each ends (tests, with the SDK's
    ``InMemorySpanExporter``), or batched in a background thread (``batch``, for the network)."""
    provider = TracerProvider(resource=Resource.create({"service.name": "myserve"}))
    provider.add_span_processor(BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter))
    return RequestTracer(provider)


def otlp_tracer(endpoint: str) -> RequestTracer:
    """The tracer ``server.otlp_traces_endpoint`` asks for: OTLP over gRPC, or over HTTP
    (``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf``; ``endpoint`` then ends in ``/v1/traces``),
    batched. ``OTEL_SERVICE_NAME`` and the exporter's other ``OTEL_*`` variables apply."""
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
    if protocol not in PROTOCOLS:
        raise ValueError(f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL must be one of {', '.join(PROTOCOLS)}, got {protocol!r}")
    exporter: SpanExporter
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        exporter = GrpcExporter(endpoint=endpoint)
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

        exporter = HttpExporter(endpoint=endpoint)
    return install(exporter, batch=True)
