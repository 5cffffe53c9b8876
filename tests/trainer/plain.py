"""The plain reference the trainer is checked against: the whole model in one piece."""
import torch

from models.model import HybridLM


def plain_packed_logprobs(model: HybridLM, lens, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Packed sequences -> per-token logprobs [N] through the model's padded full-sequence path."""
    ids = torch.zeros(len(lens), max(lens), dtype=torch.long)
    tgt = torch.zeros_like(ids)
    offset = 0
    for b, n in enumerate(lens):
        ids[b, :n], tgt[b, :n] = tokens[offset:offset + n], targets[offset:offset + n]
        offset += n
    logp = model.token_logprobs(ids, tgt, lengths=lens)
    return torch.cat([logp[b, :n] for b, n in enumerate(lens)])
