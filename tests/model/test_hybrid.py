"""Hybrid Mamba2/attention models (Bamba, NemotronH) against transformers on tiny random
checkpoints (CPU, float32): prefill and decode logits, a prefill split over several passes,
batch invariance of mixed steps, state slots, configs and weight loading."""

import copy

import pytest
import torch

from inflight.model.attention import select_backend
from inflight.model.checkpoints.loader import build_model, open_checkpoint
from inflight.model.contract import ModelCaches
from inflight.model.families.hybrid import hybrid_from_hf
from inflight.model.layers.mamba import MambaRows, MambaStates
from inflight.runtime.device.batch_builder import RowInput, build_ragged_batch

from tiny_models import VOCAB, make_tiny_hybrid

CPU = torch.device("cpu")
TOL = 1e-4
FAMILIES = ("bamba", "nemotron_h")
# 21 tokens: with chunk_size 8 the scan runs two whole blocks and a partial one.
PROMPT = [(37 * i + 11) % (VOCAB - 3) + 3 for i in range(21)]


@pytest.fixture(scope="module")
def hybrids(tmp_path_factory):
    """family -> (checkpoint directory, transformers model, our model, attention backend)."""
    root = tmp_path_factory.mktemp("hybrid")
    out = {}
    for family in FAMILIES:
        hf = make_tiny_hybrid(family, root / family)
        checkpoint = open_checkpoint(root / family)
        model = build_model(checkpoint, torch.float32, CPU, 256, quantization="none")
        backend = select_backend(None, CPU, torch.float32, checkpoint.config.head_dim)
        out[family] = (root / family, hf, model, backend)
    return out


class HybridSequences:
    """Sequences run through a hybrid model in forward passes of one or more rows, over a
    shared paged KV cache (sequence i in blocks of its own) and state slots (sequence i in
    slot i)."""

    def __init__(self, model, backend, num_seqs: int, capacity: int, block_size: int = 16):
        cfg = model.config
        self.model, self.backend, self.block_size = model, backend, block_size
        per_seq = -(-capacity // block_size)
        shape = backend.kv_cache_shape(
            num_seqs * per_seq, block_size, cfg.num_kv_heads, cfg.head_dim
        )
        self.caches = [
            (torch.zeros(shape), torch.zeros(shape)) for _ in range(model.num_attention_layers)
        ]
        self.states = MambaStates.allocate(cfg, num_seqs, torch.float32, CPU)
        self.tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(num_seqs)]
        self.lengths = [0] * num_seqs

    def step(self, work: list[tuple[int, list[int]]]) -> list[torch.Tensor]:
        """One forward pass of rows (sequence, its next tokens), decode rows first: each row's
        logits at every position."""
        rows = [RowInput(ids, self.lengths[s], self.tables[s], True, True) for s, ids in work]
        batch = build_ragged_batch(rows, self.block_size, CPU)
        seqs = [s for s, _ in work]
        mamba = MambaRows.build(seqs, [self.lengths[s] == 0 for s in seqs], CPU)
        batch.forward.recurrent = mamba
        self.backend.plan(batch.forward.attention)
        with torch.no_grad():
            caches = ModelCaches(self.caches, self.backend, self.states)
            hidden = self.model(batch.forward, caches)
            logits = self.model.compute_logits(hidden)
        for s, ids in work:
            self.lengths[s] += len(ids)
        return list(logits.split(batch.forward.attention.query_lens_host))

    def extend(self, seq: int, ids: list[int]) -> torch.Tensor:
        return self.step([(seq, ids)])[0]

    def greedy(self, seq: int, logits: torch.Tensor, n: int) -> list[int]:
        """n greedy tokens of `seq`, from the logits of its last position."""
        out = []
        for _ in range(n):
            out.append(int(logits[-1].argmax()))
            logits = self.extend(seq, out[-1:])
        return out

    def snapshot(self):
        kv = [(k.clone(), v.clone()) for k, v in self.caches]
        conv = [t.clone() for t in self.states.conv]
        ssm = [t.clone() for t in self.states.ssm]
        return kv, conv, ssm, list(self.lengths)

    def restore(self, snapshot) -> None:
        kv, conv, ssm, lengths = snapshot
        for (k, v), (k0, v0) in zip(self.caches, kv, strict=True):
            k.copy_(k0)
            v.copy_(v0)
        for t, t0 in zip([*self.states.conv, *self.states.ssm], [*conv, *ssm], strict=True):
            t.copy_(t0)
        self.lengths = list(lengths)


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(hybrids, family):
    """A prefill of 21 tokens, then 32 greedy decode steps: the logits of every position are
    within 1e-4 of transformers' forward over the whole sequence in float64 (whose Mamba scan
    runs in float32 all the same), and every greedy pick is the reference's."""
    _, hf, model, backend = hybrids[family]
    sequences = HybridSequences(model, backend, 1, len(PROMPT) + 32)
    logits = sequences.extend(0, PROMPT)
    ours, picks = [logits], []
    for _ in range(32):
        picks.append(int(logits[-1].argmax()))
        logits = sequences.extend(0, picks[-1:])
        ours.append(logits)
    with torch.no_grad():
        want = copy.deepcopy(hf).double()(torch.tensor([PROMPT + picks])).logits[0]
    ours = torch.cat(ours).double()
    error = (ours - want).abs().max().item()
    assert error < TOL, f"max |ours - transformers| {error:.2e}"
    assert picks == want[len(PROMPT) - 1 : -1].argmax(-1).tolist()


