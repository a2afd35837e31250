"""Text-level readers of generated chat replies: tool-call syntaxes and reasoning tags, by the
names vLLM's `--tool-call-parser` and `--reasoning-parser` use. The engine never sees them."""

from __future__ import annotations

from collections.abc import Callable

from inflight.server.parsers.calls import ToolCall, ToolSyntax
from inflight.server.parsers.harmony import HarmonyCalls, HarmonyChannels
from inflight.server.parsers.hermes import HermesSyntax
from inflight.server.parsers.llama3_json import Llama3JsonSyntax
from inflight.server.parsers.message import MessageDelta, MessageParser, ParsedMessage
from inflight.server.parsers.reasoning import ReasoningSyntax, ThinkTags

TOOL_PARSERS: dict[str, Callable[[], ToolSyntax]] = {
    "hermes": HermesSyntax,
    "llama3_json": Llama3JsonSyntax,
    "openai": HarmonyCalls,  # gpt-oss's calls, with --reasoning-parser openai_gptoss
}
REASONING_PARSERS: dict[str, Callable[[], ReasoningSyntax]] = {
    "qwen3": ThinkTags,
    "openai_gptoss": HarmonyChannels,
}

__all__ = [
    "REASONING_PARSERS",
    "TOOL_PARSERS",
    "MessageDelta",
    "MessageParser",
    "ParsedMessage",
    "ReasoningSyntax",
    "ThinkTags",
    "ToolCall",
    "ToolSyntax",
]
