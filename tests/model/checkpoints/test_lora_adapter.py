"""Reading PEFT LoRA adapters: the rank, the scale and the factors of what peft saves, and a
ValueError naming each thing this engine cannot run exactly."""

import dataclasses
import json
import math
import shutil

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from inflight.model.checkpoints.loader import open_checkpoint
from inflight.model.checkpoints.lora import CONFIG_FILE, WEIGHTS_FILE, load_lora_adapter

ALL_SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _save_adapter(model_dir, path, **config) -> None:
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(0)
    get_peft_model(hf, LoraConfig(init_lora_weights=False, **config)).save_pretrained(path)


@pytest.fixture(scope="module")
def saved(tiny_dirs, tmp_path_factory):
    """A rank-4 adapter on every projection of the tiny llama, and one of the tiny qwen3."""
    llama, qwen3 = tmp_path_factory.mktemp("llama-lora"), tmp_path_factory.mktemp("qwen3-lora")
    _save_adapter(tiny_dirs["llama"], llama, r=4, lora_alpha=8, target_modules=ALL_SEVEN)
    _save_adapter(tiny_dirs["qwen3"], qwen3, r=4, lora_alpha=8, target_modules=["q_proj"])
    return {"llama": llama, "qwen3": qwen3}


@pytest.fixture
def config(tiny_dirs):
    return open_checkpoint(tiny_dirs["llama"]).config


@pytest.fixture
def adapter_dir(saved, tmp_path):
    """A copy of the llama adapter, to edit."""
    return shutil.copytree(saved["llama"], tmp_path / "adapter")


def _edit_config(path, **changes) -> None:
    file = path / CONFIG_FILE
    file.write_text(json.dumps({**json.loads(file.read_text()), **changes}))


def _edit_tensors(path, edit) -> None:
    tensors = load_file(path / WEIGHTS_FILE)
    edit(tensors)
    save_file(tensors, path / WEIGHTS_FILE)


def test_reads_what_peft_saves(saved, config):
    adapter = load_lora_adapter(saved["llama"], config, max_rank=4)
    assert adapter.rank == 4 and adapter.scale == 2.0
    assert set(adapter.weights) == {(i, m) for i in range(2) for m in ALL_SEVEN}
    tensors = load_file(saved["llama"] / WEIGHTS_FILE)
    lora_a, lora_b = adapter.weights[1, "k_proj"]
    prefix = "base_model.model.model.layers.1.self_attn.k_proj"
    assert torch.equal(lora_a, tensors[f"{prefix}.lora_A.weight"])
    assert torch.equal(lora_b, tensors[f"{prefix}.lora_B.weight"])
    assert lora_a.shape == (4, 64) and lora_b.shape == (32, 4)


def test_rslora_scales_by_the_square_root_of_the_rank(adapter_dir, config):
    _edit_config(adapter_dir, use_rslora=True, lora_alpha=6)
    assert load_lora_adapter(adapter_dir, config, max_rank=8).scale == 6 / math.sqrt(4)


@pytest.mark.parametrize("targets", [".*(q|v)_proj", ["self_attn.q_proj"]])
def test_targets_are_what_the_tensors_hold(adapter_dir, config, targets):
    """peft's target_modules may be a regex or dotted suffixes of module paths."""
    _edit_config(adapter_dir, target_modules=targets)
    _edit_tensors(adapter_dir, lambda t: [t.pop(k) for k in list(t) if "q_proj" not in k])
    adapter = load_lora_adapter(adapter_dir, config, max_rank=4)
    assert set(adapter.weights) == {(0, "q_proj"), (1, "q_proj")}


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"peft_type": "LOHA"}, "not a LoRA adapter: peft_type is 'LOHA'"),
        ({"use_dora": True}, r"LoRA adapters with DoRA \(use_dora\) are not supported"),
        ({"bias": "lora_only"}, "LoRA adapters with bias='lora_only' are not supported"),
        ({"lora_bias": True}, r"a bias on lora_B \(lora_bias\) are not supported"),
        ({"modules_to_save": ["lm_head"]}, r"fully trained modules \(modules_to_save\)"),
        ({"rank_pattern": {"q_proj": 8}}, r"per-module ranks \(rank_pattern\)"),
        ({"r": 0}, "needs a rank r >= 1 and lora_alpha"),
        (
            {"target_modules": ["q_proj", "embed_tokens"]},
            "LoRA on 'embed_tokens' is not supported: an adapter may target only q_proj, k_proj",
        ),
        ({"target_modules": ["lm_head"]}, "LoRA on 'lm_head' is not supported"),
    ],
)
def test_refuses_configs_it_cannot_run(adapter_dir, config, changes, message):
    _edit_config(adapter_dir, **changes)
    with pytest.raises(ValueError, match=message):
        load_lora_adapter(adapter_dir, config, max_rank=16)


def test_refuses_a_rank_above_the_maximum(saved, config):
    with pytest.raises(ValueError, match="LoRA adapter rank r=4 is above max_lora_rank=2"):
        load_lora_adapter(saved["llama"], config, max_rank=2)


@pytest.mark.parametrize("missing", [CONFIG_FILE, WEIGHTS_FILE])
def test_refuses_a_missing_file(adapter_dir, config, missing):
    (adapter_dir / missing).unlink()
    with pytest.raises(ValueError, match=f"LoRA adapter '.*adapter' has no {missing}"):
        load_lora_adapter(adapter_dir, config, max_rank=16)


def test_refuses_an_adapter_of_another_base(saved, config):
    """qwen3's q_proj (head_dim 32) is 64 -> 128; llama's is 64 -> 64."""
    with pytest.raises(ValueError, match=r"has shape \(128, 4\), expected \(64, 4\).*another base"):
        load_lora_adapter(saved["qwen3"], config, max_rank=16)
    with pytest.raises(ValueError, match="is for layer 1, but the base model has 1 layers"):
        load_lora_adapter(saved["llama"], dataclasses.replace(config, num_layers=1), max_rank=16)


def test_refuses_tensors_it_cannot_place(adapter_dir, config):
    def add_head(tensors):
        tensors["base_model.model.lm_head.lora_A.weight"] = torch.zeros(4, 64)

    _edit_tensors(adapter_dir, add_head)
    with pytest.raises(ValueError, match="LoRA on 'lm_head' is not supported"):
        load_lora_adapter(adapter_dir, config, max_rank=16)


def test_refuses_a_lone_factor(adapter_dir, config):
    _edit_tensors(
        adapter_dir, lambda t: t.pop("base_model.model.model.layers.0.mlp.up_proj.lora_B.weight")
    )
    with pytest.raises(ValueError, match="has lora_A but not both factors for layers.0.up_proj"):
        load_lora_adapter(adapter_dir, config, max_rank=16)