def _pieces(items, sizes):
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [items[a : a + n] for a, n in zip(starts, sizes, strict=True)]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("sizes", [(5, 3, 13), (1, 1, 6, 13)])
def test_a_mixer_in_chunks_is_the_mixer_in_one(hybrids, family, sizes):
    """The first Mamba mixer over 21 tokens in passes of `sizes` (1: a decode step) gives
    the outputs and final states of one pass within 1e-5."""
    _, _, model, _ = hybrids[family]
    mixer = model.layers[0].mixer
    x = torch.randn(
        sum(sizes), model.config.hidden_size, generator=torch.Generator().manual_seed(0)
    )

    def run(pieces):
        states = MambaStates.allocate(model.config, 1, torch.float32, CPU)
        outs, past = [], 0
        for piece in pieces:
            row = RowInput([0] * len(piece), past, [0, 1], True)
            meta = build_ragged_batch([row], 16, CPU).forward.attention
            rows = MambaRows.build([0], [past == 0], CPU)
            with torch.no_grad():
                outs.append(mixer(piece, meta, rows, states.conv[0], states.ssm[0]))
            past += len(piece)
        return torch.cat(outs), states.conv[0], states.ssm[0]

    for got, want in zip(run(_pieces(x, sizes)), run([x]), strict=True):
        assert (got - want).abs().max().item() < 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_in_chunks_is_prefill_in_one(hybrids, family):
    """The prompt in passes of 5, 3 and 13 tokens gives the logits of one pass, up to float32
    rounding, and the same 8 greedy tokens after. Up to 3e-5 (measured: 1.3e-5 Bamba, 2.6e-6
    NemotronH), not 1e-5: the passes' attention and scan blocks round differently, and this
    model's layers amplify it (its one-pass float32 logits are themselves 1.5e-5 off float64;
    a 2-layer tiny Llama differs by 5.7e-6 over the same split)."""
    _, _, model, backend = hybrids[family]
    whole = HybridSequences(model, backend, 1, len(PROMPT) + 8)
    one = whole.extend(0, PROMPT)
    split = HybridSequences(model, backend, 1, len(PROMPT) + 8)
    parts = torch.cat([split.extend(0, piece) for piece in _pieces(PROMPT, (5, 3, 13))])
    assert (parts - one).abs().max().item() < 3e-5
    assert split.greedy(0, parts, 8) == whole.greedy(0, one, 8)


@pytest.mark.parametrize("family", FAMILIES)
def test_rows_of_a_mixed_step_get_their_solo_bits(hybrids, family):
    """One pass of two decode rows, a prefill chunk continuing from its carried state and a
    fresh prefill into a slot a finished sequence left full: every row's logits, and the state
    it leaves in its slot, are bit-identical to that row run alone from the same state."""
    _, _, model, backend = hybrids[family]
    sequences = HybridSequences(model, backend, 4, 40)
    prompts = [PROMPT[:12], PROMPT[3:12], PROMPT[::-1][:16], PROMPT[5:16]]
    sequences.extend(0, prompts[0])
    sequences.extend(1, prompts[1])
    sequences.extend(2, prompts[2][:7])
    sequences.extend(3, PROMPT[:10])
    sequences.lengths[3] = 0  # finished: slot 3 and its blocks go to a new sequence
    work = [(0, [17]), (1, [29]), (2, prompts[2][7:]), (3, prompts[3])]
    before = sequences.snapshot()
    batched = sequences.step(work)
    batched_states = sequences.snapshot()
    for (seq, ids), got in zip(work, batched, strict=True):
        sequences.restore(before)
        assert torch.equal(sequences.step([(seq, ids)])[0], got)
        alone = sequences.snapshot()
        for state, batch_state in zip(
            alone[1] + alone[2], batched_states[1] + batched_states[2], strict=True
        ):
            assert torch.equal(state[seq], batch_state[seq])


