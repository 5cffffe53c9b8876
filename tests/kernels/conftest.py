"""Shared setup for kernel tests: run Triton kernels under its interpreter when there is no GPU.

`triton.jit` picks the interpreter when a kernel is *decorated*, i.e. when kernels.* is first
imported, so TRITON_INTERPRET must be set here, before any test module in this folder imports
the kernels. The interpreter is ~1000x slower than a GPU and its bf16 tl.dot is wrong: Triton
tests use small fp32 inputs.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    config.addinivalue_line("markers", "triton: Triton kernels (interpreter on CPU)")
