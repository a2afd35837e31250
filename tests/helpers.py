"""Assertions and set-ups shared by the tests."""

import contextlib
import http.server
import random
import threading
import time
from collections.abc import Iterator

import numpy as np
import torch

from inflight.model.attention import TorchAttentionBackend
from inflight.model.contract import ForwardBatch, ModelCaches
from inflight.model.kernels.cpu import blocks
from inflight.model.metadata import AttentionMetadata
from inflight.protocol.outputs import materialize
from inflight.runtime.device.batch_builder import RowInput, build_ragged_batch
from inflight.runtime.device.cuda_graphs import (
    DecodeGraphs,
    DecodeInputs,
    graph_buckets,
    graph_rows,
)
from inflight.runtime.device.model_runner import allocate_kv_cache


def assert_no_leaks(target) -> None:
    """Every KV block and resident slot is free again (DESIGN invariant 11), of a Runtime or,
    through its usage counters, of an LLM."""
    if hasattr(target, "kv_cache_usage"):
        assert target.kv_cache_usage()[0] == 0, "KV blocks leaked"
        assert target.resident_slot_usage()[0] == 0, "resident slots leaked"
        return
    assert target.blocks.num_free == target.blocks.num_blocks, "KV blocks leaked"
    window = getattr(target, "window_blocks", None)
    if window is not None:
        assert window.num_free == window.num_blocks, "window group's KV blocks leaked"
    assert target.slots.num_free == target.slots.capacity, "resident slots leaked"
    voices = getattr(target, "voices", None)
    if voices is not None:
        assert voices.blocks.num_free == voices.blocks.num_blocks, "talker KV blocks leaked"
        assert not voices.voices, "voices leaked"


