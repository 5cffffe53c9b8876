"""The engine on the Triton kernels (interpreter on CPU) gives the torch path's tokens."""
import copy

import pytest
import torch

from rollout.engine import Engine, EngineConfig
from rollout.sampling import SamplingParams


@pytest.mark.triton
def test_triton_kernels_in_the_engine_match_torch(tiny_model):
    # On a CUDA host the kernels run natively: both paths on the GPU (Triton takes no CPU tensors);
    # on CPU the interpreter runs them (tests/conftest.py sets TRITON_INTERPRET=1 there).
    model = copy.deepcopy(tiny_model).to("cuda") if torch.cuda.is_available() else tiny_model
    prompts = [[5, 6, 7, 8, 9, 10, 11], [40, 41], [7]]
    params = SamplingParams(temperature=0.0, max_new_tokens=3, ignore_eos=True)
    outs = {}
    for impl in ("naive", "triton"):
        engine = Engine(model, EngineConfig.for_pages(model, 16, max_model_len=32, kernel_impl=impl,
                                                           check_every_step=True))
        outs[impl] = [o.samples[0] for o in engine.generate(prompts, params)]
    assert [s.tokens for s in outs["triton"]] == [s.tokens for s in outs["naive"]]
    for a, b in zip(outs["triton"], outs["naive"]):
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5
