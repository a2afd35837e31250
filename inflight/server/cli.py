"""The `inflight` command line."""

from __future__ import annotations

import argparse
import os
import sys


def _chat(args: argparse.Namespace) -> int:
    from inflight import LLM, SamplingParams

    llm = LLM(args.model, max_model_len=args.max_model_len)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    messages = [{"role": "user", "content": args.message}]
    for delta in llm.generate_stream(messages, params):
        print(delta.text, end="", flush=True)
    print()
    llm.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    parser = argparse.ArgumentParser(prog="inflight", description="inflight LLM serving engine")
    sub = parser.add_subparsers(dest="command", required=True)
    chat = sub.add_parser("chat", help="answer one message and exit")
    chat.add_argument("message")
    chat.add_argument("--model", default=None, help="HF directory or .gguf (default: SmolLM2)")
    chat.add_argument("--max-tokens", type=int, default=256)
    chat.add_argument("--temperature", type=float, default=0.0)
    chat.add_argument("--max-model-len", type=int, default=2048)
    chat.set_defaults(run=_chat)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
