"""Device placement of the RL loop, checked on the CPU: `experiment.device` validation and
resolution, `init_ranks` on CUDA (mocked: no GPU here), a run with the knob resolved equals the
default run bit for bit, and every tensor the loop's own code (rl/, trainer/) creates names its
device — a factory call without `device=` lands on the CPU whatever the model's device, the bug a
CPU-only machine cannot see otherwise. tests/rl/test_cuda_run.py is the GPU half."""
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.overrides import TorchFunctionMode

import rl.run.ranks
from models.checkpoint import load_checkpoint
from models.config import load_model_config
from models.model import HybridLM
from rl.run.ranks import Ranks, init_ranks
from rl.train import run
from tests.rl.test_config import composed
from tests.rl.test_train_run import SMALL, records

ROOT = Path(__file__).resolve().parents[2]
AUDITED = ("rl/", "trainer/")
"""The loop's own code: every factory call there must name its device."""


def test_device_is_validated_at_composition(monkeypatch):
    assert composed().experiment.device == "cpu"
    with pytest.raises(Exception, match=r"experiment.device='gpu0', expected 'auto', 'cpu' or 'cuda'"):
        composed("experiment.device=gpu0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(Exception, match=r"experiment.device='cuda' but CUDA is not available here") as err:
        composed("experiment.device=cuda")
    assert "experiment.device=cpu" in str(err.value)  # says what to do instead
    assert composed("experiment.device=auto").experiment.device_type == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert composed("experiment.device=auto").experiment.device_type == "cuda"
    assert composed("experiment.device=cuda").experiment.device_type == "cuda"
    assert composed("experiment.device=cpu").experiment.device_type == "cpu"


def test_init_ranks_puts_a_cuda_rank_on_its_gpu_and_refuses_too_few_gpus(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert init_ranks() == Ranks() and init_ranks("cpu").device == torch.device("cpu")
    with pytest.raises(ValueError, match="device_type='gpu'"):
        init_ranks("gpu")
    current = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", current.append)
    one = init_ranks("cuda")  # one process: no process group
    assert one.device == torch.device("cuda", 0) and one.world == 1 and one.group is None and current == [0]
    # two ranks on a node with one visible GPU: refused before any process group starts
    monkeypatch.setattr(rl.run.ranks.dist, "init_process_group", lambda *a, **k: pytest.fail("process group started"))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(ValueError, match=r"2 rank\(s\) on this node need one GPU each, but 1 are visible"):
        init_ranks("cuda")
    assert current == [0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="auto resolves to cpu only on a machine without CUDA")
def test_auto_on_a_cpu_machine_is_the_default_run_bit_for_bit(tmp_path, capsys):
    default, auto = tmp_path / "default", tmp_path / "auto"
    run(composed(f"run_dir={default}", "experiment.iterations=2", *SMALL))
    assert "device cpu (experiment.device=cpu), 1 rank" in capsys.readouterr().out  # the resolved device, once
    run(composed(f"run_dir={auto}", "experiment.iterations=2", "experiment.device=auto", *SMALL))
    assert "device cpu (experiment.device=auto), 1 rank" in capsys.readouterr().out
    final = "checkpoints/iter_000001"
    a, b = load_file(default / final / "model.safetensors"), load_file(auto / final / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    oa, ob = torch.load(default / final / "optimizer-rank0.pt"), torch.load(auto / final / "optimizer-rank0.pt")
    assert all(torch.equal(x, y) for x, y in zip(oa["masters"], ob["masters"]))
    rng_a, rng_b = (torch.load(d / final / "rng-rank0.pt") for d in (default, auto))
    assert rng_a.keys() == rng_b.keys() == {"torch"} and torch.equal(rng_a["torch"], rng_b["torch"])
    keys = ("reward_mean", "loss", "engine_checksum", "train_tokens", "rollout_tokens")
    ma, mb = records(default / "metrics.jsonl"), records(auto / "metrics.jsonl")
    assert [[m[k] for k in keys] for m in ma] == [[m[k] for k in keys] for m in mb]
    init = HybridLM(load_model_config("configs/model/tiny.yaml")).init_weights(seed=0, std=0.1)
    moved = load_checkpoint(default / final).state_dict()
    assert any(not torch.equal(moved[k], v) for k, v in init.state_dict().items()), "no update moved the weights"


class ImplicitDeviceCalls(TorchFunctionMode):
    """Counts tensor factory calls that name no device, by the repository file:line that made them
    (calls from inside torch and other libraries are theirs, not counted)."""

    FACTORIES = frozenset({torch.tensor, torch.as_tensor, torch.zeros, torch.ones, torch.full, torch.empty,
                           torch.arange, torch.rand, torch.randn, torch.randint, torch.randperm, torch.eye,
                           torch.linspace, torch.logspace, torch.scalar_tensor, torch.empty_strided})

    def __init__(self) -> None:
        super().__init__()
        self.sites: Counter[str] = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        data_is_tensor = func is torch.as_tensor and args and isinstance(args[0], torch.Tensor)
        if func in self.FACTORIES and kwargs.get("device") is None and not data_is_tensor:
            frame = sys._getframe(1)
            dispatch = ("torch/overrides.py", "torch/utils/_device.py")  # the mode machinery, not the caller
            while frame is not None and frame.f_code.co_filename.endswith(dispatch):
                frame = frame.f_back
            path = Path(frame.f_code.co_filename) if frame is not None else None
            if path is not None and path.is_relative_to(ROOT) and ".venv" not in path.parts:
                self.sites[f"{path.relative_to(ROOT)}:{frame.f_lineno}"] += 1
        return func(*args, **kwargs)


def test_the_loop_names_the_device_of_every_tensor_it_creates(tmp_path):
    """Build, rollout, reference (streamed), micro-batched update, spill, checkpoint and resume, with
    every factory call audited: none in rl/ or trainer/ may fall back to the default device. The
    sites found elsewhere (models/, rollout/, memory/) are printed: each creates a CPU tensor that a
    CUDA run mixes with device tensors (or that must stay on the host on purpose)."""
    extra = ["algo.loss.kl_coef=0.1", "trainer.micro_batch_tokens=48", "memory.spill_dir=nvme"]
    audit = ImplicitDeviceCalls()
    with audit:
        run(composed(f"run_dir={tmp_path}", "experiment.iterations=1", *SMALL, *extra))
        run(composed(f"run_dir={tmp_path}", "experiment.iterations=2", "resume=true", *SMALL, *extra))
    assert len(records(tmp_path / "metrics.jsonl")) == 2
    ours = {site: n for site, n in audit.sites.items() if site.startswith(AUDITED)}
    elsewhere = sorted(audit.sites.items())
    print("\nfactory calls without device= outside rl/ and trainer/ (site: calls):")
    for site, n in elsewhere:
        print(f"  {site}: {n}")
    assert not ours, f"tensors created on the default device in the loop's code: {ours}"
    assert audit.sites, "the audit saw no factory call at all: it is not hooked in"
