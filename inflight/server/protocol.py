"""Request bodies of the OpenAI and Anthropic APIs, as strict pydantic models.

Unknown fields are a 400 (a misspelt parameter must not be silently ignored). Fields that map to
no request option and that the server does not serve yet are accepted by the schema and refused
with a message naming them (`unsupported()`), so a client learns exactly which option to drop;
documented fields that mean nothing here are accepted and named back (`ignored_fields()`);
fields that map to request options (`n`) are refused, where they are, by the options table of
the runtime (`runtime/options.py`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

NonNegativeInt = Annotated[int, Field(ge=0)]
Temperature = Annotated[float, Field(ge=0, le=2)]
TopP = Annotated[float, Field(gt=0, le=1)]

# Bounds on what one request may ask the server to track per token (a 400 names the limit;
# prompt length, n and max_tokens are bounded by the model's context and batch).
MAX_STOP_STRINGS = 32
MAX_STOP_LENGTH = 512
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS = 1024
StopString = Annotated[str, Field(max_length=MAX_STOP_LENGTH)]
StopStrings = Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)]
StopTokenIds = Annotated[list[NonNegativeInt], Field(max_length=MAX_STOP_TOKEN_IDS)]
LogitBias = Annotated[
    dict[str, Annotated[float, Field(ge=-100, le=100)]], Field(max_length=MAX_LOGIT_BIAS)
]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Lenient(BaseModel):
    """A part of the conversation a client sends back (a message, its content parts, its tool
    calls): keys not read here are ignored, as OpenAI's Chat Completions ignores them. Clients
    send a returned message back whole (its `annotations`), keep their own bookkeeping there
    (OpenAI Swarm's `sender` and `tool_name`, tau2-bench a call's `name`, streamed deltas'
    `index`, Gemini's `thought_signature`), and LiteLLM keeps Anthropic's `cache_control` on
    the parts it sends to OpenAI-compatible servers."""

    model_config = ConfigDict(extra="ignore")


def tagged(known: Sequence[str]) -> Discriminator:
    """A tagged union's discriminator: the object's `type` when it is one of `known`, else
    "other" (the union's catch-all member, refused by name where it is read)."""

    def kind(value: Any) -> str:
        found = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
        return found if found in known else "other"

    return Discriminator(kind)


# -- OpenAI ------------------------------------------------------------------------------------


class ContentPart(Lenient):
    """A chat message's content part of a type read here."""


class TextPart(ContentPart):
    type: Literal["text"]
    text: str


class ImageURL(Strict):
    url: str  # a data:image/...;base64 URL, or http(s) where the server fetches
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(ContentPart):
    type: Literal["image_url"]
    image_url: ImageURL


class InputAudio(Strict):
    data: str  # base64
    format: str  # "wav" is read; others are refused naming the format


class InputAudioPart(ContentPart):
    type: Literal["input_audio"]
    input_audio: InputAudio


class AudioURL(Strict):
    url: str  # a data:audio/...;base64 URL, or http(s) where the server fetches


class AudioURLPart(ContentPart):
    """vLLM's audio part."""

    type: Literal["audio_url"]
    audio_url: AudioURL


class FileData(Strict):
    """A file sent in a message: its bytes (`file_data`: a data URL, `data:application/pdf;
    base64,...`, or bare base64) or an uploaded file's id."""

    file_data: str | None = None
    file_id: str | None = None
    filename: str | None = None


class FilePart(ContentPart):
    type: Literal["file"]
    file: FileData


class OtherPart(BaseModel):
    """A content part of another type: accepted by the schema, refused by name."""

    model_config = ConfigDict(extra="allow")
    type: str


# A chat message's content parts by their type, so that a malformed part of a type read here is
# refused naming its field (`messages.0.content.0.text`), not taken for a part of another type.
ChatContentPart = Annotated[
    Annotated[TextPart, Tag("text")]
    | Annotated[ImagePart, Tag("image_url")]
    | Annotated[InputAudioPart, Tag("input_audio")]
    | Annotated[AudioURLPart, Tag("audio_url")]
    | Annotated[FilePart, Tag("file")]
    | Annotated[OtherPart, Tag("other")],
    tagged(("text", "image_url", "input_audio", "audio_url", "file")),
]


class FunctionCall(Lenient):
    name: str
    arguments: str  # a JSON object's text


class AssistantToolCall(Lenient):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Lenient):
    # "function": a legacy function's result (read as a tool result).
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ChatContentPart] | None = None
    name: str | None = None
    tool_calls: list[AssistantToolCall] | None = None
    function_call: FunctionCall | None = None  # a legacy function call, an assistant's
    tool_call_id: str | None = None
    # An assistant reply's reasoning, as this server returns it (both names), sent back.
    reasoning_content: str | None = None
    reasoning: str | None = None
    audio: AssistantAudio | None = None  # a spoken reply sent back by its audio id
    # An assistant's refusal as OpenAI returns it, sent back: the message's text where it has none.
    refusal: str | None = None


