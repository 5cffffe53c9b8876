"""Triton building blocks shared by the KDA chunk forward (chunk_fwd.py) and backward (chunk_bwd.py).

Everything here works on one *segment* of at most BT = 64 tokens of one (sequence, head), held
as [BT, *] register tiles whose rows are tokens (row t of the segment lives at global row
`row0 + t * H` of a [B * T * H, width] tensor). Padded rows (t >= L) are loaded as 0.

The intra-segment products all have the pairwise-decay form

    M[i, j] = sum_c a[i, c] b[j, c] exp(G[i, c] - G[j, c]),   j <= i (or j < i)

with G the in-segment cumulative log-decay (non-increasing when g <= 0, as in the model). It is
computed without ever forming exp(G_i) * exp(-G_j) (which overflows under strong decay) and
without a [BT, BT, K] tensor, in fla's sub-chunk scheme: tokens form sub-chunks of BC = 16; for
rows of sub-chunk s and columns in earlier sub-chunks a reference row r = 16 s splits the decay
as exp(G_i - G_r) * exp(G_r - G_j), both factors <= 1, so the block is one `tl.dot`; the
16 x 16 diagonal blocks, where no such split is bounded, are summed column by column.
`decay_row` and `decay_col` are the same scheme applied to a given [BT, BT] matrix D (the
backward's row- and column-role gradients).

Dots take fp32 operands with input_precision="ieee" (exact twin of the torch path), or bf16
operands with fp32 accumulation when DOT_BF16 (tensor cores).
"""

import triton
import triton.language as tl


@triton.jit
def mm(a, b, DOT_BF16: tl.constexpr):
    """a @ b with fp32 accumulation; bf16 operands when DOT_BF16, else fp32 'ieee'."""
    if DOT_BF16:
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    else:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")


@triton.jit
def row_tile(ptr, rows, valid, c, cm, width):
    """[BT, BK] fp32 tile of `ptr` at rows (int64 [BT]) and columns c ([BK]); masked -> 0."""
    return tl.load(ptr + rows[:, None] * width + c[None, :], mask=valid[:, None] & cm[None, :], other=0.0).to(
        tl.float32
    )


