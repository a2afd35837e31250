"""Operations routes: health and readiness (open without an API key) and Prometheus metrics."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from inflight.server.routes import READ
from inflight.server.state import State

router = APIRouter()


@router.api_route("/health", methods=READ)
async def health(state: State) -> Response:
    client, llm = state.client, state.client.llm
    fault = llm.engine_fault
    if fault is not None:
        return JSONResponse({"status": "failed", "error": fault}, status_code=503)
    scheduling = llm.get_scheduling_metrics()
    cache = llm.get_context_cache_metrics()
    body: dict[str, Any] = {
        "status": "healthy",
        "model": state.settings.served_model_name,
        "active_requests": client.gate.active,
        "queued_requests": scheduling["queued"] if scheduling else client.gate.waiting,
        "scheduling": scheduling,
        "context_cache": cache,
        "speculative_decoding": llm.get_speculative_metrics(),
        "encoder": llm.get_encoder_metrics(),
        "capabilities": {
            "chat": llm.speech_facts is None,
            "completions": llm.speech_facts is None,
            "speech": llm.speech_facts is not None,
            "input_modalities": llm.input_modalities,
            "output_modalities": llm.output_modalities,
            "in_flight_batching": llm.in_flight_batching,
            "max_num_seqs": llm.max_batch_size,
            "max_model_len": llm.max_model_len,
            "context_reuse": cache is not None,
        },
    }
    return JSONResponse(body)


@router.api_route("/health/ready", methods=READ)
async def ready(state: State) -> Response:
    gate, fault = state.client.gate, state.client.llm.engine_fault
    if fault is not None:
        return JSONResponse({"status": "failed", "error": fault}, status_code=503)
    if gate.closing:
        return JSONResponse({"status": "shutting_down"}, status_code=503)
    warm_up = state.warm_up
    if warm_up.error is not None:
        return JSONResponse({"status": "warm_up_failed", "error": warm_up.error}, status_code=503)
    if not warm_up.finished:
        progress = {"done": warm_up.done, "total": warm_up.total}
        return JSONResponse({"status": "warming_up", **progress}, status_code=503)
    return JSONResponse(
        {"status": "ready", "active_requests": gate.active, "queued_requests": gate.waiting}
    )


@router.api_route("/metrics", methods=READ)
async def metrics(state: State) -> Response:
    return Response(state.client.metrics.render(), media_type="text/plain; version=0.0.4")
