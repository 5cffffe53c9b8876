"""Context parallelism: one sequence's tokens split over the C ranks of a context-parallel group.

**The split (zig-zag, as Megatron's CP and ring-flash-attention cut).** Sequence s of n tokens is
padded at its end to 2C fragments of F = max(ceil(n / 2C), min_fragment_len) tokens each
(`ZigZagSplit`); rank r holds fragments r and 2C-1-r, so every rank holds 2F tokens of every
sequence and causal attention work is even (fragment j attends j + 1 fragments). The padding rule:
pad tokens come after a sequence's real tokens (causality keeps them from touching real outputs),
are masked out of every loss, metric and count (`ZigZagSplit.shard` fills them with the caller's
value: False for masks), and nothing is ever truncated. Targets are shifted on the whole sequence
*before* the split (a label shifted after it would be wrong at every fragment boundary).

**KDA across ranks.** A fragment maps its start state affinely: S_end = M S_start + S_local
(M = the product of its tokens' transitions (I - beta k k^T) Diag(exp g), [K, K] per head). One run
of the existing chunk kernel gives both: the delta rule acts on the state's V columns
independently, so running it with K extra value columns that are zero, from an initial state whose
extra columns are the identity, carries M in those columns ([S_local | M] = final state), and the
extra output columns are scale q_t^T M_t. After one all-gather of every fragment's [S_local | M]
(fp32, C x 2 x H x K x (V + K) floats per sequence and layer, whatever the length) each rank chains
its predecessors' to get its fragments' true start states S0, and its output is the zero-start
output plus (extra columns) @ S0: exact, no second KDA implementation (fla's KCP and LASP-2 gather
the same pair; the chain stays FP32, fla issue #740). The short causal conv takes the previous
fragment's last conv_kernel - 1 pre-conv inputs (the halo, one more small all-gather). Backward: the
all-gathers' backward reduce-scatters the gradients of the states and halos to their owners
(`_Gather`), which is the reverse hand-off.

**MLA across ranks.** An all-gather of the compressed latents (d_c + d_r values per token: 576 at
48B, far fewer than per-head K/V), then each local query fragment j attends the key fragments
0..j, up-projected one fragment at a time (`latent_block_attention`): full blocks below the
diagonal, a causal block on it, merged by their log-sum-exp exactly. The backward recomputes each
block's up-projection and runs the flash backward against the merged output and log-sum-exp (as
ring attention does), so a rank holds the gathered latents and one block's K/V, never the whole
sequence's. Up-projected rather than attended in the absorbed latent form, which costs ~3.4x the
prefill FLOPs.

Lock-step: every rank of the group enters every layer's gathers in the same order, forward and
backward (the graphs have the same shape: every rank holds two fragments of every sequence). A rank
whose tokens carry no loss still runs its backward (its loss is a masked sum, connected to the graph).
"""
from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from kernels.kda.chunk import chunk_kda
from models.kda import KDALayer
from models.mla import MLALayer
from models.state import SegmentBatch


@dataclass(eq=False)
class ContextParallel:
    """This rank's place in its context-parallel group: `rank` of `size`, over `group`
    (megatron-core's context-parallel group). `sent_bytes` counts the bytes this rank has handed to
    the group's collectives for other ranks (forward gathers and their backward reduce-scatters)."""

    group: dist.ProcessGroup | None
    rank: int
    size: int
    sent_bytes: int = field(default=0)

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"context-parallel rank {self.rank} of size {self.size}: expected 0 <= rank < size")

    @property
    def active(self) -> bool:
        """Whether sequences are split at all (size > 1)."""
        return self.size > 1

    def fragment_owner(self, j: int) -> tuple[int, int]:
        """(rank, slot) holding global fragment j of a sequence: fragment j < C is slot 0 of rank j,
        fragment j >= C is slot 1 of rank 2C-1-j."""
        return (j, 0) if j < self.size else (2 * self.size - 1 - j, 1)

    def local_fragments(self) -> tuple[int, int]:
        """The two global fragment indices this rank holds, in its local (slot) order."""
        return self.rank, 2 * self.size - 1 - self.rank


