"""What every section of the GPU check shares: the run's context (device, sizes, timer) and the
work models (bytes moved, FLOPs) that turn a time into GB/s and TFLOP/s (docs/gpu_check.md)."""
from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

H200_HBM_BYTES_S = 4.8e12
"""H200 HBM3e bandwidth, bytes/s (NVIDIA's datasheet figure)."""
H200_BF16_DENSE_FLOP_S = 989e12
"""H200 dense bf16 tensor-core peak, FLOP/s (datasheet, without sparsity)."""


class Skip(Exception):
    """Raised by a section that cannot run here; the message says why."""


@dataclass(frozen=True)
class Ctx:
    """One run of the check: where kernels run, how big, where evidence goes."""

    device: torch.device
    small: bool
    out: Path

    @staticmethod
    def make(device: str, small: bool, out: Path) -> Ctx:
        """Resolves `device` and sets the Triton mode before anything imports kernels/."""
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cuda":
            if not torch.cuda.is_available():
                raise SystemExit("error: --device cuda but torch sees no CUDA device "
                                 f"(torch {torch.__version__}, CUDA build {torch.version.cuda}); "
                                 "run the CPU parts with --device cpu --small")
            if os.environ.get("TRITON_INTERPRET") == "1":
                raise SystemExit("error: TRITON_INTERPRET=1 with --device cuda: unset it to run Triton natively")
        else:
            os.environ.setdefault("TRITON_INTERPRET", "1")  # before kernels/ is imported (kernels/impl.py)
        out.mkdir(parents=True, exist_ok=True)
        return Ctx(torch.device(device), small, out)

    @property
    def native(self) -> bool:
        """Triton compiles for a GPU (False: the CPU interpreter; timings then mean nothing)."""
        return self.device.type == "cuda"

    @property
    def dtypes(self) -> tuple[tuple[torch.dtype, str], ...]:
        """Input dtypes to check: bf16 (the runs' dtype: first, so a killed section still has it) and
        fp32 natively; fp32 alone under the interpreter (its bf16 tl.dot is wrong)."""
        return ((torch.bfloat16, "bf16"), (torch.float32, "fp32")) if self.native else ((torch.float32, "fp32"),)

    def describe(self) -> dict:
        import triton

        meta = {"device": str(self.device), "native_triton": self.native, "small": self.small,
                "torch": torch.__version__, "torch_cuda": torch.version.cuda, "triton": triton.__version__,
                "python": platform.python_version(), "host": platform.node(),
                "started": time.strftime("%Y-%m-%dT%H:%M:%S")}
        if self.native:
            props = torch.cuda.get_device_properties(self.device)
            meta.update(gpu=props.name, gpu_mem_gib=round(props.total_memory / 2**30, 1),
                        sm_count=props.multi_processor_count, capability=f"{props.major}.{props.minor}")
        return meta

    def generator(self, seed: int = 0) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed)

    def randn(self, gen: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=self.device).to(dtype)

    def bench_ms(self, fn: Callable[[], object], rep_ms: int = 100) -> float:
        """Median milliseconds of `fn`: CUDA events with the L2 flushed between calls
        (triton.testing.do_bench) on a GPU; one wall-clock call on CPU (the interpreter: a figure
        that only shows the code path ran)."""
        if self.native:
            from triton.testing import do_bench

            return float(do_bench(fn, warmup=max(5, rep_ms // 10), rep=rep_ms, return_mode="median"))
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    def require_native(self, what: str) -> None:
        if not self.native:
            raise Skip(f"needs CUDA: {what}")


class Parts:
    """Runs a section's parts (one dtype, one shape) so that one failing part does not hide the next:
    each error goes to figures["error_<part>"], and `done()` then fails the section naming them."""

    def __init__(self, figures):
        self.figures, self.failed = figures, []

    def run(self, name: str, fn: Callable[[], object]):
        """fn()'s result, or None after recording its error."""
        try:
            return fn()
        except Exception as err:  # noqa: BLE001 - recorded; the section fails in done()
            self.figures[f"error_{name}"] = f"{type(err).__name__}: {err}"[:400]
            self.failed.append(name)
            return None

    def done(self) -> None:
        if self.failed:
            raise RuntimeError(f"parts failed: {self.failed} (see the error_<part> figures)")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| (Frobenius, in float64); 0 when both are empty or zero."""
    a, b = a.detach().double(), b.detach().double()
    den = b.norm().item()
    num = (a - b).norm().item()
    return num / den if den > 0 else num


def gb_s(num_bytes: float, ms: float) -> float:
    return num_bytes / (ms * 1e-3) / 1e9


def hbm_fraction(num_bytes: float, ms: float) -> float:
    """Achieved bytes/s over the H200's 4.8 TB/s."""
    return num_bytes / (ms * 1e-3) / H200_HBM_BYTES_S


def tflop_s(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12


def peak_fraction(flops: float, ms: float) -> float:
    """Achieved FLOP/s over the H200's ~989 TFLOP/s dense bf16 tensor-core peak."""
    return flops / (ms * 1e-3) / H200_BF16_DENSE_FLOP_S


def kda_chunk_flops(B: int, T: int, H: int, K: int, V: int, chunk: int = 64) -> float:
    """Matrix FLOPs of fla's chunked KDA forward: per token and head, inside a chunk of C tokens the
    products A_kk, A_qk and w (2CK each), u and the intra output (2CV each), and across chunks
    v_new = u - w S, o += q S and S += k^T v_new (2KV each). K=V=128, C=64: 180,224 per token-head."""
    per_token = 2 * chunk * (3 * K + 2 * V) + 3 * 2 * K * V
    return float(B * T * H * per_token)


def kda_decode_bytes(B: int, H: int, K: int, V: int, elem: int) -> float:
    """The state page read and written (fp32) plus q, k, g (fp32), v, beta read and o written."""
    return float(B * H * (2 * K * V * 4 + 2 * K * elem + K * 4 + 2 * V * elem + elem))


def mla_decode_bytes(total_tokens: int, B: int, H: int, Dc: int, Dr: int, cache_elem: int, elem: int) -> float:
    """Every cached token's latent row read once, plus the queries read and the outputs written."""
    return float(total_tokens * (Dc + Dr) * cache_elem + B * H * ((Dc + Dr) + Dc) * elem)


def mla_decode_flops(total_tokens: int, H: int, Dc: int, Dr: int) -> float:
    """Scores (2 (Dc + Dr)) and the weighted latent sum (2 Dc) per token and head."""
    return float(total_tokens * H * (2 * (Dc + Dr) + 2 * Dc))
