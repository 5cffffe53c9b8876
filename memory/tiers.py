"""The memory tiers a colocated run's consumers live on, by name: what the loop's memory timeline
logs after every phase and what the planner predicts, key for key.

device_weights (distinct storages of the policy's and the engine's parameters: a shared copy
counts once), device_pool (the engine's page pool, 0 while released), device_grad_slots (the
trainer's FP32 arena), device_activation_peak (train phase: the peak of autograd's saved tensors;
0 elsewhere), device_reference (a resident reference model; a streamed one lives in the grad
slots: 0); host_masters, host_moments (AdamW state incl. step counters), host_grads (train phase:
the FP32 gradient shards right before the optimizer step, their peak; 0 elsewhere), host_pool (the
host KV pool), host_parked (the part of host_pool holding paused rollouts' KV over a sleep: inside
host_pool, not added to host_total), host_reference (a streamed reference's host vectors);
disk_spilled (spill files of the optimizer states), disk_kv_pool (the host KV pool's kept contents
on NVMe between rollouts, payload bytes).
"""
from __future__ import annotations

DEVICE_KEYS = ("device_weights", "device_pool", "device_grad_slots", "device_activation_peak", "device_reference")
HOST_KEYS = ("host_masters", "host_moments", "host_grads", "host_pool", "host_parked", "host_reference")
DISK_KEYS = ("disk_spilled", "disk_kv_pool")


def with_totals(memory: dict[str, int]) -> dict[str, int]:
    """`memory` plus device_total, host_total (host_parked lies inside host_pool: not added),
    disk_total, and the older readers' train_device / train_host / train_disk."""
    out = dict(memory)
    out["device_total"] = sum(memory[k] for k in DEVICE_KEYS)
    out["host_total"] = sum(memory[k] for k in HOST_KEYS if k != "host_parked")
    out["disk_total"] = sum(memory[k] for k in DISK_KEYS)
    # train_host is the optimizer's bytes at the end of the phase: its gradients are gone by then
    out.update(train_device=memory["device_weights"], train_host=memory["host_masters"] + memory["host_moments"],
               train_disk=memory["disk_spilled"])
    return out
