"""A draft model's proposals: a smaller model of ours (sharing the target's tokenizer) samples k tokens per
sequence, and the engine verifies them against the target in one forward with the exact acceptance rule
(rollout/speculative/spec_accept.py, the draft's distribution q as the proposal's).

The draft is a hybrid too, so its state cannot be truncated after a rejection either. It keeps, per
sequence, explicit states (models/state.py `SequenceState`: each KDA layer's recurrent matrix and conv
tails, each MLA layer's latents; never mutated by the model, so every state it passes through is a
snapshot for free): the state after the tokens it has read (`fed`). To propose it reads what it has not
(the tokens the target accepted since, the last one included: one chunk), draws d_1 from its logits, reads
d_1, draws d_2 ... d_k, keeping the state after each. When the verdict comes (`settled`), the state after
the last kept proposal becomes the sequence's (after d_{k-1} when all k are kept: d_k is read with the next
catch-up). Nothing is recomputed, and no token the target did not accept stays in a draft state.

Draws: at the sequence's temperature, top-k and top-p (the draft's q is truncated as the target's p is;
greedy sequences take the draft's argmax), from a generator of the draft's own per sequence, seeded from
the sequence's seed, so a seeded request speculates reproducibly and the target's stream is untouched.
Its states live outside the page pool (dense tensors, the MLA latents of each sequence growing with it),
are dropped with their sequence and by `clear()` (the engine's sleep), and rebuilt by a catch-up.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch

from models.checkpoint import load_checkpoint
from models.config import load_model_config
from models.model import HybridLM
from models.state import SequenceState
from rollout.engine_config import EngineConfig
from rollout.speculative.proposers import Proposal, Proposer
from rollout.request import Sequence
from rollout.speculative.spec_accept import draw_rows, sampler_probs_rows

DRAFT_SEED_SALT = 0x5EED_D2AF
"""Mixed into a sequence's seed for its draft generator."""


@dataclass
class _DraftState:
    """A sequence's draft state and the snapshots of its last proposal."""

    state: SequenceState | None
    """State after the first `fed` tokens (None: nothing read yet)."""
    fed: int
    generator: torch.Generator
    snapshots: list[SequenceState] = field(default_factory=list)
    """After a proposal of k tokens from n known ones: the states after n, n + 1, ... n + k - 1 tokens."""
    base: int = 0
    """n: the tokens known when the last proposal was drawn."""


class DraftProposer(Proposer):
    """Proposals sampled from a draft model (module docstring)."""

    def __init__(self, model: HybridLM, vocab_size: int) -> None:
        if model.config.vocab_size != vocab_size:
            raise ValueError(f"draft model vocab_size={model.config.vocab_size} but the target's is {vocab_size}: "
                             f"a draft must share the target's tokenizer")
        self.model = model.eval()
        self._seqs: weakref.WeakKeyDictionary[Sequence, _DraftState] = weakref.WeakKeyDictionary()
        self.num_draft_tokens = 0
        """Tokens the draft model has read (catch-ups and proposals) since it was built."""

    def _entry(self, seq: Sequence) -> _DraftState:
        entry = self._seqs.get(seq)
        if entry is None:
            gen = torch.Generator().manual_seed((seq.generator.initial_seed() ^ DRAFT_SEED_SALT) & ((1 << 63) - 1))
            entry = self._seqs[seq] = _DraftState(None, 0, gen)
        return entry

    @torch.inference_mode()
    def propose_batch(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        out = [Proposal([]) for _ in seqs]
        active = [i for i, k in enumerate(ks) if k > 0]
        if not active:
            return out
        entries = [self._entry(seqs[i]) for i in active]
        device = next(self.model.parameters()).device
        # Catch up: everything not read yet, the last known token included (its logits draw d_1).
        feeds = [torch.tensor(seqs[i].tokens[e.fed:], dtype=torch.long, device=device) for i, e in zip(active, entries)]
        for e, i in zip(entries, active):
            e.base, e.snapshots = seqs[i].num_tokens, []
        states = [e.state for e in entries]
        tokens: list[list[int]] = [[] for _ in active]
        dists: list[list[torch.Tensor]] = [[] for _ in active]
        live = list(range(len(active)))  # positions in `active` still drawing
        while live:
            result = self.model.forward_with_state([feeds[j] for j in live], [states[j] for j in live],
                                                   last_logits_only=True)
            self.num_draft_tokens += sum(feeds[j].numel() for j in live)
            logits = torch.cat([x[-1:] for x in result.logits]).float()  # [live, vocab]
            drawn, probs = self._draw([seqs[active[j]] for j in live], logits, [entries[j].generator for j in live])
            still = []
            for row, j in enumerate(live):
                states[j] = result.states[row]
                entries[j].snapshots.append(states[j])
                tokens[j].append(drawn[row])
                dists[j].append(probs[row])
                if len(tokens[j]) < ks[active[j]]:
                    feeds[j] = torch.tensor([drawn[row]], dtype=torch.long, device=device)
                    still.append(j)
            live = still
        for j, i in enumerate(active):
            out[i] = Proposal(tokens[j], torch.stack(dists[j]), "draft")
        return out

    @staticmethod
    def _draw(seqs: list[Sequence], logits: torch.Tensor, generators: list[torch.Generator]
              ) -> tuple[list[int], torch.Tensor]:
        """One token per row at its sequence's sampling settings: (tokens, q [rows, vocab], the distribution
        drawn from: truncated and renormalised; one-hot at the argmax for greedy rows)."""
        params = [s.params for s in seqs]
        q, _ = sampler_probs_rows(logits, params)
        drawn = draw_rows(q, [torch.rand(1, generator=g, dtype=torch.float64).item() for g in generators])
        greedy = torch.tensor([p.temperature == 0 for p in params])
        if bool(greedy.any()):
            best = logits.argmax(dim=-1)
            drawn = torch.where(greedy, best, torch.tensor(drawn)).tolist()
            q = torch.where(greedy[:, None], torch.nn.functional.one_hot(best, q.shape[-1]).float(), q)
        return drawn, q

    def kind_of(self, seq: Sequence) -> str:
        return "draft"

    def settled(self, seq: Sequence, proposed: int, kept: int) -> None:
        """The state after the base tokens and the kept proposals becomes the sequence's (module docstring)."""
        entry = self._seqs.get(seq)
        if entry is None or not entry.snapshots:
            return
        at = min(kept, len(entry.snapshots) - 1)  # snapshot j: after base + j tokens
        entry.state, entry.fed = entry.snapshots[at], entry.base + at
        entry.snapshots = []

    def clear(self) -> None:
        self._seqs.clear()


def draft_proposer(config: EngineConfig, target: HybridLM, draft: HybridLM | None, seed: int) -> DraftProposer | None:
    """The proposer of speculative=draft (None otherwise): `draft` if given, else the model `config.draft_model`
    names (a checkpoint directory, or a model config YAML initialised with `seed`), on the target's device."""
    if config.speculative != "draft":
        return None
    if draft is None:
        if config.draft_model is None:
            raise ValueError("speculative=draft needs a draft model: engine.draft_model=<checkpoint directory> "
                             "(or Engine(..., draft=model))")
        path = Path(config.draft_model)
        if path.is_dir():
            draft = load_checkpoint(path)
        elif path.suffix in (".yaml", ".yml") and path.is_file():
            draft = HybridLM(load_model_config(path)).init_weights(seed=seed)
        else:
            raise ValueError(f"draft_model={str(path)!r} is neither a checkpoint directory nor a model config YAML")
    draft = draft.to(next(target.parameters()).device)
    return DraftProposer(draft, target.config.vocab_size)
