"""KDA over several tokens per sequence chained through pages (kernels/kda/decode_tokens.py): the naive
form against one-token steps of the already tested single-token ops (short conv + decode step), the fused
CPU op against the naive form, and the pages each call may write."""
import pytest
import torch

from kernels.cpu import ops
from kernels.kda.decode import kda_decode_step
from kernels.kda.decode_tokens import kda_decode_tokens
from tests.kernels.test_kda_decode import rel_err

# CPU kernels; they compare two computation orders, so they run under every CPU kernel path (make test-slow)
pytestmark = [pytest.mark.skipif(torch.cuda.is_available(), reason="CPU kernels"), pytest.mark.numerics]

H, D, KK, P = 3, 5, 4, 23
STATE_NUMEL, TAIL_NUMEL = H * D * D, H * 3 * (KK - 1) * D


def make_pool(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A pool of P pages holding a state and conv tails each, plus padding: (buffer, state, tails) views."""
    gen = torch.Generator().manual_seed(seed)
    buf = torch.randn(P, STATE_NUMEL + TAIL_NUMEL + 3, generator=gen)
    return buf, buf[:, :STATE_NUMEL].view(P, H, D, D), buf[:, STATE_NUMEL:STATE_NUMEL + TAIL_NUMEL].view(P, H, 3, KK - 1, D)


def make_rows(lens: list[int], seed: int):
    """Random inputs for sequences of `lens` rows: mixed [N, 3HD], g [N, H, D], beta [N, H], taps, and each
    sequence's source page and destination pages (distinct across the call)."""
    gen = torch.Generator().manual_seed(seed)
    n = sum(lens)
    mixed = torch.randn(n, 3 * H * D, generator=gen)
    g = -torch.rand(n, H, D, generator=gen) * 2
    beta = torch.rand(n, H, generator=gen)
    taps = torch.randn(H, 3, KK, D, generator=gen) * 0.5
    pages = torch.randperm(P, generator=gen).tolist()
    src, dst = [], []
    for length in lens:
        src.append(pages.pop())
        # A sequence of one row updates its page in place; longer ones write k position pages, then their own.
        dst += [src[-1]] if length == 1 else [pages.pop() for _ in range(length - 1)] + [src[-1]]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    return mixed, g, beta, taps, torch.tensor(src), torch.tensor(dst), cu


def one_token_at_a_time(mixed, g, beta, taps, src, dst, cu, state, tails):
    """The reference: per row, copy its source page to its destination (when they differ), then the fused
    one-token conv (tested against KDALayer.decode_conv) and the naive decode step in place there."""
    out = torch.empty(mixed.shape[0], H, D)
    for b in range(len(src)):
        page = int(src[b])
        for r in range(int(cu[b]), int(cu[b + 1])):
            target = int(dst[r])
            if target != page:
                state[target], tails[target] = state[page], tails[page]
            at = torch.tensor([target])
            qkv = ops().kda_conv_step(mixed[r:r + 1], tails, taps, at)
            q, k, v = qkv.unbind(2)
            out[r] = kda_decode_step(q, k, v, g[r:r + 1], beta[r:r + 1], state, at, impl="naive")[0]
            page = target
    return out


@pytest.mark.parametrize("lens", [[1], [5], [1, 3, 2, 1, 4], [2, 2, 2]])
def test_naive_chain_equals_one_token_steps(lens):
    buf_a, state_a, tails_a = make_pool(0)
    buf_b, state_b, tails_b = make_pool(0)
    inputs = make_rows(lens, seed=len(lens))
    mixed, g, beta, taps, src, dst, cu = inputs
    got = kda_decode_tokens(mixed, g, beta, state_a, tails_a, taps, src, dst, cu, impl="naive")
    want = one_token_at_a_time(*inputs, state_b, tails_b)
    assert rel_err(got, want) <= 1e-6
    assert rel_err(buf_a, buf_b) <= 1e-6  # every page: the written ones agree, the others are untouched


@pytest.mark.parametrize("lens", [[1], [6], [1, 3, 2, 1, 4], [4, 1, 1, 3, 2, 5, 1]])
def test_fused_equals_naive_and_writes_only_the_destination_pages(lens):
    buf_n, state_n, tails_n = make_pool(1)
    buf_c, state_c, tails_c = make_pool(1)
    before = buf_c.clone()
    mixed, g, beta, taps, src, dst, cu = make_rows(lens, seed=7)
    o_n = kda_decode_tokens(mixed, g, beta, state_n, tails_n, taps, src, dst, cu, impl="naive")
    o_c = kda_decode_tokens(mixed, g, beta, state_c, tails_c, taps, src, dst, cu, impl="cpu")
    assert rel_err(o_c, o_n) <= 1e-6 and rel_err(buf_c, buf_n) <= 1e-6
    untouched = torch.ones(P, dtype=torch.bool)
    untouched[dst] = False
    assert torch.equal(buf_c[untouched], before[untouched])
    assert torch.equal(buf_c[:, STATE_NUMEL + TAIL_NUMEL:], before[:, STATE_NUMEL + TAIL_NUMEL:])  # padding


def test_a_source_page_left_for_position_pages_keeps_the_state_it_had_until_the_last_row():
    """Rows 0..k-1 write position pages; only the last row writes the sequence's own page, so the state the
    chain started from is read once and lives on in none of the position pages (they each hold the state
    after their own row)."""
    _, state, tails = make_pool(2)
    mixed, g, beta, taps, src, dst, cu = make_rows([4], seed=3)
    start = state[int(src[0])].clone()
    kda_decode_tokens(mixed, g, beta, state, tails, taps, src, dst, cu, impl="cpu")
    assert not torch.equal(state[int(src[0])], start)
    for page in dst[:-1].tolist():
        assert not torch.equal(state[page], start)
    # Replaying the first row alone from the starting state gives position page 0's state.
    _, state2, tails2 = make_pool(2)
    kda_decode_tokens(mixed[:1], g[:1], beta[:1], state2, tails2, taps, src, dst[:1], torch.tensor([0, 1]), impl="cpu")
    assert torch.equal(state2[int(dst[0])], state[int(dst[0])])


def test_bad_inputs_name_what_is_wrong():
    _, state, tails = make_pool(0)
    mixed, g, beta, taps, src, dst, cu = make_rows([2, 2], seed=0)
    with pytest.raises(ValueError, match="page .* used by sequences 0 and 1"):
        kda_decode_tokens(mixed, g, beta, state, tails, taps, src, torch.tensor([dst[0], dst[1], dst[0], dst[3]]), cu)
    with pytest.raises(ValueError, match="cu_rows"):
        kda_decode_tokens(mixed, g, beta, state, tails, taps, src, dst, torch.tensor([0, 3, 3]))
    with pytest.raises(ValueError, match="not in \\[0, num_pages=23\\)"):
        kda_decode_tokens(mixed, g, beta, state, tails, taps, torch.tensor([0, 99]), dst, cu)
    with pytest.raises(ValueError, match="no Triton version"):
        kda_decode_tokens(mixed, g, beta, state, tails, taps, src, dst, cu, impl="triton")
