"""Reference KDA (Kimi Delta Attention) kernels: plain fp32 torch, written to be read.

KDA is the gated delta rule with a per-channel (fine-grained) decay, Kimi Linear
(arXiv:2510.26692), Sec. 3. Per batch b and head h the state S is a [K, V] matrix:

    S'_t = Diag(exp(g_t)) S_{t-1}                      # g_t in R^K, a log-decay <= 0
    S_t  = S'_t + beta_t k_t (v_t - S'_t^T k_t)^T      # delta-rule correction
    o_t  = S_t^T (scale q_t)

`naive_recurrent_kda` runs this token by token; `naive_chunk_kda` runs the chunked WY/UT
form (Yang et al., "Gated Delta Networks", arXiv:2412.06464; the UT transform of
Joffrain et al. 2006) that the Triton kernel will use. Both mirror fla's
`fla/ops/kda/naive.py` but also return the states at requested token positions, which the
model stores at hash-block boundaries for prefix caching. q and k must already be
L2-normalised: neither function normalises.
"""

import operator
from collections.abc import Sequence

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint


def check_inputs(q, k, v, g, beta, initial_state, state_positions) -> tuple[int, ...]:
    """Validates shapes and positions; returns (B, T, H, K, V) and the positions as a tuple."""
    if q.dim() != 4:
        raise ValueError(f"q must be [B, T, H, K], got shape {tuple(q.shape)}")
    B, T, H, K = q.shape
    if tuple(k.shape) != (B, T, H, K):
        raise ValueError(f"k shape {tuple(k.shape)} must equal q shape {(B, T, H, K)}")
    if tuple(g.shape) != (B, T, H, K):
        raise ValueError(f"g shape {tuple(g.shape)} must equal q shape {(B, T, H, K)}")
    if v.dim() != 4 or tuple(v.shape[:3]) != (B, T, H):
        raise ValueError(f"v shape {tuple(v.shape)} must be [B, T, H, V] = [{B}, {T}, {H}, V]")
    V = v.shape[3]
    if tuple(beta.shape) != (B, T, H):
        raise ValueError(f"beta shape {tuple(beta.shape)} must be [B, T, H] = {(B, T, H)}")
    if initial_state is not None and tuple(initial_state.shape) != (B, H, K, V):
        raise ValueError(
            f"initial_state shape {tuple(initial_state.shape)} must be [B, H, K, V] = "
            f"{(B, H, K, V)}"
        )
    positions = []
    for p in state_positions:
        try:
            p = operator.index(p)
        except TypeError:
            raise ValueError(f"state position {p!r} must be an int") from None
        if not 0 <= p <= T:
            raise ValueError(f"state position {p} out of range: expected 0 <= p <= T={T}")
        if positions and p <= positions[-1]:
            raise ValueError(
                f"state_positions must be strictly increasing, got {p} after {positions[-1]}"
            )
        positions.append(p)
    return (B, T, H, K, V), tuple(positions)


def _initial(initial_state: Tensor | None, B: int, H: int, K: int, V: int, device) -> Tensor:
    if initial_state is None:
        return torch.zeros(B, H, K, V, dtype=torch.float32, device=device)  # [B, H, K, V]
    return initial_state.to(torch.float32).clone()  # [B, H, K, V]; never alias the caller's


def _stack_states(states: list[Tensor], B: int, H: int, K: int, V: int, device) -> Tensor:
    if not states:
        return torch.zeros(B, 0, H, K, V, dtype=torch.float32, device=device)  # [B, 0, H, K, V]
    return torch.stack(states, dim=1)  # [B, P, H, K, V]


