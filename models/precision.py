"""Parameter precision: the `dtype` knob ("fp32" | "bf16") and what it changes in a model.

Megatron's mixed-precision recipe, as this project applies it:
- device parameters are in the run's dtype (bf16: half the bytes of the weights, and of every
  activation the layers produce);
- gradients accumulate in FP32 (the trainer's arena slots, a `main_grad` view per parameter:
  trainer/step.py), the optimizer keeps FP32 masters and AdamW moments on the host, and casts the
  updated masters back into the device parameters after each step;
- buffers stay FP32 (the MoE routers' `e_score_correction_bias` steers expert selection by small
  differences that bf16's 8-bit mantissa would erase): `cast_parameters` touches parameters only.

Where the model computes in FP32 whatever the parameters' dtype (each is commented in place):
RMSNorm / gated RMSNorm statistics (models/norms.py), router scores and top-k choice
(models/mlp.py `Router`), KDA's decay g, beta, q/k normalisation, the recurrent state and its
chunked cumulative sums (models/kda.py, kernels/kda), MLA softmax and scores (models/model.py
`PackedMixer.mla`, models/paged.py), the log-softmax of logprobs (models/model.py
`_chunk_logprobs`) and sampling (rollout/sampling.py). KDA state pages in the engine's pool are
FP32 by default, independent of the MLA cache dtype (memory/layout.py `state_dtype`).
"""
from __future__ import annotations

import torch
from torch import nn

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16}
"""Accepted values of the `dtype` knob and the parameter dtype each selects."""


def parse_dtype(name: str) -> torch.dtype:
    """"fp32" | "bf16" -> the torch dtype; ValueError naming the value otherwise."""
    if name not in DTYPES:
        raise ValueError(f"dtype={name!r}, expected one of {sorted(DTYPES)}")
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    """The knob's name of a torch dtype (inverse of `parse_dtype`)."""
    for name, value in DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"dtype {dtype} is not a supported parameter dtype (expected one of {list(DTYPES.values())})")


def bf16_matmul_works(device: torch.device | str) -> bool:
    """Whether `device` runs bf16 matmuls correctly: CUDA asks the driver (Ampere and newer); the CPU
    runs a small bf16 matmul and checks it against fp32 (builds without bf16 kernels raise or
    return garbage)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    try:
        a = torch.arange(12, dtype=torch.float32, device=device).view(3, 4) / 8
        got = (a.to(torch.bfloat16) @ a.t().to(torch.bfloat16)).float()
    except RuntimeError:
        return False
    return bool(torch.allclose(got, a @ a.t(), rtol=1e-2, atol=1e-2))


def check_dtype_supported(dtype: torch.dtype, device: torch.device | str) -> None:
    """Raise ValueError if `device` cannot run `dtype` parameters (today: bf16 without bf16 matmuls)."""
    if dtype == torch.bfloat16 and not bf16_matmul_works(device):
        raise ValueError(f"dtype='bf16' requested on {torch.device(device)}, which has no working bf16 matmul "
                         f"(torch {torch.__version__}); use dtype='fp32' here, or run on a GPU with bf16 support")


KEEP_FP32: tuple[str, ...] = ("mlp.gate.weight", "self_attn.dt_bias", "self_attn.A_log")
"""Parameters (name suffixes) that stay float32 whatever the run's dtype, as in Kimi Linear's
reference checkpoints: the MoE router's weight (expert choice compares scores that differ in the
3rd decimal) and KDA's decay parameters (g = -exp(A_log) * softplus(. + dt_bias) is accumulated
over thousands of tokens in the recurrent state). They are a few thousand numbers per layer."""


@torch.no_grad()
def cast_parameters(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Cast every floating-point parameter of `model` to `dtype` in place (the Parameter objects are
    kept, their `.data` replaced), except `KEEP_FP32` ones, which become float32; buffers keep their
    dtype. Returns `model`."""
    for name, param in model.named_parameters():
        target = torch.float32 if name.endswith(KEEP_FP32) else dtype
        if param.is_floating_point() and param.dtype != target:
            param.data = param.data.to(target)
    return model


def parameter_dtype(model: nn.Module) -> torch.dtype:
    """The run's dtype of `model`: that of its parameters outside `KEEP_FP32`; ValueError if they mix."""
    dtypes = {p.dtype for n, p in model.named_parameters() if not n.endswith(KEEP_FP32)}
    if len(dtypes) != 1:
        raise ValueError(f"parameters mix dtypes {sorted(map(str, dtypes))}; expected one")
    return dtypes.pop()
