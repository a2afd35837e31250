"""A Hugging Face directory with vocab.json + merges.txt + tokenizer_config.json and no
tokenizer.json (Qwen3-TTS, many Qwen2-tokenizer repos): its tokenizer against transformers'
Qwen2Tokenizer of the same files and against a plain-Python byte-level BPE."""

from __future__ import annotations

import json
import unicodedata
from itertools import pairwise
from pathlib import Path

import pytest
import regex
from tokenizers import Regex, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as BackendTokenizer

from inflight.model.checkpoints.hf import HFCheckpoint
from inflight.model.checkpoints.tokenizer import byte_alphabet

# Qwen2's pre-tokenizer pattern, written out here rather than taken from inflight.
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog. I'll say it's fine, don't you think?",
    "THEY'RE HERE and We've Been There; she'd go, you're right, I'm done. I'LL go'Llama",
    "Numbers like 12345, 2024 and 3.14159 appear in code: x = [1, 2, 3]\n",
    "def add(a, b):\n    return a + b\n\n\n# comment\r\n",
    "你好世界，我们在这里。日本語のテキスト。café naïve résumé Ünïcödé",
    "emoji 🎉🚀 and    many   spaces   \t tabs\n\n",
] * 10
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TEXTS = [
    "Hello World, hELLo wORLD",
    "I'll go, don't stop, THEY'RE here, we've I'M, I'LL go'Llama",
    "numbers 12345 and 3.14",
    "你好世界",
    "emoji 🎉🚀🦀 done",
    "\n\n",
    "trailing spaces   ",
    "   leading\tand\r\nmixed \n whitespace",
    "<|im_start|>user\nhi<|im_end|>",
    "text<|endoftext|>more<|im_end|><|im_start|>",
    "cafe\u0301 (decomposed) and café",
    "",
]


def _write_files(path: Path) -> int:
    """A tiny byte-level BPE written as vocab.json + merges.txt + tokenizer_config.json (the
    special tokens right after the vocabulary) + config.json; returns the vocabulary's size."""
    tok = BackendTokenizer(models.BPE())
    # Trained on whitespace-separated words, so that merges cross the pieces of Qwen2's pattern
    # (letters and digits, digit and digit, quote and letters): a wrong split shows in the ids.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r" ?\S+|\s+"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.model.save(str(path))  # vocab.json, merges.txt
    size = tok.get_vocab_size()
    added = {
        str(size + i): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, token in enumerate(SPECIAL)
    }
    tok_config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "chat_template": CHAT_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config))
    config = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "eos_token_id": size}
    (path / "config.json").write_text(json.dumps(config))
    return size


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> tuple[Path, int]:
    path = tmp_path_factory.mktemp("bpe_files")
    return path, _write_files(path)


@pytest.fixture(scope="module")
def ours(files):
    path, _ = files
    assert not (path / "tokenizer.json").exists()
    return HFCheckpoint(path).tokenizer()


@pytest.fixture(scope="module")
def theirs(files):
    from transformers import AutoTokenizer

    path, _ = files
    return AutoTokenizer.from_pretrained(path)


class PlainBPE:
    """Qwen2's tokenizer in plain Python: special tokens cut out, NFC, the pattern's pieces,
    each as GPT-2's printable bytes, merged pair by pair in the order of merges.txt."""

    def __init__(self, path: Path, special: dict[str, int]) -> None:
        self.vocab = json.loads((path / "vocab.json").read_text(encoding="utf-8"))
        lines = (path / "merges.txt").read_text(encoding="utf-8").splitlines()
        pairs = [tuple(line.split(" ")) for line in lines if line and not line.startswith("#")]
        self.ranks = {pair: rank for rank, pair in enumerate(pairs)}
        self.special = special
        self.bytes = byte_alphabet()

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        cut = "(" + "|".join(regex.escape(t) for t in self.special) + ")"
        for part in regex.split(cut, text):
            if part in self.special:
                ids.append(self.special[part])
                continue
            for piece in regex.findall(QWEN2_PATTERN, unicodedata.normalize("NFC", part)):
                word = "".join(self.bytes[b] for b in piece.encode("utf-8"))
                ids.extend(self.vocab[t] for t in self._merge(list(word)))
        return ids

    def _merge(self, parts: list[str]) -> list[str]:
        while len(parts) > 1:
            ranked = [(self.ranks.get(p, len(self.ranks)), p) for p in pairwise(parts)]
            rank, best = min(ranked)
            if rank == len(self.ranks):
                break
            merged, i = [], 0
            while i < len(parts):
                if i + 1 < len(parts) and (parts[i], parts[i + 1]) == best:
                    merged.append(parts[i] + parts[i + 1])
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            parts = merged
        return parts


