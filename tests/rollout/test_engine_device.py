"""The rollout engine names the device of every tensor it creates.

A short generate (chunked prefill, decode, a fork with n=2, prefix-cache hits, greedy and sampled
rows in one batch) runs under `DeviceAudit` (tests/device_audit.py) restricted to the engine's own
code: rollout/ and the model code it drives (models/model.py, models/state.py, models/paged.py). No factory call there
may omit its device, or (model on a GPU, `-m gpu`) name another one than the model's; draws from a
request's CPU generator are made on the host by design, then moved. Same rule as
tests/rl/test_device.py applies to rl/ and trainer/.

The paged mixer (models/paged.py) is audited too. Token eviction's host bookkeeping (positions,
scores: rollout/kv/kv_eviction.py) is not exercised here.
"""
import copy
from pathlib import Path

import pytest
import torch

from rollout.engine import Engine, EngineConfig
from rollout.kv import PrefixCacheConfig
from rollout.sampling import SamplingParams
from tests.device_audit import ROOT, DeviceAudit

AUDITED = ("rollout/", "models/model.py", "models/state.py", "models/paged.py")
"""The engine's code and the model code it drives: every factory call there must name its device."""
KNOWN: tuple[str, ...] = ()
"""Sites being fixed elsewhere: printed, not asserted (none left)."""


def test_the_audit_sees_missing_and_wrong_devices_but_not_host_generator_draws():
    """The helper itself, on the CPU: 'meta' stands in for a GPU model."""
    here = Path(__file__).relative_to(ROOT).as_posix()
    audit = DeviceAudit(torch.device("meta"), audited=(here,))
    gen, on_meta = torch.Generator().manual_seed(0), torch.ones(1, device="meta")
    with audit:
        torch.zeros(2)  # no device
        torch.arange(3, device="cpu")  # the wrong one
        torch.rand(1, generator=gen, device="cpu")  # a host generator's draw: fine
        torch.tensor([1], device="meta")  # fine
        torch.as_tensor(on_meta)  # keeps its input's device: not a creation
    assert sorted(s.rsplit(":", 1)[0] for s in audit.implicit) == [here]
    assert sorted(s.rsplit(":", 1)[0] for s in audit.elsewhere) == [here]
    assert sum(audit.implicit.values()) == sum(audit.elsewhere.values()) == 1
    assert sum(audit.seen.values()) == 4


def generate(engine: Engine) -> list[list[list[int]]]:
    """Two waves on one engine: the second hits the prefix cache the first registered."""
    shared = [(7 * i + 3) % 256 for i in range(40)]  # 2 hash blocks of 16 and a bit
    greedy = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)
    forked = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, max_new_tokens=5, n=2, seed=3, ignore_eos=True)
    plain = SamplingParams(temperature=1.0, max_new_tokens=3, seed=4, ignore_eos=True)
    first = engine.generate([shared + [1, 2], [9, 8, 7]], [greedy, plain])
    second = engine.generate([shared + [5, 6, 7], shared[:20], [4]], [forked, greedy, plain])
    return [[s.tokens for s in out.samples] for out in first + second]


DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])]


@pytest.mark.parametrize("device", DEVICES)
def test_the_engine_names_the_device_of_every_tensor_it_creates(tiny_model, device):
    model = copy.deepcopy(tiny_model).to(device)  # the fixture is session-wide: leave it where it is
    cfg = EngineConfig.for_pages(model, 40, max_model_len=128, max_num_batched_tokens=24,
                                 check_every_step=True, prefix_cache=PrefixCacheConfig(hash_block=16, model_id="tiny"))
    engine = Engine(model, cfg)
    audit = DeviceAudit(engine.pool.device, AUDITED, KNOWN)
    with audit:
        tokens = generate(engine)
    implicit, elsewhere = audit.report()
    assert audit.seen, "the audit saw no factory call in the engine: it is not hooked in"
    touched = {site.rsplit(":", 1)[0] for site in audit.seen}
    # the step's metadata is one buffer built by the paged mixer (models/paged.py); the sampler's own
    assert {"rollout/sampling.py", "models/paged.py"} <= touched
    assert engine.cache.prefix.hit_tokens >= 32, "the second wave was meant to hit the cached shared prefix"
    assert [len(t) for t in tokens] == [1, 1, 2, 1, 1] and tokens[2][0] != tokens[2][1]
    assert not engine.requests
    engine.check_integrity()  # every page left is one the prefix cache holds
    assert not implicit, f"tensors created on the default device by the engine's code: {implicit}"
    assert not elsewhere, f"tensors created off the model's device ({audit.expected}): {elsewhere}"
    if device == "cpu":  # the audit is transparent: the same run without it gives the same tokens
        assert generate(Engine(copy.deepcopy(tiny_model), cfg)) == tokens
