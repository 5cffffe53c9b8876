"""The engine's side of the colocated cycle, mixed into `Engine` (rollout/engine.py): what the phase
orchestrator calls between rollouts. `sleep`/`wake` hand the device pool back and take it again; the host
KV pool's lease is given back (`suspend_host`), spilled to NVMe (`spill_host`) and restored
(`restore_host`); `memory()` says what each tier holds; `load_weights`/`weights_updated` install a new
policy version. Every KV tier is reached through the engine's `cache` façade; the engine's attributes
these methods use (`cache`, `pool`, `host`, `scheduler`, `runner`, `speculator`, `config`, `ledger`,
`layout`, `model`, `requests`, `policy_version`) are set by `Engine.__init__`."""
from __future__ import annotations

import torch

from memory.nvme_store import NvmeStore
from models.fused import drop_fused, fused_bytes
from rollout.request import Sequence


class EnginePhases:
    @property
    def is_asleep(self) -> bool:
        """The device pool is released (`sleep`) until `wake`."""
        return self.pool.is_released

    def sleep(self) -> int:
        """Release the device pool. Running sequences keep their tokens and are recomputed after
        wake(). With a host pool, paused sequences' pages are parked there and restored by wake()
        (bit for bit), and the prefix cache writes its turn-boundary entries back; the rest of the
        device tier is dropped. Returns the pages written back to the host pool meanwhile."""
        written = self.cache.pages_written_back
        self.cache.park(self.scheduler.paused)
        self.scheduler.preempt_all()
        self.cache.sleep()
        self.runner.invalidate_views()
        self.drop_weight_copies()  # the CPU fused projections are rebuilt at the next step: no copy while asleep
        if self.speculator is not None:
            self.speculator.proposer.clear()  # a draft's states: rebuilt by a catch-up
        return self.cache.pages_written_back - written

    def wake(self) -> None:
        self.cache.wake(self.scheduler.paused)
        self.runner.invalidate_views()

    def sequences(self) -> list[Sequence]:
        """Every sequence of every request the engine still holds (paused ones included)."""
        return [s for request in self.requests.values() for s in request.seqs]

    def spill_host(self, store: NvmeStore, next_version: int, max_staleness: int | None = None) -> int:
        """Asleep, before the training states come back to host DRAM: the host KV pool's kept
        contents go to `store` and its DRAM back to the ledger (CacheManager.spill_host: what policy
        `next_version` may still use). Returns the bytes written."""
        return self.cache.spill_host(store, self.sequences(), next_version, max_staleness)

    def suspend_host(self) -> None:
        """Give the (empty) host KV pool's DRAM back to the ledger until `restore_host`: a run that
        time-multiplexes host DRAM leases it at each rollout only."""
        self.host.suspend()

    def restore_host(self, store: NvmeStore | None) -> int:
        """Lease the host KV pool again, before `wake`: engine.host_pool_mb's pages, or with "auto"
        every byte the host ledger has free now (0 without a ledger), and read back what
        `spill_host` kept. Returns the bytes read."""
        host_bytes, free = self.config.host_pool_bytes, self.ledger.free if self.ledger is not None else 0
        pages = (free if host_bytes is None else host_bytes) // self.layout.page_bytes
        return self.cache.restore_host(store, self.sequences(), pages)

    @property
    def prefix_cache_is_empty(self) -> bool:
        """No prefix-cache entry on any tier (True without a prefix cache)."""
        return self.cache.prefix_cache_is_empty

    def clear_prefix_cache(self) -> None:
        self.cache.clear_prefix_cache()

    def memory(self) -> dict[str, int]:
        """Bytes the engine holds by tier: device_pool (the page pool, 0 while released), host_pool
        (the host KV pool's lease), host_parked (the part of it holding paused rollouts' KV over a
        sleep; 0 while spilled), disk_kv_pool (the host pool's kept contents on NVMe between
        rollouts, payload), engine_weight_copies (`derived_weight_bytes`)."""
        host = self.host
        return {"device_pool": 0 if self.pool.is_released else self.pool.num_pages * self.layout.page_bytes,
                "host_pool": host.pool_bytes if host is not None else 0,
                "host_parked": (self.cache.num_parked_pages * host.page_bytes
                                if host is not None and not host.is_suspended else 0),
                "disk_kv_pool": self.cache.spilled_host_bytes, "engine_weight_copies": self.derived_weight_bytes()}

    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Copy external policy weights into the engine's model (our parameter names, strict) and tag
        later tokens with `version`. An engine built on the trainer's own model needs no copy: its
        weight sync is `weights_updated(version)`."""
        if version < self.policy_version:
            raise ValueError(f"policy version {version} is older than the current {self.policy_version}")
        self.model.load_state_dict(state_dict, strict=True)
        self.weights_updated(version)

    def weights_updated(self, version: int) -> None:
        """The model's parameters changed in place (the trainer's step, or `load_weights`): tag later
        tokens with `version` and refresh what derives from the weights. Fused projection copies
        (CPU) key on the parameters' version counters and rebuild by themselves; InfiniGen's partial
        keys are recalibrated; prefixes cached under older weights stop matching."""
        if version < self.policy_version:
            raise ValueError(f"policy version {version} is older than the current {self.policy_version}")
        self.policy_version = version
        self.cache.set_version(version)

    def drop_weight_copies(self) -> int:
        """Drop the fused projection copies (rebuilt at the next step); returns their bytes."""
        return drop_fused(self.model)

    def derived_weight_bytes(self) -> int:
        """Bytes of weight copies the engine holds besides the model's parameters: the fused
        projections the CPU path caches while generating (dropped by `sleep`); 0 on CUDA."""
        return fused_bytes(self.model)
