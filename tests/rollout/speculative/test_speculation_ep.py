"""Speculation under expert parallelism: 2 processes over gloo, each holding half of every MoE layer's
experts and decoding its share of the prompts with n-gram speculation (verification steps and plain steps
meet in the same all-to-all exchanges, a rank done early joins the other's steps), against plain greedy
decoding of the whole model in one process: the same tokens, logprobs within 1e-5 relative."""
import pytest
import torch
import torch.multiprocessing as mp

from tests.rollout.speculative.ep_spec_worker import PROMPTS, generate, model, run
from tests.bounds import LOGPROB_TOL

pytestmark = [pytest.mark.numerics]  # compares two computation orders: run under every CPU kernel path (make test-slow)


def test_two_expert_parallel_ranks_speculating_decode_what_the_whole_model_decodes(tmp_path):
    mp.spawn(run, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    tokens, logprobs, _ = generate(model(), PROMPTS, "off")
    for rank, out in enumerate(ranks):
        mine = [i for i in range(len(PROMPTS)) if i % 2 == rank]
        assert out["tokens"] == [tokens[i] for i in mine]
        for got, i in zip(out["logprobs"], mine):
            assert got == pytest.approx(logprobs[i], **LOGPROB_TOL)  # verification chunks, experts over ranks
    assert all(out["verified"] > 0 for out in ranks)
