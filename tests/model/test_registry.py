"""The registry of model families: its lookups name what it holds, and a family defined outside
the package (here, in this module) is read, built and served with no other file changed."""

import json
import shutil
from dataclasses import replace

import pytest
import torch

import inflight.model.families  # noqa: F401 (registers every family)
from inflight import LLM, SamplingParams
from inflight.model import registry
from inflight.model.checkpoints.loader import build_model, open_checkpoint
from inflight.model.config import ModelConfig
from inflight.model.families.llama import LlamaForCausalLM, llama_from_hf
from inflight.model.registry import Family

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


class HalvedLogits(LlamaForCausalLM):
    """A trivially different decoder: Llama's, its logits halved (which no greedy pick sees)."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) / 2


def _halved_from_hf(cfg: dict) -> ModelConfig:
    return replace(llama_from_hf(cfg, "llama"), family="halved")


HALVED = Family(
    "halved",
    HalvedLogits,
    hf_architectures=("HalvedForCausalLM",),
    from_hf=_halved_from_hf,
)


@pytest.fixture
def halved_family():
    registry.register(HALVED)
    yield HALVED
    registry.unregister(HALVED.name)


@pytest.fixture
def halved_dir(tiny_dirs, tmp_path):
    """The tiny Llama checkpoint, its config.json naming the family defined here."""
    path = shutil.copytree(tiny_dirs["llama"], tmp_path / "halved")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(
        json.dumps({**config, "architectures": ["HalvedForCausalLM"]})
    )
    return path


def test_a_family_defined_outside_the_package_loads_and_serves(
    halved_family, halved_dir, tiny_dirs
):
    checkpoint = open_checkpoint(halved_dir)
    assert checkpoint.config == replace(open_checkpoint(tiny_dirs["llama"]).config, family="halved")
    model = build_model(checkpoint, torch.float32, torch.device("cpu"), 64, quantization="none")
    assert type(model) is HalvedLogits
    hidden = torch.randn(3, checkpoint.config.hidden_size)
    plain = build_model(
        open_checkpoint(tiny_dirs["llama"]),
        torch.float32,
        torch.device("cpu"),
        64,
        quantization="none",
    )
    assert torch.equal(model.compute_logits(hidden), plain.compute_logits(hidden) / 2)
    outputs = {}
    for name, path in (("halved", halved_dir), ("llama", tiny_dirs["llama"])):
        llm = LLM(str(path), max_model_len=128)
        try:
            outputs[name] = llm.generate("The quick brown fox", GREEDY)[0].token_ids
        finally:
            llm.close()
    assert outputs["halved"] == outputs["llama"] and len(outputs["halved"]) == 8


def test_without_its_family_the_architecture_is_unsupported(halved_dir):
    with pytest.raises(ValueError, match=r"unsupported architecture \['HalvedForCausalLM'\]"):
        open_checkpoint(halved_dir)


def test_lookups_name_what_the_registry_holds():
    with pytest.raises(
        ValueError,
        match=r"unsupported architecture \['GemmaForCausalLM'\]; "
        r"supported: DiffusionGemmaForBlockDiffusion, LlamaForCausalLM, MistralForCausalLM, "
        r".*BambaForCausalLM",
    ):
        registry.config_from_hf({"architectures": ["GemmaForCausalLM"]})
    with pytest.raises(ValueError, match="unsupported architecture 'gemma'"):
        registry.config_from_hf({"model_type": "gemma"})
    with pytest.raises(
        ValueError, match="unsupported GGUF architecture 'gemma'; supported: .*granitehybrid"
    ):
        registry.gguf_family("gemma")
    with pytest.raises(
        ValueError, match="unknown model family 'gemma'; registered: diffusion_gemma, llama, "
    ):
        registry.by_name("gemma")
    assert registry.gguf_family("granitehybrid").name == "bamba"
    assert registry.by_name("qwen3").model is LlamaForCausalLM


def test_a_wrapper_builds_no_model_of_its_own(tiny_dirs):
    config = replace(open_checkpoint(tiny_dirs["llama"]).config, family="llava")
    with pytest.raises(ValueError, match="model family 'llava' builds no model of its own"):
        registry.model_builder(config)


def test_registering_refuses_what_is_taken_and_what_is_incomplete():
    with pytest.raises(ValueError, match="model family 'qwen3': qwen3 already registered"):
        registry.register(Family("qwen3", LlamaForCausalLM))
    taken = Family("other", LlamaForCausalLM, ("LlamaForCausalLM",), from_hf=_halved_from_hf)
    with pytest.raises(ValueError, match="LlamaForCausalLM already registered"):
        registry.register(taken)
    with pytest.raises(ValueError, match="reads Hugging Face configs but has no parser"):
        Family("other", LlamaForCausalLM, ("OtherForCausalLM",))
    with pytest.raises(ValueError, match="reads GGUF files but lacks"):
        Family("other", LlamaForCausalLM, gguf_architectures=("other",))
    with pytest.raises(ValueError, match="unknown model family 'other'"):
        registry.unregister("other")
