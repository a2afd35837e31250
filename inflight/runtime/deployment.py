"""The deployment plan (torch-free): what a deployment's options resolve to on its model and
its machine, decided once at load, and every rule between its features.

`resolve` takes the options (`protocol/deployment.py`), what the runtime read of the model
(`ModelFacts`) and of the machine (`MachineFacts`), and returns a frozen `DeploymentPlan`: the
device, dtype, attention backend, quantization, KV dtype, graphs, overlap, tensor parallelism,
the context length and KV cache size (a sliding-window model's sequences holding a bounded
number of blocks: its `KVWindow`), and which per-row features are on. A combination that
cannot be served is a ValueError from the one rule that names it (`RULES`, each rule once),
saying what would serve. `ifb_unsupported_reason` reads the plan: a deployment one of whose
features cannot run stepped is refused in-flight batching there, once, at load.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from inflight.protocol.deployment import DeploymentOptions
from inflight.protocol.request import SamplingParams
from inflight.runtime.host.kv_window import KVWindow

if TYPE_CHECKING:
    from inflight.model.config import ModelConfig

DEFAULT_MAX_MODEL_LEN = 4096


@dataclass(frozen=True)
class ModelFacts:
    """What the plan reads of a model: its family, its shape where rules depend on it, its
    context, and which of its parts need features."""

    family: str
    vocab_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    # Where every attention layer slides: the widest window, past which a sequence's KV is
    # never read again (None: some layer attends over the whole sequence).
    kv_window: int | None = None
    # Where some layers slide and others do not: the sliding layers' widest window.
    sliding_group_window: int | None = None
    recurrent: bool = False  # hybrid Mamba layers: recurrent state beside the KV
    experts: bool = False  # mixture-of-experts layers
    media: tuple[str, ...] = ()  # the kinds of media it takes
    mrope: bool = False  # M-RoPE positions (Qwen2-VL)
    speech: bool = False  # a text-to-speech model: its output is audio
    talker: bool = False  # a model that may speak its replies (Qwen3-Omni)
    diffusion: bool = False  # a block-diffusion model: it writes a canvas at a time


@dataclass(frozen=True)
class MachineFacts:
    """What the plan reads of the machine: its CUDA devices and their compute capability."""

    cuda_devices: int = 0
    cuda_capability: tuple[int, int] | None = None


@dataclass(frozen=True)
class Deployment:
    """The options, the model and the machine a plan is resolved from (what rules read)."""

    options: DeploymentOptions
    model: ModelFacts
    machine: MachineFacts
    draft: ModelFacts | None = None  # speculative decoding's draft model

    @property
    def device(self) -> str:
        if self.options.device is not None:
            return self.options.device
        return "cuda" if self.machine.cuda_devices else "cpu"

    @property
    def dtype(self) -> str:
        default = "bfloat16" if self.device == "cuda" else "float32"
        return self.options.dtype or default

    @property
    def tensor_parallel(self) -> bool:
        return self.options.tensor_parallel_size > 1


Rule = Callable[[Deployment], str | None]


def _cuda_present(d: Deployment) -> str | None:
    if d.options.device == "cuda" and not d.machine.cuda_devices:
        return "device='cuda' but no CUDA device is visible; start with device='cpu' (--device cpu)"
    return None


def _context(d: Deployment) -> str | None:
    limit, asked = d.model.max_position_embeddings, d.options.max_model_len
    if asked is not None and asked > limit:
        return (
            f"max_model_len ({asked}) exceeds the model's context ({limit}: its "
            f"max_position_embeddings); start with max_model_len <= {limit}"
        )
    return None


def _lora_modules_need_lora(d: Deployment) -> str | None:
    if d.options.lora_modules and not d.options.enable_lora:
        return "lora_modules needs enable_lora=True (--enable-lora)"
    return None


def _tensor_parallel(d: Deployment) -> str | None:
    """What tensor parallelism splits: a text decoder's heads and MLP width, one GPU a rank."""
    if not d.tensor_parallel:
        return None
    size, o, m = d.options.tensor_parallel_size, d.options, d.model
    alternative = "; start with tensor_parallel_size=1 (--tensor-parallel-size 1)"
    if o.enable_lora:
        return "LoRA is not served with tensor parallelism" + alternative
    if o.speculative_config is not None:
        return "speculative decoding is not served with tensor parallelism" + alternative
    if m.recurrent or m.media:
        return (
            "tensor parallelism serves text decoders (Llama, Qwen2, Qwen3 families); this "
            f"model is {m.family!r} with {'Mamba layers' if m.recurrent else 'media input'}"
            + alternative
        )
    for what, value in (
        ("attention heads", m.num_heads),
        ("intermediate size", m.intermediate_size),
    ):
        if value % size:
            return f"{what} ({value}) do not split over {size} ranks" + alternative
    if m.num_kv_heads % size and size % m.num_kv_heads:
        return (
            f"{m.num_kv_heads} KV heads neither split over {size} ranks nor divide them (to be "
            "replicated)" + alternative
        )
    if d.device == "cuda" and d.machine.cuda_devices < size:
        return (
            f"tensor_parallel_size={size} needs {size} GPUs (one per rank); "
            f"{d.machine.cuda_devices} are visible"
        )
    return None


