"""The `inflight` command line: `serve` (the OpenAI/Anthropic server) and `chat` (one answer)."""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import logging
import os
import re
import sys
from collections.abc import Collection
from dataclasses import fields
from typing import Any

from inflight.protocol.deployment import DeploymentOptions
from inflight.server.parsers import REASONING_PARSERS, TOOL_PARSERS

# `inflight bench throughput`: the knobs its inflight engines take from the command line.
BENCH_KNOBS = (
    "max_batch_size",
    "max_num_tokens",
    "max_model_len",
    "enable_context_reuse",
    "device",
    "dtype",
)
# `inflight bench throughput` engines that run inflight itself, by the quantization they use.
INFLIGHT_ENGINES = {
    "inflight": "auto",
    "inflight-none": "none",
    "inflight-int8": "int8",
    "inflight-q4": "q4",
}


def _positive(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return number


def _port(value: str) -> int:
    number = int(value)
    if not 1 <= number <= 65535:
        raise argparse.ArgumentTypeError(f"must be in 1..65535, got {value}")
    return number


def _lora_module(value: str) -> tuple[str, str]:
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"must be name=path, got {value!r}")
    return name, path


def _json_object(value: str) -> dict:
    try:
        config = json.loads(value)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"must be a JSON object: {exc}") from exc
    if not isinstance(config, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {value!r}")
    return config


# How a knob's flag reads its value, by the knob's type (`parse` in its metadata where the type
# alone does not say).
_PARSERS: dict[str, dict[str, Any]] = {
    "int": {"type": int},
    "int | None": {"type": int},
    "str": {},
    "str | None": {},
    "bool": {"action": argparse.BooleanOptionalAction},
    "bool | None": {"action": argparse.BooleanOptionalAction},
    "json": {"type": _json_object},
    "name=path": {"type": _lora_module, "nargs": "+"},
}


def add_deployment_arguments(
    parser: argparse.ArgumentParser, names: Collection[str] | None = None
) -> None:
    """A flag for each knob of `DeploymentOptions` (those in `names`, default all), named and
    explained as the knob is; a flag not given leaves the knob's one default."""
    group = parser.add_argument_group("deployment")
    for knob in fields(DeploymentOptions):
        if names is not None and knob.name not in names:
            continue
        meta = knob.metadata
        flags = ["--" + knob.name.replace("_", "-"), *([meta["alias"]] if "alias" in meta else [])]
        group.add_argument(
            *flags,
            dest=knob.name,
            default=argparse.SUPPRESS,
            help=meta["help"],
            **({"choices": meta["choices"]} if "choices" in meta else {}),
            **({"metavar": meta["metavar"]} if "metavar" in meta else {}),
            **_PARSERS[meta.get("parse", knob.type)],
        )


def deployment_options(args: argparse.Namespace) -> DeploymentOptions:
    """The knobs the command line gave (a ValueError naming a bad one by its flag too)."""
    given = {f.name: getattr(args, f.name) for f in fields(DeploymentOptions) if f.name in args}
    if "lora_modules" in given:
        given["lora_modules"] = dict(given["lora_modules"])
    try:
        return DeploymentOptions(**given)
    except ValueError as exc:
        message = str(exc)
        for knob in fields(DeploymentOptions):
            flag = "--" + knob.name.replace("_", "-")
            message = re.sub(rf"\b{knob.name}\b(?! \()", f"{knob.name} ({flag})", message)
        raise ValueError(message) from exc


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from inflight import LLM, SamplingParams
    from inflight.server.app import ServerSettings, build_app
    from inflight.server.chat_templates import read_template
    from inflight.server.client import EngineClient
    from inflight.server.metrics import ServerMetrics
    from inflight.server.serving import Server
    from inflight.server.warmup import read_warmup_prompts

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        print("inflight: --enable-auto-tool-choice needs --tool-call-parser", file=sys.stderr)
        return 2
    # --served-model-name takes every word after it: a model path given after it lands there.
    stray = next((n for n in args.served_model_name or [] if os.path.exists(n)), None)
    if args.model is None and stray is not None:
        print(
            f"inflight: --served-model-name took {stray!r}, a path: give the model first "
            "(inflight serve MODEL --served-model-name NAME ...)",
            file=sys.stderr,
        )
        return 2
    try:
        chat_template = read_template(args.chat_template) if args.chat_template else None
        warmup = read_warmup_prompts(args.warmup_prompts) if args.warmup_prompts else []
        options = deployment_options(args)
        llm = LLM(args.model, show_progress=True, **_knobs(options))
    except ValueError as exc:
        print(f"inflight: invalid server configuration: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:  # e.g. a tensor-parallel rank that could not start
        print(f"inflight: the model could not start: {exc}", file=sys.stderr)
        return 1
    names = args.served_model_name or [llm.model_name]
    client = EngineClient(
        llm,
        max_queued_requests=options.max_queued_requests,
        queue_timeout=args.queue_timeout,
        max_input_len=args.max_input_len,
        metrics=ServerMetrics(llm),
        allow_fetch=options.allow_media_fetch,
    )
    settings = ServerSettings(
        served_model_name=names[0],
        model_aliases=tuple(names[1:]),
        api_key=args.api_key,
        chat_template=chat_template,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        warmup_prompts=warmup,
    )
    try:
        # Bad warm-up prompts stop the start, as a bad flag does.
        for prompt in warmup:
            llm.prepare(prompt, SamplingParams(max_tokens=1), save_system_prompt_kv_cache=True)
        app = build_app(client, settings)
    except ValueError as exc:
        llm.close()
        print(f"inflight: invalid server configuration: {exc}", file=sys.stderr)
        return 2
    tp = options.tensor_parallel_size
    mode = (
        f"in-flight batching, batch {llm.max_batch_size}"
        if llm.in_flight_batching
        else "blocking path, one request at a time"
    )
    print(
        f"inflight: serving {names[0]} at http://{args.host}:{args.port}/v1 "
        f"({mode}; max_model_len {llm.max_model_len}; queue {options.max_queued_requests}"
        f"{'; context cache' if options.enable_context_reuse else ''}"
        f"; quantization {options.quantization}"
        f"{'; KV cache fp8' if options.kv_cache_dtype == 'fp8' else ''}"
        f"{f'; tensor parallel {tp}' if tp > 1 else ''}"
        f"{f'; tool calls: {args.tool_call_parser}' if args.tool_call_parser else ''}"
        f"{f'; reasoning: {args.reasoning_parser}' if args.reasoning_parser else ''}"
        f"{f'; LoRA adapters: {llm.lora_adapters}' if options.enable_lora else ''}"
        f"{'; API key required' if args.api_key else ''})",
        flush=True,
    )
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level)
    return asyncio.run(Server(config, client, args.shutdown_timeout).run_until_stopped())


def _knobs(options: DeploymentOptions) -> dict[str, Any]:
    return {f.name: getattr(options, f.name) for f in fields(DeploymentOptions)}


def _chat(args: argparse.Namespace) -> int:
    from inflight import LLM, SamplingParams

    try:
        llm = LLM(args.model, **_knobs(deployment_options(args)))
    except ValueError as exc:
        print(f"inflight: invalid configuration: {exc}", file=sys.stderr)
        return 2
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    for delta in llm.generate_stream([{"role": "user", "content": args.message}], params):
        print(delta.text, end="", flush=True)
    print()
    llm.close()
    return 0


def _bench_throughput(args: argparse.Namespace) -> int:
    import contextlib
    import statistics

    import torch

    from inflight.bench import offline
    from inflight.bench.report import write_report

    torch.set_num_threads(args.threads)
    tokenizer = offline.load_tokenizer(args.model)
    work = offline.make_workload(
        tokenizer, args.num_prompts, args.prompt_len, args.output_len, rounds=args.rounds
    )
    knobs = {k: v for k, v in _knobs(deployment_options(args)).items() if k in BENCH_KNOBS}
    # Every prompt generating at once unless --max-batch-size says otherwise, as llama-server
    # gets a slot per prompt (the deployment default, 8, would run 16 prompts in two waves).
    batch = knobs.pop("max_batch_size")
    if "max_batch_size" not in args:
        batch = args.num_prompts
    engines = {
        name: functools.partial(
            offline.open_inflight, args.model, work, batch, quantization=quantization, **knobs
        )
        for name, quantization in INFLIGHT_ENGINES.items()
    }
    engines |= {
        "hf-static": lambda: offline.open_hf_static(args.model, work, tokenizer.eos_token_ids[0]),
        "hf-continuous": lambda: offline.open_hf_continuous(args.model, work),
        "llama-server": lambda: offline.open_llama_server(
            args.llama_server, args.model, work, args.threads
        ),
    }
    names = [n for n in args.engines if n != "llama-server" or args.llama_server]
    if "llama-server" in args.engines and not args.llama_server:
        print("llama-server: skipped (pass --llama-server PATH)", flush=True)
    ours = [n for n in names if n in INFLIGHT_ENGINES]
    if args.rounds > 1 and len(ours) > 1:
        # Each open engine keeps an OpenMP pool on its thread, and libgomp throttles every
        # pool's waiting once their threads outnumber the CPUs (a second thread running kernels
        # beside an engine cut its short chats from ~690 to ~550 tok/s: bench/RESULTS.md).
        print(
            f"inflight: --rounds keeps the engines open, so it takes one inflight engine at a "
            f"time; got {', '.join(ours)}",
            file=sys.stderr,
        )
        return 2
    rounds: list[dict[str, float]] = []
    if args.rounds == 1:  # one engine open at a time
        rounds.append({})
        for name in names:
            with engines[name]() as timed:
                rounds[0][name] = timed(work.prompts)
    else:
        with contextlib.ExitStack() as stack:
            passes = {name: stack.enter_context(engines[name]()) for name in names}
            for r, prompts in enumerate(work.rounds):
                rounds.append({name: timed(prompts) for name, timed in passes.items()})
                line = ", ".join(f"{name} {tok_s:.1f}" for name, tok_s in rounds[-1].items())
                print(f"round {r + 1}: {line} output tok/s", flush=True)
    results = {name: statistics.median(r[name] for r in rounds) for name in names}
    for name, tok_s in results.items():
        spread = ""
        if args.rounds > 1:
            low, high = min(r[name] for r in rounds), max(r[name] for r in rounds)
            spread = f" (median of {args.rounds} rounds, {low:.1f}-{high:.1f})"
        print(f"{name:<14} {tok_s:8.1f} output tok/s{spread}", flush=True)
    peers = [n for n in names if not n.startswith("inflight")]
    for name in INFLIGHT_ENGINES:
        if name in results and peers:
            # each round's ratio, its engines having run within seconds of each other
            ratios = [r[name] / max(r[p] for p in peers) for r in rounds]
            spread = ""
            if args.rounds > 1:
                spread = f" (median of the rounds' ratios, {min(ratios):.2f}-{max(ratios):.2f})"
            print(f"{name} / best peer: {statistics.median(ratios):.2f}x{spread}")
    if args.out:
        write_report(
            args.out,
            threads=torch.get_num_threads(),
            workload=vars(args) | {"run": None},
            output_tok_s=results,
            rounds=rounds,
        )
    return 0


def _bench_serve(args: argparse.Namespace) -> int:
    import asyncio

    from inflight.bench.offline import load_tokenizer, make_workload
    from inflight.bench.online import run_load

    tokenizer = load_tokenizer(args.tokenizer_model)
    work = make_workload(tokenizer, args.num_prompts, args.prompt_len, args.output_len)
    for rate in args.rates:
        r = asyncio.run(
            run_load(
                args.url,
                args.served_model,
                work.prompts,
                [work.output_len] * len(work.prompts),
                rate,
            )
        )
        print(r.summary(), flush=True)
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
        "--queue-timeout",
        type=float,
        default=600.0,
        help="seconds a request waits for the slot on the blocking path",
    )
    serve.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds running requests get to finish before they are cancelled",
    )
    serve.add_argument("--api-key", default=None, help="require this key (Bearer or x-api-key)")
    serve.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="the model's name in the API (replies carry the first); requests may use any",
    )
    serve.add_argument(
        "--max-input-len",
        type=_positive,
        default=None,
        help="longest prompt in tokens (a 400 beyond)",
    )
    serve.add_argument(
        "--chat-template",
        default=None,
        help="a Jinja chat template (a file, or the template's text) in place of the model's own",
    )
    serve.add_argument(
        "--tool-call-parser",
        choices=sorted(TOOL_PARSERS),
        default=None,
        help='how tool calls are read from the output under tool_choice "auto" (which needs '
        "one): hermes (<tool_call> JSON, Qwen2.5/Qwen3, the shipped template), llama3_json, "
        "or openai (gpt-oss's harmony calls, with --reasoning-parser openai_gptoss)",
    )
    serve.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="accepted for vLLM command lines: --tool-call-parser alone enables auto tool choice",
    )
    serve.add_argument(
        "--reasoning-parser",
        choices=sorted(REASONING_PARSERS),
        default=None,
        help="split the reasoning (<think>...</think>; gpt-oss's analysis channel) into the "
        "message's reasoning fields",
    )
    serve.add_argument(
        "--warmup-prompts",
        default=None,
        metavar="FILE",
        help="a JSON list of prompts or chat conversations to prefill and pin in the context "
        "cache (a conversation's system turn) before /health/ready reports ready",
    )
    serve.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"]
    )
    add_deployment_arguments(serve)
    serve.set_defaults(run=_serve)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    through = bench.add_parser("throughput", help="offline: every request at once, beside peers")
    through.add_argument("--model", default=None)
    through.add_argument("--num-prompts", type=_positive, default=16)
    through.add_argument("--prompt-len", type=_positive, default=100)
    through.add_argument("--output-len", type=_positive, default=64)
    through.add_argument("--threads", type=_positive, default=os.cpu_count() or 1)
    through.add_argument(
        "--engines",
        nargs="+",
        default=["inflight"],
        choices=[*INFLIGHT_ENGINES, "hf-static", "hf-continuous", "llama-server"],
    )
    through.add_argument("--llama-server", default=None, help="path to llama.cpp's llama-server")
    through.add_argument("--out", default=None, help="write the results as JSON here")
    through.add_argument(
        "--rounds",
        type=_positive,
        default=1,
        help="timed passes per engine, alternated between the engines, which stay loaded (one "
        "inflight engine at most); each engine's median and the median of the rounds' ratios "
        "are reported",
    )
    # The knobs the inflight engines take; each engine sets its quantization and in-flight
    # batching itself.
    add_deployment_arguments(through, BENCH_KNOBS)
    through.set_defaults(run=_bench_throughput)
    online = bench.add_parser("serve", help="online: Poisson arrivals against a running server")
    online.add_argument("--url", default="http://127.0.0.1:8000")
    online.add_argument("--served-model", required=True)
    online.add_argument(
        "--tokenizer-model",
        default=None,
        help="checkpoint whose tokenizer builds the prompts (default: SmolLM2)",
    )
    online.add_argument("--rates", type=float, nargs="+", default=[1.0])
    online.add_argument("--num-prompts", type=_positive, default=16)
    online.add_argument("--prompt-len", type=_positive, default=100)
    online.add_argument("--output-len", type=_positive, default=64)
    online.set_defaults(run=_bench_serve)

    chat = sub.add_parser("chat", help="answer one message and exit")
    chat.add_argument("message")
    chat.add_argument("--model", default=None, help="HF directory or .gguf (default: SmolLM2)")
    chat.add_argument("--max-tokens", type=int, default=256)
    chat.add_argument("--temperature", type=float, default=0.0)
    add_deployment_arguments(chat)
    chat.set_defaults(run=_chat)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
