"""The tool choice of a chat request, which both APIs map onto: the tools, whether the model may
call them (`auto`), must call one or more (`required`), must call one named function, or may
not (`none`); and the output constraint that makes a forced choice hold.

A forced choice constrains the output with a JSON schema built from the tools: a call object
`{"name": NAME, ARGUMENTS_KEY: PARAMETERS}` for a named function, an array of one or more of
them for `required` (vLLM's schema, with the name's enum written as a const), so the arguments
always parse and match the tool's parameters. Objects of the parameters take only the
properties they declare unless they allow more (`additionalProperties`); a tool's `strict`
(OpenAI's) closes also the objects that declare no properties, as OpenAI's strict mode
requires. `auto` reads what the model writes with the server's `--tool-call-parser`, and needs
one: its calls are not constrained, `strict` or not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from inflight.protocol.request import StructuredOutputs
from inflight.server.errors import ServerError

ToolMode = Literal["none", "auto", "required", "named"]
_NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True)
class FunctionTool:
    name: str
    description: str | None
    parameters: dict[str, Any] | None  # a JSON schema; None: the function takes no arguments
    strict: bool = False  # OpenAI's strict function calling: every object of its parameters closed

    def as_openai(self) -> dict[str, Any]:
        """The tool as chat templates read it (OpenAI's function tool), as it was sent."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        if self.parameters is not None:
            function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolChoice:
    tools: list[FunctionTool]
    mode: ToolMode
    function: str | None = None  # the function a named choice calls
    parallel: bool = True  # more than one call in a reply

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "named")

    @property
    def sole_function(self) -> str | None:
        """The one function a forced choice leaves to call: the named one, or `required`'s
        only tool."""
        if self.mode == "required" and len(self.tools) == 1:
            return self.tools[0].name
        return self.function if self.mode == "named" else None


def tool_choice(
    tools: list[FunctionTool],
    mode: ToolMode | None,
    function: str | None,
    parallel: bool,
    *,
    parser: str | None,
) -> ToolChoice | None:
    """Check a request's tools and tool choice (a 400 naming the field) against the server's
    tool-call parser; None when the request has no tools to offer."""
    names = [t.name for t in tools]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ServerError(
            400, f"tools: function names must be unique, got {repeated} twice", "tools"
        )
    if mode is None:
        mode = "auto" if tools else "none"
    if mode in ("required", "named") and not tools:
        raise ServerError(400, f"tool_choice {mode!r} needs tools to choose from", "tool_choice")
    if mode == "named" and function not in names:
        raise ServerError(
            400,
            f"tool_choice names the function {function!r}, which is not among the tools "
            f"({', '.join(names)})",
            "tool_choice",
        )
    if mode == "auto" and tools and parser is None:
        raise ServerError(
            400,
            '"auto" tool choice needs a tool-call parser: start the server with '
            '--tool-call-parser (hermes or llama3_json), or send tool_choice "required", '
            '"none" or a named function',
            "tool_choice",
        )
    if not tools:
        return None
    return ToolChoice(tools, mode, function if mode == "named" else None, parallel)


def allowed_tools(tools: list[FunctionTool], names: list[str], field: str) -> list[FunctionTool]:
    """The tools an `allowed_tools` choice keeps, in the request's order: the only ones the
    model is shown and may call (a 400 naming an allowed function the request lacks)."""
    offered = [t.name for t in tools]
    for i, name in enumerate(names):
        if name not in offered:
            raise ServerError(
                400,
                f"tool_choice allows the function {name!r}, which is not among the tools "
                f"({', '.join(offered)})",
                f"{field}.{i}",
            )
    return [t for t in tools if t.name in names]


def forced_constraint(choice: ToolChoice, arguments_key: str) -> StructuredOutputs:
    """The JSON schema a `required` or named choice constrains the output to; strict when one
    of the tools it may call is (the constraint is one schema: a non-strict tool beside a strict
    one then gets its property-less objects closed too)."""
    defs: dict[tuple[str, str], Any] = {}

    def call_schema(tool: FunctionTool) -> dict[str, Any]:
        parameters = dict(tool.parameters or _NO_ARGUMENTS)
        # References point at the schema's root, so the definitions move there.
        for key in ("$defs", "definitions"):
            for name, definition in (parameters.pop(key, None) or {}).items():
                if defs.setdefault((key, name), definition) != definition:
                    raise ServerError(
                        400,
                        f"tools define {key} {name!r} differently; rename one of them",
                        "tools",
                    )
        return {
            "type": "object",
            "properties": {"name": {"const": tool.name}, arguments_key: parameters},
            "required": ["name", arguments_key],
            "additionalProperties": False,
        }

    if choice.mode == "named":
        callable_tools = [t for t in choice.tools if t.name == choice.function]
        schema = call_schema(callable_tools[0])
    else:
        callable_tools = choice.tools
        schema = {
            "type": "array",
            "minItems": 1,
            "items": {"anyOf": [call_schema(t) for t in choice.tools]},
        }
        if not choice.parallel:
            schema["maxItems"] = 1
    for (key, name), definition in defs.items():
        schema.setdefault(key, {})[name] = definition
    return StructuredOutputs(json=schema, strict=any(t.strict for t in callable_tools))