def _recurrent(d: Deployment) -> str | None:
    """A hybrid Mamba model's sequences carry state that no rollback or adapter covers."""
    if not d.model.recurrent:
        return None
    o, family = d.options, d.model.family
    if o.speculative_config is not None:
        return (
            f"speculative decoding is not served for hybrid Mamba models ({family}): a rejected "
            "draft would need its sequence's recurrent state rolled back; start without "
            "speculative_config (--speculative-config)"
        )
    if o.enable_lora:
        return f"LoRA is not served for hybrid Mamba models ({family}); start without --enable-lora"
    if o.max_num_tokens <= o.max_batch_size:
        return (
            f"a hybrid Mamba model needs max_num_tokens ({o.max_num_tokens}) above "
            f"max_batch_size ({o.max_batch_size}): its prefill chunks are the difference"
        )
    return None


def _experts(d: Deployment) -> str | None:
    """Mixture-of-experts layers run whole on one device, without adapters."""
    if not d.model.experts:
        return None
    family = d.model.family
    if d.tensor_parallel:
        return (
            f"tensor parallelism does not split mixture-of-experts layers ({family}); start "
            "with tensor_parallel_size=1 (--tensor-parallel-size 1)"
        )
    if d.options.enable_lora:
        return (
            f"LoRA is not served for mixture-of-experts models ({family}); start without "
            "--enable-lora"
        )
    return None


def _quantization(d: Deployment) -> str | None:
    q = d.options.quantization
    if q == "fp8":
        capability = d.machine.cuda_capability
        if d.device != "cuda" or capability is None or capability < (8, 9):
            return (
                "quantization='fp8' needs a CUDA GPU with FP8 tensor cores (compute capability "
                f"8.9 or above: Ada, Hopper), got {d.device}"
                f"{'' if capability is None else f' {capability[0]}.{capability[1]}'}; "
                "start with quantization='auto' (--quantization auto)"
            )
    if q in ("int8", "q4") and (d.device != "cpu" or d.dtype != "float32"):
        return (
            f"quantization={q!r} needs the CPU float32 path, got {d.device} {d.dtype}; on CUDA "
            "use quantization='fp8' or 'none'"
        )
    return None


def _attention(d: Deployment) -> str | None:
    backend = d.options.attention_backend
    if backend == "triton" and d.device != "cuda":
        return (
            "the triton attention backend needs a CUDA device; start with "
            "attention_backend='cpu' or 'torch'"
        )
    if backend == "cpu" and not (
        d.device == "cpu" and d.dtype == "float32" and d.model.head_dim % 8 == 0
    ):
        return (
            "the cpu attention backend runs float32 on the CPU with a head_dim multiple of 8 "
            f"only, got {d.dtype} on {d.device} with head_dim {d.model.head_dim}; start with "
            "attention_backend='torch'"
        )
    return None


def _kv_cache_dtype(d: Deployment) -> str | None:
    if d.options.kv_cache_dtype == "fp8" and (
        d.device != "cuda" or d.options.attention_backend == "torch"
    ):
        return (
            "kv_cache_dtype='fp8' needs a CUDA device and the triton attention backend, got "
            f"device={d.device!r}, attention_backend={d.options.attention_backend!r}; start with "
            "kv_cache_dtype='auto'"
        )
    return None


