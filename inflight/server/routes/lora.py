"""LoRA adapters served at run time: vLLM's load and unload endpoints."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from inflight.server.errors import ServerError
from inflight.server.protocol import LoadLoRARequest, UnloadLoRARequest
from inflight.server.state import State

router = APIRouter()


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoRARequest, state: State) -> Response:
    """Serve a PEFT adapter under a name (then a `model` of requests); 400 with the reason when
    it cannot be served (LoRA off, a name taken, another base model's shapes, a rank too high)."""
    llm = state.client.llm
    if body.lora_name in state.settings.model_names:
        raise ServerError(400, "lora_name is a name of the base model", "lora_name")
    try:
        # Reading the adapter's files does not touch the model: off the event loop.
        await asyncio.get_running_loop().run_in_executor(
            None, llm.load_lora_adapter, body.lora_name, body.lora_path
        )
    except ValueError as exc:
        raise ServerError(400, str(exc), "lora_path") from exc
    return JSONResponse({"status": "loaded", "lora_name": body.lora_name})


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoRARequest, state: State) -> Response:
    """Stop serving an adapter (requests running with it finish); 404 when none has that name."""
    try:
        state.client.llm.unload_lora_adapter(body.lora_name)
    except ValueError as exc:
        raise ServerError(404, str(exc), "lora_name") from exc
    return JSONResponse({"status": "unloaded", "lora_name": body.lora_name})
