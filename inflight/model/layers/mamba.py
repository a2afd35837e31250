"""The Mamba2 mixer of hybrid decoders (Bamba, NemotronH) over a packed ragged batch, and the
recurrent state each sequence carries in a slot of its own from one forward pass to the next.

Per sequence, a mixer maps hidden states u_t to out_proj(norm(y_t, z_t)), where in_proj splits
each token's projection into the gate z_t, the convolution's input xBC_t and dt_t, and, for each
head h (its B and C those of its group, every n_heads / n_groups heads sharing one):

    x_t, B_t, C_t = split(silu(conv1d_bias + sum_k conv1d_w[k] * xBC_{t-d_conv+1+k}))
    dt_t = clamp(softplus(dt_t + dt_bias), *time_step_limit)           per head
    S_t  = exp(dt_t * A) * S_{t-1} + dt_t * outer(x_t, B_t)            A = -exp(A_log)
    y_t  = S_t @ C_t + D * x_t
    norm(y, z) = weight * group_rms_normalize(y * silu(z))             groups of d_inner / n_groups

S_t is [head_dim, d_state] per head. A slot holds a sequence's last d_conv - 1 convolution
inputs (the conv state) and its S (the ssm state, float32 whatever the model's dtype).

A decode row (one token) takes the recurrent step above, all decode rows of a pass together in
elementwise ops that never mix rows. A prefill chunk runs the chunked ("SSD") form of the same
scan on its own, from its slot's state (zero for a sequence's first chunk), and leaves its final
states in the slot: a prefill split over several passes computes what one pass would (up to
float rounding). Unlike transformers, the decode step clamps dt too, so that one token computes
the same in either form (transformers clamps in its full forward only; a no-op but for
NemotronH, whose lower limit is time_step_min).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from inflight.model.config import MambaConfig, ModelConfig
from inflight.model.layers.linear import Linear
from inflight.model.layers.quantization import LinearMethods
from inflight.model.metadata import AttentionMetadata
from inflight.model.transfer import to_device


@dataclass
class MambaStates:
    """Each Mamba layer's recurrent state, one slot per resident sequence."""

    conv: list[torch.Tensor]  # per Mamba layer: [num_slots, conv_dim, d_conv - 1], model dtype
    ssm: list[torch.Tensor]  # per Mamba layer: [num_slots, n_heads, head_dim, d_state], float32

    @classmethod
    def allocate(
        cls, config: ModelConfig, num_slots: int, dtype: torch.dtype, device: torch.device
    ) -> MambaStates:
        """Zeroed slots for every Mamba layer of a hybrid model of `config`."""
        mamba = config.mamba
        if mamba is None:
            raise ValueError(f"a {config.family} model has no Mamba layers")
        layers = range(mamba.num_mamba_layers)
        conv_shape = (num_slots, mamba.conv_dim, mamba.d_conv - 1)
        ssm_shape = (num_slots, mamba.n_heads, mamba.head_dim, mamba.d_state)
        return cls(
            conv=[torch.zeros(conv_shape, dtype=dtype, device=device) for _ in layers],
            ssm=[torch.zeros(ssm_shape, dtype=torch.float32, device=device) for _ in layers],
        )

    def reset(self, slots: list[int]) -> None:
        """Zero those slots in every layer: a new sequence starts from zero state."""
        if not slots or not self.ssm:
            return
        index = torch.tensor(slots, dtype=torch.int64, device=self.ssm[0].device)
        for state in (*self.conv, *self.ssm):
            state.index_fill_(0, index, 0)


@dataclass
class MambaRows:
    """Which state slot each packed row (same order as AttentionMetadata rows) reads and writes.
    No two rows of a pass may share a slot."""

    slots: torch.Tensor  # [R] int64 on the model's device
    slots_host: list[int]
    fresh_host: list[bool]  # True: the row's first chunk (start from zero state, ignore the slot)

    @classmethod
    def build(cls, slots: list[int], fresh: list[bool], device: torch.device) -> MambaRows:
        return cls(to_device(slots, torch.int64, device), list(slots), list(fresh))


