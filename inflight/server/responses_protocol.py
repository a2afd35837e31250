"""Request bodies of the OpenAI Responses API, as strict pydantic models (a field in no API is a
400), with `refusal` for the options this server does not serve. Objects of a type the server
does not serve (a built-in tool, another item or part type) are accepted by the schema as
`OpenObject`, so that the refusal names their type."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, TypeAdapter, model_validator

from inflight.server.errors import ServerError
from inflight.server.protocol import Strict, Temperature, TopP, VllmExtensions, tagged

ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OpenObject(BaseModel):
    """An object of a kind this server does not serve (a tool, item or part type): accepted by
    the schema, so that the refusal names its type."""

    model_config = ConfigDict(extra="allow")
    type: str | None = None


class InputText(Strict):
    type: Literal["input_text"]
    text: str
    prompt_cache_breakpoint: dict[str, Any] | None = None


class InputImage(Strict):
    type: Literal["input_image"]
    image_url: str | None = None  # a data:image/...;base64 URL, or http(s) where the server fetches
    file_id: str | None = None
    detail: str | None = None
    prompt_cache_breakpoint: dict[str, Any] | None = None


class InputFile(Strict):
    """A file in a message: its bytes (`file_data`, a data URL or bare base64), an uploaded
    file's id, or a URL (fetched where the server fetches media)."""

    type: Literal["input_file"]
    file_data: str | None = None
    file_id: str | None = None
    file_url: str | None = None
    filename: str | None = None
    detail: str | None = None
    prompt_cache_breakpoint: dict[str, Any] | None = None


class OutputText(Strict):
    """An assistant's text, as a response returned it and a client sends it back."""

    type: Literal["output_text"]
    text: str
    annotations: list[dict[str, Any]] | None = None
    logprobs: list[dict[str, Any]] | None = None


class Refusal(Strict):
    type: Literal["refusal"]
    refusal: str


_PART_TYPES = ("input_text", "input_image", "input_file", "output_text", "refusal")
ContentPart = Annotated[
    Annotated[InputText, Tag("input_text")]
    | Annotated[InputImage, Tag("input_image")]
    | Annotated[InputFile, Tag("input_file")]
    | Annotated[OutputText, Tag("output_text")]
    | Annotated[Refusal, Tag("refusal")]
    | Annotated[OpenObject, Tag("other")],
    tagged(_PART_TYPES),
]


class Item(Strict):
    """What every input item may carry beside its own fields."""

    # The Codex CLI's metadata of a message on the OpenAI provider (its turn, when it was
    # written), which the hosted service passes through: kept with the item, unread.
    internal_chat_message_metadata_passthrough: dict[str, Any] | None = None


class MessageItem(Item):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ContentPart]
    id: str | None = None
    status: ItemStatus | None = None
    phase: Literal["commentary", "final_answer"] | None = None


class FunctionCallItem(Item):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # a JSON object's text
    id: str | None = None
    status: ItemStatus | None = None
    namespace: str | None = None
    caller: dict[str, Any] | None = None


class FunctionCallOutputItem(Item):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[ContentPart]
    id: str | None = None
    status: ItemStatus | None = None
    name: str | None = None
    namespace: str | None = None
    caller: dict[str, Any] | None = None


class SummaryText(Strict):
    type: Literal["summary_text"]
    text: str


class ReasoningText(Strict):
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(Item):
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[SummaryText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None
    status: ItemStatus | None = None


class CompactionItem(Item):
    """What `POST /v1/responses/compact` returned for the conversation it summarized."""

    type: Literal["compaction"]
    encrypted_content: str
    id: str | None = None
    created_by: str | None = None


class CompactionTriggerItem(Item):
    """The last input item of a request whose response is a compaction of the conversation
    (what the Codex CLI sends instead of calling /v1/responses/compact)."""

    type: Literal["compaction_trigger"]
    id: str | None = None
    metadata: dict[str, Any] | None = None


_ITEM_TYPES = (
    "message",
    "function_call",
    "function_call_output",
    "reasoning",
    "compaction",
    "compaction_trigger",
)


def _item_type(value: Any) -> str:
    found = (
        value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", None)
    )
    return found if found in _ITEM_TYPES else "other"


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")]
    | Annotated[CompactionItem, Tag("compaction")]
    | Annotated[CompactionTriggerItem, Tag("compaction_trigger")]
    | Annotated[OpenObject, Tag("other")],
    Discriminator(_item_type),  # a message may leave out its type
]
INPUT_ITEM: TypeAdapter[Any] = TypeAdapter(InputItem)


