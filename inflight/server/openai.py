"""OpenAI request mapping and response shapes (chat completions and text completions)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, fields
from typing import Any

from inflight.protocol.outputs import CompletionOutput, LogprobEntry, RequestOutput, StreamChunk
from inflight.protocol.request import (
    DiffusionParams,
    GenerationRequest,
    RequestFieldError,
    SamplingParams,
    StructuredOutputs,
)
from inflight.protocol.speech import SpeechFacts
from inflight.protocol.tokenizer import Tokenizer
from inflight.server import documents
from inflight.server.chat import ChatSetup
from inflight.server.client import Run
from inflight.server.errors import ServerError
from inflight.server.parsers import MessageDelta, MessageParser
from inflight.server.parsers.json_scan import arguments_object
from inflight.server.protocol import (
    AllowedToolsChoice,
    AudioURLPart,
    ChatCompletionRequest,
    ChatMessage,
    ChatTool,
    CompletionRequest,
    FilePart,
    ImagePart,
    InputAudioPart,
    NamedFunction,
    NamedToolChoice,
    SamplingFields,
    StreamOptions,
    TextPart,
)
from inflight.server.spoken import SpokenReply, audio_tokens
from inflight.server.tools import FunctionTool, ToolChoice, allowed_tools, tool_choice


def sampling_params(
    body: SamplingFields,
    defaults: SamplingParams,
    *,
    max_tokens: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
    skip_special_tokens: bool = True,
    constraint: StructuredOutputs | None = None,
) -> SamplingParams:
    """The request's sampling fields over the model's defaults; a bad value is a 400."""
    bias: dict[int, float] = {}
    for key, value in (body.logit_bias or {}).items():
        if not key.lstrip("-").isdigit():
            raise ServerError(400, f"logit_bias keys must be token ids, got {key!r}", "logit_bias")
        bias[int(key)] = value
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            min_tokens=body.min_tokens or 0,
            temperature=defaults.temperature if body.temperature is None else body.temperature,
            top_p=defaults.top_p if body.top_p is None else body.top_p,
            top_k=defaults.top_k if body.top_k is None else body.top_k,
            min_p=defaults.min_p if body.min_p is None else body.min_p,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=(
                defaults.repetition_penalty
                if body.repetition_penalty is None
                else body.repetition_penalty
            ),
            seed=_seed(body),
            stop=[body.stop] if isinstance(body.stop, str) else (body.stop or []),
            stop_token_ids=body.stop_token_ids or [],
            ignore_eos=body.ignore_eos,
            include_stop_str_in_output=body.include_stop_str_in_output,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            logit_bias=bias,
            skip_special_tokens=skip_special_tokens,
            structured_outputs=constraint,
            n=body.n,
            speculative=body.speculative,
        )
    except ValueError as exc:
        raise ServerError(400, str(exc), str(exc).split(" ", 1)[0]) from exc


def _seed(body: SamplingFields) -> int | None:
    """The seed, also under the name Mistral's client gives it (`random_seed`)."""
    named = body.random_seed if isinstance(body, ChatCompletionRequest) else None
    if named is None:
        return body.seed
    if body.seed is not None and body.seed != named:
        raise ServerError(400, "send seed or random_seed, not both", "random_seed")
    return named


# The denoising settings a body may carry (drafts are for library streams: no OpenAI shape
# carries them).
DIFFUSION_FIELDS = tuple(f.name for f in fields(DiffusionParams) if f.name != "stream_drafts")


def diffusion_params(body: SamplingFields) -> DiffusionParams | None:
    """The block-diffusion fields the body sets (None: none); a bad value is a 400."""
    given = {name: getattr(body, name) for name in DIFFUSION_FIELDS}
    given = {name: value for name, value in given.items() if value is not None}
    if not given:
        return None
    try:
        return DiffusionParams(**given)
    except RequestFieldError as exc:
        raise ServerError(400, str(exc), exc.field) from exc


def field_params(body: SamplingFields, choice: ToolChoice | None = None) -> dict[str, str]:
    """The HTTP field each request field a refusal may name came from."""
    constraint = next(iter(_constraint_fields(body)), "structured_outputs")
    if choice is not None and choice.forced:
        constraint = "tools"
    diffusion = next((name for name in DIFFUSION_FIELDS if getattr(body, name) is not None), "")
    chat = isinstance(body, ChatCompletionRequest)
    newer = chat and body.max_completion_tokens is not None
    return {
        "n": "n",
        "structured_outputs": constraint,
        "diffusion": diffusion,
        "prompt": "messages" if chat else "prompt",
        "max_tokens": "max_completion_tokens" if newer else "max_tokens",
    }


