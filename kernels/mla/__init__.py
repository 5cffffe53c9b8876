from kernels.mla.naive import naive_mla_attention, naive_mla_attention_absorbed

__all__ = ["naive_mla_attention", "naive_mla_attention_absorbed"]
