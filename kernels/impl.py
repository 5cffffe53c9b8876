"""The `impl=` switch every kernel dispatcher takes: "naive" (plain torch), "triton", or "cpu"
(the torch path plus the fused C++ CPU kernels of kernels/cpu/ where one exists: KDA decode).

A dispatcher calls `check_impl(impl)` first and, on the Triton path, `require_triton(kernel,
device)` before launching, so a Triton request that cannot run fails loudly instead of
falling back to the naive path (STYLE.md: no silent fallbacks).

On a CPU-only machine Triton kernels run under its interpreter, which `triton.jit` selects
when the kernel is *decorated*: TRITON_INTERPRET=1 must be in the environment before the
kernel module is imported (tests/kernels/conftest.py sets it).
"""

import torch
import triton

IMPLS = ("naive", "triton", "cpu")


def check_impl(impl: str) -> str:
    """Returns impl if it names a known implementation; ValueError otherwise."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    return impl


def default_impl() -> str:
    """"triton" where CUDA is available; else "cpu" when the fused CPU kernels build here, else
    "naive" (the Triton interpreter is for tests only)."""
    if torch.cuda.is_available():
        return "triton"
    from kernels.cpu import available

    return "cpu" if available() else "naive"


def require_cpu_ops(device: torch.device):
    """The fused CPU kernels' module for impl="cpu"; RuntimeError if they cannot run here."""
    from kernels.cpu import ops

    module = ops()
    if module is None or device.type != "cpu":
        raise RuntimeError(f"impl='cpu' needs CPU tensors and the fused CPU kernels (kernels/cpu/); got {device}, "
                           f"kernels {'built' if module is not None else 'not buildable here'}. Use impl='naive'.")
    return module


def _interpreting() -> bool:
    return bool(triton.knobs.runtime.interpret)  # reads TRITON_INTERPRET now


def require_triton(kernel, device: torch.device) -> None:
    """RuntimeError unless `kernel` (a @triton.jit function) can run on tensors on `device`.

    CUDA tensors run natively; CPU tensors need the interpreter, both switched on in the
    environment (TRITON_INTERPRET=1) and in effect for this kernel (set before its import).
    """
    if device.type == "cuda":
        return
    if not _interpreting():
        raise RuntimeError(
            f"impl='triton' needs CUDA tensors or TRITON_INTERPRET=1; got tensors on {device} "
            f"(CUDA available: {torch.cuda.is_available()}) and TRITON_INTERPRET unset. "
            "Use impl='naive' on this machine."
        )
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(kernel, InterpretedFunction):
        module = getattr(kernel, "fn", kernel).__module__
        raise RuntimeError(
            f"TRITON_INTERPRET=1 was set after {module} was imported, so its Triton kernels "
            "were compiled for a GPU; set it before importing the kernels package."
        )


def gpu_autotune(key: list[str], warps: tuple[int, ...] = (4, 8), stages: tuple[int, ...] = (2, 3)):
    """`triton.autotune` over num_warps x num_stages on a GPU; the identity under the interpreter
    (which cannot time kernels). Decide at decoration, as `triton.jit` does: put it above the jit.
    Only for kernels whose launches overwrite their outputs (autotuning launches them repeatedly)."""
    if _interpreting():
        return lambda fn: fn
    configs = [triton.Config({}, num_warps=w, num_stages=s) for w in warps for s in stages]
    return triton.autotune(configs=configs, key=key)
