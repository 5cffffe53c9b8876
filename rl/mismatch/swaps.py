"""The trainer's forward with one piece computed the engine's way, and the mismatch figures.

`side_logprobs` is the trainer's old-logprob forward (trainer/chunks.py `forward_logprobs`: the
batched whole-sequence `PackedMixer`, unfused projections, the head in the model dtype then float32)
written out layer by layer, so that each piece can be switched to the engine's computation alone:
- "kda": the KDA layers through `EngineMixer` (rl/mismatch/replay.py) with the fused projections;
  split in two: "kda_proj" (the trainer's KDA with the engine's fused projections only) and
  "kda_mix" (the engine's conv, prefill form, decode kernel and state pages with unfused projections);
- "mla": the MLA layers through `EngineMixer` (paged, absorbed attention);
- "mlp": the dense MLP / MoE with the engine's fused inference path (models/fused.py; a model
  whose MoE runs routed has none, and this swap changes nothing);
and `head_fp32` forms the logits from float32 hidden states and weights instead. With no piece
switched it is the trainer's forward (tests: bit-identical). The head has no engine twin to swap in:
the engine forms its logits with the trainer's op, `F.linear(hidden, weight).float()`
(rollout/model_runner.py), so its precision is compared by running it in float32 on both sides
(the engine's side from the hidden rows it sampled from).
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from models.fused import unfused
from models.model import HybridLM
from rl.mismatch.record import Rollout
from rl.mismatch.replay import EngineMixer

PIECES = ("kda", "kda_proj", "kda_mix", "mla", "mlp")
"""What `side_logprobs` can take from the engine."""


@dataclass(frozen=True)
class Figures:
    """The mismatch of trainer logprobs against engine logprobs over the sampled tokens, d = trainer - engine."""

    k3: float
    """mean(exp(d) - d - 1): the k3 estimate of KL(engine || trainer) over tokens the engine sampled."""
    max_abs: float
    """max |d|."""
    ratio_p1: float
    """Quantiles of the importance ratio exp(d)."""
    ratio_p50: float
    ratio_p99: float

    @classmethod
    def of(cls, trainer: torch.Tensor, engine: torch.Tensor) -> "Figures":
        """trainer, engine: [G] logprobs of the same tokens."""
        d = trainer.double() - engine.double()
        ratio = d.exp()
        p1, p50, p99 = torch.quantile(ratio, torch.tensor([0.01, 0.5, 0.99], dtype=torch.float64,
                                                          device=ratio.device)).tolist()
        return cls(float((ratio - d - 1).mean()), float(d.abs().max()), p1, p50, p99)


def head_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, fp32: bool) -> torch.Tensor:
    """hidden [n, D], weight [V, D], targets [n] -> float32 [n] log-probabilities; `fp32`: the
    logits from float32 operands (else in the model dtype, then float32, as both sides do)."""
    logits = F.linear(hidden.float(), weight.float()) if fp32 else F.linear(hidden, weight).float()  # [n, V]
    return logits.gather(1, targets[:, None])[:, 0] - torch.logsumexp(logits, dim=-1)


@torch.no_grad()
def side_logprobs(model: HybridLM, rollout: Rollout, engine: EngineMixer | None = None,
                  pieces: frozenset[str] = frozenset(), head_fp32: bool = False) -> torch.Tensor:
    """The trainer's logprobs of the generated tokens [G] (rollout.behaviour's order), with `pieces`
    (of PIECES) computed the engine's way through `engine` (needed for "kda" and "mla")."""
    unknown = set(pieces) - set(PIECES)
    if unknown or ({"kda", "kda_mix", "mla"} & set(pieces) and engine is None):
        raise ValueError(f"pieces {sorted(pieces)}: expected a subset of {PIECES}, with an EngineMixer for "
                         f"kda, kda_mix and mla")
    trainer = model.whole_sequence_mixer(rollout.seq_lens).stage(rollout.device)
    # The trainer's forward runs unfused (trainer/chunks.py); the engine's projections are its fused path.
    fused = {"kda": bool({"kda", "kda_proj"} & pieces), "mla": "mla" in pieces, "mlp": "mlp" in pieces}
    mixers = {"kda": engine if {"kda", "kda_mix"} & pieces else trainer, "mla": engine if "mla" in pieces else trainer}
    path = {kind: nullcontext if on else unfused for kind, on in fused.items()}
    hidden = model.model.embed_tokens(rollout.token_ids)  # [N, D]
    for index, layer in enumerate(model.model.layers):
        kind = layer.mixer_type
        mixer = mixers[kind]
        with path[kind]():
            mix = mixer.kda if kind == "kda" else mixer.mla
            hidden = hidden + mix(index, layer.self_attn, layer.input_layernorm(hidden))
        with path["mlp"]():
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    hidden = model.model.norm(hidden)
    rows, targets = rollout.policy_rows, rollout.targets[rollout.policy_rows]
    if head_fp32:
        return head_logprobs(hidden.index_select(0, rows), model.output_weight, targets, fp32=True)
    return model.packed_logprobs(hidden, rollout.targets).index_select(0, rows)  # the trainer's head op itself


@dataclass(frozen=True)
class Swap:
    """One row of the diagnosis: the trainer's side with `pieces` from the engine (and the head in
    float32 on both sides when `head_fp32`) against the engine's logprobs."""

    name: str
    pieces: frozenset[str]
    head_fp32: bool = False
    text: str = ""


SWAPS = (
    Swap("kda", frozenset({"kda"}), text="KDA matched (engine's fused projections, prefill form, decode kernel, state pages)"),
    Swap("kda_proj", frozenset({"kda_proj"}), text="  of which the fused projections alone (trainer's conv and chunk kernel)"),
    Swap("kda_mix", frozenset({"kda_mix"}), text="  of which conv, prefill/decode kernels, state pages alone (unfused projections)"),
    Swap("mla", frozenset({"mla"}), text="MLA matched (engine's paged absorbed attention over its latent pages)"),
    Swap("mlp", frozenset({"mlp"}), text="MLP/MoE matched (engine's fused inference projections)"),
    Swap("head_fp32", frozenset(), head_fp32=True, text="head in fp32 on both sides"),
    Swap("replay", frozenset({"kda", "mla", "mlp"}), text="every piece matched (engine replay; left: batching of the rest)"),
)
"""The swaps `diagnose` runs, in the order printed."""


@torch.no_grad()
def diagnose(model: HybridLM, rollout: Rollout, engine: EngineMixer, trainer_logprobs: torch.Tensor
             ) -> dict[str, tuple[Figures, bool]]:
    """Every swap's figures against the engine, keyed by name ("full" first: `trainer_logprobs`, the
    trainer's own forward, against the behaviour logprobs), each with whether the swap changed the
    trainer's logprobs at all (False: that piece is computed alike on both sides)."""
    plain = side_logprobs(model, rollout)
    out = {"full": (Figures.of(trainer_logprobs, rollout.behaviour), True)}
    for swap in SWAPS:
        mine = side_logprobs(model, rollout, engine, swap.pieces, swap.head_fp32)
        reference = rollout.behaviour
        if swap.head_fp32:  # the engine's own sampled-from rows through a float32 head
            reference = head_logprobs(rollout.engine_hidden, model.output_weight, rollout.targets[rollout.policy_rows],
                                      fp32=True)
        out[swap.name] = (Figures.of(mine, reference), not torch.equal(mine, plain))
    return out
