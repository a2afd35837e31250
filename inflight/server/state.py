"""What every route reads: the server's settings and its engine client, kept on the app."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import Depends, Request
from pydantic import BaseModel

from inflight.server.chat import ChatSetup
from inflight.server.client import EngineClient
from inflight.server.errors import ServerError
from inflight.server.protocol import unsupported
from inflight.server.spoken import Transcripts
from inflight.server.warmup import WarmUp


@dataclass(frozen=True)
class ServerSettings:
    served_model_name: str  # the name replies carry
    # --served-model-name's further names (vLLM's): a request may name the model by any of them.
    model_aliases: tuple[str, ...] = ()
    api_key: str | None = None
    max_body_bytes: int = 8 * 1024 * 1024
    chat_template: str | None = None  # the text of --chat-template
    tool_call_parser: str | None = None  # --tool-call-parser: how `auto` tool choice reads calls
    reasoning_parser: str | None = None  # --reasoning-parser
    # --warmup-prompts: prefilled and pinned before the server reports ready.
    warmup_prompts: list[Any] = field(default_factory=list)

    @property
    def model_names(self) -> tuple[str, ...]:
        return (self.served_model_name, *self.model_aliases)


@dataclass(frozen=True)
class ServerState:
    client: EngineClient
    settings: ServerSettings
    chat: ChatSetup
    warm_up: WarmUp
    # The transcripts of the replies this server spoke, by audio id.
    transcripts: Transcripts = field(default_factory=Transcripts)


async def server_state(request: Request) -> ServerState:
    """The state `build_app` stored on the app (a FastAPI dependency; async, so that FastAPI
    does not run it on a worker thread)."""
    return request.app.state.inflight


def check_body(state: ServerState, body: BaseModel, model: str | None) -> str | None:
    """The LoRA adapter `model` names (None: the base model); 404 for a name served by no
    model here; 400 naming the first field this server does not serve."""
    served = state.settings.served_model_name
    llm = state.client.llm
    if llm.speech_facts is not None:
        raise ServerError(
            400, f"{served} is a text-to-speech model: send text to POST /v1/audio/speech", "model"
        )
    adapters = llm.lora_adapters
    names = state.settings.model_names
    if model is not None and model not in names and model not in adapters:
        raise not_served(model, [*names, *adapters])
    refusal = unsupported(body)
    if refusal is not None:
        raise ServerError(400, refusal[1], refusal[0])
    return model if model in adapters else None


def not_served(model: str, names: list[str]) -> ServerError:
    """The 404 for a model name none of the served `names` has."""
    served = ", ".join(repr(n) for n in names)
    message = f"model {model!r} is not served here; served: {served}"
    return ServerError(404, message, "model", code="model_not_found")


# A route's parameter of this type receives the server's state.
State = Annotated[ServerState, Depends(server_state)]
