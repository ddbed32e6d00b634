"""`tokenmill serve [MODEL] --device …` (or `--model MODEL`, as vLLM): the OpenAI-compatible HTTP server."""
from __future__ import annotations

import argparse
import logging
import os
from typing import Any

from ..engine_args import add_engine_args, engine_kwargs

logger = logging.getLogger("tokenmill.serve")

API_KEY_ENV = "TOKENMILL_API_KEY"


def add_subparser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a model over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, ...).")
    add_engine_args(parser)
    add_model_args(parser)
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    group.add_argument("--port", type=int, default=8000, help="port to bind (default 8000)")
    group.add_argument("--api-key", action="append", default=None,
                       help=f"require `Authorization: Bearer KEY` on /v1 routes and /tokenize, /detokenize; "
                            f"repeat for several valid keys (rotation). Also read from ${API_KEY_ENV} "
                            f"(comma-separated)")
    group.add_argument("--max-waiting-requests", type=int, default=None,
                       help="refuse new requests with 503 + Retry-After when they would make more than this many "
                            "wait in the engine for a running slot (default 4 x --max-num-seqs; 0: none wait)")
    group.add_argument("--restart-engine", action="store_true",
                       help="when the engine process dies, fail its in-flight requests and start it again "
                            "(default: fail them and exit with status 1, for a supervisor to restart the server)")
    group.add_argument("--max-request-body-bytes", type=int, default=8 * 1024 * 1024,
                       help="refuse larger request bodies with 413 (default 8 MiB)")
    group.add_argument("--shutdown-timeout", type=float, default=5.0,
                       help="on Ctrl-C, seconds in-flight requests get to finish before they are aborted")
    group.add_argument("--disable-access-log", action="store_true", help="do not log every HTTP request")
    group.add_argument("--engine-startup-timeout", type=float, default=None,
                       help="give up if the engine has not loaded the model after this many seconds")
    group.add_argument("--max-stored-responses", type=int, default=1000,
                       help="finished /v1/responses kept in memory for previous_response_id and GET (LRU; "
                            "default 1000, 0: none)")
    group.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                       help="send an OpenTelemetry span per request (queue, prefill, decode, detokenize; GenAI "
                            "semantic conventions) to this OTLP endpoint; the protocol is "
                            "$OTEL_EXPORTER_OTLP_TRACES_PROTOCOL (grpc, the default, or http/protobuf). "
                            "Needs the otel extra: pip install 'tokenmill[otel]'")
    group.add_argument("--batch-dir", default=None, metavar="DIR",
                       help="where /v1/files and /v1/batches keep their state (resumed after a restart; "
                            "default ~/.cache/tokenmill/batches)")
    from .connection_guard import add_connection_args
    from .limits import add_limit_args
    from .model_config import add_model_table_args
    add_model_table_args(parser.add_argument_group("several models, data parallelism (docs/serving.md)"))
    add_limit_args(parser.add_argument_group("request limits (docs/serving.md, Limits and timeouts)"))
    add_connection_args(parser.add_argument_group("connections and timeouts"))
    parser.set_defaults(func=run)
    return parser


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """What `serve` and `run-batch` share besides the engine args: the model flag, served names, the chat
    template, tool-call and reasoning parsers."""
    parser.add_argument("--model", dest="model_flag", default=None, metavar="MODEL",
                        help="the model, as vLLM's `serve --model X` (same as the positional MODEL)")
    parser.add_argument("--served-model-name", nargs="+", default=None,
                        help="name(s) clients use for the model; the first is reported in responses and metrics "
                             "(default: the model file or directory stem)")
    parser.add_argument("--chat-template", default=None, metavar="FILE",
                        help="a Jinja chat template (a file, or the template itself) replacing the tokenizer's")
    parser.add_argument("--engine-factory", default=None, help=argparse.SUPPRESS)   # module:callable, for tests
    tools = parser.add_argument_group("tool calls and reasoning")
    tools.add_argument("--enable-auto-tool-choice", action="store_true",
                       help="read tool calls from the output of chat requests with tools and tool_choice "
                            "'auto' (needs --tool-call-parser)")
    tools.add_argument("--tool-call-parser", default=None, metavar="NAME",
                       help="the tool-call format of the model: a registered tool parser (built-in: hermes, "
                            "llama3_json, mistral, pythonic, granite, phi4_mini_json, glm45, cohere_command3; "
                            "`tokenmill plugins` lists all)")
    tools.add_argument("--reasoning-parser", default=None, metavar="NAME",
                       help="split the model's reasoning into reasoning_content: a registered reasoning "
                            "parser (built-in: qwen3, deepseek_r1, glm45, granite, cohere_command3)")


