from kernels.kda.naive import naive_chunk_kda, naive_recurrent_kda

__all__ = ["naive_chunk_kda", "naive_recurrent_kda"]
