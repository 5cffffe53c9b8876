from kernels.kda.chunk import chunk_kda
from kernels.kda.decode import kda_decode_step
from kernels.kda.naive import naive_chunk_kda, naive_recurrent_kda

__all__ = ["chunk_kda", "kda_decode_step", "naive_chunk_kda", "naive_recurrent_kda"]
