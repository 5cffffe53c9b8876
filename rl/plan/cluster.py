"""The memory planner's own config: the cluster it plans for, and what it assumes of the workload.

`ClusterConfig` is the Hydra group `cluster` (`configs/cluster/<preset>.yaml`): `python -m rl.plan
cluster=h200x8 cluster.nodes=2 ...`. Capacities are what a run can use: a GPU's memory as torch
sees it (less the CUDA context), a node's DRAM before the host ledger's 10% reserve (the planner
applies it, as rl/train.py does, unless memory.host_budget_mb sets the node's budget).
`PlanOptions` (`plan.*` overrides) holds the workload figures the run config does not fix.
"""
from __future__ import annotations

from dataclasses import dataclass

GIB = 1 << 30


@dataclass(frozen=True, kw_only=True)
class ClusterConfig:
    name: str = "cpu"
    """Preset name, for the printout."""
    gpus_per_node: int = 1
    """Ranks per node (one GPU each; data-parallel ranks of the run)."""
    nodes: int = 1
    """Nodes; the run's world size is gpus_per_node * nodes."""
    gpu_memory_gib: float = 16.0
    """Device memory one rank may use, GiB (a GPU's capacity less the CUDA context and NCCL buffers)."""
    host_dram_gib: float = 16.0
    """DRAM of one node, GiB (the host ledger keeps 10% of it in reserve)."""
    nvme_gib: float = 100.0
    """NVMe capacity of one node for memory.spill_dir, GiB."""
    nvme_gb_s: float = 1.0
    """NVMe bandwidth of one node, GB/s (10^9 bytes), shared by its ranks: spill / restore seconds."""
    device_is_host: bool = False
    """The "device" is host memory (experiment.device=cpu): device and host tiers share host_dram_gib."""
    grouped_mm_bf16: bool = False
    """The GPU runs the MoE's bf16 experts through torch._grouped_mm (SM90/SM100: H100, H200, B200;
    models/mlp.py `grouped_mm_usable`), else the padded blocked form, whose saved expert-weight
    gathers cost far more activation memory. A device_is_host cluster asks this machine's CPU."""

    def __post_init__(self) -> None:
        for name in ("gpus_per_node", "nodes"):
            if getattr(self, name) < 1:
                raise ValueError(f"cluster.{name}={getattr(self, name)}, expected >= 1")
        for name in ("gpu_memory_gib", "host_dram_gib", "nvme_gib", "nvme_gb_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"cluster.{name}={getattr(self, name)}, expected > 0")

    @property
    def world(self) -> int:
        return self.gpus_per_node * self.nodes


@dataclass(frozen=True, kw_only=True)
class PlanOptions:
    seq_len: int | None = None
    """Tokens of one trajectory (prompt + answers) the train phase sees; null = engine.max_model_len
    (the worst case). Each becomes a trained sequence of seq_len - 1 tokens."""
    png: str | None = None
    """Where to draw the planned memory timeline (the run's memory.png); null = no picture."""
    activation_probe: str = "compose"
    """How the activation probe meters a micro-batch of one sequence (rl/plan/activation.py): "compose"
    at its length, "affine" from two short probes on the same 1024-token lattice, equal to the byte and
    seconds instead of minutes at 100k+ tokens (`affine_activations`). Micro-batches of several
    sequences are probed at their lengths either way."""

    def __post_init__(self) -> None:
        if self.seq_len is not None and self.seq_len < 2:
            raise ValueError(f"plan.seq_len={self.seq_len}, expected >= 2 (a trained token needs a prefix)")
        if self.activation_probe not in ACTIVATION_PROBES:
            raise ValueError(f"plan.activation_probe={self.activation_probe!r}, expected one of {ACTIVATION_PROBES}")


ACTIVATION_PROBES = ("compose", "affine")

