"""`InputProcessor`: prompts in, checked requests out. It tokenizes text, renders chat
conversations through the chat template, prepares their media (decoded, preprocessed, the
placeholders expanded) and hands each request to the runtime's check, so a request leaves
carrying its admission intent and bad input fails here, before anything is queued."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from itertools import takewhile
from typing import Any

from inflight.protocol.request import (
    MEDIA_FIELD,
    GenerationRequest,
    MediaItem,
    RequestFieldError,
    SamplingParams,
)
from inflight.protocol.tokenizer import Tokenizer
from inflight.runtime.host.media import expand, keep_ratio, media_spec
from inflight.runtime.inputs.chat_media import MediaLimits, as_text, take_media
from inflight.runtime.inputs.preprocessing import MediaInput

Message = dict[str, Any]
# A prompt is raw text, a chat conversation (a list of messages), or a dict of vLLM's keys.
Prompt = str | list[Message] | dict[str, Any]

# What a prompt given as a dict may hold (vLLM's keys).
_PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids", "multi_modal_data", "mm_processor_kwargs"})

# Variables the rendering itself sets; chat_template_kwargs may not replace them.
_RESERVED_TEMPLATE_VARIABLES = frozenset(
    {"messages", "tools", "add_generation_prompt", "continue_final_message", "chat_template"}
)


class InputProcessor:
    """Turns prompts into requests for one loaded model: its `tokenizer`, the `media` kinds it
    takes, the deployment's media `limits`, and `check` (the runtime's: a request carrying its
    admission intent, or a ValueError naming the problem)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        media: Mapping[str, MediaInput],
        limits: MediaLimits,
        check: Callable[[GenerationRequest], GenerationRequest],
    ) -> None:
        self.tokenizer = tokenizer
        self.media = dict(media)
        self.specs = {kind: found.spec for kind, found in self.media.items()}
        self.limits = limits
        self._check = check

    def requests(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams],
        options: Mapping[str, Any] | None = None,
        template: Mapping[str, Any] | None = None,
        processor_kwargs: Mapping[str, Any] | None = None,
    ) -> list[GenerationRequest]:
        """One checked request per prompt, in order. `params`: one for all, or one per prompt;
        `options`: request options of the support matrix (`lora_name`, ...); `template`: the
        chat template's arguments (see `template_args`); `processor_kwargs`: vLLM's
        `mm_processor_kwargs` for the prompts' media (a prompt dict's own take precedence)."""
        items = _as_prompt_list(prompts)
        if isinstance(params, SamplingParams):
            param_list = [params] * len(items)
        else:
            param_list = list(params)
            if len(param_list) != len(items):
                raise ValueError(
                    f"got {len(param_list)} SamplingParams for {len(items)} prompts; "
                    "pass one, or one per prompt"
                )
        options = options or {}
        requests = []
        for prompt, sp in zip(items, param_list, strict=True):
            ids, data = self.tokenize(prompt, template)
            media: list[MediaItem] = []
            if data:
                kwargs = processor_kwargs
                if isinstance(prompt, dict):
                    kwargs = prompt.get("mm_processor_kwargs", kwargs)
                ids, media = self.expand_media(ids, data, kwargs)
            system = None
            if options.get("save_system_prompt_kv_cache") and isinstance(prompt, list):
                system = self.system_prompt_tokens(prompt, ids, template)
            requests.append(
                GenerationRequest(ids, sp, media=media, system_prompt_tokens=system, **options)
            )
        # Every prompt is checked before any is returned: a list fails whole or not at all.
        return [self._check(request) for request in requests]

    def tokenize(
        self, prompt: Prompt, template: Mapping[str, Any] | None = None
    ) -> tuple[list[int], dict[str, Any] | None]:
        """A prompt's token ids, and its media (`multi_modal_data`) if any."""
        if template and not isinstance(prompt, list):
            raise ValueError("tools and chat template arguments apply to chat messages only")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            return self.tokenizer.encode(prompt, add_special_tokens=True), None
        if isinstance(prompt, dict):
            return self._tokenize_dict(prompt)
        _check_messages(prompt)
        messages, media = take_media(prompt, self.limits, self.specs)
        if not media:
            return self._render(as_text(messages, {}), template), None
        placeholders = {kind: self.placeholder(kind) for kind in media}
        # A template of a media model renders media parts as their placeholders; one that
        # renders text only gets each placeholder's text on a line before the message's text,
        # as does one that fails on parts (it joins a message's content to strings: the
        # hermes template the server renders tool conversations with).
        try:
            ids = self._render(messages, template)
        except ValueError:
            ids = []
        counts = {kind: sum(1 for t in ids if t == token) for kind, token in placeholders.items()}
        if any(counts[kind] != len(items) for kind, items in media.items()):
            texts = {
                kind: self.tokenizer.decode([token], skip_special_tokens=False)
                for kind, token in placeholders.items()
            }
            ids = self._render(as_text(messages, texts), template)
        return ids, media

    def system_prompt_tokens(
        self, messages: list[Message], ids: Sequence[int], template: Mapping[str, Any] | None
    ) -> int:
        """How many of a conversation's prompt tokens `ids` are its system turn: those its
        leading system (or developer) messages render to alone. A RequestFieldError where it
        has none, or the template renders them alone differently."""
        field = "save_system_prompt_kv_cache"
        leading = list(takewhile(lambda m: m.get("role") in ("system", "developer"), messages))
        if not leading:
            raise RequestFieldError(
                f"{field}: the conversation opens with no system message to pin", field
            )
        try:
            alone = {**(template or {}), "add_generation_prompt": False}
            alone.pop("continue_final_message", None)
            text = self.tokenizer.apply_chat_template(as_text(leading, {}), **alone)
        except Exception as exc:  # a template may insist on a user turn
            raise RequestFieldError(
                f"{field}: the chat template does not render the system message alone ({exc})",
                field,
            ) from exc
        alone = self.tokenizer.encode(text, add_special_tokens=False)
        common = next(
            (i for i, (a, b) in enumerate(zip(alone, ids, strict=False)) if a != b),
            min(len(alone), len(ids)),
        )
        if common == 0:
            raise RequestFieldError(
                f"{field}: the chat template renders the system message alone unlike at the "
                "head of the conversation",
                field,
            )
        return common

    def placeholder(self, kind: str) -> int:
        """The token that stands for one `kind` item in a prompt (RequestFieldError when the
        model takes none)."""
        return media_spec(self.specs, kind).placeholder

    def expand_media(
        self,
        prompt: Sequence[int],
        data: Mapping[str, Any],
        processor_kwargs: Mapping[str, Any] | None = None,
    ) -> tuple[list[int], list[MediaItem]]:
        """A tokenized prompt with its placeholders expanded for `data` (vLLM's
        `multi_modal_data`: {"image": a PIL image or a list of them, "audio": an array of 16 kHz
        samples, (samples, sampling rate), or a list of those; one per placeholder of the kind,
        in order}), and its media, preprocessed; `processor_kwargs` (vLLM's
        `mm_processor_kwargs`): {"keep_ratio": r} keeps that share of each image's tokens
        (`model.encoders.vision.prune_image_tokens`). A RequestFieldError names what is wrong."""
        ratio = keep_ratio(processor_kwargs)
        groups = []
        for kind, given in data.items():
            spec = media_spec(self.specs, kind)
            items = list(given) if isinstance(given, list) else [given]
            try:
                prepared = [self.media[kind].prepare(item) for item in items]
            except (ValueError, OSError) as exc:
                raise RequestFieldError(f"cannot read an {kind}: {exc}", MEDIA_FIELD) from exc
            groups.append((spec, prepared))
        return expand(prompt, groups, ratio)

    def _tokenize_dict(self, prompt: dict[str, Any]) -> tuple[list[int], dict[str, Any] | None]:
        unknown = sorted(set(prompt) - _PROMPT_KEYS)
        if unknown or ("prompt" in prompt) == ("prompt_token_ids" in prompt):
            raise ValueError(
                "a prompt dict holds 'prompt' (text) or 'prompt_token_ids' ([int, ...]), "
                "and optionally 'multi_modal_data' and 'mm_processor_kwargs'; got keys "
                f"{sorted(prompt)}"
            )
        data = prompt.get("multi_modal_data")
        if data is not None and not isinstance(data, dict):
            raise ValueError("multi_modal_data must be a dict such as {'image': image}")
        for kind, items in (data or {}).items():
            items = items if isinstance(items, list) else [items]
            self.limits.check_count(kind, len(items))
            if kind == "audio":
                for clip in items:
                    self.limits.check_audio(clip)
        if "prompt" in prompt:
            if not isinstance(prompt["prompt"], str):
                raise ValueError("a prompt dict's 'prompt' must be a string")
            return self.tokenize(prompt["prompt"])[0], data
        ids = prompt["prompt_token_ids"]
        if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
            raise ValueError("a token prompt must be {'prompt_token_ids': [int, ...]}")
        return ids, data

    def _render(self, messages: list[Message], template: Mapping[str, Any] | None) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            messages, **{"add_generation_prompt": True, **(template or {})}
        )
        return self.tokenizer.encode(text, add_special_tokens=False)


def template_args(
    tools: list[dict[str, Any]] | None,
    chat_template: str | None,
    chat_template_kwargs: Mapping[str, Any] | None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> dict[str, Any]:
    """The keyword arguments of `Tokenizer.apply_chat_template` for a conversation (vLLM's
    `add_generation_prompt` and `continue_final_message` only where they differ from the
    default: a reply opened after the conversation)."""
    kwargs = dict(chat_template_kwargs or {})
    reserved = sorted(_RESERVED_TEMPLATE_VARIABLES & set(kwargs))
    if reserved:
        raise ValueError(f"chat_template_kwargs may not set {reserved}; pass them as arguments")
    if add_generation_prompt and continue_final_message:
        raise RequestFieldError(
            "continue_final_message continues the final message in place of a new reply: send "
            "add_generation_prompt=False with it",
            "continue_final_message",
        )
    if tools is not None:
        kwargs["tools"] = tools
    if chat_template is not None:
        kwargs["chat_template"] = chat_template
    if not add_generation_prompt:
        kwargs["add_generation_prompt"] = False
    if continue_final_message:
        kwargs["continue_final_message"] = True
    return kwargs


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