def chat_tools(tools: list[ChatTool] | None) -> list[FunctionTool]:
    """A chat body's function tools."""
    return [
        FunctionTool(
            t.function.name,
            t.function.description,
            t.function.arguments_schema,
            strict=(t.strict if t.function.strict is None else t.function.strict) is True,
        )
        for t in tools or []
    ]


def chat_tool_choice(body: ChatCompletionRequest, chat: ChatSetup) -> ToolChoice | None:
    """The request's tools and tool_choice (or the legacy functions and function_call: at
    most one call), checked (a 400 naming the field)."""
    if body.functions is not None:
        if body.tools is not None or body.tool_choice is not None:
            raise ServerError(
                400, "send tools and tool_choice or the legacy functions, not both", "functions"
            )
        functions = [
            FunctionTool(f.name, f.description, f.arguments_schema, strict=f.strict is True)
            for f in body.functions
        ]
        legacy = body.function_call
        named = isinstance(legacy, NamedFunction)
        return tool_choice(
            functions,
            "named" if named else legacy,
            legacy.name if named else None,
            False,
            parser=chat.tool_parser,
        )
    if body.function_call is not None:
        raise ServerError(400, "function_call needs functions", "function_call")
    tools = chat_tools(body.tools)
    choice = "required" if body.tool_choice == "any" else body.tool_choice
    if isinstance(choice, AllowedToolsChoice):
        allowed = choice.allowed_tools
        names = [t.function.name for t in allowed.tools]
        tools = allowed_tools(tools, names, "tool_choice.allowed_tools.tools")
        choice = allowed.mode
    named = isinstance(choice, NamedToolChoice)
    return tool_choice(
        tools,
        "named" if named else choice,
        choice.function.name if named else None,
        body.parallel_tool_calls is not False,
        parser=chat.tool_parser,
    )


# The fields of each `response_format` type. Beside OpenAI's: Hugging Face's InferenceClient
# sends a json_schema format as TGI's grammar, {"type": "json_object", "value": schema} (TGI also
# names it "json", and takes {"type": "regex", "value": pattern}); llama.cpp's server reads a
# json_object's "schema".
RESPONSE_FORMAT_FIELDS = {
    "text": {"type"},
    "json_object": {"type", "value", "schema"},
    "json_schema": {"type", "json_schema"},
    "json": {"type", "value"},
    "regex": {"type", "value"},
}
JSON_SCHEMA_FIELDS = {"name", "description", "schema", "strict"}