class ZigZagSplit:
    """How packed whole sequences of `seq_lens` tokens are cut over a context-parallel group of
    `size` ranks (module docstring: the padding rule). Host-side bookkeeping only."""

    def __init__(self, seq_lens: Sequence[int], size: int, min_fragment_len: int = 1) -> None:
        if size < 1:
            raise ValueError(f"context-parallel size {size}, expected >= 1")
        if min_fragment_len < 1:
            raise ValueError(f"min_fragment_len={min_fragment_len}, expected >= 1")
        bad = [n for n in seq_lens if n < 1]
        if bad:
            raise ValueError(f"sequence lengths {bad} cannot be split: expected >= 1 token each")
        self.seq_lens, self.size = [int(n) for n in seq_lens], size
        self.fragment_lens = [max(-(-n // (2 * size)), min_fragment_len) for n in self.seq_lens]
        """F of every sequence: the length of each of its 2C fragments."""

    @property
    def padded_lens(self) -> list[int]:
        return [2 * self.size * f for f in self.fragment_lens]

    @property
    def local_lens(self) -> list[int]:
        """Tokens of every sequence on each rank (its two fragments, 2F)."""
        return [2 * f for f in self.fragment_lens]

    @property
    def num_pad_tokens(self) -> int:
        return sum(self.padded_lens) - sum(self.seq_lens)

    def source_rows(self, rank: int) -> list[int]:
        """For each of `rank`'s local rows (sequence by sequence, fragment r then 2C-1-r), its row in
        the unsplit packed batch, or -1 for a pad token."""
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} of a context-parallel group of {self.size}")
        rows, offset = [], 0
        for n, f in zip(self.seq_lens, self.fragment_lens):
            for j in (rank, 2 * self.size - 1 - rank):
                rows += [offset + p if p < n else -1 for p in range(j * f, (j + 1) * f)]
            offset += n
        return rows

    def positions(self, rank: int) -> list[int]:
        """Position within its (padded) sequence of each of `rank`'s local rows."""
        out = []
        for f in self.fragment_lens:
            for j in (rank, 2 * self.size - 1 - rank):
                out += range(j * f, (j + 1) * f)
        return out

    def shard(self, values: torch.Tensor, rank: int, fill: float | bool | int = 0) -> torch.Tensor:
        """Unsplit packed [N, *rest] (N = sum(seq_lens)) -> `rank`'s rows [sum(local_lens), *rest],
        pad rows set to `fill`. A new tensor."""
        if values.shape[0] != sum(self.seq_lens):
            raise ValueError(f"values have {values.shape[0]} rows, expected the {sum(self.seq_lens)} packed tokens")
        src = torch.tensor(self.source_rows(rank), dtype=torch.long, device=values.device)
        out = values.index_select(0, src.clamp(min=0))
        keep = (src >= 0).view(-1, *([1] * (values.dim() - 1)))
        return torch.where(keep, out, torch.full_like(out, fill))

    def unshard(self, per_rank: Sequence[torch.Tensor]) -> torch.Tensor:
        """Every rank's local rows (rank order) -> the unsplit packed [N, *rest] (pad rows dropped)."""
        if len(per_rank) != self.size:
            raise ValueError(f"got {len(per_rank)} ranks' rows, expected {self.size}")
        first = per_rank[0]
        out = first.new_zeros(sum(self.seq_lens), *first.shape[1:])
        for rank, part in enumerate(per_rank):
            src = torch.tensor(self.source_rows(rank), dtype=torch.long, device=part.device)
            real = src >= 0
            out[src[real]] = part[real]
        return out


# ---- collectives ------------------------------------------------------------------------------------
class _Gather(torch.autograd.Function):
    """All-gather of one same-shaped tensor per rank -> [C, *shape]; backward reduce-scatters the
    gradient (an all-to-all of the C slices, summed: gloo has no reduce-scatter of its own)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
        ctx.cp = cp
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(cp.size)]
        dist.all_gather(parts, x, group=cp.group)
        cp.sent_bytes += (cp.size - 1) * x.numel() * x.element_size()
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        cp = ctx.cp
        grad = grad.contiguous()
        received = torch.empty_like(grad)
        dist.all_to_all_single(received, grad, group=cp.group)
        cp.sent_bytes += (cp.size - 1) * grad[0].numel() * grad.element_size()
        return received.sum(dim=0), None


def gather(x: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
    """Every rank's `x` stacked in rank order, [C, *x.shape]; differentiable (the gradient of each
    rank's x is the sum of what every rank's use of it sends back)."""
    return _Gather.apply(x, cp)


# ---- MLA: causal attention of a query fragment over the gathered latents -----------------------------
def _up_project(latent: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor, d_c: int, pad_to: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """latent [B, L, d_c + d_r] -> keys [B, H, L, Dn + Dr], values [B, H, L, pad_to] (fp32; the
    values zero-padded to the keys' width, which CPU flash attention needs)."""
    c_kv, k_rope = latent[..., :d_c].float(), latent[..., d_c:].float()
    heads = w_uk.shape[0]
    k_nope = torch.einsum("hnc,blc->bhln", w_uk.float(), c_kv)
    keys = torch.cat([k_nope, k_rope[:, None].expand(-1, heads, -1, -1)], dim=-1)
    values = torch.einsum("hvc,blc->bhlv", w_uv.float(), c_kv)
    return keys, F.pad(values, (0, pad_to - values.shape[-1]))


class _LatentBlockAttention(torch.autograd.Function):
    """Queries of one fragment (the last `block_len` positions of a prefix) against the prefix's
    latents, one key block at a time, merged by log-sum-exp; the backward recomputes each block's
    K/V and runs the CPU flash backward with the merged output and log-sum-exp."""

    @staticmethod
    def forward(ctx, q, latent, w_uk, w_uv, block_len, d_c, scale):
        dk, dv = q.shape[-1], w_uv.shape[1]
        num_blocks = latent.shape[1] // block_len
        out = lse = None
        for j in range(num_blocks):
            keys, values = _up_project(latent[:, j * block_len:(j + 1) * block_len], w_uk, w_uv, d_c, dk)
            o, l = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, keys, values, 0.0, j == num_blocks - 1, scale=scale)[:2]  # [B, H, F, Dk], [B, H, F]
            o, l = o.contiguous(), l.contiguous()
            if out is None:
                out, lse = o, l
            else:  # exact merge of two softmax-normalised partial outputs
                merged = torch.logaddexp(lse, l)
                out = out * (lse - merged).exp()[..., None] + o * (l - merged).exp()[..., None]
                lse = merged
        ctx.save_for_backward(q, latent, w_uk, w_uv, out, lse)
        ctx.block_len, ctx.d_c, ctx.scale, ctx.dv = block_len, d_c, scale, dv
        return out[..., :dv].clone()

    @staticmethod
    def backward(ctx, grad):
        q, latent, w_uk, w_uv, out, lse = ctx.saved_tensors
        block_len, d_c, dk = ctx.block_len, ctx.d_c, q.shape[-1]
        grad = F.pad(grad.contiguous(), (0, dk - ctx.dv))  # the padded output columns are zeros
        num_blocks = latent.shape[1] // block_len
        dq = torch.zeros_like(q)
        d_latent = torch.zeros_like(latent)
        w_uk_, w_uv_ = w_uk.detach().requires_grad_(), w_uv.detach().requires_grad_()
        for j in range(num_blocks):
            with torch.enable_grad():
                block = latent[:, j * block_len:(j + 1) * block_len].detach().requires_grad_()
                keys, values = _up_project(block, w_uk_, w_uv_, d_c, dk)
            dq_j, dk_j, dv_j = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                grad, q, keys.detach(), values.detach(), out, lse, 0.0, j == num_blocks - 1, scale=ctx.scale)
            dq += dq_j
            torch.autograd.backward([keys, values], [dk_j, dv_j])
            d_latent[:, j * block_len:(j + 1) * block_len] = block.grad
        return dq, d_latent, w_uk_.grad, w_uv_.grad, None, None, None