def api_keys_from(args: argparse.Namespace, parser: Any = None) -> list[str]:
    """The valid keys. An empty (or blank) --api-key would silently disable authentication: with `parser`,
    it exits with status 2, as a malformed flag does."""
    given = args.api_key or []
    if parser is not None and any(not k.strip() for k in given):
        parser.error("--api-key is empty: that would disable authentication; give a key, or leave the flag out")
    keys = [k for k in given if k]
    env = os.environ.get(API_KEY_ENV, "")
    keys += [k.strip() for k in env.split(",") if k.strip()]
    return list(dict.fromkeys(keys))


def check_parser_args(args: argparse.Namespace) -> None:
    """Refuse (SystemExit, before the engine starts) unknown parser names and auto tool choice
    without a parser."""
    from .chat_output import parser_class
    if getattr(args, "enable_auto_tool_choice", False) and not getattr(args, "tool_call_parser", None):
        raise SystemExit("--enable-auto-tool-choice needs --tool-call-parser NAME")
    try:
        parser_class("tool_parser", getattr(args, "tool_call_parser", None))
        parser_class("reasoning_parser", getattr(args, "reasoning_parser", None))
    except ValueError as exc:
        raise SystemExit(str(exc)) from None


def check_vllm_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """vLLM's spellings, settled before the engine starts; a wrong one exits (status 2) under the serve
    usage line. Fills args.model from --model, args.chat_template with the template's text and
    args.generation_defaults from a --generation-config FOLDER."""
    from ..engine_args import generation_config_folder
    if args.model_flag is not None:
        if args.model is not None and args.model != args.model_flag:
            parser.error(f"the model is given twice: {args.model!r} and --model {args.model_flag!r}")
        args.model = args.model_flag
    for flag, value in (("--tensor-parallel-size/-tp", args.tensor_parallel_size),
                        ("--pipeline-parallel-size/-pp", getattr(args, "pipeline_parallel_size", 1))):
        if value < 1:
            parser.error(f"{flag} {value}: must be >= 1")
    if args.trust_remote_code:
        logger.info("--trust-remote-code: accepted; no remote code is run (tokenmill implements the supported "
                    "architectures itself)")
    template = args.chat_template
    if template is not None and os.path.isfile(template):
        with open(template, encoding="utf-8") as fh:
            args.chat_template = fh.read()
    elif template is not None and not any(tag in template for tag in ("{{", "{%")):
        parser.error(f"--chat-template {template!r}: no such file (and not a Jinja template)")
    args.generation_defaults = {}
    folder = generation_config_folder(args.generation_config)
    if folder is not None:
        if not os.path.isfile(os.path.join(folder, "generation_config.json")):
            parser.error(f"--generation-config {folder!r}: expected auto, vllm, none or a folder with a "
                         "generation_config.json")
        from ...core.loaders.hf import read_generation_config
        args.generation_defaults = read_generation_config(folder)[0]


def serving_engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine's kwargs from the engine args plus the served name and the reasoning parser."""
    kwargs = engine_kwargs(args)
    if args.served_model_name:
        kwargs["served_model_name"] = args.served_model_name[0]
    if args.reasoning_parser:   # the engine holds a constraint back until the reasoning is over
        kwargs["reasoning_parser"] = args.reasoning_parser
    return kwargs


def serving_settings(args: argparse.Namespace, **extra: Any) -> Any:
    """The ServerSettings the serving code reads (model names, parsers, template, generation defaults)."""
    from .serving import ServerSettings
    return ServerSettings(served_model_names=args.served_model_name or [], tool_call_parser=args.tool_call_parser,
                          enable_auto_tool_choice=args.enable_auto_tool_choice,
                          reasoning_parser=args.reasoning_parser, chat_template=args.chat_template,
                          generation_defaults=args.generation_defaults, **extra)