# The constraint fields that carry one kind of `StructuredOutputs` each: SGLang's and vLLM's
# older ones.
KIND_FIELDS = {
    "regex": "regex",
    "ebnf": "grammar",
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
# vLLM's names for its constraint backends (an option may follow a colon).
GUIDED_BACKENDS = ("auto", "guidance", "xgrammar", "outlines", "lm-format-enforcer")


def _constraint_fields(body: SamplingFields) -> list[str]:
    """The fields of `body` that constrain its output (a text response_format does not)."""
    response_format = body.response_format if isinstance(body, ChatCompletionRequest) else None
    sent = {
        "response_format": (response_format or {}).get("type", "text") != "text",
        "structured_outputs": body.structured_outputs is not None,
        **{name: getattr(body, name) is not None for name in KIND_FIELDS},
    }
    return [name for name, given in sent.items() if given]


def structured_outputs(body: SamplingFields) -> StructuredOutputs | None:
    """The output constraint of `response_format` (chat), vLLM's `structured_outputs` field (or
    its older `guided_*` ones) or SGLang's `regex` and `ebnf`; a 400 naming the field when it is
    malformed, or when two fields give different constraints."""
    backend = body.guided_decoding_backend
    if backend is not None and backend.split(":")[0] not in GUIDED_BACKENDS:
        raise ServerError(
            400,
            f"guided_decoding_backend must be one of {', '.join(GUIDED_BACKENDS)}, got {backend!r}",
            "guided_decoding_backend",
        )
    fields = _constraint_fields(body)
    constraints = [_constraint_of(body, name) for name in fields]
    if any(c != constraints[0] for c in constraints[1:]):
        raise ServerError(400, f"send one output constraint, not {' and '.join(fields)}", fields[1])
    return constraints[0] if constraints else None


def _constraint_of(body: SamplingFields, field: str) -> StructuredOutputs:
    """The constraint the (sent) field `field` of `body` gives."""
    if field == "structured_outputs":
        assert body.structured_outputs is not None
        return vllm_constraint(body.structured_outputs)
    if field == "response_format":
        assert isinstance(body, ChatCompletionRequest) and body.response_format is not None
        constraint = _response_format(body.response_format)
        assert constraint is not None  # a text format is no constraint field
        return constraint
    kind = KIND_FIELDS[field]
    try:
        return StructuredOutputs(**{kind: getattr(body, field)})
    except ValueError as exc:
        shape = {"json": "a JSON schema object or its text", "choice": "a list of strings"}
        raise ServerError(
            400, f"{field} must be {shape.get(kind, 'a non-empty string')}", field
        ) from exc


def _response_format(spec: dict[str, Any]) -> StructuredOutputs | None:
    """The constraint of a `response_format` body (OpenAI's, TGI's or llama.cpp's types)."""
    kind = spec.get("type", "text")
    if not isinstance(kind, str) or kind not in RESPONSE_FORMAT_FIELDS:
        raise ServerError(
            400,
            f"response_format type must be text, json_object or json_schema (or TGI's json and "
            f"regex), got {kind!r}",
            "response_format.type",
        )
    unknown = sorted(set(spec) - RESPONSE_FORMAT_FIELDS[kind])
    if unknown:
        raise ServerError(
            400,
            f"response_format of type {kind!r} has no field {unknown[0]!r}",
            f"response_format.{unknown[0]}",
        )
    if kind == "text":
        return None
    if kind == "json_schema":
        inner = spec.get("json_schema")
        if not isinstance(inner, dict) or not isinstance(inner.get("schema", {}), dict):
            raise ServerError(
                400,
                "response_format json_schema needs a json_schema object with a schema",
                "response_format.json_schema",
            )
        unknown = sorted(set(inner) - JSON_SCHEMA_FIELDS)
        if unknown:
            raise ServerError(
                400,
                f"response_format.json_schema has no field {unknown[0]!r}",
                f"response_format.json_schema.{unknown[0]}",
            )
        return StructuredOutputs(json=inner.get("schema", {}), strict=inner.get("strict") is True)
    if "value" in spec and "schema" in spec:
        raise ServerError(
            400, "send a json_object's schema as value or as schema, not both", "response_format"
        )
    name = "schema" if "schema" in spec else "value"
    if name not in spec and kind == "json_object":
        return StructuredOutputs(json_object=True)
    field, value = f"response_format.{name}", spec.get(name)
    if kind == "regex":
        if not isinstance(value, str):
            raise ServerError(400, "a regex response_format needs its pattern as value", field)
        return StructuredOutputs(regex=value)
    if not isinstance(value, dict):
        raise ServerError(400, f"{field} must be a JSON schema object", field)
    return StructuredOutputs(json=value)


def vllm_constraint(spec: dict[str, Any]) -> StructuredOutputs:
    """The constraint of vLLM's `structured_outputs` field; a 400 naming it when malformed."""
    try:
        return StructuredOutputs(**spec)
    except (TypeError, ValueError) as exc:
        raise ServerError(400, f"structured_outputs: {exc}", "structured_outputs") from exc


def chat_messages(
    messages: list[ChatMessage], recall: Callable[[str], str | None] = lambda audio_id: None
) -> list[dict[str, Any]]:
    """Chat messages for the template: text content, an assistant's tool calls (arguments as
    objects, which is what templates read) and reasoning, and tool results. An assistant's
    spoken reply sent back by its audio id (and no text) is its transcript (`recall`), and a
    refusal sent back (and no text) is its text."""
    out = []
    for i, m in enumerate(messages):
        content: Any = m.content
        if m.audio is not None and not content:
            if m.role != "assistant":
                raise ServerError(400, "only assistant messages carry audio", f"messages.{i}.audio")
            content = recall(m.audio.id)
            if content is None:
                raise ServerError(
                    400,
                    f"audio id {m.audio.id!r} is unknown here or has expired: send the reply's "
                    "transcript as content",
                    f"messages.{i}.audio.id",
                )
        if isinstance(content, list):
            content = _content_parts(content, f"messages.{i}.content")
        if m.refusal and not content and m.role == "assistant":
            content = m.refusal
        role = {"developer": "system", "function": "tool"}.get(m.role, m.role)
        message: dict[str, Any] = {"role": role, "content": content or ""}
        if m.function_call is not None:
            if m.role != "assistant" or m.tool_calls:
                raise ServerError(
                    400,
                    "only an assistant message without tool_calls carries a function_call",
                    f"messages.{i}.function_call",
                )
            call = m.function_call
            arguments = arguments_object(call.arguments)
            # A legacy result names its function, not a call id: the function's name is both.
            message["tool_calls"] = [
                {
                    "id": call.name,
                    "type": "function",
                    "function": {"name": call.name, "arguments": arguments},
                }
            ]
        if m.role == "function":
            if m.name is None:
                raise ServerError(
                    400, "a function message needs the name of the function", f"messages.{i}"
                )
            message["tool_call_id"] = m.name
        if m.tool_calls:
            if m.role != "assistant":
                raise ServerError(
                    400, "only assistant messages carry tool_calls", f"messages.{i}.tool_calls"
                )
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {
                        "name": call.function.name,
                        "arguments": arguments_object(call.function.arguments),
                    },
                }
                for call in m.tool_calls
            ]
        # A tool message without the id of the call it answers is rendered without one, as
        # vLLM takes it (Llama Stack's vLLM adapter sends none); a template may still ask for it.
        if m.role == "tool" and m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        reasoning = m.reasoning_content or m.reasoning
        if reasoning and m.role == "assistant":
            message["reasoning_content"] = reasoning
        out.append(message)
    return out