def latent_block_attention(q: torch.Tensor, latent: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor,
                           block_len: int, d_c: int, scale: float) -> torch.Tensor:
    """Causal attention of the last `block_len` positions of a prefix over the whole prefix.

    q: [B, H, F, Dn + Dr] fp32 (F = block_len), the queries at positions L-F .. L-1; latent:
    [B, L, d_c + d_r] the prefix's MLA latents (L a multiple of F); w_uk [H, Dn, d_c], w_uv
    [H, Dv, d_c]. -> [B, H, F, Dv] fp32. Memory: one block's K/V at a time, forward and backward.
    On CPU the flash kernels run; elsewhere the plain twin `latent_block_attention_dense` (said
    once: no GPU kernel for this path has run)."""
    if latent.shape[1] % block_len or q.shape[2] != block_len:
        raise ValueError(f"latent length {latent.shape[1]} and queries {q.shape[2]} must be multiples of, and "
                         f"equal to, block_len={block_len}")
    if q.device.type != "cpu":
        _warn_dense_once(q.device)
        return latent_block_attention_dense(q, latent, w_uk, w_uv, block_len, d_c, scale)
    return _LatentBlockAttention.apply(q, latent, w_uk, w_uv, block_len, d_c, scale)


def latent_block_attention_dense(q, latent, w_uk, w_uv, block_len, d_c, scale) -> torch.Tensor:
    """`latent_block_attention`'s plain twin: the whole prefix's K/V and the [F, L] scores,
    masked so query i (position L-F+i) sees keys 0..L-F+i."""
    keys, values = _up_project(latent, w_uk, w_uv, d_c, w_uv.shape[1])
    length = latent.shape[1]
    scores = (q @ keys.transpose(-1, -2)) * scale  # [B, H, F, L]
    query_pos = torch.arange(length - block_len, length, device=q.device)
    future = torch.arange(length, device=q.device)[None, :] > query_pos[:, None]  # [F, L]
    return scores.masked_fill(future, float("-inf")).softmax(dim=-1) @ values