@triton.jit
def gram_tile(a_ptr, b_ptr, G_ptr, row0, H, t, valid, L, K,
          STRICT: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, DOT_BF16: tl.constexpr):
    """M[i, j] = sum_c a_ic b_jc exp(G_ic - G_jc) for j < i (STRICT) or j <= i; [BT, BT] fp32.

    a_ptr, b_ptr, G_ptr: [B * T * H, K] row-major (G fp32). Rows and columns past L are 0.
    """
    rows = row0 + t * H  # [BT] int64
    acc = tl.zeros([BT, BT], dtype=tl.float32)
    for c0 in range(0, K, BK):
        c = c0 + tl.arange(0, BK)  # [BK]
        cm = c < K
        a = row_tile(a_ptr, rows, valid, c, cm, K)  # [BT, BK]
        b = row_tile(b_ptr, rows, valid, c, cm, K)
        G = row_tile(G_ptr, rows, valid, c, cm, K)
        for sc in tl.static_range(1, BT // BC):  # sub-chunk 0 has no earlier columns
            r = sc * BC
            G_r = tl.load(G_ptr + (row0 + r * H) * K + c, mask=cm & (r < L), other=0.0)  # [BK]
            mine = (t >= r) & (t < r + BC) & valid  # [BT] rows of this sub-chunk
            before = (t < r) & valid & (r < L)  # [BT] columns in earlier sub-chunks (none if s is empty)
            a_t = tl.where(mine[:, None], a * tl.exp(tl.where(mine[:, None], G - G_r[None, :], 0.0)), 0.0)
            b_t = tl.where(before[:, None], b * tl.exp(tl.where(before[:, None], G_r[None, :] - G, 0.0)), 0.0)
            acc += mm(a_t, tl.trans(b_t), DOT_BF16)
        for jj in tl.static_range(BC):  # the diagonal 16 x 16 blocks, column jj of each
            j = (t // BC) * BC + jj  # [BT] the column each row pairs with
            if STRICT:
                ok = (j < t) & valid
            else:
                ok = (j <= t) & valid
            b_j = row_tile(b_ptr, row0 + j * H, ok, c, cm, K)  # [BT, BK]
            G_j = row_tile(G_ptr, row0 + j * H, ok, c, cm, K)
            col = tl.sum(a * b_j * tl.exp(tl.where(ok[:, None], G - G_j, float("-inf"))), axis=1)  # [BT]
            acc += tl.where(t[None, :] == j[:, None], col[:, None], 0.0)
    return acc


@triton.jit
def decay_row(D, b_ptr, G_ptr, G, row0, H, t, valid, L, c, cm, K,
               BT: tl.constexpr, BC: tl.constexpr, DOT_BF16: tl.constexpr):
    """R[i] = sum_{j <= i} D[i, j] b_j exp(G_i - G_j) for the K block c: [BT, BK] fp32.

    D: [BT, BT] lower triangular (zero above the diagonal and at padded rows/columns).
    G: [BT, BK] this block's cumulative gates (the tile of G_ptr at these rows).
    """
    rows = row0 + t * H
    b = row_tile(b_ptr, rows, valid, c, cm, K)  # [BT, BK]
    out = tl.zeros(b.shape, dtype=tl.float32)
    for sc in tl.static_range(1, BT // BC):
        r = sc * BC
        G_r = tl.load(G_ptr + (row0 + r * H) * K + c, mask=cm & (r < L), other=0.0)  # [BK]
        mine = (t >= r) & (t < r + BC) & valid
        before = (t < r) & valid & (r < L)  # an empty sub-chunk pairs with nothing
        D_s = tl.where(mine[:, None] & (t[None, :] < r), D, 0.0)  # [BT, BT]
        b_t = tl.where(before[:, None], b * tl.exp(tl.where(before[:, None], G_r[None, :] - G, 0.0)), 0.0)
        decay_i = tl.where(mine[:, None], tl.exp(tl.where(mine[:, None], G - G_r[None, :], 0.0)), 0.0)
        out += decay_i * mm(D_s, b_t, DOT_BF16)
    for jj in tl.static_range(BC):
        j = (t // BC) * BC + jj
        ok = (j <= t) & valid
        d = tl.sum(tl.where(t[None, :] == j[:, None], D, 0.0), axis=1)  # [BT] D[i, j(i)]
        b_j = row_tile(b_ptr, row0 + j * H, ok, c, cm, K)
        G_j = row_tile(G_ptr, row0 + j * H, ok, c, cm, K)
        out += d[:, None] * b_j * tl.exp(tl.where(ok[:, None], G - G_j, float("-inf")))
    return out


@triton.jit
def decay_col(D, b_ptr, G_ptr, G, row0, H, t, valid, L, c, cm, K,
               BT: tl.constexpr, BC: tl.constexpr, DOT_BF16: tl.constexpr):
    """C[j] = sum_{i >= j} D[i, j] b_i exp(G_i - G_j) for the K block c: [BT, BK] fp32.

    Same D and G as `decay_row`. For columns of sub-chunk s and rows in later sub-chunks the
    reference is the sub-chunk's last valid row r: exp(G_i - G_r) and exp(G_r - G_j) are <= 1.
    """
    rows = row0 + t * H
    b = row_tile(b_ptr, rows, valid, c, cm, K)  # [BT, BK]
    out = tl.zeros(b.shape, dtype=tl.float32)
    for sc in tl.static_range(0, BT // BC - 1):  # the last sub-chunk has no later rows
        r = tl.minimum(sc * BC + BC - 1, L - 1)  # a valid row >= every valid column of sc
        G_r = tl.load(G_ptr + (row0 + r * H) * K + c, mask=cm, other=0.0)  # [BK]
        mine = (t >= sc * BC) & (t < sc * BC + BC) & valid
        after = (t >= sc * BC + BC) & valid
        D_s = tl.where(after[:, None] & mine[None, :], D, 0.0)  # [BT(i), BT(j)]
        b_t = tl.where(after[:, None], b * tl.exp(tl.where(after[:, None], G - G_r[None, :], 0.0)), 0.0)
        decay_j = tl.where(mine[:, None], tl.exp(tl.where(mine[:, None], G_r[None, :] - G, 0.0)), 0.0)
        out += decay_j * mm(tl.trans(D_s), b_t, DOT_BF16)
    Dt = tl.trans(D)  # [BT(j), BT(i)]
    for ii in tl.static_range(BC):
        i = (t // BC) * BC + ii  # [BT] the row each column pairs with
        ok = (i >= t) & (i < L) & valid
        d = tl.sum(tl.where(t[None, :] == i[:, None], Dt, 0.0), axis=1)  # [BT] D[i(j), j]
        b_i = row_tile(b_ptr, row0 + i * H, ok, c, cm, K)
        G_i = row_tile(G_ptr, row0 + i * H, ok, c, cm, K)
        out += d[:, None] * b_i * tl.exp(tl.where(ok[:, None], G_i - G, float("-inf")))
    return out


@triton.jit
def _unit_lower_inverse(A, t, BT: tl.constexpr):
    """(I + A)^{-1} for a strictly lower triangular [BT, BT] A, by forward substitution:
    row i of the inverse is e_i - sum_{j < i} A[i, j] (row j), rows taken in order."""
    inv = tl.where(t[:, None] == t[None, :], 1.0, 0.0)  # [BT, BT]
    for i in range(1, BT):
        a_i = tl.sum(tl.where(t[:, None] == i, A, 0.0), axis=0)  # [BT] row i of A
        row = tl.where(t == i, 1.0, 0.0) - tl.sum(a_i[:, None] * inv, axis=0)  # [BT]
        inv = tl.where(t[:, None] == i, row[None, :], inv)
    return inv


@triton.jit
def _block(ptr, row0, H, L, a: tl.constexpr, b: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """Block (a, b) [BC, BC] of the [BT, BT] matrix whose row t is at ptr + (row0 + t H) BT; rows >= L are 0."""
    r, c = a * BC + tl.arange(0, BC), b * BC + tl.arange(0, BC)
    return tl.load(ptr + (row0 + r * H)[:, None] * BT + c[None, :], mask=(r < L)[:, None], other=0.0)


@triton.jit
def _put(ptr, row0, H, L, a: tl.constexpr, b: tl.constexpr, x, BT: tl.constexpr, BC: tl.constexpr):
    r, c = a * BC + tl.arange(0, BC), b * BC + tl.arange(0, BC)
    tl.store(ptr + (row0 + r * H)[:, None] * BT + c[None, :], x, mask=(r < L)[:, None])


@triton.jit
def block_inverse(ptr, row0, H, L, BT: tl.constexpr, BC: tl.constexpr):
    """(I + A)^{-1} in place, A the strictly lower [BT, BT] (BT = 4 BC) matrix stored at ptr's rows.

    Block forward substitution (fla's solve_tril): the four diagonal [BC, BC] blocks are inverted
    by forward substitution, then X_ab = -X_aa sum_{b <= c < a} A_ac X_cb with [BC, BC] dots, in
    fp32 'ieee' whatever the inputs (the inverse's error feeds every output). Blocks above the
    diagonal are left as stored (zero). Call between tl.debug_barrier()s when the same program
    wrote A or reads the result.
    """
    tl.static_assert(BT == 4 * BC)
    t = tl.arange(0, BC)
    X00 = _unit_lower_inverse(_block(ptr, row0, H, L, 0, 0, BT, BC), t, BC)
    X11 = _unit_lower_inverse(_block(ptr, row0, H, L, 1, 1, BT, BC), t, BC)
    X22 = _unit_lower_inverse(_block(ptr, row0, H, L, 2, 2, BT, BC), t, BC)
    X33 = _unit_lower_inverse(_block(ptr, row0, H, L, 3, 3, BT, BC), t, BC)
    A10, A21, A32 = (_block(ptr, row0, H, L, 1, 0, BT, BC), _block(ptr, row0, H, L, 2, 1, BT, BC),
                     _block(ptr, row0, H, L, 3, 2, BT, BC))
    A20, A31, A30 = (_block(ptr, row0, H, L, 2, 0, BT, BC), _block(ptr, row0, H, L, 3, 1, BT, BC),
                     _block(ptr, row0, H, L, 3, 0, BT, BC))
    X10 = -mm(X11, mm(A10, X00, False), False)
    X21 = -mm(X22, mm(A21, X11, False), False)
    X32 = -mm(X33, mm(A32, X22, False), False)
    X20 = -mm(X22, mm(A20, X00, False) + mm(A21, X10, False), False)
    X31 = -mm(X33, mm(A31, X11, False) + mm(A32, X21, False), False)
    X30 = -mm(X33, mm(A30, X00, False) + mm(A31, X10, False) + mm(A32, X20, False), False)
    _put(ptr, row0, H, L, 0, 0, X00, BT, BC)
    _put(ptr, row0, H, L, 1, 1, X11, BT, BC)
    _put(ptr, row0, H, L, 2, 2, X22, BT, BC)
    _put(ptr, row0, H, L, 3, 3, X33, BT, BC)
    _put(ptr, row0, H, L, 1, 0, X10, BT, BC)
    _put(ptr, row0, H, L, 2, 1, X21, BT, BC)
    _put(ptr, row0, H, L, 3, 2, X32, BT, BC)
    _put(ptr, row0, H, L, 2, 0, X20, BT, BC)
    _put(ptr, row0, H, L, 3, 1, X31, BT, BC)
    _put(ptr, row0, H, L, 3, 0, X30, BT, BC)


@triton.jit
def state_program(H, K, V, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """The indices of a serial-walk program (grid (b*h, V block)): bh (int64), b, h, its value
    columns cv [BV] and mask, the key channels c [BK] and mask, token offsets t [BT], and the
    offsets and mask of its [BK, BV] block within one [K, V] state."""
    bh = tl.program_id(0).to(tl.int64)
    cv = tl.program_id(1) * BV + tl.arange(0, BV)
    c = tl.arange(0, BK)
    vm, cm = cv < V, c < K
    return bh, bh // H, bh % H, cv, vm, c, cm, tl.arange(0, BT), c[:, None] * V + cv[None, :], cm[:, None] & vm[None, :]


@triton.jit
def segment_program(seg_ptr, NS, T, H, BT: tl.constexpr):
    """The indices of a per-segment program (grid (segment, b*h, ...)): s, bh (int64), b, h, the
    segment's length L, token offsets t [BT] and their mask, and the global rows (int64 [BT]) of its
    tokens, row0 = rows[0]."""
    s, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    b, h = bh // H, bh % H
    start, L = tl.load(seg_ptr + s), tl.load(seg_ptr + NS + s)
    t = tl.arange(0, BT)
    row0 = (b * T + start) * H + h
    return s, bh, b, h, L, t, t < L, row0, row0 + t * H
