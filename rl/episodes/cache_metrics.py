"""The rollout's KV-cache and speculation figures per iteration, from the engine's cumulative counters
(`Engine.stats`)."""
from __future__ import annotations


def cache_metrics(before: dict[str, float], after: dict[str, float], computed: int) -> dict[str, float]:
    """The iteration's KV-cache figures from two `Engine.stats()` readings: prefix hits (tokens,
    stale ones, and `prefix_hit_frac` = hit / (hit + computed) tokens of KV), host-tier pages written
    back and prefetched (`host_pages_prefetched_ahead`: before their sequence was admitted), the
    tokens hits read from pages the host tier gave back (`host_hit_tokens`), prompt tokens computed again
    although the cache held them earlier (`reprefilled_tokens`), admissions that waited a step on a
    copy (`admissions_deferred`), `prefetch_hidden_fraction` = 1 - (time the forward waited on
    prefetch copies) / (their copy time), the host pool's bytes at the end; with speculative decoding the tokens
    proposed and kept, the verifications, the steps past the break-even (`spec_gated_steps`: none
    asked for proposals) and `spec_acceptance` = kept / proposed."""
    out: dict[str, float] = {}
    for key in ("prefix_hit_tokens", "prefix_stale_hit_tokens", "host_pages_written_back", "host_pages_prefetched",
                "host_pages_prefetched_ahead", "host_hit_tokens", "reprefilled_tokens", "admissions_deferred"):
        if key in after:
            out[key] = float(after[key] - before.get(key, 0))
    if "host_copy_load_s" in after:
        load = after["host_copy_load_s"] - before.get("host_copy_load_s", 0.0)
        waited = after["host_copy_wait_s"] - before.get("host_copy_wait_s", 0.0)
        out.update(host_copy_load_s=load, host_copy_wait_s=waited,
                   prefetch_hidden_fraction=min(1.0, max(0.0, 1.0 - waited / load)) if load > 0 else 1.0)
    if "prefix_hit_tokens" in out:
        out["kv_computed_tokens"] = float(computed)
        out["prefix_hit_frac"] = out["prefix_hit_tokens"] / max(1.0, out["prefix_hit_tokens"] + computed)
    if "host_pool_bytes" in after:
        out["host_pool_bytes"] = float(after["host_pool_bytes"])
    if "spec_proposed" in after:  # speculative decoding: tokens proposed and kept, verifications
        for key in ("spec_proposed", "spec_accepted", "spec_verifications", "spec_gated_steps"):
            out[key] = float(after.get(key, 0) - before.get(key, 0))
        out["spec_acceptance"] = out["spec_accepted"] / max(1.0, out["spec_proposed"])
    return out