def _speech(d: Deployment) -> str | None:
    """A text-to-speech model's steps run its talker, code predictor and codec decoder: none
    of the text decoder's extras."""
    if not d.model.speech:
        return None
    o = d.options
    for on, what, flag in (
        (o.enable_lora, "LoRA", "enable_lora=False"),
        (o.speculative_config is not None, "speculative decoding", "no speculative_config"),
        (d.tensor_parallel, "tensor parallelism", "tensor_parallel_size=1"),
        (
            o.quantization not in ("auto", "none"),
            f"quantization={o.quantization!r}",
            "quantization='auto' or 'none'",
        ),
    ):
        if on:
            return f"{what} is not served for a text-to-speech model; start with {flag}"
    return None


def _diffusion(d: Deployment) -> str | None:
    """A block-diffusion model's steps encode and denoise canvases on one device, its float
    weights unquantized: none of an autoregressive decoder's extras."""
    if not d.model.diffusion:
        return None
    o = d.options
    for on, what, flag in (
        (o.enable_lora, "LoRA", "enable_lora=False"),
        (
            o.speculative_config is not None,
            "speculative decoding (a draft model beside it included)",
            "no speculative_config",
        ),
        (d.tensor_parallel, "tensor parallelism", "tensor_parallel_size=1"),
        (
            o.quantization not in ("auto", "none"),
            f"quantization={o.quantization!r}",
            "quantization='auto' or 'none'",
        ),
        (
            o.kv_cache_dtype != "auto",
            f"kv_cache_dtype={o.kv_cache_dtype!r}",
            "kv_cache_dtype='auto'",
        ),
    ):
        if on:
            return (
                f"{what} is not served for a block-diffusion model ({d.model.family}); "
                f"start with {flag}"
            )
    return None


def _batch_invariant(d: Deployment) -> str | None:
    """Batch-invariant mode where each kernel a step runs keeps a row's bits whatever shares
    the step, as checked: the CPU float32 path (its kernels work per row); on CUDA, a dense
    decoder of full-attention layers, text in and text out, in float through triton."""
    o, m = d.options, d.model
    if not o.batch_invariant:
        return None
    if d.device == "cpu":
        if d.dtype != "float32":
            return (
                f"batch_invariant=True on the CPU is its float32 path, got dtype={d.dtype!r}; "
                "start with dtype='float32'"
            )
        if o.attention_backend not in (None, "cpu") or m.head_dim % 8:
            return (
                "batch_invariant=True on the CPU runs its native attention kernel (head_dim a "
                f"multiple of 8, got {m.head_dim}; attention_backend='cpu', got "
                f"{o.attention_backend!r}); start with batch_invariant=False"
            )
        return None
    for on, what, flag in (
        (
            o.attention_backend not in (None, "triton"),
            f"attention_backend={o.attention_backend!r}",
            "attention_backend='triton'",
        ),
        (o.quantization == "fp8", "quantization='fp8'", "quantization='none'"),
        (o.enable_lora, "LoRA", "enable_lora=False"),
        (o.speculative_config is not None, "speculative decoding", "no speculative_config"),
        (d.tensor_parallel, "tensor parallelism", "tensor_parallel_size=1"),
    ):
        if on:
            return f"batch_invariant=True on CUDA is not served with {what}; start with {flag}"
    windowed = m.kv_window is not None or m.sliding_group_window is not None
    for on, what in (
        (m.experts, "mixture-of-experts layers"),
        (m.recurrent, "Mamba layers"),
        (windowed, "sliding-window attention"),
        (bool(m.media), "media encoders"),
        (m.speech or m.talker or m.diffusion, "speech or diffusion output"),
    ):
        if on:
            return (
                f"batch_invariant=True on CUDA is not served for a model with {what} "
                f"({m.family}); start with batch_invariant=False"
            )
    return None


def _talker(d: Deployment) -> str | None:
    """A model's talker runs on one device beside its thinker."""
    if d.model.talker and d.options.speech and d.tensor_parallel:
        return (
            "a talker (spoken replies) does not run under tensor parallelism; start with "
            "--no-speech (speech=False) to serve text only"
        )
    return None