def naive_recurrent_kda(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    state_positions: Sequence[int] = (),
) -> tuple[Tensor, Tensor, Tensor]:
    """Token-by-token KDA; the ground truth the chunked and Triton forms are tested against.

    Args:
        q, k: [B, T, H, K], already L2-normalised over K.
        v: [B, T, H, V].
        g: [B, T, H, K] per-channel log-decay (<= 0 in the model; not checked).
        beta: [B, T, H] delta-rule write strength, in (0, 1) in the model.
        scale: query scale, default K ** -0.5.
        initial_state: [B, H, K, V] state before token 0, or None for zeros. Not mutated.
        state_positions: strictly increasing ints p in [0, T]; the state after the first p
            tokens of this call is returned for each (p = 0 gives the initial state).

    Returns:
        o: [B, T, H, V] in q's dtype (all math in fp32).
        final_state: [B, H, K, V] fp32, the state after all T tokens.
        position_states: [B, P, H, K, V] fp32, P = len(state_positions).
    """
    (B, T, H, K, V), positions = check_inputs(q, k, v, g, beta, initial_state, state_positions)
    scale = K**-0.5 if scale is None else scale
    out_dtype = q.dtype
    q, k, v, g, beta = (x.to(torch.float32) for x in (q, k, v, g, beta))
    S = _initial(initial_state, B, H, K, V, q.device)  # [B, H, K, V]
    o = torch.zeros(B, T, H, V, dtype=torch.float32, device=q.device)  # [B, T, H, V]
    wanted = set(positions)
    states = [S.clone()] if 0 in wanted else []
    for t in range(T):
        S = S * g[:, t].exp().unsqueeze(-1)  # decay each key channel (row of S)
        k_t = k[:, t]  # [B, H, K]
        predicted = torch.einsum("bhk,bhkv->bhv", k_t, S)  # S'^T k: what the state recalls
        delta = beta[:, t].unsqueeze(-1) * (v[:, t] - predicted)  # [B, H, V]
        S = S + k_t.unsqueeze(-1) * delta.unsqueeze(-2)  # rank-1 write k delta^T
        o[:, t] = torch.einsum("bhk,bhkv->bhv", scale * q[:, t], S)
        if t + 1 in wanted:
            states.append(S.clone())
    return o.to(out_dtype), S, _stack_states(states, B, H, K, V, q.device)


def _segment_ends(T: int, chunk_len: int, positions: tuple[int, ...]) -> list[int]:
    """Ends of the segments a call is cut into: multiples of chunk_len, requested positions, T.

    Cutting at every requested position makes the state there exact without padding; a
    segment is never longer than chunk_len, so the intra-segment matrices stay [L, L].
    """
    ends = set(range(chunk_len, T, chunk_len)) | {p for p in positions if p > 0}
    if T > 0:
        ends.add(T)
    return sorted(ends)


def _segment(q_s: Tensor, k_s: Tensor, v_s: Tensor, g_s: Tensor, b_s: Tensor, S: Tensor, scale: float
             ) -> tuple[Tensor, Tensor]:
    """One segment of `naive_chunk_kda` (derivation there): q_s, k_s, g_s [B, H, L, K], v_s [B, H, L, V],
    b_s [B, H, L, 1], S [B, H, K, V] the state before it -> (outputs [B, H, L, V], state after it)."""
    L = q_s.shape[2]
    G = g_s.cumsum(dim=-2)  # [B, H, L, K]
    # Pairwise decay exp(G_i - G_j) for j <= i, taken as one difference rather than
    # exp(G_i) * exp(-G_j) so long segments cannot overflow; j > i is masked to 0.
    causal = torch.ones(L, L, dtype=torch.bool, device=q_s.device).tril()  # [L, L]
    diff = G.unsqueeze(-2) - G.unsqueeze(-3)  # [B, H, L(i), L(j), K]
    decay = diff.masked_fill(~causal.unsqueeze(-1), float("-inf")).exp()
    kk = torch.einsum("bhik,bhjk,bhijk->bhij", k_s, k_s, decay)  # [B, H, L, L]
    A = (b_s * kk).tril(diagonal=-1)  # [B, H, L, L] strictly lower
    eye = torch.eye(L, dtype=torch.float32, device=q_s.device)  # [L, L]
    V = v_s.shape[-1]
    rhs = torch.cat([b_s * v_s, b_s * k_s * G.exp()], dim=-1)  # [B, H, L, V + K]
    uw = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
    u, w = uw[..., :V], uw[..., V:]  # [B, H, L, V], [B, H, L, K]
    v_new = u - w @ S  # [B, H, L, V] the delta_i actually written
    q_scaled = scale * q_s  # [B, H, L, K]
    qk = torch.einsum("bhik,bhjk,bhijk->bhij", q_scaled, k_s, decay)  # [B, H, L, L] incl. diag
    o_s = (q_scaled * G.exp()) @ S + qk @ v_new
    G_last = G[:, :, -1]  # [B, H, K]
    S = G_last.exp().unsqueeze(-1) * S + (k_s * (G_last.unsqueeze(-2) - G).exp()).transpose(-1, -2) @ v_new
    return o_s, S


