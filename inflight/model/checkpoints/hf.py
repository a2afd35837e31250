"""A Hugging Face checkpoint directory: config, safetensors shards, tokenizer, generation config."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from tokenizers import Tokenizer as BackendTokenizer

import inflight.model.families  # noqa: F401 (registers every family)
from inflight.model import registry
from inflight.model.checkpoints.bpe_files import bpe_files_tokenizer
from inflight.model.checkpoints.tokenizer import SpecialTokens, Tokenizer
from inflight.model.config import ModelConfig

# Subdirectories holding a component of the model, each a config.json and safetensors of its
# own (Qwen3-TTS's speech tokenizer): the config joins the model's as "<name>_config", the
# tensors its weights as "<name>.<tensor>".
COMPONENTS = ("speech_tokenizer",)


class HFCheckpoint:
    def __init__(self, path: Path) -> None:
        self.path = path
        if not (path / "config.json").is_file():
            raise ValueError(f"model directory {path} has no config.json")
        self.raw_config = self._json("config.json")
        for name in self._components():
            self.raw_config[f"{name}_config"] = self._json(f"{name}/config.json")
        self.generation_config = self._json("generation_config.json", {})
        # Some families read their settings from it (a diffusion model's denoising defaults).
        self.raw_config.setdefault("generation_config", self.generation_config)

    def _json(self, name: str, default: Any = None) -> Any:
        file = self.path / name
        if not file.is_file():
            if default is None:
                raise ValueError(f"model directory {self.path} has no {name}")
            return default
        return json.loads(file.read_text(encoding="utf-8"))

    def config(self) -> ModelConfig:
        """Parsed by the family registered for its `architectures`."""
        return registry.config_from_hf(self.raw_config)

    def _components(self) -> list[str]:
        return [name for name in COMPONENTS if (self.path / name / "config.json").is_file()]

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from _safetensors(self.path, "")
        for name in self._components():
            yield from _safetensors(self.path / name, f"{name}.")

    def tokenizer(self) -> Tokenizer:
        tok_config = self._json("tokenizer_config.json", {})
        backend, byte_level = self._backend_tokenizer(tok_config)
        template = tok_config.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        jinja_file = self.path / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")
        bos, eos = (
            _token_text(tok_config.get("bos_token")),
            _token_text(tok_config.get("eos_token")),
        )
        eos_ids = _ids(self.generation_config.get("eos_token_id"))
        eos_ids += _ids(self.raw_config.get("eos_token_id"))
        if eos is not None and backend.token_to_id(eos) is not None:
            eos_ids.append(backend.token_to_id(eos))
        return Tokenizer(
            backend,
            SpecialTokens(bos=bos, eos=eos, eos_ids=list(dict.fromkeys(eos_ids))),
            chat_template=template,
            byte_level=byte_level,
        )

    def _backend_tokenizer(self, tok_config: dict[str, Any]) -> tuple[BackendTokenizer, bool]:
        """The tokenizer of tokenizer.json, or else of vocab.json + merges.txt (a Qwen2-style
        byte-level BPE), and whether it is byte-level."""
        file = self.path / "tokenizer.json"
        if file.is_file():
            decoder = json.loads(file.read_text(encoding="utf-8")).get("decoder")
            return BackendTokenizer.from_file(str(file)), "ByteLevel" in json.dumps(decoder)
        files = ("vocab.json", "merges.txt")
        missing = [name for name in files if not (self.path / name).is_file()]
        if missing:
            raise ValueError(
                f"model directory {self.path} has no tokenizer.json, nor the vocab.json and "
                f"merges.txt that can stand in for it (missing: {', '.join(missing)})"
            )
        added = tok_config.get("added_tokens_decoder") or {}
        vocab, merges = (self.path / name for name in files)
        return bpe_files_tokenizer(vocab, merges, added), True

    def processor_config(self) -> dict[str, Any]:
        return self._json("preprocessor_config.json", {})

    def sampling_defaults(self) -> dict[str, Any]:
        """The sampling settings generation_config.json recommends (temperature, top_p, top_k,
        repetition_penalty: what vLLM takes from it)."""
        gen = self.generation_config
        keys = ("temperature", "top_p", "top_k", "repetition_penalty")
        return {k: gen[k] for k in keys if gen.get(k) is not None}


def _safetensors(path: Path, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model directory {path} has no *.safetensors weights")
    for name in files:
        with safe_open(str(path / name), framework="pt") as shard:
            for key in shard.keys():  # noqa: SIM118 (a safetensors handle is no dict)
                yield prefix + key, shard.get_tensor(key)


def _token_text(token: Any) -> str | None:
    if isinstance(token, dict):
        return token.get("content")
    return token


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]