def _draft_model(d: Deployment) -> str | None:
    if d.draft is not None and d.draft.vocab_size != d.model.vocab_size:
        return (
            f"the draft model's vocabulary ({d.draft.vocab_size} tokens) is not the target's "
            f"({d.model.vocab_size}); draft with a model of the same tokenizer, or with "
            '{"method": "ngram"}'
        )
    return None


# Every rule between the options, the model and the machine, each once; the first that fails
# names the problem.
RULES: tuple[Rule, ...] = (
    _cuda_present,
    _context,
    _lora_modules_need_lora,
    _diffusion,  # before the rules of what it shares with others (experts), naming it
    _tensor_parallel,
    _recurrent,
    _experts,
    _quantization,
    _attention,
    _kv_cache_dtype,
    _speech,
    _talker,
    _draft_model,
    _batch_invariant,
)

# Features a deployment may use, and why one cannot run stepped beside joiners (None: it can, so
# in-flight batching serves it; otherwise the blocking path does, one request at a time). Every
# feature today runs stepped.
STEPPED: dict[str, str | None] = {
    "text": None,
    "lora": None,
    "speculative": None,
    "media": None,
    "recurrent": None,
    "tensor_parallel": None,
    "structured_outputs": None,
    "speech": None,
    "diffusion": None,
}


@dataclass(frozen=True)
class DeploymentPlan:
    """A deployment resolved: every choice the runtime's parts are built from beside the
    options and model facts it was resolved from (which the parts read as they are)."""

    options: DeploymentOptions
    model: ModelFacts
    device: str  # "cpu" or "cuda"
    dtype: str
    cuda_graphs: bool
    overlap: bool
    max_model_len: int
    num_kv_blocks: int
    features: tuple[str, ...]  # the features it uses (keys of STEPPED)
    # Where a sequence's KV before its window is given back as it grows (see `_kv_window`).
    kv_window: KVWindow | None = None
    # Where some layers slide and others do not: how the sliding layers' KV follows their
    # window, in a pool of `num_window_blocks` blocks of its own (see `_window_group`).
    window_group: KVWindow | None = None
    num_window_blocks: int = 0

    @property
    def max_batch_size(self) -> int:
        return self.options.max_batch_size

    @property
    def block_size(self) -> int:
        return self.options.block_size

    @property
    def max_num_tokens(self) -> int:
        return self.options.max_num_tokens

    @property
    def served_options(self) -> frozenset[str]:
        """The request options of the options table this deployment serves: LoRA where it is
        on; pinned system prompts where the context cache is and the model's KV prefixes are
        reusable (a hybrid's hold no recurrent state)."""
        if self.model.speech:
            return frozenset({"speech"})
        if self.model.diffusion:
            return frozenset({"diffusion"})
        served = {"lora_name"} if self.options.enable_lora else set()
        if self.speaks:
            served.add("generate_audio")
        if self.options.enable_context_reuse and not self.model.recurrent:
            served.add("save_system_prompt_kv_cache")
        return frozenset(served)

    @property
    def speaks(self) -> bool:
        """Whether it speaks replies (`generate_audio`): a model with a talker, not served
        text only."""
        return self.model.talker and self.options.speech

    @property
    def max_pinned_blocks(self) -> int:
        """The most KV blocks pinned prefixes may hold: `max_pinned_prefix_tokens`' full blocks,
        by default a quarter of the cache."""
        tokens = self.options.max_pinned_prefix_tokens
        if tokens is None:
            return self.num_kv_blocks // 4
        return tokens // self.block_size

    @property
    def prefill_chunk(self) -> int | None:
        """A hybrid's fixed prefill chunk (its state then never depends on the batch)."""
        return self.max_num_tokens - self.max_batch_size if self.model.recurrent else None


