"""`ValueModel`: the critic of PPO with GAE, the policy's architecture with a scalar head.

Why a separate model rather than a value head on the policy's trunk: a shared trunk would let the
value loss move the policy (and the engine, the reference and the KL all read the policy's weights),
and couple the two learning rates; every anchor that trains a critic (verl, OpenRLHF) keeps it apart.
What it costs: a second set of weights on the device and its own FP32 gradient slots and host
optimizer states (the planner counts them).

The head is a bias-free [1, D] projection in place of the LM head; `packed_logprobs` returns the
value V(s_t) of each row's input position instead of a log-probability, so the trainer's chunk path
(VPP chunks, micro-batches, recompute, gradient slots, ZeRO sharding, spill, checkpoints) trains it
unchanged: what the trainer hands its loss function as "logp" is the value.
"""
from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from models.config import ModelConfig
from models.model import HybridLM


class ValueModel(HybridLM):
    """The policy's architecture (untied) with `lm_head` a [1, D] value head."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(replace(config, tie_word_embeddings=False))
        self.lm_head = nn.Linear(config.hidden_size, 1, bias=False)

    def packed_logprobs(self, hidden: torch.Tensor, targets: torch.Tensor, chunk_len: int = 1024) -> torch.Tensor:
        """Final-normed hidden [N, D] -> float32 [N] values (targets unused: the trainer's signature)."""
        return F.linear(hidden, self.lm_head.weight).float()[:, 0]

    @torch.no_grad()
    def start_from(self, policy: HybridLM) -> "ValueModel":
        """The trunk copied from `policy` (embeddings, every layer, the final norm), the head at zero:
        V = 0 everywhere until the critic learns (verl and OpenRLHF start the critic from a trained model)."""
        own = self.state_dict()
        for name, tensor in policy.state_dict().items():
            if not name.startswith("lm_head.") and name in own:
                own[name].copy_(tensor.to(own[name].dtype))
        self.lm_head.weight.zero_()
        return self
