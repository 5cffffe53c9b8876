"""Session-wide test setup.

Triton: `triton.jit` picks its interpreter when a kernel is *decorated*, i.e. when kernels.* is
first imported by any test module (models/ and rollout/ import them too), so TRITON_INTERPRET must
be set here, before collection imports anything. On CPU the interpreter runs the Triton tests
(~1000x slower than a GPU; its bf16 tl.dot is wrong, so Triton tests use small fp32 inputs).
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def kernel_path() -> str:
    """The CPU kernel path this process runs: what a bound between two computation orders depends on."""
    import os as _os

    extra = " ".join(f"{k}={_os.environ[k]}" for k in ("MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA") if k in _os.environ)
    return (f"torch CPU capability {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} intra-op "
            f"threads" + (f", {extra}" if extra else ""))


def pytest_report_header(config):
    return kernel_path()


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line(f"kernel path: {kernel_path()}")
