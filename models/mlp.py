"""Channel mixers: dense SwiGLU MLP and the MoE block of Kimi Linear / DeepSeek-V3.

MoE routing (transformers' `KimiLinearTopkRouter`, DeepSeek-V3's "noaux_tc"): sigmoid scores;
choice scores = scores + e_score_correction_bias (a load-balancing bias that steers selection
only); experts are split into groups, each group scored by the sum of its top-2 choice scores,
the top `topk_group` groups are kept; top-k experts among them; weights are the plain sigmoid
scores of the chosen experts, renormalised (optional), times routed_scaling_factor. Shared
experts run on every token.

Routed experts run dense (every expert on every token) when there are few, else grouped: the
(token, slot) rows sorted by expert, three grouped matmuls, a weighted scatter back; no step of
it copies the routing to the host, so a GPU need not wait for it in the middle of a layer (the
per-expert loop it replaces, `experts_loop`, waits once per expert; it stays as the reference).
"""
from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from models.config import ModelConfig
from kernels.cpu import ops as cpu_ops
from models.expert_parallel import ExpertParallel, all_to_all, exchange_counts
from models.fused import fused_weight, use_fused


class SwiGLU(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


EXPERT_IMPLS = ("auto", "dense", "grouped", "padded", "loop")
"""`Experts.impl` values. auto: dense when `runs_dense`, else grouped. dense: every expert on every
token. grouped: rows sorted by expert, three grouped matmuls (`torch._grouped_mm` where it runs
without a host sync, else the padded form or dense, by a static cost model). padded: the grouped
path with its static-shape blocked batched matmul forced. loop: `experts_loop`, the plain
reference (one host sync per expert)."""


class Experts(nn.Module):
    """The routed experts' SwiGLU weights, stacked: w1 (gate) and w3 (up) [E, I, D], w2 (down) [E, D, I].

    Stacked so that all experts run in a few batched matmuls; the checkpoint keeps one tensor per
    expert (`experts.N.w1.weight`), see models/checkpoint.py. `impl` (one of EXPERT_IMPLS, a plain
    attribute that tests and benchmarks may set) picks the path; every path computes the same sum.
    Under expert parallelism the module holds `num_experts` of the layer's `num_global` experts,
    global indices `first` .. `first + num_experts - 1` (models/expert_parallel.py).
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *, impl: str = "auto",
                 first: int = 0, num_global: int | None = None) -> None:
        super().__init__()
        if impl not in EXPERT_IMPLS:
            raise ValueError(f"impl={impl!r}, expected one of {EXPERT_IMPLS}")
        self.impl = impl
        self.first = first
        self.num_global = num_experts if num_global is None else num_global
        self.w1 = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.w3 = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def runs_dense(self, top_k: int) -> bool:
        """Whether every expert runs on every token (few experts: at most 4x the routed FLOPs)."""
        return self.w1.shape[0] <= 4 * top_k

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x: [N, D]; weights, ids: [N, top_k] -> sum_k weights * expert_ids(x): [N, D]."""
        impl = self.impl
        if impl == "auto":
            impl = "dense" if self.runs_dense(ids.shape[1]) else "grouped"
        if impl == "dense":
            return experts_dense(x, weights, ids, self.w1, self.w2, self.w3)
        if impl == "loop":
            return experts_loop(x, weights, ids, self.w1, self.w2, self.w3)
        return experts_grouped(x, weights, ids, self.w1, self.w2, self.w3, padded=impl == "padded")


def experts_dense(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                  w3: torch.Tensor) -> torch.Tensor:
    """Every expert on every token, as two matmuls against all experts' weights at once, with the
    routing weights (zero for unchosen experts) folded in before the down projection: ~8 ops
    instead of ~10 per expert, E / top_k times the routed FLOPs. Shapes as `experts_loop`."""
    (num_tokens, _), (num_experts, inter, _) = x.shape, w1.shape
    gate = F.linear(x, w1.reshape(-1, w1.shape[-1]))  # [N, E*I]
    up = F.linear(x, w3.reshape(-1, w3.shape[-1]))  # [N, E*I]
    dense = torch.zeros(num_tokens, num_experts, dtype=weights.dtype, device=x.device)
    dense.scatter_(1, ids, weights)  # [N, E] routing weights
    h = (F.silu(gate) * up).view(num_tokens, num_experts, inter) * dense[:, :, None].to(x.dtype)
    down = w2.permute(1, 0, 2).reshape(w2.shape[1], -1)  # [D, E*I]
    return F.linear(h.reshape(num_tokens, num_experts * inter), down)  # [N, D]


def experts_loop(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                 w3: torch.Tensor) -> torch.Tensor:
    """The plain reference: one gather, SwiGLU and weighted scatter per expert present.
    x: [N, D]; weights, ids: [N, top_k]; w1, w3: [E, I, D]; w2: [E, D, I] -> [N, D].
    `ids.unique().tolist()` and `torch.where` read the routing on the host: a sync per expert on a GPU."""
    out = torch.zeros_like(x)
    for e in ids.unique().tolist():
        token, slot = torch.where(ids == e)
        xe = x[token]
        y = F.linear(F.silu(F.linear(xe, w1[e])) * F.linear(xe, w3[e]), w2[e])
        # index_put_ with accumulate rather than index_add_: the same sum (a token meets each
        # expert once), and index_add_ is orders of magnitude slower on a busy 2-core CPU.
        out.index_put_((token,), (y * weights[token, slot, None]).to(out.dtype), accumulate=True)
    return out


def experts_grouped(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                    w3: torch.Tensor, *, padded: bool = False) -> torch.Tensor:
    """`experts_loop` without reading the routing on the host. The M = N * top_k (token, slot) rows
    are sorted by expert (stably: tokens ascending within an expert, the loop's order), the three
    projections run as grouped matmuls over the sorted rows, and the weighted rows are summed back
    into their tokens. The grouped matmuls: `torch._grouped_mm` where `grouped_mm_usable`, else
    the static-shape blocked form `_padded_swiglu`, or `experts_dense` when `_blocked_beats_dense`
    says the blocked form's weight gathers cost more (few tokens); `padded=True` forces the blocked
    form. Every shape follows from N, top_k and E alone, so no op waits for the device.
    Shapes as `experts_loop`; differentiable in x, weights, w1, w2, w3."""
    (num_tokens, top_k), num_experts = ids.shape, w1.shape[0]
    out = torch.zeros_like(x)
    if num_tokens == 0:
        return out
    grouped_mm = not padded and grouped_mm_usable(x, w1)
    if not (padded or grouped_mm or _blocked_beats_dense(num_tokens, num_experts, top_k)):
        return experts_dense(x, weights, ids, w1, w2, w3)
    sorted_ids, order = torch.sort(ids.reshape(-1), stable=True)  # [M] each
    token = order // top_k  # [M] the token of each sorted row
    # Rows up to the end of each expert, from the sorted ids: torch.bincount would copy the ids' min
    # and max to the host on CUDA (to size its output), searchsorted reads nothing back.
    ends = torch.searchsorted(sorted_ids, torch.arange(1, num_experts + 1, device=ids.device))  # [E]
    if grouped_mm:
        offs = ends.to(torch.int32)
        h = x[token]  # [M, D]
        h = F.silu(torch._grouped_mm(h, w1.transpose(1, 2), offs=offs)) * torch._grouped_mm(
            h, w3.transpose(1, 2), offs=offs)  # [M, I]
        y = torch._grouped_mm(h, w2.transpose(1, 2), offs=offs)  # [M, D]
    else:
        y = _padded_swiglu(x, token, sorted_ids, ends, w1, w2, w3)
    scale = weights.reshape(-1)[order, None]  # [M, 1] routing weight of each row
    # Gathers by advanced indexing (backward: index_put_ with accumulate) and index_put_ with
    # accumulate rather than index_select / index_add_: see experts_loop.
    return out.index_put_((token,), (y * scale).to(out.dtype), accumulate=True)


def _padded_swiglu(x: torch.Tensor, token: torch.Tensor, sorted_ids: torch.Tensor, ends: torch.Tensor,
                   w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor) -> torch.Tensor:
    """SwiGLU of the sorted rows (token [M], their experts sorted_ids [M], cumulative counts ends [E])
    as batched matmuls over blocks of B rows that each belong to one expert (the block-sparse layout
    of MegaBlocks, Gale et al. 2022, in plain torch ops): each expert's rows start a fresh block.
    Static shapes: at most nb = (M + min(E, M) * (B - 1)) // B blocks are used whatever the routing;
    with B = ceil(M / E), the mean load, that is under 2E blocks of at most 2M rows, so the FLOPs
    stay within 2x the routed ones (the dense path's are E / top_k x) and each projection gathers
    under 2E expert matrices (kept for backward: the price of not knowing the counts). A capacity
    of N rows per expert, [E, N, D], is static too but costs the dense path's FLOPs. Padding rows
    and unused trailing blocks compute on token 0's row and are dropped. -> [M, D] in sorted order."""
    num_rows, num_experts = token.shape[0], w1.shape[0]
    block, num_blocks = _block_shape(num_rows, num_experts)
    device = token.device
    counts = torch.diff(ends, prepend=ends.new_zeros(1))  # [E]
    expert_blocks = (counts + block - 1) // block  # [E]
    block_ends = torch.cumsum(expert_blocks, 0)  # [E]
    rank = torch.arange(num_rows, device=device) - (ends - counts).index_select(0, sorted_ids)  # [M] row in its expert
    dest = ((block_ends - expert_blocks) * block).index_select(0, sorted_ids) + rank  # [M] padded row
    source = torch.zeros(num_blocks * block, dtype=torch.long, device=device).index_copy_(0, dest, token)  # [nb*B]
    block_expert = torch.searchsorted(block_ends, torch.arange(num_blocks, device=device), right=True
                                      ).clamp_(max=num_experts - 1)  # [nb]

    def project(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # [nb, B, in] -> [nb, B, out]
        return torch.bmm(h, w[block_expert].transpose(1, 2))

    h = x[source].view(num_blocks, block, -1)  # [nb, B, D]
    h = F.silu(project(h, w1)) * project(h, w3)  # [nb, B, I]
    return project(h, w2).view(num_blocks * block, -1)[dest]  # [M, D]


def _block_shape(num_rows: int, num_experts: int) -> tuple[int, int]:
    """(rows per block B, blocks nb) of `_padded_swiglu`'s layout for M rows over E experts."""
    block = -(-num_rows // num_experts)
    return block, (num_rows + min(num_experts, num_rows) * (block - 1)) // block


ROW_COST = 1 / 16
"""One row through one expert matrix, in units of reading that matrix from memory: fp32 on a CPU
(~10 GB/s per ~50 GFLOP/s) and on an H200 (4.8 TB/s per ~60 TFLOP/s) both sit near 1/16-1/10."""


def _blocked_beats_dense(num_tokens: int, num_experts: int, top_k: int) -> bool:
    """Whether the blocked form should run rather than the dense path, by a static cost model per
    projection in matrix reads: blocked = 3 reads per gathered matrix (gather read + write, bmm
    read) + its rows, dense = every matrix once + N rows each. Blocked wins for a handful of tokens
    (gathers fewer than E matrices) and for many (FLOPs within 2x the routed ones); dense between
    (measured on CPU, 64 experts top-8: dense faster at 8-64 tokens, blocked at 1 and 512)."""
    block, num_blocks = _block_shape(num_tokens * top_k, num_experts)
    return 3 * num_blocks + ROW_COST * num_blocks * block <= num_experts + ROW_COST * num_tokens * num_experts


_GROUPED_MM: dict[tuple, bool] = {}
"""grouped_mm_usable's verdicts by (device type, dtype) and by unaligned shape, each warned once."""


def grouped_mm_usable(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether `torch._grouped_mm` may run the projections of x [M, D] by w [E, I, D]: dims of
    16-byte multiples (its kernels' stride rule) and a device/dtype it runs without a host sync and
    right (`_grouped_mm_problem`, probed once). Says why not once per case (warnings.warn)."""
    align = 16 // x.element_size()
    key: tuple = (x.device.type, x.dtype)
    if x.dtype != w.dtype or w.shape[1] % align or w.shape[2] % align:
        key = key + tuple(w.shape[1:])
        problem = (f"weights {w.dtype} [{w.shape[1]}, {w.shape[2]}] for input {x.dtype}: needs one dtype and "
                   f"dims that are multiples of {align}")
    elif key not in _GROUPED_MM:
        problem = _grouped_mm_problem(x.device, x.dtype)
    if key not in _GROUPED_MM:
        if problem is not None:
            warnings.warn(f"MoE experts: torch._grouped_mm not used ({problem}); running the padded batched "
                          f"matmul or the dense path instead (models/mlp.py experts_grouped)", stacklevel=3)
        _GROUPED_MM[key] = problem is None
    return _GROUPED_MM[key]


def _grouped_mm_problem(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why torch._grouped_mm should not run experts on this device and dtype, or None. On CUDA its
    grouped kernel covers bf16 on SM90/SM100; every other case (and every CPU call) runs a loop of
    matmuls that first copies the offsets to the host: free on a CPU, a sync per call on a GPU.
    The probe also checks forward and backward against per-group matmuls at uneven group sizes."""
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no torch._grouped_mm"
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if dtype != torch.bfloat16 or major not in (9, 10):
            return (f"{dtype} on SM{major}{minor}: its grouped kernel is bf16 on SM90/SM100 only, otherwise it "
                    f"loops over the groups after copying the offsets to the host, a sync per call")
    elif device.type != "cpu":
        return f"not known to run without a host sync on {device.type}"
    gen = torch.Generator().manual_seed(0)  # CPU draws, moved: the same inputs on every device
    starts, ends = [0, 3, 3, 8], [3, 3, 8, 17]  # an empty group and uneven ones
    with torch.inference_mode(False), torch.enable_grad():
        a = torch.randn(17, 16, generator=gen, device="cpu").to(device, dtype).requires_grad_()
        w = torch.randn(4, 8, 16, generator=gen, device="cpu").to(device, dtype).requires_grad_()
        grad = torch.randn(17, 8, generator=gen, device="cpu").to(device, dtype)
        try:
            out = torch._grouped_mm(a, w.transpose(1, 2), offs=torch.tensor(ends, dtype=torch.int32, device=device))
            got = (out, *torch.autograd.grad(out, (a, w), grad))
        except RuntimeError as err:
            return f"it failed on {device.type} {dtype}: {err}"
        ref = torch.cat([a[s:e] @ w[g].T for g, (s, e) in enumerate(zip(starts, ends))])
        want = (ref, *torch.autograd.grad(ref, (a, w), grad))
    if not all(((p.float() - q.float()).norm() <= 1e-2 * q.float().norm()).item() for p, q in zip(got, want)):
        return f"it disagrees with per-group matmuls on {device.type} {dtype}"
    return None


def _exchange_ids(ids: torch.Tensor, recv: list[int], send: list[int], ep: ExpertParallel) -> torch.Tensor:
    """The local expert id of every row, sent along with the rows (integers: no gradient)."""
    out = ids.new_empty(sum(recv))
    dist.all_to_all_single(out, ids.contiguous(), recv, send, group=ep.group)
    return out


class Router(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.top_k, self.num_experts = config.num_experts_per_token, config.num_experts
        self.num_groups, self.topk_group = config.num_expert_group, config.topk_group
        self.renormalize, self.scaling = config.moe_renormalize, config.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        # Updated by load balancing, not by gradients: a buffer that is saved with the weights.
        self.register_buffer("e_score_correction_bias", torch.zeros(config.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [N, D] -> (weights [N, top_k] float32, expert ids [N, top_k])."""
        scores = F.linear(x.float(), self.weight.float()).sigmoid()  # [N, E]
        choice = scores + self.e_score_correction_bias.float()
        if self.topk_group < self.num_groups:  # group-limited routing: experts of the best groups only
            grouped = choice.view(-1, self.num_groups, self.num_experts // self.num_groups)  # [N, G, E/G]
            group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)  # [N, G]
            kept_groups = group_scores.topk(self.topk_group, dim=-1, sorted=False).indices  # [N, topk_group]
            dropped = torch.ones_like(group_scores, dtype=torch.bool).scatter_(1, kept_groups, False)  # [N, G]
            choice = grouped.masked_fill(dropped[:, :, None], float("-inf")).view(-1, self.num_experts)
        ids = choice.topk(self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        if self.renormalize:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * self.scaling, ids


class MoE(nn.Module):
    """`expert_parallel`: the experts are this rank's share of its expert-parallel group's
    (models/expert_parallel.py); None or size 1 = all of them."""

    def __init__(self, config: ModelConfig, expert_parallel: ExpertParallel | None = None) -> None:
        super().__init__()
        self.gate = Router(config)
        ep = expert_parallel if expert_parallel is not None and expert_parallel.active else None
        self.expert_parallel = ep
        mine = ep.experts_of(config.num_experts) if ep is not None else range(config.num_experts)
        self.experts = Experts(len(mine), config.hidden_size, config.moe_intermediate_size, first=mine.start,
                               num_global=config.num_experts)
        self.shared_experts = (SwiGLU(config.hidden_size, config.moe_intermediate_size * config.num_shared_experts)
                               if config.num_shared_experts else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [N, D] -> [N, D]."""
        experts, shared = self.experts, self.shared_experts
        if self.expert_parallel is not None:
            return self._forward_parallel(x)
        if (use_fused(x) and shared is not None and experts.impl in ("auto", "dense")
                and experts.runs_dense(self.gate.top_k) and shared.gate_proj.weight.shape[0] % experts.w1.shape[1] == 0):
            return self._fused_dense(x)
        weights, ids = self.gate(x)
        out = experts(x, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

    def _forward_parallel(self, x: torch.Tensor) -> torch.Tensor:
        """The layer with its experts split over the expert-parallel group (models/expert_parallel.py):
        the rows sorted by expert as `experts_grouped` sorts them, sent to their experts' ranks, run
        there (weight 1), sent back, then weighted and summed into their tokens in that order.
        x: [N, D] (N may be 0: the rank still joins every exchange) -> [N, D]."""
        ep, experts = self.expert_parallel, self.experts
        weights, ids = self.gate(x)  # [N, k] each, global expert ids
        top_k, per = ids.shape[1], experts.w1.shape[0]
        sorted_ids, order = torch.sort(ids.reshape(-1), stable=True)  # [M]: grouped by rank, since rank = id // per
        token = order // top_k  # [M]
        bounds = torch.arange(1, ep.size + 1, device=ids.device) * per
        ends = torch.searchsorted(sorted_ids, bounds)  # [P] rows up to the end of each rank's experts
        recv, send = exchange_counts(torch.diff(ends, prepend=ends.new_zeros(1)).to(torch.int64), ep)
        local = _exchange_ids((sorted_ids % per).to(torch.int64), recv, send, ep)  # [R] this rank's expert per row
        rows = all_to_all(x[token], recv, send, ep)  # [R, D]
        ones = torch.ones(rows.shape[0], 1, dtype=torch.float32, device=x.device)
        y = experts(rows, ones, local[:, None])  # [R, D]: each row through its one expert
        back = all_to_all(y, send, recv, ep)  # [M, D], in sorted order
        scale = weights.reshape(-1)[order, None]  # [M, 1]
        out = torch.zeros_like(x).index_put_((token,), (back * scale).to(x.dtype), accumulate=True)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

    def _routing_dense(self, x: torch.Tensor, num_shared: int) -> torch.Tensor:
        """[N, E + num_shared] routing weights: the router's, zero for unchosen experts, 1 for the
        shared ones. On CPU fp32 with the fused kernels built, one C++ op after the scores
        (kernels/cpu/, same comparisons and float ops as `Router.forward`); else the router + scatter."""
        gate = self.gate
        if x.dtype == torch.float32 and gate.weight.dtype == torch.float32 and cpu_ops() is not None:
            scores = F.linear(x, gate.weight).sigmoid_()  # [N, E]
            return cpu_ops().moe_route_dense(scores, gate.e_score_correction_bias.float(), gate.top_k, gate.num_groups,
                                             gate.topk_group, gate.renormalize, float(gate.scaling), num_shared)
        weights, ids = gate(x)
        dense = torch.zeros(x.shape[0], gate.num_experts + num_shared, dtype=weights.dtype, device=x.device)
        dense[:, gate.num_experts:] = 1.0  # the shared experts
        return dense.scatter_(1, ids, weights)

    def _fused_dense(self, x: torch.Tensor) -> torch.Tensor:
        """Inference form of the dense all-experts path plus the shared experts, with the shared
        intermediate (num_shared * I channels) run as `num_shared` extra experts of routing weight 1
        (SwiGLU is per channel and the down projection sums channels, so the split is exact):
        one matmul for every gate|up projection, one for every down projection."""
        experts, shared = self.experts, self.shared_experts
        num_experts, inter, dim = experts.w1.shape
        num_shared = shared.gate_proj.weight.shape[0] // inter
        total, num_tokens = num_experts + num_shared, x.shape[0]
        sources = [experts.w1, experts.w3, experts.w2, shared.gate_proj.weight, shared.up_proj.weight,
                   shared.down_proj.weight]
        w_in = fused_weight(self, "in", sources, lambda: torch.cat(
            [experts.w1.reshape(-1, dim), shared.gate_proj.weight, experts.w3.reshape(-1, dim), shared.up_proj.weight]))
        w_out = fused_weight(self, "out", sources, lambda: torch.cat(
            [experts.w2.permute(1, 0, 2).reshape(dim, -1), shared.down_proj.weight], dim=1))  # [D, (E + S) * I]
        gate, up = F.linear(x, w_in).chunk(2, dim=-1)  # [N, (E + S) * I] each
        dense = self._routing_dense(x, num_shared)  # [N, E + S] routing weights, zero for unchosen experts
        hidden = (F.silu(gate) * up).view(num_tokens, total, inter) * dense[:, :, None].to(x.dtype)
        return F.linear(hidden.view(num_tokens, -1), w_out)