def scattered_step(shapes, block_size: int, num_blocks: int, seed: int = 0) -> AttentionMetadata:
    """The metadata of a ragged CPU step, (query length, past length) per row, each row's
    blocks drawn from a shuffled pool (so no table is contiguous)."""
    rng = random.Random(seed)
    blocks = list(range(num_blocks))
    rng.shuffle(blocks)
    rows, cursor = [], 0
    for qlen, past in shapes:
        need = -(-(qlen + past) // block_size)
        rows.append(RowInput([0] * qlen, past, blocks[cursor : cursor + need], True))
        cursor += need
    return build_ragged_batch(rows, block_size, torch.device("cpu")).forward.attention


def windowed_steps(shapes, block_size: int, num_blocks: int, window: int):
    """The metadata of a ragged CPU step, (query length, past length) per row, each row's blocks
    drawn at random from 1..num_blocks - 1; and of the same step whose table entries before each
    row's `window` all name block 0 (which a test poisons: no kernel may read it)."""
    blocks = torch.randperm(num_blocks - 1).add(1).tolist()
    rows, poisoned = [], []
    for qlen, past in shapes:
        table = [blocks.pop() for _ in range(-(-(qlen + past) // block_size))]
        rows.append(RowInput([0] * qlen, past, table, True))
        unseen = max(0, past - window + 1) // block_size
        poisoned.append(RowInput([0] * qlen, past, [0] * unseen + table[unseen:], True))
    cpu = torch.device("cpu")
    return tuple(build_ragged_batch(r, block_size, cpu).forward.attention for r in (rows, poisoned))


def float64_reference(hf):
    """A copy of transformers' model in float64, its experts (if any) in their per-expert loop:
    its grouped matmul takes no float64."""
    import copy

    hf = copy.deepcopy(hf).double()
    if hasattr(hf, "set_experts_implementation"):
        hf.set_experts_implementation("eager")
    return hf


def run_staggered(runtime, requests) -> list:
    """Requests admitted to one session every other step (a request waits while there is no
    room), joining the running batch; their outputs in order."""
    from inflight.protocol.stepped import AdmissionAnswer

    session = runtime.new_session()
    outputs, refs, queue, steps = {}, {}, list(enumerate(requests)), 0
    while queue or session.residents():
        if queue and steps % 2 == 0:
            admission = session.admit(queue[0][1])
            if admission.answer is AdmissionAnswer.ADMITTED:
                refs[admission.ref] = queue.pop(0)[0]
        for ref, snapshot in session.step().finished.items():
            outputs[refs[ref]] = materialize([snapshot])
        steps += 1
    session.finish()
    return [outputs[i] for i in range(len(requests))]


def assert_same_outputs(got, want) -> None:
    """Each request's tokens and logprobs, bit for bit, in two runs of the same requests."""
    for a, b in zip(got, want, strict=True):
        assert a.token_ids == b.token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs


def watch_media_prefills(runtime, monkeypatch) -> list[bool]:
    """Per launched step from now on: whether a prefill with media shared it with rows already
    decoding."""
    mixed: list[bool] = []
    launch = runtime.executor.launch

    def watching(step):
        rows = [(r.resident.request.media, r.past_len < r.resident.prompt_len) for r in step.rows]
        mixed.append(any(m and p for m, p in rows) and any(not p for _, p in rows))
        return launch(step)

    monkeypatch.setattr(runtime.executor, "launch", watching)
    return mixed


def wait_for_outcome(handle, timeout: float = 10.0) -> None:
    """Wait until the engine has published the request's outcome (a cancelled one included)."""
    deadline = time.monotonic() + timeout
    while not handle.ready():
        assert time.monotonic() < deadline, "no outcome in time"
        time.sleep(0.005)


def float32_model(path):
    """Our model of the checkpoint at `path` (float32, CPU, exact): checkpoint, model, backend."""
    from inflight.model.attention import select_backend
    from inflight.model.checkpoints.loader import build_model, open_checkpoint

    checkpoint = open_checkpoint(path)
    cpu = torch.device("cpu")
    model = build_model(checkpoint, torch.float32, cpu, 512, quantization="none")
    return checkpoint, model, select_backend(None, cpu, torch.float32, checkpoint.config.head_dim)


def assert_tracks(model, backend, ids, theirs, media=None, shift=0, delta=0, tol=1e-4) -> None:
    """Prefill `ids` (`media` and rotary `shift` as `PagedSequence.extend` takes them), then 8
    greedy decode steps (rotary shift `delta`): every step's logits within `tol` of
    `theirs(sequence so far)` (transformers in float64) at every new position, and the same
    greedy pick."""
    sequence = PagedSequence(model, backend, len(ids) + 8)
    ours = sequence.extend(ids, media, shift)
    seq = list(ids)
    want = theirs(seq)
    assert (ours.double() - want).abs().max().item() < tol
    for _ in range(8):
        seq.append(int(want[-1].argmax()))
        assert int(ours[-1].argmax()) == seq[-1]
        ours = sequence.extend(seq[-1:], shift=delta)
        want = theirs(seq)
        assert (ours[-1].double() - want[-1]).abs().max().item() < tol


def assert_greedy_as(model, backend, ids, theirs, n: int = 24) -> None:
    """`n` greedy tokens after `ids` through a paged sequence are those of `theirs` (the
    reference's logits of a whole sequence), re-run on each token it picks."""
    greedy = PagedSequence(model, backend, len(ids) + n).greedy(ids, n)
    seq = list(ids)
    for _ in range(n):
        seq.append(int(theirs(seq)[-1].argmax()))
    assert greedy == seq[len(ids) :]


def prefill_logits(model, ids: list[int]) -> torch.Tensor:
    """Logits at every position of one sequence prefilled from an empty cache."""
    return PagedSequence(model, TorchAttentionBackend(), len(ids)).extend(ids)


class PagedSequence:
    """One sequence run through a model a chunk at a time (a prefill, then decode steps), over
    a paged KV cache of its own with room for `capacity` tokens (CPU, float32)."""

    def __init__(self, model, backend, capacity: int, block_size: int = 16) -> None:
        cfg = model.config
        self.model, self.backend, self.block_size = model, backend, block_size
        self.num_blocks = -(-capacity // block_size)
        shape = backend.kv_cache_shape(self.num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(cfg.num_layers)]
        self.length = 0

    def extend(self, ids: list[int], media=None, shift: int = 0) -> torch.Tensor:
        """The logits at every position of `ids`, appended to the sequence (`media`: the
        model's `MediaEmbeds`, for the positions of `ids` that take an embedding in place of
        their token; `shift`: added to the tokens' rotary positions, M-RoPE's delta)."""
        past, tokens = self.length, len(ids)
        total = past + tokens
        meta = AttentionMetadata(
            query_start_loc=torch.tensor([0, tokens], dtype=torch.int32),
            seq_lens=torch.tensor([total], dtype=torch.int32),
            block_tables=torch.arange(self.num_blocks, dtype=torch.int32)[None],
            slot_mapping=torch.arange(past, total),
            num_decodes=1 if tokens == 1 else 0,
            block_size=self.block_size,
            max_query_len=tokens,
            max_seq_len=total,
            query_lens_host=[tokens],
            seq_lens_host=[total],
            contiguous_kv_host=[0],
        )
        self.backend.plan(meta)
        batch = ForwardBatch(
            torch.tensor(ids), torch.arange(past, total) + shift, meta, media=media
        )
        with torch.no_grad():
            hidden = self.model(batch, ModelCaches(self.caches, self.backend))
            logits = self.model.compute_logits(hidden)
        self.length = total
        return logits

    def greedy(self, ids: list[int], n: int) -> list[int]:
        """Prefill `ids`, then the n tokens of greedy decoding, one decode step each."""
        logits, out = self.extend(ids)[-1], []
        for _ in range(n):
            out.append(int(logits.argmax()))
            logits = self.extend(out[-1:])[-1]
        return out


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's (and so the native kernels') thread count set to n inside the block."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class EagerGraphs(DecodeGraphs):
    """Decode graphs whose "replay" runs the forward they would have captured, eagerly: every
    step a CUDA runtime replays goes through the same buffers and unfolding on the CPU."""

    def __init__(self, forward, inputs, buckets, max_seq_len: int) -> None:
        self.max_seq_len = max_seq_len
        super().__init__(forward, inputs, buckets)

    def _capture(self, forward):
        # The CPU kernel sizes its scratch by the longest sequence, which the metadata of a
        # graph leaves open (the Triton kernel reads only seq_lens).
        meta = forward.args[0].attention
        for view in (meta, meta.window):  # the window group's too, where it has one
            if view is not None:
                view.max_seq_len = self.max_seq_len
        hidden = forward()

        class Replay:
            def replay(self) -> None:
                hidden.copy_(forward())

        return Replay(), hidden


def with_eager_graphs(runtime):
    """The (CPU, float32) runtime with EagerGraphs in its model runner, and the scratch block (and,
    for a hybrid, state slot) their padding rows write added, as a CUDA runtime has captured
    graphs. A text runtime's or a speech runtime's (whose graphs read embeddings)."""
    speech = runtime.plan.model.speech
    runner, config = runtime.runner if speech else runtime.executor.runner, runtime.plan
    blocks = runtime.blocks.num_blocks
    # The window group's pool, where the sliding layers' KV is apart: a scratch block too.
    pool = getattr(runtime, "window_blocks", None)
    window = None if pool is None else pool.num_blocks
    kv = allocate_kv_cache(
        runtime.checkpoint.config,
        runner.model.num_attention_layers,
        blocks + 1,
        config.block_size,
        runner.caches.backend,
        torch.float32,
        torch.device("cpu"),
        None if window is None else window + 1,
    )
    # One state slot more, for the padding rows (a hybrid's).
    states = runner.model.allocate_states(
        config.max_batch_size + 1, torch.float32, torch.device("cpu")
    )
    runner.caches = ModelCaches(kv, runner.caches.backend, states)
    rows = graph_rows(config.max_batch_size, config.max_num_tokens)
    inputs = DecodeInputs(
        rows,
        -(-runtime.max_model_len // config.block_size),
        config.block_size,
        scratch_block=blocks,
        device=torch.device("cpu"),
        lora=runner.model.max_loras > 0,
        scratch_state=config.max_batch_size if states is not None else None,
        window_scratch_block=window,
        embeds=(runtime.checkpoint.config.hidden_size, torch.float32) if speech else None,
    )
    with torch.inference_mode():
        runner.graphs = EagerGraphs(
            runner.forward, inputs, graph_buckets(rows), runtime.max_model_len
        )
    # As `runner_for` does after a capture: the eager path once, on the scratch block.
    runner.warm_up(config.max_num_tokens, runtime.max_model_len)
    return runtime


def assert_warm_up_writes_only_scratch(runtime) -> None:
    """The model runner's warm-up (of a runtime `with_eager_graphs` gave graphs) over caches
    filled with noise: it writes the scratch block of every layer's KV pool (and, for a hybrid,
    the scratch state slot) and nothing else, bit for bit."""
    speech = runtime.plan.model.speech
    runner = runtime.runner if speech else runtime.executor.runner
    inputs = runner.graphs.inputs
    scratch = {runtime.blocks.num_blocks + 1: inputs.scratch_block}
    if inputs.window_scratch_block is not None:
        scratch[inputs.window_scratch_block + 1] = inputs.window_scratch_block

    def by_block(t: torch.Tensor) -> torch.Tensor:
        """A view of a KV tensor with blocks first: the CPU backends' [heads, slots, dim] or
        the Triton backend's [blocks, block_size, heads, dim]."""
        if t.dim() == 4:
            return t
        return t.unflatten(1, (-1, runtime.plan.block_size)).transpose(0, 1)

    views = [by_block(t) for pair in runner.caches.kv for t in pair]
    tensors = [(t, scratch[t.shape[0]]) for t in views]
    states = runner.caches.states
    if states is not None:
        tensors += [(t, inputs.scratch_state) for t in (*states.conv, *states.ssm)]
    generator = torch.Generator().manual_seed(0)
    for t, _ in tensors:
        t.copy_(torch.randn(t.shape, generator=generator))
    before = [t.clone() for t, _ in tensors]
    runner.warm_up(runtime.plan.max_num_tokens, runtime.max_model_len)
    for (t, own), old in zip(tensors, before, strict=True):
        rest = torch.ones(t.shape[0], dtype=torch.bool)
        rest[own] = False
        assert torch.equal(t[rest], old[rest])
        assert not torch.equal(t[own], old[own])


def random_blocks(
    type_name: str, rows: int, k: int, seed: int, decades: tuple[float, float] = (-4, -2)
) -> np.ndarray:
    """Valid random rows [rows, bytes] of `type_name`: random integers and packed scales, and
    float16 d (and dmin) positive and finite, 10^decades[0] up to 2 * 10^decades[1]."""
    rng = np.random.default_rng(seed)
    values, size = blocks.BLOCK_SHAPES[type_name]
    supers = k // values
    raw = rng.integers(0, 256, (rows, supers, size), dtype=np.uint8)

    def half() -> np.ndarray:
        values = rng.uniform(1.0, 2.0, (rows, supers)) * 10.0 ** rng.uniform(
            *decades, (rows, supers)
        )
        return values.astype(np.float16).view(np.uint8).reshape(rows, supers, 2)

    if type_name == "Q6_K":
        raw[..., 208:210] = half()
    elif type_name in ("Q8_0", "Q5_0"):
        raw[..., 0:2] = half()
        if type_name == "Q8_0":  # int8 values in -127..127, as GGML's quantizer writes them
            raw[..., 2:][raw[..., 2:] == 128] = 129
    else:
        raw[..., 0:2], raw[..., 2:4] = half(), half()
    return raw.reshape(rows, -1)


@contextlib.contextmanager
def serving_files(files: dict[str, tuple[str, bytes]]) -> Iterator[str]:
    """A real HTTP server on loopback answering GET `path` with `files[path]` (its content type
    and body) and a 404 for anything else; yields its base URL."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path not in files:
                self.send_error(404)
                return
            kind, body = files[self.path]
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