def resolve(
    options: DeploymentOptions,
    model: ModelFacts,
    machine: MachineFacts,
    draft: ModelFacts | None = None,
) -> DeploymentPlan:
    """The plan of a deployment, or a ValueError from the first rule it breaks."""
    d = Deployment(options, model, machine, draft)
    for rule in RULES:
        problem = rule(d)
        if problem is not None:
            raise ValueError(problem)
    max_model_len = min(
        options.max_model_len or DEFAULT_MAX_MODEL_LEN, model.max_position_embeddings
    )
    window = _kv_window(options, model)
    group = _window_group(options, model)
    if window is None:
        blocks_per_sequence = -(-max_model_len // options.block_size)
    else:
        blocks_per_sequence = window.sequence_blocks(max_model_len)
    cuda = d.device == "cuda"
    features = ["text", "structured_outputs"]
    for name, on in (
        ("lora", options.enable_lora),
        ("speculative", options.speculative_config is not None),
        ("media", bool(model.media)),
        ("recurrent", model.recurrent),
        ("tensor_parallel", d.tensor_parallel),
        ("speech", model.speech or (model.talker and options.speech)),
        ("diffusion", model.diffusion),
    ):
        if on:
            features.append(name)
    return DeploymentPlan(
        options=options,
        model=model,
        device=d.device,
        dtype=d.dtype,
        # FP8 experts run one matmul per expert chosen, sized by the step's routing, which a
        # graph cannot replay; float experts run the grouped kernel, which it can.
        cuda_graphs=options.cuda_graphs
        and cuda
        and options.attention_backend != "torch"
        and not (model.experts and options.quantization == "fp8"),
        overlap=cuda if options.overlap is None else options.overlap,
        max_model_len=max_model_len,
        num_kv_blocks=options.num_kv_blocks or options.max_batch_size * blocks_per_sequence,
        features=tuple(features),
        kv_window=window,
        window_group=group,
        num_window_blocks=0 if group is None else options.max_batch_size * group.quota,
    )


def _kv_window(options: DeploymentOptions, model: ModelFacts) -> KVWindow | None:
    """How a sequence's blocks follow its window, where every attention layer of the model
    slides; None where some layer reads the whole sequence."""
    return _following(options, model.kv_window)


def _window_group(options: DeploymentOptions, model: ModelFacts) -> KVWindow | None:
    """How the sliding layers' KV follows their window, where only some layers slide: in a
    pool of its own (a quota a resident), so that a long sequence holds window-sized KV in those
    layers. None where every layer slides or none does, and where the KV is laid out as one
    pool for every layer: a hybrid's, a tensor-parallel deployment's (their steps carry one
    block table)."""
    if model.recurrent or options.tensor_parallel_size > 1:
        return None
    return _following(options, model.sliding_group_window)


def _following(options: DeploymentOptions, window: int | None) -> KVWindow | None:
    """KV that follows a `window` (None: none), rows computing 1 + the drafts of speculative
    decoding; None with a draft model, which keeps its own KV in the same blocks (the draft's
    lags behind the target's)."""
    spec = options.speculative_config
    if window is None or (spec is not None and spec.method == "draft_model"):
        return None
    drafts = 0 if spec is None else spec.num_speculative_tokens
    return KVWindow(window, options.block_size, 1 + drafts)


def ifb_unsupported_reason(plan: DeploymentPlan) -> str | None:
    """Why this deployment cannot run under in-flight batching, or None: a feature it uses
    that cannot run stepped. Decided once, at load."""
    return next(
        (f"{f}: {STEPPED[f]}" for f in plan.features if STEPPED[f] is not None),
        None,
    )


# Each resident carries its own SamplingParams: the sampler, detokenizer, stop checks and KV
# reservation all work per row, so no sampling parameter keeps two requests from sharing a step.
PER_ROW_FIELDS = frozenset(f"params.{f.name}" for f in fields(SamplingParams))


def model_facts(config: ModelConfig) -> ModelFacts:
    """What the deployment plan reads of a model."""
    return ModelFacts(
        family=config.family,
        vocab_size=config.vocab_size,
        num_heads=config.num_heads,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        intermediate_size=config.intermediate_size,
        max_position_embeddings=config.max_position_embeddings,
        kv_window=config.kv_window,
        sliding_group_window=config.sliding_group_window,
        recurrent=config.mamba is not None,
        experts=config.moe is not None,
        media=tuple(encoder.kind for encoder in config.encoders),
        mrope=config.rope.mrope_section is not None,
        speech=config.speech is not None,
        talker=config.talker is not None,
        diffusion=config.diffusion is not None,
    )