_WARNED: set[str] = set()


def _warn_dense_once(device: torch.device) -> None:
    if device.type not in _WARNED:
        _WARNED.add(device.type)
        warnings.warn(f"context-parallel MLA on {device.type}: the plain twin (whole-prefix K/V and scores, "
                      f"quadratic memory) runs; only the CPU flash path is built and it has never run on a GPU",
                      stacklevel=3)


# ---- the mixer ---------------------------------------------------------------------------------------
class ContextParallelMixer:
    """Mixer (models/model.py `Mixer`) for this rank's share of whole sequences under context
    parallelism: `batch` holds each sequence's 2F local rows (fragment r, then 2C-1-r; from
    `ZigZagSplit.shard`). Same math as `PackedMixer` on the unsplit batch (tests compare them)."""

    def __init__(self, batch: SegmentBatch, cp: ContextParallel, kda_impl: str | None = None) -> None:
        if any(batch.starts):
            raise ValueError(f"context-parallel sequences start at position 0, got starts {batch.starts}")
        odd = [n for n in batch.new_lens if n % 2]
        if odd:
            raise ValueError(f"context-parallel local lengths {odd} are odd: each rank holds two equal fragments "
                             f"of every sequence (ZigZagSplit.local_lens)")
        self.batch, self.cp, self.kda_impl = batch, cp, kda_impl
        self.fragment_lens = [n // 2 for n in batch.new_lens]
        size = cp.size
        low, high = cp.local_fragments()
        self.position_list = [p for f in self.fragment_lens for j in (low, high) for p in range(j * f, (j + 1) * f)]
        self._positions: dict[torch.device, torch.Tensor] = {}
        self.kept = None  # the kept-attention optimisation of PackedMixer does not apply here
        # the global fragment order: fragment j lives in slot `fragment_owner(j)` of the gathers
        self.order = [cp.fragment_owner(j) for j in range(2 * size)]
        by_len: dict[int, list[int]] = {}
        for s, f in enumerate(self.fragment_lens):
            by_len.setdefault(f, []).append(s)
        self.groups = list(by_len.items())  # (F, sequences of that fragment length)

    def stage(self, device: torch.device) -> "ContextParallelMixer":
        self.positions(device)
        return self

    def positions(self, device: torch.device) -> torch.Tensor:
        """[N_local] int64 position of every local row within its sequence (RoPE)."""
        if device not in self._positions:
            self._positions[device] = torch.tensor(self.position_list, dtype=torch.long, device=device)
        return self._positions[device]

    def _fragment_rows(self, s: int, slot: int) -> slice:
        start = self.batch.offsets[s] + slot * self.fragment_lens[s]
        return slice(start, start + self.fragment_lens[s])

    def _halo(self, all_tails: torch.Tensor, s: int, j: int) -> torch.Tensor:
        """Conv inputs before global fragment j of sequence s: fragment j-1's tail (zeros for j = 0)."""
        if j == 0:
            return torch.zeros_like(all_tails[0, 0, 0])
        rank, slot = self.order[j - 1]
        return all_tails[rank, s, slot]

    def kda(self, index: int, layer: KDALayer, x: torch.Tensor) -> torch.Tensor:
        mixed, g, beta, gate = layer.project(x)
        halo_len, cp = layer.kernel - 1, self.cp
        short = [f for f in self.fragment_lens if f < halo_len]
        if short:
            raise ValueError(f"fragments of {short} tokens are shorter than the conv halo ({halo_len}): split with "
                             f"ZigZagSplit(min_fragment_len={halo_len})")
        num_seqs, heads, dk = len(self.fragment_lens), layer.num_heads, layer.head_dim
        # every fragment's last conv_kernel-1 pre-conv inputs: the next fragment's halo
        tails = torch.stack([torch.stack([mixed[self._fragment_rows(s, slot)][-halo_len:] for slot in (0, 1)])
                             for s in range(num_seqs)])  # [S, 2, K-1, 3*qkv]
        all_tails = gather(tails, cp)  # [C, S, 2, K-1, 3*qkv]
        core = [None] * (2 * num_seqs)
        ext_states = [None] * (2 * num_seqs)
        for frag_len, seqs in self.groups:
            frags = [(s, slot) for s in seqs for slot in (0, 1)]
            globals_ = [cp.local_fragments()[slot] for _, slot in frags]
            rows = [self._fragment_rows(s, slot) for s, slot in frags]
            halos = torch.stack([self._halo(all_tails, s, j) for (s, _), j in zip(frags, globals_)])  # [B, K-1, 3*qkv]
            q, k, v, _ = layer.short_conv(torch.stack([mixed[r] for r in rows]), halos)
            b = len(frags)
            # V value columns and K identity columns: [S_local | M] in one run (module docstring)
            v_ext = torch.cat([v, v.new_zeros(b, frag_len, heads, dk)], dim=-1)  # [B, F, H, V + K]
            eye = torch.eye(dk, dtype=torch.float32, device=x.device).expand(b, heads, dk, dk)
            init = torch.cat([torch.zeros(b, heads, dk, v.shape[-1], device=x.device), eye], dim=-1)
            impl = self.kda_impl or ("triton" if q.is_cuda else "naive")
            o, final, _ = chunk_kda(q, k, v_ext, torch.stack([g[r] for r in rows]), torch.stack([beta[r] for r in rows]),
                                    initial_state=init, chunk_len=min(64, frag_len), impl=impl)
            for i, (s, slot) in enumerate(frags):
                core[2 * s + slot] = o[i]
                ext_states[2 * s + slot] = final[i]
        dv = layer.head_dim
        local = torch.stack(ext_states).view(num_seqs, 2, heads, dk, dv + dk)
        every = gather(local, cp)  # [C, S, 2, H, K, V + K] fp32
        starts = [torch.zeros(num_seqs, heads, dk, dv, device=x.device)]
        for j in range(2 * cp.size - 1):  # S0 of fragment j + 1 = M_j S0_j + S_local_j
            state = every[self.order[j][0], :, self.order[j][1]]  # [S, H, K, V + K]
            starts.append(state[..., dv:] @ starts[-1] + state[..., :dv])
        low, high = cp.local_fragments()
        pieces = []
        for s in range(num_seqs):
            for slot, j in enumerate((low, high)):
                o = core[2 * s + slot]  # [F, H, V + K]
                pieces.append(o[..., :dv] + torch.einsum("thk,hkv->thv", o[..., dv:], starts[j][s]))
        out = torch.cat(pieces)  # [N_local, H, V]: local rows are fragments in (s, slot) order
        return layer.output(out, gate)

    def mla(self, index: int, layer: MLALayer, x: torch.Tensor) -> torch.Tensor:
        cp = self.cp
        positions = self.positions(x.device)
        q_nope, q_rope = layer.queries(x, positions)
        latent_rows = layer.latent(x, positions)  # [N_local, d_c + d_r]
        every = gather(latent_rows, cp)  # [C, N_local, d_c + d_r]
        w_uk, w_uv = layer.up_projections()
        queries = torch.cat([q_nope, q_rope], dim=-1).float()  # [N_local, H, Dn + Dr]
        low, high = cp.local_fragments()
        pieces = []
        for s, frag_len in enumerate(self.fragment_lens):
            # the sequence's latents in global order: fragment j from its owner's rows
            whole = torch.cat([every[rank, self._fragment_rows(s, slot)] for rank, slot in self.order])  # [2CF, dl]
            for slot, j in enumerate((low, high)):
                q = queries[self._fragment_rows(s, slot)].transpose(0, 1)[None]  # [1, H, F, Dn + Dr]
                attn = latent_block_attention(q, whole[None, :(j + 1) * frag_len], w_uk, w_uv, frag_len,
                                              layer.kv_lora_rank, layer.scale)  # [1, H, F, Dv]
                pieces.append(attn[0].transpose(0, 1))
        return layer.output(x, torch.cat(pieces).to(x.dtype))


def comm_bytes(config, seq_lens: Sequence[int], size: int, dtype_bytes: int, backward: bool = True,
               layer_types: Sequence[str] | None = None) -> int:
    """Analytic bytes one rank sends in one forward (+ backward) of `seq_lens` under a
    context-parallel group of `size`: per KDA layer the halo and state gathers, per MLA layer the
    latent gather; each sends (C-1) copies of the local tensor, and the backward's reduce-scatter
    the same again. `config`: models.config.ModelConfig; dtype_bytes: the activations' element size;
    layer_types: the layers counted (default all of config.layer_types)."""
    if size == 1:
        return 0
    split = ZigZagSplit(seq_lens, size, config.linear_conv_kernel_dim - 1)
    num_seqs, local_tokens = len(seq_lens), sum(split.local_lens)
    h, dk = config.linear_num_heads, config.linear_head_dim
    halo = num_seqs * 2 * (config.linear_conv_kernel_dim - 1) * 3 * h * dk * dtype_bytes
    states = num_seqs * 2 * h * dk * (dk + dk) * 4
    latents = local_tokens * config.mla_latent_dim * dtype_bytes
    types = config.layer_types if layer_types is None else layer_types
    kda_layers = sum(t == "kda" for t in types)
    mla_layers = len(types) - kda_layers
    per_pass = (size - 1) * (kda_layers * (halo + states) + mla_layers * latents)
    return per_pass * (2 if backward else 1)