def _content_parts(parts: list[Any], where: str) -> list[dict[str, Any]]:
    """The parts as `LLM.chat` takes them (which joins text parts into the message's text)."""
    out: list[dict[str, Any]] = []
    for j, part in enumerate(parts):
        if isinstance(part, TextPart):
            out.append({"type": "text", "text": part.text})
        elif isinstance(part, ImagePart):
            out.append({"type": "image_url", "image_url": {"url": part.image_url.url}})
        elif isinstance(part, InputAudioPart):
            audio = {"data": part.input_audio.data, "format": part.input_audio.format}
            out.append({"type": "input_audio", "input_audio": audio})
        elif isinstance(part, AudioURLPart):
            out.append({"type": "audio_url", "audio_url": {"url": part.audio_url.url}})
        elif isinstance(part, FilePart):
            file, at = part.file, f"{where}.{j}.file"
            document = documents.sent_file(at, file.file_data, file.file_id, file.filename)
            out.append(documents.part(document))
        else:
            raise ServerError(
                400,
                f"content of type {part.type!r} is not supported; this server reads text, "
                "images (image_url), audio (input_audio, audio_url) and files (file)",
                f"{where}.{j}",
            )
    return out


@dataclass(frozen=True)
class ThinkingAsked:
    """A chat's wish for the template's thinking switch, and the field it came in."""

    field: str
    enabled: bool
    effort: str | None


def thinking_asked(body: ChatCompletionRequest) -> ThinkingAsked | None:
    """`reasoning_effort` ("none" turns thinking off), else Ollama's `think` (true / false, or
    an effort, as Open WebUI sends it)."""
    if body.reasoning_effort is not None:
        effort = body.reasoning_effort
        return ThinkingAsked("reasoning_effort", effort != "none", effort)
    if body.think is None:
        return None
    if isinstance(body.think, str):
        return ThinkingAsked("think", body.think != "none", body.think)
    return ThinkingAsked("think", body.think, None)


