"""Build every JIT-compiled op once, at install time: `python -m kernels.prebuild` (the Makefile's
install step runs it). The ops: our fused CPU kernels (kernels/cpu, ~30 s), DeepSpeed's async_io
(the NVMe tensor store, memory/nvme_io.py, ~3 min) and cpu_adam (the host optimizer,
trainer/optimizer.py, ~45 s). Each is cached under $TORCH_EXTENSIONS_DIR (the Makefile puts it in
.cache/), so a run never compiles on its hot path; a build that still happens at run time (another
extensions directory, a cleaned cache) is announced on stderr before it starts (kernels/jit.py `announce_build`).
"""
from __future__ import annotations

import sys
import time
from collections.abc import Callable

from kernels.jit import building

def _fused_cpu() -> None:
    from kernels.cpu import available

    if not available():
        raise RuntimeError("the fused CPU kernels did not build (see the warning above)")


def _deepspeed(builder_name: str) -> Callable[[], None]:
    def build() -> None:
        from deepspeed.ops import op_builder

        builder = getattr(op_builder, builder_name)()
        if not builder.is_compatible(verbose=False):
            raise RuntimeError(f"DeepSpeed's {builder.name} is not compatible here (libaio-dev or g++ missing?)")
        builder.load(verbose=False)

    return build


OPS: tuple[tuple[str, str, Callable[[], None]], ...] = (
    ("hybridrl_kda_cpu", "the fused CPU kernels", _fused_cpu),
    ("async_io", "DeepSpeed's async_io op (NVMe store)", _deepspeed("AsyncIOBuilder")),
    ("cpu_adam", "DeepSpeed's cpu_adam op (host optimizer)", _deepspeed("CPUAdamBuilder")),
)


def main() -> int:
    """Build each op that is not built yet; one line per op. Returns the number that failed (each
    has a fallback at run time: impl=naive, the buffered NVMe backend, torch's AdamW)."""
    failed = 0
    for name, what, build in OPS:
        t0 = time.perf_counter()
        try:
            with building(name, what) as already:
                build()
        except Exception as err:  # noqa: BLE001 - reported; the run falls back
            failed += 1
            print(f"prebuild: {what}: FAILED ({type(err).__name__}: {err}); runs will use the fallback",
                  file=sys.stderr)
            continue
        print(f"prebuild: {what}: {'built and current' if already else f'built in {time.perf_counter() - t0:.0f} s'}")
    return failed


if __name__ == "__main__":
    main()