class FunctionToolSpec(Strict):
    type: Literal["function"]
    name: Annotated[str, Field(min_length=1)]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no arguments
    strict: bool | None = None  # forced tool choices are always constrained; auto never

    @model_validator(mode="before")
    @classmethod
    def _flat(cls, value: Any) -> Any:
        # A tool in chat completions' shape, as code ported from that API sends it, would
        # otherwise be refused for a missing `function.name`, which it has.
        if isinstance(value, dict) and "function" in value and "name" not in value:
            raise ValueError(
                'a Responses API function tool is flat ({"type": "function", "name": ..., '
                '"parameters": ...}); {"function": {...}} is the chat completions API\'s shape'
            )
        return value


NamespaceMember = Annotated[
    Annotated[FunctionToolSpec, Tag("function")] | Annotated[OpenObject, Tag("other")],
    tagged(("function",)),
]


class NamespaceToolSpec(Strict):
    """Function tools grouped under a name (Codex sends each MCP server's tools, and its
    sub-agent tools, as one): the model sees each as the function `{namespace}__{name}`, and
    its calls come back as `name` and `namespace` apart."""

    type: Literal["namespace"]
    name: Annotated[str, Field(min_length=1)]
    description: str | None = None
    tools: list[NamespaceMember]


ResponsesTool = Annotated[
    Annotated[FunctionToolSpec, Tag("function")]
    | Annotated[NamespaceToolSpec, Tag("namespace")]
    | Annotated[OpenObject, Tag("other")],
    tagged(("function", "namespace")),
]


class FunctionChoice(Strict):
    type: Literal["function"]
    name: str


ToolReference = Annotated[
    Annotated[FunctionChoice, Tag("function")] | Annotated[OpenObject, Tag("other")],
    tagged(("function",)),
]


class AllowedChoice(Strict):
    """A choice among a subset of the tools: only those are offered to the model, as `mode`
    says."""

    type: Literal["allowed_tools"]
    mode: Literal["auto", "required"]
    tools: Annotated[list[ToolReference], Field(min_length=1)]


ToolChoiceObject = Annotated[
    Annotated[FunctionChoice, Tag("function")]
    | Annotated[AllowedChoice, Tag("allowed_tools")]
    | Annotated[OpenObject, Tag("other")],
    tagged(("function", "allowed_tools")),
]


class TextFormatText(Strict):
    type: Literal["text"]


class TextFormatJsonObject(Strict):
    type: Literal["json_object"]


class TextFormatJsonSchema(Strict):
    type: Literal["json_schema"]
    name: str
    json_schema: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


TextFormat = Annotated[
    Annotated[TextFormatText, Tag("text")]
    | Annotated[TextFormatJsonObject, Tag("json_object")]
    | Annotated[TextFormatJsonSchema, Tag("json_schema")],
    Discriminator("type"),
]


class TextConfig(Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


Effort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]
Summary = Literal["auto", "concise", "detailed"]


class ReasoningConfig(Strict):
    effort: Effort | None = None
    summary: Summary | None = None
    generate_summary: Summary | None = None  # the older name of `summary`


class ResponsesStreamOptions(Strict):
    include_obfuscation: bool = True  # the padding field is never sent here


class ConversationRef(Strict):
    id: str


def conversation_id(value: str | ConversationRef) -> str:
    return value if isinstance(value, str) else value.id