@pytest.mark.parametrize("text", TEXTS)
def test_encoding_matches_transformers_and_plain_bpe(files, ours, theirs, text):
    path, size = files
    ids = ours.encode(text)
    assert ids == theirs.encode(text)  # and no BOS: Qwen2 adds none
    assert ids == theirs.encode(text, add_special_tokens=False)
    plain = PlainBPE(path, {t: size + i for i, t in enumerate(SPECIAL)})
    assert ids == plain.encode(text)
    decoded = ours.decode(ids, skip_special_tokens=False)
    assert decoded == unicodedata.normalize("NFC", text)
    assert decoded == theirs.decode(ids, skip_special_tokens=False)
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)


def test_merges_are_used(ours, files):
    _, size = files
    # The vocabulary did learn merges: text takes fewer tokens than bytes.
    assert len(ours.encode(CORPUS[0])) < len(CORPUS[0].encode()) * 2 / 3
    assert ours.vocab_size == size + len(SPECIAL)


def test_added_tokens_and_the_rest_of_the_tokenizer(files, ours):
    _, size = files
    for i, token in enumerate(SPECIAL):
        assert ours.backend.token_to_id(token) == size + i
        assert ours.encode(token) == [size + i]
    assert ours.special_ids == frozenset(range(size, size + len(SPECIAL)))
    assert ours.decode(ours.encode("<|im_start|>user\nhi<|im_end|>")) == "user\nhi"
    assert ours.byte_level
    assert ours.special.bos is None and ours.bos_token_id is None
    assert ours.special.eos == "<|im_end|>"
    assert ours.eos_token_ids == [size, size + 2]  # config.json's, then eos_token's
    assert ours.apply_chat_template([{"role": "user", "content": "hi"}]) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert b"".join(ours.token_bytes(i) for i in ours.encode("你好 🎉")) == "你好 🎉".encode()


def test_chat_template_from_jinja_file(files, tmp_path):
    path, _ = files
    for name in ("vocab.json", "merges.txt", "config.json"):
        (tmp_path / name).write_bytes((path / name).read_bytes())
    tok_config = json.loads((path / "tokenizer_config.json").read_text())
    del tok_config["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tok_config))
    (tmp_path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    assert HFCheckpoint(tmp_path).tokenizer().chat_template == CHAT_TEMPLATE


def test_added_token_off_its_id_is_an_error(files, tmp_path):
    path, size = files
    for name in ("vocab.json", "merges.txt", "config.json"):
        (tmp_path / name).write_bytes((path / name).read_bytes())
    tok_config = json.loads((path / "tokenizer_config.json").read_text())
    added = tok_config["added_tokens_decoder"]
    added[str(size + 5)] = added.pop(str(size + 1))  # a gap before <|im_start|>
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tok_config))
    with pytest.raises(ValueError, match=r"<\|im_end\|>.*id"):
        HFCheckpoint(tmp_path).tokenizer()


@pytest.mark.parametrize(
    ("present", "missing"),
    [((), "vocab.json, merges.txt"), (("vocab.json",), "merges.txt"), (("merges.txt",), "vocab")],
)
def test_neither_file_set_is_an_error(files, tmp_path, present, missing):
    path, _ = files
    for name in (*present, "config.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((path / name).read_bytes())
    with pytest.raises(ValueError, match=rf"no tokenizer\.json.*missing: {missing}"):
        HFCheckpoint(tmp_path).tokenizer()