# torch's CPU F.silu, F.softplus and sigmoid run SIMD over the bulk of a tensor and a scalar loop
# (other rounding) over its last numel % (2 x vector width) values, so a row's bits would depend
# on where the batch puts it. exp and log1p run SIMD throughout (torch's vml path, a partial
# vector at the end): built from them, these two give a row the same bits in any batch.
def silu(x: torch.Tensor) -> torch.Tensor:
    return x / (1 + torch.exp(-x))


def softplus(x: torch.Tensor) -> torch.Tensor:
    """log(1 + e^x), x itself above 20 (where F.softplus switches too)."""
    return torch.where(x > 20, x, torch.log1p(torch.exp(x)))


class GatedRMSNorm(nn.Module):
    """weight * RMS-normalized (y * silu(z)), normalized over groups of `group_size` channels;
    computed in float32, the result float32."""

    def __init__(self, size: int, group_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.group_size = group_size
        self.eps = eps

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        gated = y.float() * silu(z.float())
        groups = gated.view(*gated.shape[:-1], -1, self.group_size)
        groups = groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight.float() * groups.view_as(gated)


class Mamba2Mixer(nn.Module):
    """One Mamba2 layer's mixer (see the module docstring), with transformers' parameter names
    and shapes. in_proj and out_proj are `Linear`s run by the method `methods` picks for them;
    conv1d is an `nn.Conv1d` for its parameters only (the convolution runs in `forward`)."""

    def __init__(
        self, config: MambaConfig, hidden_size: int, methods: LinearMethods, prefix: str
    ) -> None:
        super().__init__()
        self.config = config
        inner, conv_dim, heads = config.d_inner, config.conv_dim, config.n_heads
        sources = (f"{prefix}.in_proj.weight",)
        self.in_proj = Linear(
            hidden_size,
            inner + conv_dim + heads,
            config.proj_bias,
            methods.choose(hidden_size, sources),
            sources,
        )
        self.conv1d = nn.Conv1d(
            conv_dim, conv_dim, config.d_conv, groups=conv_dim, bias=config.conv_bias
        )
        self.dt_bias = nn.Parameter(torch.empty(heads))
        self.A_log = nn.Parameter(torch.empty(heads))
        self.D = nn.Parameter(torch.empty(heads))
        self.norm = GatedRMSNorm(inner, inner // config.n_groups, config.norm_eps)
        sources = (f"{prefix}.out_proj.weight",)
        self.out_proj = Linear(
            inner, hidden_size, config.proj_bias, methods.choose(inner, sources), sources
        )

    def forward(
        self,
        x: torch.Tensor,
        meta: AttentionMetadata,
        rows: MambaRows,
        conv_state: torch.Tensor,
        ssm_state: torch.Tensor,
    ) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; reads and updates the rows' slots of this layer's
        `conv_state` [slots, conv_dim, d_conv - 1] and `ssm_state` [slots, heads, head_dim,
        d_state] in place."""
        cfg = self.config
        z, xbc, dt = self.in_proj(x).split([cfg.d_inner, cfg.conv_dim, cfg.n_heads], dim=-1)
        decodes = meta.num_decodes
        parts = []
        if decodes:
            parts.append(self._decode(xbc[:decodes], dt[:decodes], rows, conv_state, ssm_state))
        start = decodes
        for row in range(decodes, len(meta.query_lens_host)):
            end = start + meta.query_lens_host[row]
            slot = rows.slots_host[row]
            parts.append(
                self._prefill(
                    xbc[start:end], dt[start:end], slot, rows.fresh_host[row], conv_state, ssm_state
                )
            )
            start = end
        y = parts[0] if len(parts) == 1 else torch.cat(parts)
        return self.out_proj(self.norm(y, z).to(x.dtype))

    def _decode(
        self,
        xbc: torch.Tensor,
        dt: torch.Tensor,
        rows: MambaRows,
        conv_state: torch.Tensor,
        ssm_state: torch.Tensor,
    ) -> torch.Tensor:
        """The recurrent step of the first len(xbc) rows, one token each -> y [R, d_inner]."""
        cfg = self.config
        count = xbc.shape[0]
        slots = rows.slots[:count]
        fresh = [
            s
            for s, new in zip(rows.slots_host[:count], rows.fresh_host[:count], strict=True)
            if new
        ]
        if fresh:  # a one-token prompt: its slot holds what a finished sequence left there
            index = torch.tensor(fresh, dtype=torch.int64, device=slots.device)
            conv_state.index_fill_(0, index, 0)
            ssm_state.index_fill_(0, index, 0)
        window = torch.cat((conv_state.index_select(0, slots), xbc[:, :, None]), dim=2)
        conv_state.index_copy_(0, slots, window[:, :, 1:])
        # One multiply-add per tap: elementwise, so no row's result depends on the others'.
        window, weight = window.float(), self.conv1d.weight[:, 0].float()
        conv = window[:, :, 0] * weight[:, 0]
        for tap in range(1, cfg.d_conv):
            conv = conv + window[:, :, tap] * weight[:, tap]
        if self.conv1d.bias is not None:
            conv = conv + self.conv1d.bias.float()
        x, b, c = self._split(silu(conv))
        step = self._time_step(dt)  # [R, H]
        a = -torch.exp(self.A_log.float())
        kernel = ssm_decode
        if ssm_state.is_cuda and cfg.d_state & (cfg.d_state - 1) == 0:
            from inflight.model.kernels.triton import mamba as triton_mamba

            kernel = triton_mamba.ssm_decode
        y = kernel(ssm_state, slots, x, step, a, b, c, self.D.float())
        return y.reshape(count, cfg.d_inner)

    def _prefill(
        self,
        xbc: torch.Tensor,
        dt: torch.Tensor,
        slot: int,
        fresh: bool,
        conv_state: torch.Tensor,
        ssm_state: torch.Tensor,
    ) -> torch.Tensor:
        """One row's chunk of L tokens from its slot's state -> y [L, d_inner]."""
        cfg = self.config
        past = xbc.new_zeros(cfg.conv_dim, cfg.d_conv - 1) if fresh else conv_state[slot]
        window = torch.cat((past, xbc.T), dim=1)  # [conv_dim, d_conv - 1 + L]
        conv_state[slot] = window[:, -(cfg.d_conv - 1) :]
        bias = None if self.conv1d.bias is None else self.conv1d.bias.float()
        conv = F.conv1d(window[None].float(), self.conv1d.weight.float(), bias, groups=cfg.conv_dim)
        x, b, c = self._split(silu(conv[0].T))
        b, c = self._per_head(b), self._per_head(c)
        initial = None if fresh else ssm_state[slot]
        a = -torch.exp(self.A_log.float())
        y, final = chunked_scan(x, self._time_step(dt), a, b, c, cfg.chunk_size, initial)
        ssm_state[slot] = final
        y = y + self.D.float()[:, None] * x
        return y.reshape(-1, cfg.d_inner)

    def _split(self, xbc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Activated convolution outputs [N, conv_dim] -> x [N, H, P], and B, C per group
        [N, G, d_state]."""
        cfg = self.config
        tokens, group_width = xbc.shape[0], cfg.n_groups * cfg.d_state
        x, b, c = xbc.split([cfg.d_inner, group_width, group_width], dim=-1)
        b = b.reshape(tokens, cfg.n_groups, cfg.d_state)
        c = c.reshape(tokens, cfg.n_groups, cfg.d_state)
        return x.reshape(tokens, cfg.n_heads, cfg.head_dim), b, c

    def _per_head(self, bc: torch.Tensor) -> torch.Tensor:
        """B or C per group [N, G, d_state] -> per head [N, H, d_state]."""
        return bc.repeat_interleave(self.config.n_heads // self.config.n_groups, dim=1)

    def _time_step(self, dt: torch.Tensor) -> torch.Tensor:
        low, high = self.config.time_step_limit
        return softplus(dt.float() + self.dt_bias.float()).clamp(low, high)


def ssm_decode(
    state: torch.Tensor,
    slots: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    d: torch.Tensor,
) -> torch.Tensor:
    """One step of each decode row's scan, its slot of `state` [slots, H, P, N] updated in
    place: S = exp(dt a) S + dt outer(x, b); y = S c + D x. x [R, H, P], dt [R, H], a and d
    [H], b and c [R, G, N] (one per group of heads), all float32 -> y [R, H, P]. CUDA runs the
    same formula in one Triton kernel (`kernels/triton/mamba.py`)."""
    per_group = x.shape[1] // b.shape[1]
    b, c = b.repeat_interleave(per_group, dim=1), c.repeat_interleave(per_group, dim=1)
    rows = state.index_select(0, slots)
    decay = torch.exp(dt * a)
    rows = rows * decay[:, :, None, None] + (dt[:, :, None] * x)[..., None] * b[:, :, None]
    state.index_copy_(0, slots, rows)
    return (rows * c[:, :, None]).sum(-1) + d[:, None] * x


def chunked_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    chunk_size: int,
    initial: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The scan S_t = exp(dt_t a) S_{t-1} + dt_t outer(x_t, b_t), y_t = S_t c_t of one sequence,
    in float32: x [L, H, P], dt [L, H], a [H], b and c [L, H, N], initial S [H, P, N] (None:
    zero) -> y [L, H, P] and the final S [H, P, N].

    Blocks of `chunk_size` tokens are computed in parallel: within a block, y is an
    attention-like product of c and b weighted by the decay between each pair of positions;
    across blocks, the state at each block's start carries the rest, one block at a time."""
    length, heads, head_dim = x.shape
    pad = -length % chunk_size

    def blocks(t: torch.Tensor) -> torch.Tensor:  # [L, ...] -> [blocks, chunk_size, ...]
        # Zero padding: dt = 0 neither decays the state nor adds to it.
        t = F.pad(t, (0, 0) * (t.dim() - 1) + (0, pad))
        return t.view(-1, chunk_size, *t.shape[1:])

    xdt = blocks(x * dt[..., None])  # [n, Q, H, P]
    log_decay = blocks(dt * a)  # [n, Q, H]
    b, c = blocks(b), blocks(c)  # [n, Q, H, N]
    cumulative = log_decay.cumsum(dim=1)  # from the block's start through each position

    # Within blocks: y_l += sum_{s <= l} exp(decay from s to l) (c_l . b_s) xdt_s.
    pair_decay = torch.exp(_segment_sums(log_decay.permute(0, 2, 1)))  # [n, H, Q(l), Q(s)]
    scores = torch.einsum("nlhk,nshk->nhls", c, b) * pair_decay
    y = torch.einsum("nhls,nshp->nlhp", scores, xdt)

    # Each block's contribution to the state at its end, then the state entering each block.
    to_end = torch.exp(cumulative[:, -1:] - cumulative)  # [n, Q, H]
    block_states = torch.einsum("nlhk,nlhp->nhpk", b * to_end[..., None], xdt)
    block_decay = torch.exp(cumulative[:, -1])  # [n, H]
    state = initial if initial is not None else x.new_zeros(heads, head_dim, b.shape[-1])
    entering = []
    for block in range(block_states.shape[0]):
        entering.append(state)
        state = state * block_decay[block][:, None, None] + block_states[block]

    # Across blocks: y_l += exp(decay from the block's start to l) S_entering c_l.
    carried = torch.einsum("nlhk,nhpk->nlhp", c, torch.stack(entering))
    y = y + carried * torch.exp(cumulative)[..., None]
    return y.reshape(-1, heads, head_dim)[:length], state


def _segment_sums(log_decay: torch.Tensor) -> torch.Tensor:
    """[..., Q] -> [..., Q, Q]: out[..., l, s] = log_decay[s+1] + ... + log_decay[l] for s <= l,
    -inf above the diagonal. Summed directly, not as a difference of cumulative sums, which
    loses precision."""
    size = log_decay.shape[-1]
    ones = torch.ones(size, size, dtype=torch.bool, device=log_decay.device)
    steps = log_decay[..., :, None].expand(*log_decay.shape, size)  # steps[..., k, s] = ld[k]
    sums = steps.masked_fill(~ones.tril(-1), 0).cumsum(dim=-2)  # over s < k <= l
    return sums.masked_fill(~ones.tril(), float("-inf"))