class AssistantAudio(Strict):
    id: str


class FunctionDefinition(Strict):
    name: Annotated[str, Field(min_length=1)]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no arguments
    # Closes every object of a forced call's arguments; auto calls are read, not constrained.
    strict: bool | None = None
    # Beside the parameters, as guardrails' function-calling tool sends it (OpenAI takes it):
    # the names the arguments must hold where the parameters' schema names none.
    required: list[str] | None = None

    @property
    def arguments_schema(self) -> dict[str, Any] | None:
        """The arguments' JSON schema."""
        if self.required is None or self.parameters is None or "required" in self.parameters:
            return self.parameters
        return {**self.parameters, "required": self.required}


class ChatTool(Strict):
    type: Literal["function"]
    function: FunctionDefinition
    # Beside the function, as TensorZero sends it (and as the Responses API's tools carry it):
    # the function's own `strict` where that says nothing.
    strict: bool | None = None


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


class AllowedTools(Strict):
    mode: Literal["auto", "required"]
    tools: Annotated[list[NamedToolChoice], Field(min_length=1)]


class AllowedToolsChoice(Strict):
    """OpenAI's choice among a subset of the tools: only those are offered to the model, as
    `mode` says."""

    type: Literal["allowed_tools"]
    allowed_tools: AllowedTools


class StreamOptions(Strict):
    include_usage: bool = False
    # vLLM's: with include_usage, every chunk carries the usage so far.
    continuous_usage_stats: bool = False

    @property
    def every_chunk(self) -> bool:
        return self.include_usage and self.continuous_usage_stats


class VllmExtensions(Strict):
    """Sampling fields, and vLLM's scheduling priority, that every OpenAI endpoint takes here:
    chat, completions and responses (on /v1/responses they are vLLM's extensions: `vllm bench
    serve` sends `ignore_eos` there)."""

    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    stop: StopString | StopStrings | None = None
    stop_token_ids: StopTokenIds | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: NonNegativeInt | None = None
    seed: int | None = None
    logit_bias: LogitBias | None = None
    # vLLM's constraint field: {"json" | "regex" | "choice" | "grammar" | "json_object": ...}
    structured_outputs: dict[str, Any] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0)] | None = None
    # The request's place in the queue under --scheduling-policy priority (lower first).
    priority: int = 0


