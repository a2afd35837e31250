"""vLLM's tokenizer routes: /tokenize (a text prompt, or chat messages as a chat completion
renders them) and /detokenize. `vllm bench serve` aligns its prompts to the server's tokenizer
through them."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from inflight.server import openai
from inflight.server.errors import ServerError
from inflight.server.protocol import DetokenizeRequest, TokenizeRequest
from inflight.server.state import State, check_body
from inflight.server.tools import ToolChoice

router = APIRouter()


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, state: State) -> dict[str, Any]:
    check_body(state, body, body.model)
    llm = state.client.llm
    if (body.prompt is None) == (body.messages is None):
        raise ServerError(400, "send a prompt or messages (one of them)", "prompt")
    if body.prompt is not None:
        unused = [f for f in ("tools", "chat_template_kwargs") if getattr(body, f) is not None]
        if unused:
            raise ServerError(400, f"{unused[0]} applies to messages only", unused[0])
        ids = llm.tokenizer.encode(
            body.prompt, add_special_tokens=body.add_special_tokens is not False
        )
    else:
        ids = await _chat_tokens(body, state)
    return {
        "count": len(ids),
        "max_model_len": llm.max_model_len,
        "tokens": ids,
        "token_strs": [llm.tokenizer.token_str(t) for t in ids] if body.return_token_strs else None,
    }


async def _chat_tokens(body: TokenizeRequest, state: State) -> list[int]:
    """The prompt a chat completion of these messages would run (its tools rendered whatever
    the tool choice)."""
    if body.add_special_tokens:
        raise ServerError(
            400,
            "add_special_tokens: true is not supported with messages: they are tokenized as a "
            "chat completion's prompt, whose special tokens are the chat template's",
            "add_special_tokens",
        )
    assert body.messages is not None
    messages = openai.chat_messages(body.messages)
    tools = openai.chat_tools(body.tools)
    choice = ToolChoice(tools, "none") if tools else None
    template = state.chat.template_args(
        messages,
        choice,
        body.chat_template_kwargs,
        add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message,
    )
    return await state.client.prompt_tokens(messages, **template)


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, state: State) -> dict[str, str]:
    check_body(state, body, body.model)
    tokenizer = state.client.llm.tokenizer
    bad = next((t for t in body.tokens if t >= tokenizer.vocab_size), None)
    if bad is not None:
        raise ServerError(
            400,
            f"token id {bad} is outside the tokenizer's vocabulary (size {tokenizer.vocab_size})",
            "tokens",
        )
    return {"prompt": tokenizer.decode(body.tokens, skip_special_tokens=False)}
