"""The model code the trainer drives names the device of every tensor it creates: `PackedMixer`
(buckets, regather, MLA positions and masks) and `SegmentBatch.positions` build their index tensors
on the hidden states' device, audited by `DeviceAudit` (tests/device_audit.py) over a forward and
backward on the CPU, and on a GPU with `-m gpu`. Sites in other models/ files are printed only."""
import copy

import pytest
import torch

from models.config import load_model_config
from models.model import HybridLM, PackedMixer
from models.state import SegmentBatch
from tests.device_audit import DeviceAudit

AUDITED = ("models/model.py", "models/state.py")
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])]


@pytest.mark.parametrize("device", DEVICES)
def test_packed_mixer_builds_its_index_tensors_on_the_hidden_states_device(device):
    cfg = load_model_config("configs/model/tiny.yaml")
    model = HybridLM(cfg).init_weights(seed=3, std=0.1)
    lens = [17, 3, 40, 2, 16, 15]  # several buckets at this score cap: the regather runs
    ids = torch.randint(0, 256, (sum(lens),), generator=torch.Generator().manual_seed(1))
    batch = SegmentBatch(new_lens=lens, starts=[0] * len(lens))
    on_device = copy.deepcopy(model).to(device)
    mixer = PackedMixer(batch, max_score_elements=600)
    assert len(mixer.buckets) >= 3
    audit = DeviceAudit(torch.device(device), AUDITED)
    with audit:
        out = on_device.run_layers(ids.to(device), mixer)  # [N, D]
        out.square().sum().backward()
    implicit, elsewhere = audit.report()
    assert {site.rsplit(":", 1)[0] for site in audit.seen} == {"models/model.py"}  # positions() charged here
    assert not implicit and not elsewhere, f"model code creating tensors off {device}: {implicit} {elsewhere}"
    ref = HybridLM.run_layers(model, ids, PackedMixer(batch, max_score_elements=600))
    torch.testing.assert_close(out.detach().cpu(), ref.detach(), rtol=1e-4, atol=1e-4)
