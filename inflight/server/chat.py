"""What the chat routes of both APIs share: the server's chat setup (templates, tool-call and
reasoning parsers, decided at start), and, per request, the template's arguments, the output
constraint of a forced tool choice and the reader of the reply."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from inflight.protocol.request import SamplingParams, StructuredOutputs
from inflight.protocol.tokenizer import Tokenizer
from inflight.server.chat_templates import ChatTemplates, choose_templates
from inflight.server.parsers import REASONING_PARSERS, TOOL_PARSERS, MessageParser
from inflight.server.parsers.calls import ToolSyntax
from inflight.server.parsers.forced import ForcedCallsSyntax
from inflight.server.parsers.harmony import HarmonyCalls, HarmonyChannels
from inflight.server.parsers.hermes import HermesSyntax
from inflight.server.parsers.reasoning import ReasoningSyntax
from inflight.server.tools import ToolChoice, forced_constraint

# Enough of the prompt's end to see whether it opens a reasoning block.
_PROMPT_TAIL_TOKENS = 8


@dataclass(frozen=True)
class ChatSetup:
    templates: ChatTemplates
    tool_parser: str | None
    tool_syntax: ToolSyntax | None
    reasoning: ReasoningSyntax | None

    @classmethod
    def create(
        cls,
        model_template: str | None,
        chat_template: str | None,
        tool_parser: str | None,
        reasoning_parser: str | None,
    ) -> ChatSetup:
        """The setup of a server; ValueError for parsers it does not know or cannot serve."""
        if tool_parser is not None and tool_parser not in TOOL_PARSERS:
            raise ValueError(
                f"--tool-call-parser {tool_parser!r} is not known; "
                f"use one of {sorted(TOOL_PARSERS)}"
            )
        if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
            raise ValueError(
                f"--reasoning-parser {reasoning_parser!r} is not known; "
                f"use one of {sorted(REASONING_PARSERS)}"
            )
        if tool_parser == "openai" and reasoning_parser != "openai_gptoss":
            raise ValueError(
                "--tool-call-parser openai reads gpt-oss's harmony messages: it needs "
                "--reasoning-parser openai_gptoss"
            )
        templates = choose_templates(model_template, chat_template)
        syntax = TOOL_PARSERS[tool_parser]() if tool_parser else None
        if templates.shipped and syntax is not None and not isinstance(syntax, HermesSyntax):
            # The shipped template asks for hermes calls, which this parser would not read.
            raise ValueError(
                f"--tool-call-parser {tool_parser} needs a chat template that renders tools in "
                "its syntax, and this model's has no tools; pass one with --chat-template"
            )
        reasoning = REASONING_PARSERS[reasoning_parser]() if reasoning_parser else None
        return cls(templates, tool_parser, syntax, reasoning)

    def reply_params(self, params: SamplingParams) -> SamplingParams:
        """`params` with the reply decoded as the reasoning parser reads it: keeping the
        special tokens where its markers are ones (harmony's)."""
        keeps = self.reasoning is not None and self.reasoning.keeps_special_tokens
        if not keeps or not params.skip_special_tokens:
            return params
        return replace(params, skip_special_tokens=False)

    @property
    def arguments_key(self) -> str:
        """The member a forced call object carries its arguments in (the parser's own)."""
        return self.tool_syntax.arguments_key if self.tool_syntax else "arguments"

    def thinking_switch(self, enabled: bool | None, effort: str | None) -> dict[str, Any] | None:
        """The chat-template variables that turn thinking on or off (`enable_thinking`, as
        Qwen3's templates read it) or set its effort (`reasoning_effort`, as gpt-oss's do), for
        those the template reads; None when it reads neither (the request's wish has no
        effect on this model)."""
        variables = self.templates.variables
        switch: dict[str, Any] = {}
        if enabled is not None and "enable_thinking" in variables:
            switch["enable_thinking"] = enabled
        if effort is not None and "reasoning_effort" in variables:
            switch["reasoning_effort"] = effort
        return switch or None

    def template_args(
        self,
        messages: Sequence[dict[str, Any]],
        choice: ToolChoice | None,
        chat_template_kwargs: dict[str, Any] | None = None,
        thinking: dict[str, Any] | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> dict[str, Any]:
        """The chat-template arguments of `LLM.prepare` for a conversation; `thinking`: the
        thinking switch's variables, under those `chat_template_kwargs` sets itself;
        `continue_final_message` (with `add_generation_prompt` off): the reply goes on with
        the final message's text."""
        has_tools = choice is not None or any(
            m.get("tool_calls") or m.get("role") == "tool" for m in messages
        )
        template = self.templates.tools if has_tools else self.templates.plain
        if thinking:
            chat_template_kwargs = {**thinking, **(chat_template_kwargs or {})}
        args: dict[str, Any] = {
            "chat_template_kwargs": chat_template_kwargs,
            "add_generation_prompt": add_generation_prompt,
            "continue_final_message": continue_final_message,
        }
        if template is not None:
            args["chat_template"] = template
        if choice is not None:
            args["tools"] = [t.as_openai() for t in choice.tools]
        return args

    def constraint(
        self, choice: ToolChoice | None, requested: StructuredOutputs | None, requested_by: str
    ) -> tuple[StructuredOutputs | None, list[str]]:
        """The output constraint: a forced tool choice's, or the one the request asked for in
        the field `requested_by` names; and the fields this leaves without effect. A forced
        choice's calls are the whole reply, so a format asked for beside it shapes no text:
        accepted and named back (as OpenAI and vLLM take the pair; instructor's Responses
        tools mode sends both)."""
        if choice is None or not choice.forced:
            return requested, []
        return forced_constraint(choice, self.arguments_key), [requested_by] if requested else []

    def reader(
        self, choice: ToolChoice | None, tokenizer: Tokenizer, prompt_token_ids: Sequence[int]
    ) -> MessageParser:
        """How the reply to this prompt is read. A forced choice's output is the constrained
        call JSON, from its first token: no reasoning comes before it."""
        if choice is not None and choice.forced:
            array = choice.mode == "required"
            syntax = ForcedCallsSyntax(self.arguments_key, array, choice.sole_function)
            return MessageParser(tools=syntax)
        thinking = False
        if self.reasoning is not None:
            tail = prompt_token_ids[-_PROMPT_TAIL_TOKENS:]
            thinking = self.reasoning.thinks_from_prompt(
                tokenizer.decode(tail, skip_special_tokens=False)
            )
        auto = choice is not None and choice.mode == "auto"
        reasoning = self.reasoning
        if auto and isinstance(self.tool_syntax, HarmonyCalls):
            # Harmony's calls are messages of their own: the channels' reader marks them.
            reasoning = HarmonyChannels(calls=True)
        return MessageParser(
            reasoning=reasoning,
            thinking=thinking,
            tools=self.tool_syntax if auto else None,
            max_calls=None if choice is None or choice.parallel else 1,
        )
