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
