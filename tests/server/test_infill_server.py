"""Fill in the middle over HTTP: a completion's `suffix` runs the prompt prefix-suffix-middle in
the model's FIM markers (a tiny random Llama whose vocabulary has Qwen's), driven by the official
`openai` client; a suffix the model cannot serve, or beside echo or token ids, is a 400."""

import httpx
import openai
import pytest

from inflight import LLM, SamplingParams
from inflight.server.errors import ServerError
from inflight.server.infill import FIM_MARKERS, fim_markers, infill_prompts

from server_harness import serve
from tiny_models import make_tiny_model

pytestmark = pytest.mark.slow

PREFIX = "def add(a, b):\n    "
SUFFIX = "\n\nprint(add(1, 2))\n"
MARKERS = FIM_MARKERS[0]  # Qwen2.5-Coder's


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = tmp_path_factory.mktemp("fim") / "llama"
    make_tiny_model("llama", path, special=MARKERS)
    llm = LLM(
        path, enable_in_flight_batching=True, max_batch_size=4, max_model_len=256,
        quantization="none",
    )  # fmt: skip
    with serve(llm, name="coder") as (url, _):
        yield url, llm
    llm.close()


def _expected_prompt(llm):
    """What the gap's prompt should be: whatever a plain prompt starts with (a BOS), then each
    marker before its part, the middle's last."""
    tok = llm.tokenizer
    full, bare = tok.encode(PREFIX), tok.encode(PREFIX, add_special_tokens=False)
    pre, suf, mid = (tok.encode(m, add_special_tokens=False) for m in MARKERS)
    assert len(pre) == len(suf) == len(mid) == 1
    return [*full[: len(full) - len(bare)], *pre, *bare, *suf,
            *tok.encode(SUFFIX, add_special_tokens=False), *mid]  # fmt: skip


def test_a_suffix_fills_the_middle_between_the_markers(served):
    url, llm = served
    expected = _expected_prompt(llm)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    want = llm.generate({"prompt_token_ids": expected}, params)[0]
    oa = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    body = dict(model="coder", prompt=PREFIX, suffix=SUFFIX, max_tokens=8, temperature=0)
    reply = oa.completions.create(**body, extra_body={"ignore_eos": True})
    assert reply.usage.prompt_tokens == len(expected)
    assert reply.choices[0].text == want.text
    stream = oa.completions.create(**body, stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in stream if c.choices) == want.text
    # Two prompts, one suffix: each its own gap.
    pair = oa.completions.create(
        **{**body, "prompt": [PREFIX, PREFIX]}, extra_body={"ignore_eos": True}
    )
    assert [c.text for c in pair.choices] == [want.text, want.text]


@pytest.mark.parametrize(
    ("extra", "param"),
    [({"echo": True}, "echo"), ({"prompt": [5, 6, 7]}, "prompt")],
)
def test_a_suffix_beside_echo_or_token_ids_is_a_400(served, extra, param):
    url, _ = served
    body = {"model": "coder", "prompt": PREFIX, "suffix": SUFFIX, "max_tokens": 4, **extra}
    r = httpx.post(url + "/v1/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_a_model_without_markers_refuses_a_suffix_by_name(server_llm):
    """The default model's vocabulary has no FIM markers."""
    assert fim_markers(server_llm.tokenizer) is None
    with pytest.raises(ServerError) as refused:
        infill_prompts([PREFIX], SUFFIX, False, server_llm.tokenizer)
    assert refused.value.param == "suffix" and refused.value.status == 400


class _CharTokenizer:
    """A token a character, `markers` as single tokens from id 1000; optionally a BOS (1) in
    front and an EOS (2) after what it encodes with special tokens."""

    def __init__(self, markers: tuple[str, ...], bos: bool, eos: bool) -> None:
        self.special = {m: 1000 + i for i, m in enumerate(markers)}
        self.bos, self.eos = bos, eos

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if text in self.special:
            return [self.special[text]]
        ids = [ord(c) for c in text]
        return (
            [1] * (self.bos and add_special_tokens) + ids + [2] * (self.eos and add_special_tokens)
        )

    def token_str(self, token_id: int) -> str:
        return next(m for m, i in self.special.items() if i == token_id)


@pytest.mark.parametrize("markers", FIM_MARKERS, ids=["qwen", "starcoder", "deepseek"])
@pytest.mark.parametrize(("bos", "eos"), [(False, False), (True, False), (True, True)])
def test_each_family_frames_the_gap_after_a_bos_and_before_no_eos(markers, bos, eos):
    tok = _CharTokenizer(markers, bos, eos)
    pre, suf, mid = (tok.special[m] for m in markers)
    assert fim_markers(tok) == (pre, suf, mid)
    (framed,) = infill_prompts(["ab"], "c", False, tok)
    assert framed == {"prompt_token_ids": [1] * bos + [pre, 97, 98, suf, 99, mid]}