def test_reset_zeroes_only_its_slots(hybrids):
    _, _, model, _ = hybrids["bamba"]
    states = MambaStates.allocate(model.config, 3, torch.float32, CPU)
    assert len(states.conv) == len(states.ssm) == model.num_mamba_layers == 2
    assert states.conv[0].shape == (3, 128 + 2 * 16, 3)
    assert states.ssm[0].shape == (3, 8, 16, 16) and states.ssm[0].dtype == torch.float32
    for state in (*states.conv, *states.ssm):
        state.normal_()
    kept = [state[[0, 2]].clone() for state in (*states.conv, *states.ssm)]
    states.reset([1])
    for state, old in zip((*states.conv, *states.ssm), kept, strict=True):
        assert not state[1].any()
        assert torch.equal(state[[0, 2]], old)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("length", [1, 9])
def test_a_fresh_row_ignores_its_slots_stale_state(hybrids, family, length):
    """A first chunk (a one-token prompt: the decode path; or a longer one) into a slot that
    another sequence left full computes what it computes from zeroed slots."""
    _, _, model, backend = hybrids[family]
    clean = HybridSequences(model, backend, 1, 32)
    stale = HybridSequences(model, backend, 1, 32)
    stale.extend(0, PROMPT)
    stale.lengths[0] = 0
    prompt = PROMPT[4 : 4 + length]
    assert torch.equal(stale.extend(0, prompt), clean.extend(0, prompt))
    assert torch.equal(stale.extend(0, [5]), clean.extend(0, [5]))


def _with_weights(checkpoint, weights):
    checkpoint.source = type("Source", (), {"weights": lambda self: iter(weights)})()
    return checkpoint


@pytest.mark.parametrize("family", FAMILIES)
def test_load_weights_refuses_unknown_and_missing_tensors(hybrids, family):
    path = hybrids[family][0]
    weights = list(open_checkpoint(path).weights())
    unknown = _with_weights(open_checkpoint(path), [*weights, ("lm_head.extra", torch.zeros(1))])
    with pytest.raises(ValueError, match="'lm_head.extra' has no place"):
        build_model(unknown, torch.float32, CPU, 64, quantization="none")
    without = [(n, t) for n, t in weights if not n.endswith("layers.0.mixer.A_log")]
    without = [(n, t) for n, t in without if not n.endswith("layers.0.mamba.A_log")]
    assert len(without) == len(weights) - 1
    missing = _with_weights(open_checkpoint(path), without)
    with pytest.raises(
        ValueError, match=r"checkpoint lacks 1 tensors, e.g. \['layers.0.mixer.A_log"
    ):
        build_model(missing, torch.float32, CPU, 64, quantization="none")


def test_lora_is_refused(hybrids):
    checkpoint = open_checkpoint(hybrids["bamba"][0])
    with pytest.raises(ValueError, match="LoRA"):
        build_model(checkpoint, torch.float32, CPU, 64, quantization="none", max_loras=1)


def test_configs_of_both_families(hybrids):
    bamba = open_checkpoint(hybrids["bamba"][0]).config
    assert bamba.family == "bamba" and bamba.mamba.layer_types == (
        "mamba",
        "attention",
        "mamba",
        "attention",
    )
    assert bamba.mamba.partial_rotary_factor == 0.5 and bamba.mamba.conv_dim == 160
    nemotron = open_checkpoint(hybrids["nemotron_h"][0]).config
    assert nemotron.mamba.layer_types == ("mamba", "mlp", "attention", "mlp")
    # softplus(dt + dt_bias) clamped as `time_step_limit` says, not at `time_step_min` (which
    # only seeds dt_bias; transformers before 5.25 clamped at it).
    assert nemotron.mamba.time_step_limit == (0.0, float("inf"))
    assert nemotron.mamba.partial_rotary_factor == 0.0
    # Older NemotronH configs give the layers as a pattern string (E: mixture of experts).
    legacy = {"architectures": ["NemotronHForCausalLM"], "hybrid_override_pattern": "M-M*-"}
    assert hybrid_from_hf(legacy).mamba.layer_types == ("mamba", "mlp", "mamba", "attention", "mlp")
    limited = hybrid_from_hf({**legacy, "time_step_min": 0.02, "time_step_limit": [0.01, 0.5]})
    assert limited.mamba.time_step_limit == (0.01, 0.5)
    moe = hybrid_from_hf({**legacy, "hybrid_override_pattern": "ME*"})
    assert moe.mamba.layer_types == ("mamba", "moe", "attention") and moe.moe.sparse_layers == (1,)
