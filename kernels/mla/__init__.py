from kernels.mla.naive import naive_mla_attention, naive_mla_attention_absorbed
from kernels.mla.paged import paged_mla_decode
from kernels.mla.prefill import paged_mla_prefill

__all__ = ["naive_mla_attention", "naive_mla_attention_absorbed", "paged_mla_decode", "paged_mla_prefill"]
