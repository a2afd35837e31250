"""The `inflight` command line: `serve` (the OpenAI/Anthropic server) and `chat` (one answer)."""

from __future__ import annotations

import argparse
import logging
import os
import sys


def _positive(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return number


def _non_negative(value: str) -> int:
    number = int(value)
    if number < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return number


def _port(value: str) -> int:
    number = int(value)
    if not 1 <= number <= 65535:
        raise argparse.ArgumentTypeError(f"must be in 1..65535, got {value}")
    return number


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from inflight import LLM
    from inflight.server.app import ServerSettings, build_app
    from inflight.server.client import EngineClient
    from inflight.server.metrics import ServerMetrics

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        llm = LLM(
            args.model,
            enable_in_flight_batching=args.enable_in_flight_batching,
            max_batch_size=args.max_batch_size,
            max_model_len=args.max_kv_cache_capacity,
            max_num_tokens=args.max_num_tokens,
            context_cache=args.enable_context_reuse,
            show_progress=True,
        )
    except ValueError as exc:
        print(f"inflight: invalid server configuration: {exc}", file=sys.stderr)
        return 2
    name = args.served_model_name or llm.model_name
    client = EngineClient(
        llm,
        max_queued_requests=args.max_queued_requests,
        queue_timeout=args.queue_timeout,
        max_input_len=args.max_input_len,
        metrics=ServerMetrics(llm),
    )
    app = build_app(client, ServerSettings(served_model_name=name, api_key=args.api_key))
    mode = (
        f"in-flight batching, batch {llm.max_batch_size}"
        if llm.in_flight_batching
        else "blocking path, one request at a time"
    )
    print(
        f"inflight: serving {name} at http://{args.host}:{args.port}/v1 "
        f"({mode}; max_model_len {llm.max_model_len}; queue {args.max_queued_requests}"
        f"{'; context cache' if args.enable_context_reuse else ''}"
        f"{'; API key required' if args.api_key else ''})",
        flush=True,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def _chat(args: argparse.Namespace) -> int:
    from inflight import LLM, SamplingParams

    llm = LLM(args.model, max_model_len=args.max_model_len)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    for delta in llm.generate_stream([{"role": "user", "content": args.message}], params):
        print(delta.text, end="", flush=True)
    print()
    llm.close()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="inflight", description="inflight LLM serving engine")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve the OpenAI- and Anthropic-compatible HTTP API")
    serve.add_argument(
        "model",
        nargs="?",
        default=None,
        help="HF directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)",
    )
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=_port, default=8000)
    serve.add_argument(
        "--enable-in-flight-batching",
        action="store_true",
        help="admit queued requests into the running batch",
    )
    serve.add_argument(
        "--max-batch-size",
        type=_positive,
        default=8,
        help="requests generating at once under in-flight batching",
    )
    serve.add_argument(
        "--max-queued-requests",
        type=_non_negative,
        default=16,
        help="requests waiting beyond the batch before 429",
    )
    serve.add_argument(
        "--queue-timeout",
        type=float,
        default=600.0,
        help="seconds a request waits for the slot on the blocking path",
    )
    serve.add_argument("--api-key", default=None, help="require this key (Bearer or x-api-key)")
    serve.add_argument("--served-model-name", default=None)
    serve.add_argument(
        "--max-input-len",
        type=_positive,
        default=None,
        help="longest prompt in tokens (413 beyond)",
    )
    serve.add_argument(
        "--max-kv-cache-capacity",
        type=_positive,
        default=None,
        help="longest sequence (prompt + output) in tokens",
    )
    serve.add_argument(
        "--max-num-tokens",
        type=_positive,
        default=512,
        help="tokens computed per step (decode rows plus prefill chunks)",
    )
    serve.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"]
    )
    serve.set_defaults(run=_serve)

    chat = sub.add_parser("chat", help="answer one message and exit")
    chat.add_argument("message")
    chat.add_argument("--model", default=None, help="HF directory or .gguf (default: SmolLM2)")
    chat.add_argument("--max-tokens", type=int, default=256)
    chat.add_argument("--temperature", type=float, default=0.0)
    chat.add_argument("--max-model-len", type=int, default=2048)
    chat.set_defaults(run=_chat)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