def naive_chunk_kda(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    state_positions: Sequence[int] = (),
    chunk_len: int = 64,
) -> tuple[Tensor, Tensor, Tensor]:
    """Chunked (WY/UT) KDA; same arguments and results as `naive_recurrent_kda`.

    chunk_len: the longest segment processed in one parallel step (fla uses 64).

    Derivation, within one segment of L tokens starting from state S, with G = cumsum(g)
    ([L, K], G_i = total log-decay from the segment start through token i) and
    delta_i = beta_i (v_i - S'_i^T k_i) the value actually written at token i:
      S_i = exp(G_i) * S + sum_{j<=i} (k_j * exp(G_i - G_j)) delta_j^T          (unrolling)
      => delta_i + beta_i sum_{j<i} <k_i, k_j * exp(G_i - G_j)> delta_j
           = beta_i v_i - beta_i (k_i * exp(G_i))^T S
      i.e. (I + A) delta = beta v - (beta k exp(G)) S, A strictly lower triangular.
    With T_mat = (I + A)^{-1} (the UT transform), u = T_mat (beta v), w = T_mat (beta k exp(G)),
    delta = u - w S ("v_new"); the outputs and the next state follow from the unrolled S_i.
    This matches fla's `fla/ops/kda/naive.py::naive_chunk_kda` up to the segment cutting.
    """
    (B, T, H, K, V), positions = check_inputs(q, k, v, g, beta, initial_state, state_positions)
    if isinstance(chunk_len, bool) or not isinstance(chunk_len, int) or chunk_len < 1:
        raise ValueError(f"chunk_len must be a positive int, got {chunk_len!r}")
    scale = K**-0.5 if scale is None else scale
    out_dtype = q.dtype
    # Heads-major layout so each segment is a batch of [L, *] matrices.
    q, k, v, g = (x.to(torch.float32).transpose(1, 2) for x in (q, k, v, g))  # [B, H, T, *]
    beta = beta.to(torch.float32).transpose(1, 2)  # [B, H, T]
    S = _initial(initial_state, B, H, K, V, q.device)  # [B, H, K, V]
    states = [S.clone()] if 0 in positions else []
    # Under autograd each segment is recomputed in backward (activation checkpointing): only its
    # inputs (views of q, k, v, g, beta) and its initial state S are kept, never the [L, L, K]
    # decay tensors of every segment, so training memory grows linearly with T. Same ops, same
    # gradients as keeping everything.
    recompute = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v, g, beta, S))
    ends = _segment_ends(T, chunk_len, positions)
    # One split per input, not a slice per segment: under autograd a slice's backward writes its
    # gradient into a zero tensor of the whole length, so T / chunk_len slices cost O(T^2) in
    # memory traffic; a split's backward is one concatenation.
    sizes = [end - start for start, end in zip([0, *ends[:-1]], ends)]
    segments = zip(*(x.split(sizes, dim=2) for x in (q, k, v, g, beta.unsqueeze(-1)))) if ends else ()
    pieces = []
    for end, (q_s, k_s, v_s, g_s, b_s) in zip(ends, segments):
        args = (q_s, k_s, v_s, g_s, b_s, S)
        o_s, S = (checkpoint(_segment, *args, scale, use_reentrant=False) if recompute
                  else _segment(*args, scale))
        pieces.append(o_s)
        if end in positions:
            states.append(S.clone())
    o = torch.cat(pieces, dim=2) if pieces else q.new_zeros(B, H, T, V)  # [B, H, T, V]
    o = o.transpose(1, 2).to(out_dtype)  # [B, T, H, V]
    return o, S, _stack_states(states, B, H, K, V, q.device)