def _server_class() -> type:
    import asyncio
    import contextlib
    import signal
    import threading

    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn, plus: drain in-flight requests on shutdown, and exit normally (status 0) after
        SIGINT/SIGTERM instead of re-raising the signal once shut down."""

        def __init__(self, config: Any, state: Any, drain_timeout: float) -> None:
            super().__init__(config)
            self._state = state
            self._drain_timeout = drain_timeout
            self._drain_task: Any = None

        async def shutdown(self, sockets: Any = None) -> None:
            self._drain_task = asyncio.get_running_loop().create_task(self._state.drain(self._drain_timeout))
            await super().shutdown(sockets)

        @contextlib.contextmanager
        def capture_signals(self) -> Any:
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            originals = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in originals.items():
                    signal.signal(sig, handler)

    return Server


def _Server(config: Any, state: Any, drain_timeout: float) -> Any:
    return _server_class()(config, state, drain_timeout)


def run(args: argparse.Namespace) -> int:
    from .model_config import build_engines

    check_parser_args(args)
    check_vllm_args(getattr(args, "_cli_parser", None) or argparse.ArgumentParser("tokenmill serve"), args)
    kwargs = serving_engine_kwargs(args)
    if args.max_waiting_requests is not None:
        if args.max_waiting_requests < 0:
            raise SystemExit("--max-waiting-requests must be >= 0")
        kwargs["max_waiting_requests"] = args.max_waiting_requests
    parser = getattr(args, "_cli_parser", None) or argparse.ArgumentParser("tokenmill serve")
    keys = api_keys_from(args, parser)
    from .connection_guard import check_connection_args, guarded_protocol
    from .limits import limits_from_args
    limits = limits_from_args(parser, args)
    check_connection_args(parser, args)
    log_level = logging.getLogger().getEffectiveLevel()
    tracer = None
    if getattr(args, "otlp_traces_endpoint", None):   # before the engine starts: a missing package exits at once
        from .tracing import RequestTracer
        try:
            tracer = RequestTracer(args.otlp_traces_endpoint)
        except (RuntimeError, ValueError) as exc:
            raise SystemExit(str(exc)) from None
        logger.info("tracing: OpenTelemetry spans to %s", args.otlp_traces_endpoint)

    client = build_engines(args, kwargs, log_level)     # one engine, -dp replicas, or --models FILE's models
    client.spawn()          # the model loads while the web stack below is imported
    import uvicorn

    from .app import create_app
    settings = serving_settings(args, api_keys=keys, max_waiting_requests=args.max_waiting_requests,
                                max_request_body_bytes=args.max_request_body_bytes, host=args.host, port=args.port,
                                max_stored_responses=args.max_stored_responses, batch_dir=args.batch_dir,
                                restart_engine=args.restart_engine, limits=limits)
    server: Any = None
    failed: list[BaseException] = []

    def on_ready(state: Any) -> None:
        info = state.info
        logger.info("model %s (served as %s), max_model_len %d", info.model_path or "(default)",
                    ", ".join(state.model_names), info.max_model_len)
        logger.info("platform: %s; attention backend: %s", info.platform, info.attention_backend)
        logger.info("KV cache: %d blocks of %d tokens (%d tokens); maximum concurrency for %d-token requests: "
                    "%.2fx; max_num_seqs %d", info.num_kv_blocks, info.block_size, info.num_kv_blocks * info.block_size,
                    info.max_model_len, info.max_concurrency, info.max_num_seqs)
        if keys:
            logger.info("API key required (%d key%s)", len(keys), "" if len(keys) == 1 else "s")
        logger.info("ready: OpenAI-compatible API for model %r at http://%s:%d/v1", state.model_name,
                    args.host, args.port)

    def on_failed(exc: BaseException) -> None:
        if not client.is_closing:   # not merely Ctrl-C during the load
            logger.error("%s", exc)
            failed.append(exc)
        if server is not None:
            server.should_exit = True

    try:
        # The HTTP server answers at once (/health/live; 503 on /health/ready) while the model loads.
        app = create_app(client, settings, startup_timeout=args.engine_startup_timeout, on_ready=on_ready,
                         on_failed=on_failed, tracer=tracer)
        # uvicorn's own deadline is a backstop: the app aborts what is left after --shutdown-timeout itself.
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level=max(log_level, logging.INFO),
                                access_log=not args.disable_access_log,
                                timeout_graceful_shutdown=args.shutdown_timeout + 5, lifespan="on",
                                timeout_keep_alive=args.timeout_keep_alive,
                                http=guarded_protocol(args.timeout_request_header, args.timeout_request_body,
                                                      args.limit_concurrency))
        server = _Server(config, app.state, args.shutdown_timeout)
        server.run()
        return 1 if failed else 0
    finally:
        client.shutdown()
        logger.info("server stopped")