class ResponsesRequest(VllmExtensions):
    model: str | None = None
    input: str | list[InputItem] | None = None
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    tools: list[ResponsesTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceObject | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    stream: bool = False
    stream_options: ResponsesStreamOptions | None = None
    store: bool | None = True
    previous_response_id: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    metadata: dict[str, str] | None = None
    include: list[str] | None = None
    # The alternatives each token's logprob lists, with `include` asking for them.
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    # Accepted, with nothing to do here: a limit on built-in tools (not served), hints to a
    # hosted service's caching, routing and abuse checks.
    max_tool_calls: Annotated[int, Field(ge=0)] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    service_tier: str | None = None
    client_metadata: dict[str, Any] | None = None  # Codex's ids of its session and turn
    # The hosted service's compaction, moderation, cache, image-compression and access
    # options: accepted and named back (IGNORED_FIELDS).
    context_management: list[dict[str, Any]] | None = None
    moderation: dict[str, Any] | None = None
    prompt_cache_options: dict[str, Any] | None = None
    image: dict[str, Any] | None = None
    access_programs: dict[str, Any] | None = None
    # vLLM's extensions beside its sampling ones (`VllmExtensions`), as on chat completions.
    skip_special_tokens: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    # Generated by a task of its own, answered at once as queued (responses.py).
    background: bool | None = None
    # Accepted by the schema, refused (`refusal`) when set.
    background_options: dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    # A conversation of the Conversations API (its id, or {"id": ...}): read before the input,
    # the input and output items added to it once the response finishes (conversations.py).
    conversation: str | ConversationRef | None = None


class CompactRequest(Strict):
    """POST /v1/responses/compact: the conversation to compact (its input, instructions and
    previous response, as a Responses request has them; reasoning and chat_template_kwargs
    set the template's thinking switch; max_output_tokens bounds the summary); what Codex
    sends beside them for the model's next turn (tools, text, caching and tier hints) is
    accepted and named back."""

    model: str | None = None
    input: str | list[InputItem] | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    reasoning: ReasoningConfig | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # This server's: the summary's length at most (compaction.SUMMARY_MAX_TOKENS by default).
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    tools: list[dict[str, Any]] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    safety_identifier: str | None = None
    image: dict[str, Any] | None = None

    def as_response(self) -> ResponsesRequest:
        """The Responses request asking for the same compaction: the input ended with a
        compaction trigger, not stored."""
        fields = ("model", "instructions", "previous_response_id", "reasoning", "max_output_tokens")
        given = self.input or []
        if isinstance(given, str):
            given = [MessageItem(role="user", content=given)]
        return ResponsesRequest(
            **{name: getattr(self, name) for name in fields if name in self.model_fields_set},
            input=[*given, CompactionTriggerItem(type="compaction_trigger")],
            chat_template_kwargs=self.chat_template_kwargs,
            store=False,
        )


class InputTokensRequest(Strict):
    """POST /v1/responses/input_tokens: the fields of a Responses request that make its prompt,
    counted as the response would render it (vLLM's chat_template_kwargs too)."""

    model: str | None = None
    input: str | list[InputItem] | None = None
    instructions: str | None = None
    tools: list[ResponsesTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceObject | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    previous_response_id: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    conversation: str | ConversationRef | None = None

    def as_response(self) -> ResponsesRequest:
        """The Responses request these fields belong to."""
        return ResponsesRequest(**{name: getattr(self, name) for name in self.model_fields_set})


def output_logprobs(body: ResponsesRequest) -> bool:
    """Whether the reply's message carries its tokens' logprobs."""
    return "message.output_text.logprobs" in (body.include or [])


def offers_functions(body: ResponsesRequest) -> bool:
    """Whether the model is offered functions to call: not with no tools, an empty list (the
    agents SDK sends `tools: []` with every request) or only hosted tools left out of the
    prompt (web search)."""
    return any(isinstance(t, FunctionToolSpec | NamespaceToolSpec) for t in body.tools or [])


def refusal(body: ResponsesRequest) -> ServerError | None:
    """A 400 naming the first option of this request the server does not serve."""
    checks = [
        (
            "store",
            bool(body.background) and body.store is False,
            "a background response is stored to be polled: store cannot be false",
        ),
        (
            "background_options",
            body.background_options is not None,
            "background_options are not supported (background: true is)",
        ),
        (
            "conversation",
            body.conversation is not None and body.previous_response_id is not None,
            "conversation and previous_response_id cannot both be given",
        ),
        ("prompt", body.prompt is not None, "stored prompt templates are not supported"),
        (
            "include",
            output_logprobs(body) and offers_functions(body) and body.tool_choice != "none",
            "output logprobs are served for replies without tools: a message's tokens are "
            "told from its calls' only as the reply is read",
        ),
    ]
    return next((ServerError(400, m, f) for f, bad, m in checks if bad), None)


class ConversationCreate(Strict):
    """POST /v1/conversations."""

    items: list[InputItem] | None = None
    metadata: dict[str, str] | None = None


class ConversationUpdate(Strict):
    """POST /v1/conversations/{id}: the metadata, replaced."""

    metadata: dict[str, str]


class ConversationItemsCreate(Strict):
    """POST /v1/conversations/{id}/items."""

    items: list[InputItem]