def completion_prompts(prompt: Any) -> list[str | dict[str, Any]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise ServerError(400, "prompt is empty", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [{"prompt_token_ids": list(prompt)}]
    return [p if isinstance(p, str) else {"prompt_token_ids": list(p)} for p in prompt]


def chat_logprob(entry: LogprobEntry) -> dict[str, Any]:
    """A token's logprob as chat completions and the Responses API write it."""
    return {
        "token": entry.token,
        "logprob": entry.logprob,
        "bytes": list(entry.bytes),
        "top_logprobs": [
            {"token": t.token, "logprob": t.logprob, "bytes": list(t.bytes)} for t in entry.top
        ],
    }


def chat_logprobs(entries: Iterable[LogprobEntry]) -> dict[str, Any]:
    """A chat choice's `logprobs`: `refusal` null beside the content, as OpenAI sends it (the
    clients whose types come from its spec require the key)."""
    return {"content": [chat_logprob(e) for e in entries], "refusal": None}


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ChatReply:
    """A chat completion, whole or streamed; `reader` splits the generated text into reasoning
    (sent as `reasoning_content` and `reasoning`, vLLM's older and newer names, when
    `reasoning_fields`), content and tool calls."""

    def __init__(
        self,
        model: str,
        logprobs: bool,
        reader: MessageParser,
        reasoning_fields: bool,
        legacy_functions: bool = False,
        named: bool = False,
        audio: SpokenReply | None = None,
        voices: SpeechFacts | None = None,
        prompt_token_ids: Sequence[int] | None = None,
    ) -> None:
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.logprobs = logprobs
        self.reader = reader
        self.reasoning_fields = reasoning_fields
        # Asked with the legacy `functions`: its call comes back as `function_call`.
        self.legacy_functions = legacy_functions
        # A named tool_choice's call ends as "stop", as OpenAI's and vLLM's do.
        self.named = named
        # Asked spoken (`spoken.py`): the text is the audio's transcript.
        self.audio, self.voices = audio, voices
        # vLLM's return_token_ids: the prompt's ids, sent with each choice's (None: not asked).
        self.prompt_token_ids = prompt_token_ids

    def whole(self, output: RequestOutput) -> dict[str, Any]:
        completion_tokens = sum(len(o.token_ids) for o in output.outputs)
        usage = _usage(output.prompt_tokens, completion_tokens, output.cached_tokens)
        if self.voices is not None:
            frames = sum(audio_tokens(o, self.voices) for o in output.outputs)
            self._count_audio(usage, frames)
        body = {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            # null, as vLLM sends it: OpenAI's key, which strictly validating clients require.
            "system_fingerprint": None,
            "choices": [self._choice(sequence) for sequence in output.outputs],
            "usage": usage,
        }
        if self.prompt_token_ids is not None:
            body["prompt_token_ids"] = list(self.prompt_token_ids)
        return body

    @staticmethod
    def _count_audio(usage: dict[str, Any], frames: int) -> None:
        """Audio frames as OpenAI counts audio tokens: among the completion's."""
        usage["completion_tokens"] += frames
        usage["total_tokens"] += frames
        usage["completion_tokens_details"] = {"audio_tokens": frames}

    def _choice(self, output: CompletionOutput) -> dict[str, Any]:
        logprobs = None
        if self.logprobs:
            logprobs = chat_logprobs(output.logprobs or ())
        parsed = self.reader.whole(output.text)
        # `refusal` null as OpenAI and vLLM send it (openai-node's type requires the key).
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content, "refusal": None}
        if self.audio is not None:
            message["content"] = None
            message["audio"] = self.audio.whole(output, parsed.content or "")
        if self.reasoning_fields:
            message["reasoning_content"] = message["reasoning"] = parsed.reasoning
        if parsed.tool_calls and self.legacy_functions:
            call = parsed.tool_calls[0]
            message["function_call"] = {"name": call.name, "arguments": call.arguments}
        elif parsed.tool_calls:
            message["tool_calls"] = [
                {
                    "id": tool_call_id(),
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
                for call in parsed.tool_calls
            ]
        choice = {
            "index": output.index,
            "message": message,
            "logprobs": logprobs,
            "finish_reason": self._finish_reason(output.finish_reason, bool(parsed.tool_calls)),
            "stop_reason": output.stop_reason,
        }
        if self.prompt_token_ids is not None:
            choice["token_ids"] = list(output.token_ids)
        return choice

    def _finish_reason(self, reason: str | None, called: bool) -> str | None:
        """A reply that ended by itself after calling tools finishes with "tool_calls" (with
        "function_call", asked with the legacy functions), but the call of a named choice,
        which OpenAI and vLLM end with "stop"."""
        if not called or reason != "stop":
            return reason
        if self.legacy_functions:
            return "function_call"
        return "stop" if self.named else "tool_calls"

    def _chunk(self, delta: dict[str, Any], index: int = 0, **choice: Any) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": [
                {"index": index, "delta": delta, "logprobs": None, "finish_reason": None, **choice}
            ],
        }

    def _delta(self, parsed: MessageDelta) -> dict[str, Any]:
        """A message delta as OpenAI sends it: a call's first delta carries its index, id, type
        and name (and the arguments so far), later ones argument fragments."""
        delta: dict[str, Any] = {}
        if parsed.reasoning:
            delta["reasoning_content"] = delta["reasoning"] = parsed.reasoning
        if parsed.content:
            delta["content"] = parsed.content
        calls = []
        for call in parsed.tool_calls:
            if call.name is None:
                calls.append({"index": call.index, "function": {"arguments": call.arguments}})
                continue
            calls.append(
                {
                    "index": call.index,
                    "id": tool_call_id(),
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
            )
        if calls and self.legacy_functions:
            delta["function_call"] = calls[0]["function"]  # one call, from its first delta on
        elif calls:
            delta["tool_calls"] = calls
        return delta

    async def stream(
        self, run: Run, options: StreamOptions | None
    ) -> AsyncIterator[dict[str, Any]]:
        """For each of the n choices: its role (once the run has its first output), its
        reasoning / content / tool-call deltas (as they come, tagged with its index) and its
        finish reason; then usage (if asked for, and on every chunk with vLLM's
        continuous_usage_stats). With token ids asked for, the first chunk carries the prompt's
        and each chunk its choice's new ones."""
        n = run.n
        every_chunk = options is not None and options.every_chunk
        prompt_tokens = len(run.prompt_token_ids)
        completion_tokens, frames = 0, 0

        def counted(chunk: dict[str, Any]) -> dict[str, Any]:
            if every_chunk:
                chunk["usage"] = _usage(prompt_tokens, completion_tokens)
            return chunk

        def openings() -> Iterator[dict[str, Any]]:
            for index in range(n):
                opening = self._chunk({"role": "assistant", "content": ""}, index)
                if self.prompt_token_ids is not None and index == 0:
                    opening["prompt_token_ids"] = list(self.prompt_token_ids)
                yield counted(opening)

        finish_reasons: list[str | None] = [None] * n
        readings = [self.reader.stream() for _ in range(n)]
        opened = False
        async for chunk in run:
            if not opened:
                # The roles go out with the first output, as vLLM's do, not on arrival: clients
                # that time the first chunk take it for the first token (a queued or long
                # prompt's wait would read as none).
                opened = True
                for opening in openings():
                    yield opening
            index = chunk.index
            completion_tokens += len(chunk.token_ids)
            frames += len(chunk.codes)
            if chunk.finished:
                finish_reasons[index] = chunk.finish_reason
            delta = self._delta(readings[index].feed(chunk.text))
            if self.audio is not None:
                # Spoken: the text is the audio's transcript (no tools, no reasoning here).
                audio = self.audio.delta(chunk.audio, delta.pop("content", ""))
                delta = {"audio": audio} if audio else {}
            logprobs = self.logprobs and chunk.logprobs
            token_ids = self.prompt_token_ids is not None and chunk.token_ids
            if not delta and not logprobs and not token_ids:
                continue
            extra: dict[str, Any] = {}
            if logprobs:
                extra["logprobs"] = chat_logprobs(chunk.logprobs)
            if token_ids:
                extra["token_ids"] = list(chunk.token_ids)
            yield counted(self._chunk(delta or {"content": ""}, index, **extra))
        if not opened:
            for opening in openings():
                yield opening
        for index in range(n):
            rest = self._delta(readings[index].finish())
            if self.audio is not None:
                audio = self.audio.delta(b"", rest.pop("content", ""))
                rest = {"audio": {**(audio or {}), **self.audio.last()}}
            if rest:
                yield counted(self._chunk(rest, index))
            reason = self._finish_reason(finish_reasons[index], readings[index].calls_made > 0)
            stop = run.output.outputs[index].stop_reason if run.output is not None else None
            yield counted(self._chunk({}, index, finish_reason=reason, stop_reason=stop))
        if options is not None and options.include_usage:
            chunk = self._chunk({})
            chunk["choices"] = []
            # The context cache's hits are known once the run ended, as the whole reply has them.
            cached = run.output.cached_tokens if run.output is not None else 0
            chunk["usage"] = _usage(prompt_tokens, completion_tokens, cached)
            if self.audio is not None:
                self._count_audio(chunk["usage"], frames)
            yield chunk


class CompletionReply:
    def __init__(self, model: str, tokenizer: Tokenizer, body: CompletionRequest) -> None:
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.tokenizer = tokenizer
        self.body = body

    def _prompt_text(self, request: GenerationRequest) -> str:
        return self.tokenizer.decode(request.prompt_token_ids, skip_special_tokens=False)

    def _row(self, entry: LogprobEntry) -> tuple[str, float | None, dict[str, float] | None]:
        """(token, logprob, top): `top` holds the token itself beside the `logprobs` likeliest,
        up to logprobs + 1 entries, as OpenAI's legacy completions and vLLM's give them (one
        entry at `logprobs: 0`)."""
        top = None
        if self.body.logprobs is not None:
            top = {**{t.token: t.logprob for t in entry.top}, entry.token: entry.logprob}
        return entry.token, entry.logprob, top

    def _prompt_rows(
        self, request: GenerationRequest, whole: RequestOutput
    ) -> list[tuple[str, float | None, dict[str, float] | None]]:
        """The echoed prompt's rows: nothing predicts its first token (a null logprob)."""
        first = self.tokenizer.decode(request.prompt_token_ids[:1], skip_special_tokens=False)
        prompt = [self._row(e) for e in (whole.prompt_logprobs or ())[1:]]
        return [(first, None, None), *prompt]

    @staticmethod
    def _logprobs(
        rows: list[tuple[str, float | None, dict[str, float] | None]], start: int = 0
    ) -> dict:
        """The legacy completions logprobs object over (token, logprob, top) rows, their text
        offsets counted from `start` (a stream's rows sent before)."""
        offsets, offset = [], start
        for token, _, _ in rows:
            offsets.append(offset)
            offset += len(token)
        return {
            "tokens": [token for token, _, _ in rows],
            "token_logprobs": [lp for _, lp, _ in rows],
            "top_logprobs": [top for _, _, top in rows],
            "text_offset": offsets,
        }

    def _choice(
        self,
        index: int,
        request: GenerationRequest,
        whole: RequestOutput,
        output: CompletionOutput,
    ) -> dict:
        text = output.text
        logprobs = None
        rows = [self._row(e) for e in output.logprobs or ()]
        if self.body.echo:
            text = self._prompt_text(request) + text
            rows = [*self._prompt_rows(request, whole), *rows]
        if self.body.logprobs is not None:
            logprobs = self._logprobs(rows)
        choice = {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": output.finish_reason,
            "stop_reason": output.stop_reason,
        }
        if self.body.return_token_ids:
            choice["prompt_token_ids"] = list(request.prompt_token_ids)
            choice["token_ids"] = list(output.token_ids)
        return choice

    def whole(
        self, requests: list[GenerationRequest], outputs: list[RequestOutput]
    ) -> dict[str, Any]:
        """Choice `prompt * n + sequence` for each prompt's n sequences; the prompts counted
        once each in usage."""
        n = self.body.n
        choices = [
            self._choice(p * n + s.index, r, o, s)
            for p, (r, o) in enumerate(zip(requests, outputs, strict=True))
            for s in o.outputs
        ]
        prompt_tokens = sum(o.prompt_tokens for o in outputs)
        completion_tokens = sum(len(s.token_ids) for o in outputs for s in o.outputs)
        cached_tokens = sum(o.cached_tokens for o in outputs)
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": choices,
            "usage": _usage(prompt_tokens, completion_tokens, cached_tokens),
        }

    def _chunk(self, index: int, text: str, **extra: Any) -> dict[str, Any]:
        choice = {"index": index, "text": text, "logprobs": None, "finish_reason": None, **extra}
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": [choice],
        }

    async def stream(
        self, requests: list[GenerationRequest], runs: list[Run], options: StreamOptions | None
    ) -> AsyncIterator[dict[str, Any]]:
        """Each prompt's deltas, interleaved as they come, tagged with the choice index
        `prompt * n + sequence`; usage at the end if asked for (and on every chunk with vLLM's
        continuous_usage_stats). With token ids asked for, each choice's first chunk carries
        its prompt's, and each chunk its new ones. Logprobs' text offsets run on over a
        choice's chunks, as in the whole reply. An echo with logprobs carries the prompt's,
        which come with the prompt's output: its choices' chunks go out once it has ended."""
        queue: asyncio.Queue[tuple[int, StreamChunk | BaseException | None]] = asyncio.Queue()

        async def pump(index: int, run: Run) -> None:
            try:
                async for delta in run:
                    await queue.put((index, delta))
                await queue.put((index, None))
            except BaseException as exc:  # handed to the consumer, which re-raises it
                await queue.put((index, exc))

        tasks = [asyncio.ensure_future(pump(i, run)) for i, run in enumerate(runs)]
        # Every prompt's tokens count from the start, as the whole reply's usage counts them.
        usage = [sum(len(r.prompt_token_ids) for r in requests), 0]
        every_chunk = options is not None and options.every_chunk
        ids = self.body.return_token_ids
        opened: set[int] = set()  # choices whose first chunk went out
        offsets: dict[int, int] = {}  # each choice's text so far, as its logprobs' tokens spell it
        n = self.body.n
        scored_echo = self.body.echo and self.body.logprobs is not None
        held: dict[int, list[StreamChunk]] = {}  # with scored_echo: each prompt's, till its end

        def chunk_of(choice: int, text: str, request: GenerationRequest, **extra: Any) -> dict:
            if ids and choice not in opened:
                extra["prompt_token_ids"] = list(request.prompt_token_ids)
            opened.add(choice)
            chunk = self._chunk(choice, text, **extra)
            if every_chunk:
                chunk["usage"] = _usage(*usage)
            return chunk

        def logprobs_of(choice: int, rows: list) -> dict:
            start = offsets.get(choice, 0)
            offsets[choice] = start + sum(len(token) for token, _, _ in rows)
            return self._logprobs(rows, start)

        def deltas(index: int, item: StreamChunk) -> Iterator[dict]:
            choice, request = index * n + item.index, requests[index]
            if item.text or item.token_ids:
                extra: dict[str, Any] = {}
                if self.body.logprobs is not None:
                    rows = [self._row(e) for e in item.logprobs or ()]
                    extra["logprobs"] = logprobs_of(choice, rows)
                if ids:
                    extra["token_ids"] = list(item.token_ids)
                yield chunk_of(choice, item.text, request, **extra)

        try:
            if self.body.echo and not scored_echo:
                for i, request in enumerate(requests):
                    text = self._prompt_text(request)
                    for sequence in range(n):
                        yield chunk_of(i * n + sequence, text, request)
            running = len(runs)
            # Sequences that ended, by prompt: their last chunk goes out once the prompt's run
            # has its output (the stop reason is in it).
            ended: dict[int, list[StreamChunk]] = {}
            while running:
                index, item = await queue.get()
                if item is None:
                    running -= 1
                    output = runs[index].output
                    assert output is not None
                    if scored_echo:
                        request = requests[index]
                        text = self._prompt_text(request)
                        rows = self._prompt_rows(request, output)
                        for choice in range(index * n, index * n + n):
                            scores = logprobs_of(choice, rows)
                            yield chunk_of(choice, text, request, logprobs=scores)
                        for kept in held.pop(index, []):
                            for chunk in deltas(index, kept):
                                yield chunk
                    for last in ended.pop(index, []):
                        (sequence,) = (o for o in output.outputs if o.index == last.index)
                        choice = index * n + last.index
                        # Asked for, logprobs are an object on every chunk of a choice, rows
                        # or none (LMQL indexes each chunk's `tokens`), as vLLM sends them.
                        scores = None if self.body.logprobs is None else logprobs_of(choice, [])
                        yield chunk_of(
                            choice,
                            "",
                            requests[index],
                            logprobs=scores,
                            finish_reason=last.finish_reason,
                            stop_reason=sequence.stop_reason,
                        )
                    continue
                if isinstance(item, BaseException):
                    raise item
                usage[1] += len(item.token_ids)
                if scored_echo:
                    held.setdefault(index, []).append(item)
                else:
                    for chunk in deltas(index, item):
                        yield chunk
                if item.finished:
                    ended.setdefault(index, []).append(item)
            if options is not None and options.include_usage:
                chunk = self._chunk(0, "")
                chunk["choices"] = []
                cached = sum(r.output.cached_tokens for r in runs if r.output is not None)
                chunk["usage"] = _usage(*usage, cached)
                yield chunk
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