class SamplingFields(VllmExtensions):
    """Fields shared by chat and text completions (including vLLM's extensions)."""

    model: str | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    n: Annotated[int, Field(ge=1)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    # With --speculative-config: False decodes this request without drafts (same output).
    speculative: bool = True
    user: str | None = None
    # vLLM's: the reply carries the prompt's and each choice's token ids (streamed: the
    # prompt's in the first chunk, each chunk its new ones).
    return_token_ids: bool = False
    # Pin the KV of the prompt's system turn (a text prompt: all of it) in the context cache.
    save_system_prompt_kv_cache: bool = False
    # SGLang's constraint fields: a regular expression (matched whole), an EBNF grammar (GBNF or
    # Lark).
    regex: str | None = None
    ebnf: str | None = None
    # vLLM's constraint fields before `structured_outputs` (0.11 and older), each one of its
    # kinds; guidance's vLLM model sends one beside `structured_outputs`, the same constraint.
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # The backend vLLM would constrain with; llguidance serves every one of them.
    guided_decoding_backend: str | None = None
    # vLLM's fields that ask for nothing at their defaults (VLLM_DEFAULTS): a client built for
    # vLLM may send them so; any other value is a 400 naming the field (`unsupported`).
    use_beam_search: Any = None
    length_penalty: Any = None
    spaces_between_special_tokens: Any = None
    truncate_prompt_tokens: Any = None
    allowed_token_ids: Any = None
    bad_words: Any = None
    return_tokens_as_token_ids: Any = None
    cache_salt: Any = None
    kv_transfer_params: Any = None
    vllm_xargs: Any = None
    logits_processors: Any = None
    # vLLM's id for the request, for its logs (accepted and ignored: IGNORED_FIELDS).
    request_id: str | None = None
    # A block-diffusion model's denoising (DiffusionParams; unset: the model's defaults).
    max_denoising_steps: int | None = None
    t_min: float | None = None
    t_max: float | None = None
    entropy_bound: float | None = None
    stability_threshold: int | None = None
    confidence_threshold: float | None = None


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    response_format: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None
    # "any": Mistral's client's name for "required".
    tool_choice: (
        Literal["none", "auto", "required", "any"] | NamedToolChoice | AllowedToolsChoice | None
    ) = None
    parallel_tool_calls: bool | None = None
    # Mistral's client's name for the seed.
    random_seed: int | None = None
    # The legacy form of tools and tool_choice (one call a reply, returned as function_call).
    functions: list[FunctionDefinition] | None = None
    function_call: Literal["none", "auto"] | NamedFunction | None = None
    # The chat template's thinking switch, where it has one ("none" turns thinking off).
    reasoning_effort: str | None = None
    # The context cache reuses every shared prefix by content, whatever the key.
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    # xAI's live search, which grok-cli sends to every server ("off" where the model is not
    # Grok's): off, accepted and named as ignored; any other mode a 400 (`unsupported`).
    search_parameters: dict[str, Any] | None = None
    # Accepted and ignored (IGNORED_FIELDS).
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prediction: dict[str, Any] | None = None
    verbosity: str | None = None
    moderation: Any = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    skip_special_tokens: bool = True
    # Ollama's thinking switch (true / false, or an effort): as `reasoning_effort`, under it.
    think: bool | str | None = None
    # Open WebUI's chat controls for Ollama and llama.cpp, which it sends to any OpenAI server
    # as set: accepted and ignored (OLLAMA_CONTROLS), so that its chats are served.
    repeat_penalty: Any = None
    repeat_last_n: Any = None
    mirostat: Any = None
    mirostat_eta: Any = None
    mirostat_tau: Any = None
    tfs_z: Any = None
    num_ctx: Any = None
    num_batch: Any = None
    num_keep: Any = None
    num_thread: Any = None
    num_gpu: Any = None
    num_predict: Any = None
    use_mmap: Any = None
    use_mlock: Any = None
    keep_alive: Any = None
    format: Any = None
    # vLLM's field: {"keep_ratio": r} keeps that share of each image's tokens (the pruner).
    mm_processor_kwargs: dict[str, Any] | None = None
    # Variables of the chat template (vLLM's field), e.g. {"enable_thinking": false}.
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: continue_final_message (with add_generation_prompt false) goes on with the final
    # message's text (an assistant's prefill) instead of opening a new reply.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # vLLM's chat fields that ask for nothing at their defaults (VLLM_CHAT_DEFAULTS).
    include_reasoning: Any = None
    echo: Any = None
    add_special_tokens: Any = None
    chat_template: Any = None
    documents: Any = None
    prompt_logprobs: Any = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: Annotated[int, Field(ge=0)] | None = 16
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    echo: bool = False
    best_of: Annotated[int, Field(ge=1)] | None = None
    suffix: str | None = None


class TokenizeRequest(Strict):
    """vLLM's /tokenize: a text prompt, or chat messages rendered as a chat completion of them
    renders them (its template, tools and template variables, the reply's opening)."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool | None = None  # unset: True for a prompt, False for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False
    tools: list[ChatTool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[NonNegativeInt]


class LoadLoRARequest(Strict):
    lora_name: Annotated[str, Field(min_length=1)]
    lora_path: Annotated[str, Field(min_length=1)]


class UnloadLoRARequest(Strict):
    lora_name: Annotated[str, Field(min_length=1)]


# -- Anthropic ---------------------------------------------------------------------------------


class AnthropicTextBlock(BaseModel):
    model_config = ConfigDict(extra="allow")  # e.g. cache_control, citations
    type: Literal["text"]
    text: str


class AnthropicImageSource(Strict):
    type: Literal["base64", "url"]
    media_type: str | None = None
    data: str | None = None
    url: str | None = None


class AnthropicImageBlock(BaseModel):
    model_config = ConfigDict(extra="allow")  # e.g. cache_control
    type: Literal["image"]
    source: AnthropicImageSource


class AnthropicOtherBlock(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str


class AnthropicDocumentSource(Strict):
    """A PDF (`base64`), plain text (`text`), text blocks (`content`), a URL (fetched where
    the server fetches media), or a file id (refused: Anthropic's Files API is not served)."""

    type: Literal["base64", "text", "content", "url", "file"]
    media_type: str | None = None
    data: str | None = None
    content: str | list[AnthropicTextBlock | AnthropicOtherBlock] | None = None
    url: str | None = None
    file_id: str | None = None


class AnthropicDocumentBlock(BaseModel):
    model_config = ConfigDict(extra="allow")  # e.g. cache_control
    type: Literal["document"]
    source: AnthropicDocumentSource
    title: str | None = None
    context: str | None = None
    citations: dict[str, Any] | None = None  # read, never given: named as ignored


# A tool result's blocks: text, images, documents, and blocks read by type (a tool reference).
AnthropicResultBlock = Annotated[
    Annotated[AnthropicTextBlock, Tag("text")]
    | Annotated[AnthropicImageBlock, Tag("image")]
    | Annotated[AnthropicDocumentBlock, Tag("document")]
    | Annotated[AnthropicOtherBlock, Tag("other")],
    tagged(("text", "image", "document")),
]


class AnthropicToolUseBlock(BaseModel):
    model_config = ConfigDict(extra="allow")  # e.g. cache_control
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class AnthropicToolResultBlock(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[AnthropicResultBlock] | None = None
    is_error: bool = False


class AnthropicThinkingBlock(BaseModel):
    model_config = ConfigDict(extra="allow")  # the signature
    type: Literal["thinking"]
    thinking: str


AnthropicBlock = Annotated[
    Annotated[AnthropicTextBlock, Tag("text")]
    | Annotated[AnthropicImageBlock, Tag("image")]
    | Annotated[AnthropicDocumentBlock, Tag("document")]
    | Annotated[AnthropicToolUseBlock, Tag("tool_use")]
    | Annotated[AnthropicToolResultBlock, Tag("tool_result")]
    | Annotated[AnthropicThinkingBlock, Tag("thinking")]
    | Annotated[AnthropicOtherBlock, Tag("other")],
    tagged(("text", "image", "document", "tool_use", "tool_result", "thinking")),
]


class AnthropicMessage(Strict):
    # "system": instructions given later in a conversation (Claude Code sends them), rendered
    # where they stand; their `tool_addition` / `tool_removal` blocks change the tools offered.
    role: Literal["user", "assistant", "system"]
    content: str | list[AnthropicBlock]
    # A system message's life: "next_user_message" shows it only until a later user message.
    clear_at: Literal["next_user_message", "never"] | None = None


class AnthropicTool(Strict):
    """A custom tool. Anthropic's own tool types but web search (a server tool such as
    `code_execution_20250825`, a client tool of Anthropic's schema such as `bash_20250124`) are
    refused by name: no hosted tool runs here, and their schemas are not this server's to
    know."""

    name: Annotated[str, Field(min_length=1)]
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None
    strict: bool = False  # every object of its input closed, as OpenAI's strict tools
    # Left out of the prompt until a tool_reference block in a tool result loads it.
    defer_loading: bool = False
    input_examples: list[dict[str, Any]] | None = None  # shown with the description
    # Accepted without effect: the input streams as it is generated whatever this says, and a
    # tool is only ever called by the model directly (no code execution here).
    eager_input_streaming: bool | None = None
    allowed_callers: list[str] | None = None

    @model_validator(mode="before")
    @classmethod
    def _custom_only(cls, value: Any) -> Any:
        kind = value.get("type") if isinstance(value, dict) else None
        if kind not in (None, "custom"):
            raise ValueError(
                f"tools of type {kind!r} are not supported; this server serves custom tools "
                "(name, description, input_schema)"
            )
        return value


_WEB_SEARCH_TOOL = re.compile(r"web_search_\d{8}")


class AnthropicWebSearchTool(BaseModel):
    """Anthropic's hosted web search (`web_search_20250305` and its later versions), which Cline
    offers with every request on the Anthropic API: a hosted service runs it, this server
    cannot, and a model may answer without it, so it is left out of the prompt and named back
    as ignored, as the Responses API's `web_search` is (a tool_choice naming it stays a 400)."""

    model_config = ConfigDict(extra="allow")  # its options (max_uses, allowed_domains, ...)
    type: str
    name: str


def _tool_kind(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    hosted = isinstance(kind, str) and _WEB_SEARCH_TOOL.fullmatch(kind)
    return "WebSearch" if hosted else "Custom"  # capitalized: no field's name in an error's param


AnthropicToolSpec = Annotated[
    Annotated[AnthropicTool, Tag("Custom")] | Annotated[AnthropicWebSearchTool, Tag("WebSearch")],
    Discriminator(_tool_kind),
]


class AnthropicToolChoice(Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class AnthropicJSONFormat(Strict):
    type: Literal["json_schema"]
    schema_: Annotated[dict[str, Any], Field(alias="schema")]


class AnthropicOutputConfig(Strict):
    format: AnthropicJSONFormat | None = None
    effort: str | None = None  # the chat template's thinking switch, where it has one


class AnthropicCountTokensRequest(Strict):
    model: str
    messages: Annotated[list[AnthropicMessage], Field(min_length=1)]
    system: str | list[AnthropicTextBlock] | None = None
    tools: list[AnthropicToolSpec] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: dict[str, Any] | None = None
    output_config: AnthropicOutputConfig | None = None
    output_format: AnthropicJSONFormat | None = None  # the beta's name for output_config.format
    # The context cache reuses every shared prefix by content, marked or not.
    cache_control: dict[str, Any] | None = None
    # Context editing: its edits applied to the conversation (checked in `context_edits.py`;
    # named in IGNORED_FIELDS for the Responses API's, which is not served).
    context_management: dict[str, Any] | None = None
    # Accepted and ignored (IGNORED_FIELDS).
    speed: str | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None


class AnthropicThreadCreate(Strict):
    type: Literal["create"]


class AnthropicThreadContinue(Strict):
    type: Literal["continue"]
    previous_message_id: Annotated[str, Field(min_length=1)]


AnthropicThread = Annotated[
    AnthropicThreadCreate | AnthropicThreadContinue, Field(discriminator="type")
]


class AnthropicMessagesRequest(AnthropicCountTokensRequest):
    max_tokens: Annotated[int, Field(ge=1)]
    # A message thread: the conversation held by the server between turns (threads.py).
    thread: AnthropicThread | None = None
    stop_sequences: StopStrings | None = None
    # Pin the KV of the system prompt in the context cache (this server's extension).
    save_system_prompt_kv_cache: bool = False
    temperature: Annotated[float, Field(ge=0, le=1)] | None = None
    top_p: TopP | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    stream: bool = False
    # vLLM's length controls, this server's extension here (benchmarks such as aiperf send them
    # to every endpoint to fix the output's length).
    ignore_eos: bool = False
    min_tokens: NonNegativeInt | None = None
    # Accepted and ignored (IGNORED_FIELDS).
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    container: Any = None
    diagnostics: Any = None
    inference_geo: str | None = None
    billing_policy: dict[str, Any] | None = None
    fallback_credit_token: str | None = None
    # Substitute models for a request the model declines on policy: this server's never does.
    fallbacks: Any = None


# Fields of the OpenAI and Anthropic request bodies that mean nothing to this server (billing,
# storage, routing, moderation): accepted so that the SDKs' requests are served, and named in the
# log and in a response header (`ignored_fields`).
IGNORED_FIELDS = (
    "store",
    "metadata",
    "service_tier",
    "safety_identifier",
    "prediction",
    "verbosity",
    "moderation",
    "user",
    "container",
    "diagnostics",
    "inference_geo",
    "speed",
    "user_profile_id",
    "workspace_id",
    "client_metadata",
    "context_management",
    "prompt_cache_options",
    "image",
    "access_programs",
    "billing_policy",
    "fallback_credit_token",
    "fallbacks",
    "search_parameters",
    "request_id",
)

# vLLM's request fields this server does not serve, and the values at which they ask for
# nothing (vLLM's defaults, which a client may send as they are): any other a 400 naming the
# field (vLLM accepts unknown fields; here a field is served, ignored by name, or refused).
VLLM_DEFAULTS: dict[str, tuple[Any, ...]] = {
    "use_beam_search": (False,),
    "length_penalty": (1.0,),
    "spaces_between_special_tokens": (True,),
    "truncate_prompt_tokens": (None,),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "return_tokens_as_token_ids": (False,),
    "cache_salt": (None,),
    "kv_transfer_params": (None,),
    "vllm_xargs": (None,),
    "logits_processors": (None,),
}
VLLM_CHAT_DEFAULTS: dict[str, tuple[Any, ...]] = {
    "include_reasoning": (True,),
    "echo": (False,),
    "add_special_tokens": (False,),
    "chat_template": (None,),
    "documents": (None,),
    "prompt_logprobs": (None,),
}


# Open WebUI's chat controls for Ollama and llama.cpp (its "advanced params" beside OpenAI's):
# sampling and runtime knobs of those engines with no counterpart here (llama.cpp's
# `repeat_penalty` looks at the last `repeat_last_n` tokens, vLLM's `repetition_penalty` at all
# of them), and Ollama's `format` and `num_predict`, whose OpenAI fields Open WebUI sends itself.
OLLAMA_CONTROLS = (
    "repeat_penalty",
    "repeat_last_n",
    "mirostat",
    "mirostat_eta",
    "mirostat_tau",
    "tfs_z",
    "num_ctx",
    "num_batch",
    "num_keep",
    "num_thread",
    "num_gpu",
    "num_predict",
    "use_mmap",
    "use_mlock",
    "keep_alive",
    "format",
)


def ignored_fields(body: BaseModel) -> list[str]:
    """The fields of this request that were sent and that this server ignores."""
    return [
        name
        for name in (*IGNORED_FIELDS, *OLLAMA_CONTROLS)
        if name in body.model_fields_set and getattr(body, name) is not None
    ]


def unsupported(body: BaseModel) -> tuple[str, str] | None:
    """(field, message) for the first option of this request the engine does not serve, or
    that the request's other fields leave without meaning."""
    checks: list[tuple[str, bool, str]] = []
    if isinstance(body, SamplingFields):
        # As OpenAI and vLLM refuse it: a client sending it expects a stream.
        checks.append(
            (
                "stream_options",
                body.stream_options is not None and not body.stream,
                "stream_options is only allowed when stream is true",
            )
        )
        defaults = VLLM_DEFAULTS
        if isinstance(body, ChatCompletionRequest):
            defaults = {**VLLM_DEFAULTS, **VLLM_CHAT_DEFAULTS}
        for name, values in defaults.items():
            value = getattr(body, name)
            checks.append(
                (
                    name,
                    name in body.model_fields_set and value not in values,
                    f"{name} is not supported (only {' or '.join(map(json.dumps, values))})",
                )
            )
    if isinstance(body, ChatCompletionRequest):
        checks += [
            (
                "web_search_options",
                body.web_search_options is not None,
                "web search is not supported",
            ),
            (
                "search_parameters",
                body.search_parameters is not None
                and body.search_parameters.get("mode", "auto") != "off",
                'live search is not supported (search_parameters.mode other than "off")',
            ),
        ]
    if isinstance(body, CompletionRequest):
        checks += [
            ("best_of", body.best_of not in (None, 1), "best_of other than 1 is not supported"),
        ]
    return next(((field, message) for field, bad, message in checks if bad), None)
