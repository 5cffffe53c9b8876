"""The AdamW that runs on the host shards: its config (`OptimizerConfig`), the backend (DeepSpeed's CPU Adam,
JIT-built once and cached in TORCH_EXTENSIONS_DIR, ~1e-7 from torch's; or torch.optim.AdamW; "auto" takes
DeepSpeed's when it builds, else says it falls back), and the replay that makes a loaded DeepSpeed Adam
continue bit for bit. trainer/optimizer.py holds the sharded states it steps."""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch import nn

from kernels.jit import building
from trainer.lr_schedule import LR_SCHEDULES


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    lr: float = 1e-6
    """AdamW learning rate."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW (beta1, beta2)."""
    eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    backend: str = "auto"
    """"deepspeed" (DeepSpeedCPUAdam), "torch" (torch.optim.AdamW) or "auto" (deepspeed if it builds)."""
    lr_schedule: str = "constant"
    """The lr over optimizer steps (trainer/lr_schedule.py): "constant", "linear" or "cosine" decay."""
    warmup_steps: int = 0
    """Optimizer steps of linear warm-up from 0 to `lr` (every schedule), >= 0; 0 = none."""
    min_lr_ratio: float = 0.0
    """Floor of the linear / cosine decay, as a fraction of `lr`, in [0, 1]."""
    total_steps: int | None = None
    """Decay horizon in optimizer steps (lr reaches min_lr_ratio * lr there); None = the run's
    (`Trainer(total_steps=)`: iterations x optimizer steps per iteration)."""

    def __post_init__(self) -> None:
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"lr_schedule={self.lr_schedule!r}, expected one of {sorted(LR_SCHEDULES)}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps={self.warmup_steps}, expected >= 0")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio={self.min_lr_ratio}, expected a value in [0, 1]")
        if self.total_steps is not None:
            check_horizon(self, self.total_steps)
        if self.backend not in ("auto", "deepspeed", "torch"):
            raise ValueError(f"backend={self.backend!r}, expected 'auto', 'deepspeed' or 'torch'")
        if not self.lr > 0:
            raise ValueError(f"lr={self.lr}, expected > 0")
        if not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"betas={self.betas}, expected values in [0, 1)")
        if self.eps <= 0 or self.weight_decay < 0:
            raise ValueError(f"eps={self.eps} (> 0), weight_decay={self.weight_decay} (>= 0) out of range")


def check_horizon(config: OptimizerConfig, total_steps: int | None) -> None:
    """Raise ValueError unless `total_steps` (the resolved decay horizon) suits `config`'s schedule."""
    if total_steps is None:
        if config.lr_schedule != "constant":
            raise ValueError(f"lr_schedule={config.lr_schedule!r} decays over total_steps, but none is known: set "
                             f"trainer.optimizer.total_steps or pass Trainer(total_steps=)")
        return
    if total_steps < 1:
        raise ValueError(f"total_steps={total_steps}, expected >= 1 optimizer steps")
    if config.warmup_steps > total_steps:
        raise ValueError(f"warmup_steps={config.warmup_steps} > total_steps={total_steps}, expected the warm-up "
                         f"to fit in the schedule's horizon")


def make_host_adam(params: list[nn.Parameter], config: OptimizerConfig) -> tuple[torch.optim.Optimizer, str]:
    """(optimizer over `params`, backend name actually used)."""
    kwargs = dict(lr=config.lr, betas=config.betas, eps=config.eps, weight_decay=config.weight_decay)
    if config.backend in ("auto", "deepspeed"):
        try:
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            with building("cpu_adam", "DeepSpeed's cpu_adam op (host optimizer)"):
                return DeepSpeedCPUAdam(params, adamw_mode=True, **kwargs), "deepspeed"
        except Exception as err:  # the op's JIT build can fail for many reasons (compiler, headers)
            if config.backend == "deepspeed":
                raise RuntimeError(f"DeepSpeed CPU Adam could not be built or loaded: {err}") from err
            warnings.warn(f"trainer: DeepSpeed CPU Adam unavailable ({type(err).__name__}: {err}); "
                          f"falling back to torch.optim.AdamW on the host shards", stacklevel=3)
    return torch.optim.AdamW(params, foreach=False, **kwargs), "torch"




def adam_steps(adam: torch.optim.Optimizer) -> int:
    """Steps Adam's state records (its per-parameter `step`; 0 before the first)."""
    stepped = [p for p in adam.param_groups[0]["params"] if adam.state.get(p)]
    return int(adam.state[stepped[0]]["step"]) if stepped else 0

def replay_deepspeed_steps(adam: torch.optim.Optimizer) -> None:
    """DeepSpeed's C++ Adam keeps beta^t between calls: the first parameter of a step multiplies
    the previous power by beta, the others recompute pow(beta, t), and a fresh object starts
    from pow. A loaded optimizer (ShardedHostAdamW.load_state_dict) replays every past step's call sequence on empty tensors, so its
    powers, and with them a resumed run, are bit for bit those of the run that never stopped."""
    group = adam.param_groups[0]
    stepped = [p for p in group["params"] if adam.state.get(p)]
    steps = adam_steps(adam)
    empty = torch.empty(0, device="cpu")  # host Adam: its states are on the host
    for step in range(1, steps + 1):
        for _ in stepped:
            adam.ds_opt_adam.adam_update(adam.opt_id, step, group["lr"], *group["betas"], group["eps"],
                                              group["weight_decay"], group["bias_correction"], empty, empty,
                                              empty, empty)
