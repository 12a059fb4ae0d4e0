"""The ``server`` section of a deployment: the HTTP front end (address, key, limits, CORS, tool and
reasoning parsers, processes, tracing). Its own module to keep ``schema.py`` readable; ``myserve.config``
re-exports it with the sections it holds."""

import dataclasses

from myserve.config.fields import check, check_choice, check_names, check_not_empty

LOG_LEVELS = ("debug", "info", "warning", "error")
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral")
"""``server.tool_call_parser`` values (``frontend/tool_parsers.py``)."""
REASONING_PARSERS = ("deepseek_r1", "qwen3")
"""``server.reasoning_parser`` values (``frontend/reasoning.py``)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """The HTTP front end."""

    host: str = "127.0.0.1"
    """Address to listen on; 0.0.0.0 listens on all interfaces."""
    port: int = 8000
    """TCP port to listen on, 1..65535."""
    served_model_name: str | tuple[str, ...] | None = None
    """Model name reported by /v1/models and accepted in requests, or a list of names (aliases; the
    first is the one responses report); null = derived from the checkpoint. One model only: with
    ``models`` each entry names its own."""
    api_key: str | None = None
    """If set, requests must send 'Authorization: Bearer <api_key>'; null = no authentication."""
    log_level: str = "info"
    """Logging verbosity: debug, info, warning or error."""
    drain_timeout_s: float = 30.0
    """On SIGTERM/SIGINT, how long in-flight requests may take to finish before the server exits."""
    max_body_bytes: int = 4194304
    """Largest request body accepted; larger ones get HTTP 413."""
    allowed_origins: tuple[str, ...] = ("*",)
    """CORS: origins (scheme://host[:port]) whose pages may call the API; "*" = any."""
    allowed_methods: tuple[str, ...] = ("*",)
    """CORS: HTTP methods a browser's preflight may ask for; "*" = any."""
    allowed_headers: tuple[str, ...] = ("*",)
    """CORS: request headers a browser's preflight may ask for; "*" = any."""
    allow_credentials: bool = False
    """CORS: let pages send cookies and HTTP authentication with their requests."""
    request_timeout_s: float | None = None
    """Seconds a generation request may take from its arrival (queueing included) before it is aborted
    with HTTP 504 (or an error event, when streaming), > 0; null = no limit."""
    tool_call_parser: str | None = None
    """How tool calls are read out of the model's text: hermes, llama3_json or mistral; null = none."""
    enable_auto_tool_choice: bool = False
    """Serve tool_choice auto (the default with tools) by parsing calls with tool_call_parser."""
    reasoning_parser: str | None = None
    """Split a <think> block into reasoning_content: deepseek_r1 or qwen3; null = none."""
    engine_process: bool = True
    """Run the engine core in its own process (HTTP, tokenization and text never share its GIL);
    false = one process. On a multi-host mesh the leader (mesh.process_id 0) runs its core in a process
    of its own too; followers have no front end, and a process whose id JAX detects (process_id null)
    runs in one process."""
    api_server_count: int = 1
    """HTTP front-end processes sharing the port and feeding the one engine core (>= 1; more than
    one needs engine_process). For hosts where tokenization and SSE are the bottleneck."""
    responses_store_size: int = 256
    """Responses API objects kept in memory for GET /v1/responses/{id}, previous_response_id and
    background requests, >= 0 (beyond it the oldest is dropped; each front-end process keeps its own);
    0 = none stored (store true is then a 400)."""
    otlp_traces_endpoint: str | None = None
    """OTLP collector for a span per request (needs myserve[otel]); null = no tracing, SDK never loaded."""
    log_requests: bool = True
    """Log one line per finished request (logger myserve.requests: id, tokens, times, finish reasons)."""
    max_logprobs: int = 20
    """Most top logprobs a request may ask for (logprobs, top_logprobs, prompt_logprobs), 0..20."""
    trust_request_chat_template: bool = False
    """Accept a chat_template field in requests (a Jinja template the server renders, sandboxed);
    false = such requests are refused (vLLM's default)."""
    return_tokens_as_token_ids: bool = False
    """Logprobs name every token token_id:<id>, as if each request asked (return_tokens_as_token_ids)."""
    ssl_keyfile: str | None = None
    """HTTPS: the server's private key file (PEM); null = plain HTTP."""
    ssl_certfile: str | None = None
    """HTTPS: the server's certificate chain file (PEM), with ssl_keyfile."""
    ssl_ca_certs: str | None = None
    """HTTPS: CA certificates (PEM) that client certificates are checked against; null = none asked."""

    def __post_init__(self) -> None:
        check(self.drain_timeout_s >= 0, f"server.drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        check(self.api_server_count >= 1, f"server.api_server_count must be >= 1, got {self.api_server_count}")
        check(
            self.api_server_count == 1 or self.engine_process,
            "server.api_server_count > 1 needs server.engine_process: true (the front ends share one engine core)",
        )
        check(self.max_body_bytes >= 1024, f"server.max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        timeout = self.request_timeout_s
        check(timeout is None or timeout > 0, f"server.request_timeout_s must be > 0 or null, got {timeout}")
        check(1 <= self.port <= 65535, f"server.port must be in 1..65535, got {self.port}")
        check_names("server.served_model_name", self.served_model_name)
        check(0 <= self.max_logprobs <= 20, f"server.max_logprobs must be in 0..20, got {self.max_logprobs}")
        size = self.responses_store_size
        check(size >= 0, f"server.responses_store_size must be >= 0, got {size}")
        check(
            (self.ssl_keyfile is None) == (self.ssl_certfile is None),
            "server.ssl_keyfile and server.ssl_certfile go together (HTTPS needs both)",
        )
        has_cert = self.ssl_certfile is not None
        check(self.ssl_ca_certs is None or has_cert, "server.ssl_ca_certs needs server.ssl_certfile")
        for name in ("host", "api_key", "otlp_traces_endpoint", "ssl_keyfile", "ssl_certfile", "ssl_ca_certs"):
            check_not_empty(f"server.{name}", getattr(self, name))
        for key in ("allowed_origins", "allowed_methods", "allowed_headers"):
            check(all(v.strip() for v in getattr(self, key)), f"server.{key} must not hold an empty string")
        check_choice("server.log_level", self.log_level, LOG_LEVELS)
        if self.tool_call_parser is not None:
            check_choice("server.tool_call_parser", self.tool_call_parser, TOOL_CALL_PARSERS)
        check(
            not self.enable_auto_tool_choice or self.tool_call_parser is not None,
            "server.enable_auto_tool_choice needs server.tool_call_parser",
        )
        if self.reasoning_parser is not None:
            check_choice("server.reasoning_parser", self.reasoning_parser, REASONING_PARSERS)
