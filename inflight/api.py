"""The Python API: `LLM` and `SamplingParams`, in the shape vLLM users know."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inflight.runtime.request import GenerationRequest, SamplingParams
from inflight.runtime.runtime import Runtime, RuntimeConfig
from inflight.runtime.stepped import CompletionOutput, LogprobEntry

Message = dict[str, Any]
# A prompt is raw text, a chat conversation (a list of messages), or pre-tokenized ids.
Prompt = str | list[Message] | dict[str, Any]


@dataclass(frozen=True)
class StreamDelta:
    """One piece of a streamed generation; the last one has `finished` set."""

    text: str
    token_ids: tuple[int, ...]
    finished: bool
    finish_reason: str | None
    logprobs: tuple[LogprobEntry, ...] | None
    prompt_tokens: int


class LLM:
    """A loaded model you can generate from.

    `model` is a Hugging Face checkpoint directory or a `.gguf` file; None loads the embedded
    default, SmolLM2-135M-Instruct. Requests run one at a time, each to completion (the
    blocking path).
    """

    def __init__(
        self,
        model: str | Path | None = None,
        *,
        max_batch_size: int = 8,
        max_model_len: int | None = None,
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        max_num_tokens: int = 2048,
        dtype: str | None = None,
        device: str | None = None,
        seed: int | None = None,
    ) -> None:
        config = RuntimeConfig(
            max_batch_size=max_batch_size,
            max_model_len=max_model_len,
            block_size=block_size,
            num_kv_blocks=num_kv_blocks,
            max_num_tokens=max_num_tokens,
            dtype=dtype,
            device=device,
            seed=seed,
        )
        self._runtime: Runtime | None = Runtime(model, config)
        self._lock = threading.Lock()  # the blocking path serves one request at a time
        self.tokenizer = self._runtime.tokenizer
        self.model_name = self._runtime.model_name
        self.max_model_len = self._runtime.max_model_len

    # -- generation -----------------------------------------------------------------------------

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's recommended settings (generation_config.json)."""
        return SamplingParams(**self._live().checkpoint.sampling_defaults)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[CompletionOutput]:
        """Generate for one prompt or a list of them; returns one output per prompt, in order."""
        requests = self._requests(prompts, params)
        return [self._run(request) for request in requests]

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[CompletionOutput]:
        """Generate a reply to a conversation (or to each of a list of conversations)."""
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list of chat messages")
        conversations = messages if isinstance(messages[0], list) else [messages]
        return self.generate(conversations, params)

    def generate_stream(
        self, prompt: Prompt, params: SamplingParams | None = None
    ) -> Iterator[StreamDelta]:
        """Yield the output as it is generated; closing the iterator cancels the request."""
        (request,) = self._requests(prompt, params)
        return self._stream(request)

    def close(self) -> None:
        """Release the model; the LLM cannot generate afterwards. Safe to call twice."""
        with self._lock:
            self._runtime = None

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ------------------------------------------------------------------------------

    def _live(self) -> Runtime:
        if self._runtime is None:
            raise RuntimeError("this LLM is closed")
        return self._runtime

    def _run(self, request: GenerationRequest) -> CompletionOutput:
        with self._lock:
            return self._live().handle_request(request).result()

    def _stream(self, request: GenerationRequest) -> Iterator[StreamDelta]:
        prompt_tokens = len(request.prompt_token_ids)
        with self._lock:
            run = self._live().handle_request(request)
            finished = False
            for delta in run:
                out = run.output
                finished = out is not None
                yield StreamDelta(
                    delta.text,
                    tuple(delta.token_ids),
                    finished,
                    out.finish_reason if out else None,
                    None if delta.logprobs is None else tuple(delta.logprobs),
                    prompt_tokens,
                )
            if not finished:
                yield StreamDelta("", (), True, run.output.finish_reason, None, prompt_tokens)

    def _requests(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None,
    ) -> list[GenerationRequest]:
        items = _as_prompt_list(prompts)
        if params is None:
            params = self.get_default_sampling_params()
        if isinstance(params, SamplingParams):
            param_list = [params] * len(items)
        else:
            param_list = list(params)
            if len(param_list) != len(items):
                raise ValueError(
                    f"got {len(param_list)} SamplingParams for {len(items)} prompts; "
                    "pass one, or one per prompt"
                )
        return [
            GenerationRequest(self._tokenize(p), sp)
            for p, sp in zip(items, param_list, strict=True)
        ]

    def _tokenize(self, prompt: Prompt) -> list[int]:
        tokenizer = self.tokenizer
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            return tokenizer.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, dict):
            ids = prompt.get("prompt_token_ids")
            if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
                raise ValueError("a token prompt must be {'prompt_token_ids': [int, ...]}")
            return ids
        _check_messages(prompt)
        text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True)
        return tokenizer.encode(text, add_special_tokens=False)


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str | dict):
        return [prompts]
    if isinstance(prompts, list | tuple):
        if not prompts:
            raise ValueError("prompts is empty")
        if all(isinstance(m, dict) and "role" in m for m in prompts):
            return [list(prompts)]  # one conversation
        return list(prompts)
    raise ValueError(
        f"prompts must be a string, a list of strings or a list of chat conversations, "
        f"got {type(prompts).__name__}"
    )


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError("a chat conversation must be a non-empty list of messages")
    for m in messages:
        if not isinstance(m, dict) or "role" not in m:
            raise ValueError(f"each chat message must be a dict with a 'role', got {m!r}")
