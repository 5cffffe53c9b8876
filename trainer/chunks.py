"""VPP model chunks: contiguous layer ranges trained chunk by chunk.

A chunk owns a contiguous range of decoder layers; the embedding belongs to the first chunk, the
final norm and the output head to the last (a tied head stays with the embedding, in chunk 0).
With chunk_split="params" the embedding and the head may be chunks of their own, with no layer.
`ChunkedModel.forward_backward` runs the forward once without keeping activations (only the
hidden state entering each chunk is saved; the last chunk is skipped there, its recompute being the
first step of the backward walk), then walks the chunks in reverse: it recomputes one
chunk's forward with autograd, backpropagates the gradient arriving from the chunk above, and
hands the finished chunk to `on_chunk_done` before moving down. So at any moment only one chunk's
activation graph is alive and each chunk's parameter gradients are complete, and final, when
its callback runs: the point where a gradient arena can reduce-scatter them and free the slot.
`forward_backward_batches` does the same for several micro-batches chunk-major (every micro-batch's
backward of a chunk before the next chunk down), so each chunk's callback runs once per step.
Gradients equal a plain backward of the whole model (tests/trainer/test_chunks.py).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from models.fused import unfused
from models.model import HybridLM, Mixer


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch of packed sequences (`ChunkedModel.forward_backward_batches`)."""
    token_ids: torch.Tensor
    """[N] packed token ids; sequence i owns `seq_lens[i]` consecutive rows."""
    seq_lens: Sequence[int]
    targets: torch.Tensor
    """[N] next-token targets."""
    loss_fn: Callable[[torch.Tensor], torch.Tensor]
    """Per-token logprobs [N] (float32, differentiable) -> a scalar."""


@dataclass(frozen=True)
class ChunkSpec:
    index: int
    layers: range
    """Decoder layers of this chunk, in order."""
    has_embedding: bool
    has_head: bool
    """Final norm and (untied) lm_head."""


CHUNK_SPLITS = ("layers", "params")
"""How the model is cut into VPP chunks (trainer.chunk_split): "layers" = equal layer counts, the
embedding with the first chunk and the head with the last (at most num_layers chunks); "params" =
contiguous chunks of the fewest parameters in the largest one, with the embedding and the head as
units of their own (at most num_layers + 2 chunks), the split that makes the gradient slots (sized
for the largest chunk) smallest, like Megatron's account_for_embedding/loss_in_pipeline_split."""


def split_chunks(num_layers: int, num_chunks: int, unit_numels: Sequence[int] | None = None) -> list[ChunkSpec]:
    """Contiguous chunks. Without `unit_numels`: balanced layer ranges, earlier chunks take the
    remainder layers ("layers"). With `unit_numels` (num_layers + 2 parameter counts: the embedding,
    each layer, the final norm + head): the split minimising the largest chunk's count ("params"),
    ties going to the split whose earlier chunks are fuller."""
    if unit_numels is None:
        if not 1 <= num_chunks <= num_layers:
            raise ValueError(f"num_chunks={num_chunks}, expected 1..num_layers={num_layers} "
                             f"(chunk_split='layers'; 'params' allows up to num_layers + 2)")
        base, extra = divmod(num_layers, num_chunks)
        sizes = [base + (1 if c < extra else 0) for c in range(num_chunks)]
        bounds = [0]
        for size in sizes:
            bounds.append(bounds[-1] + size)
        return [ChunkSpec(c, range(bounds[c], bounds[c + 1]), c == 0, c == num_chunks - 1) for c in range(num_chunks)]
    if len(unit_numels) != num_layers + 2:
        raise ValueError(f"unit_numels has {len(unit_numels)} entries, expected num_layers + 2 = {num_layers + 2} "
                         f"(embedding, layers, head)")
    if not 1 <= num_chunks <= num_layers + 2:
        raise ValueError(f"num_chunks={num_chunks}, expected 1..num_layers + 2 = {num_layers + 2} (chunk_split='params')")
    cuts = _min_max_partition(list(unit_numels), num_chunks)  # unit index where each chunk starts, + the end
    specs = []
    for c in range(num_chunks):
        lo, hi = cuts[c], cuts[c + 1]  # units [lo, hi): unit 0 = embedding, 1..L = layers, L + 1 = head
        layers = range(min(max(lo - 1, 0), num_layers), min(max(hi - 1, 0), num_layers))
        specs.append(ChunkSpec(c, layers, lo == 0, hi == num_layers + 2))
    return specs


def _min_max_partition(sizes: list[int], parts: int) -> list[int]:
    """Boundaries b[0]=0 < b[1] < ... < b[parts]=len(sizes) of the contiguous split of `sizes` into
    `parts` non-empty runs with the smallest largest sum; among those, each run as long as the
    remaining runs allow (greedy from the left under the optimal bound)."""
    n = len(sizes)
    prefix = [0]
    for size in sizes:
        prefix.append(prefix[-1] + size)

    def greedy(bound: int) -> list[int] | None:
        cuts, start = [0], 0
        for left in range(parts - 1, 0, -1):  # runs still to place after this one
            end = start + 1
            if prefix[end] - prefix[start] > bound:
                return None
            while end < n - left and prefix[end + 1] - prefix[start] <= bound:
                end += 1
            cuts.append(end)
            start = end
        if prefix[n] - prefix[start] > bound:
            return None
        return cuts + [n]

    lo, hi = max(sizes), prefix[n]
    while lo < hi:  # smallest feasible bound
        mid = (lo + hi) // 2
        if greedy(mid) is None:
            lo = mid + 1
        else:
            hi = mid
    return greedy(lo)


def unit_numels(model: HybridLM) -> list[int]:
    """Parameter counts of the split's units: the embedding, each decoder layer, the final norm + the
    untied head (a tied head's weight is the embedding's, counted there)."""
    backbone = model.model
    head = sum(p.numel() for p in backbone.norm.parameters())
    if model.lm_head is not None:
        head += sum(p.numel() for p in model.lm_head.parameters())
    return ([sum(p.numel() for p in backbone.embed_tokens.parameters())]
            + [sum(p.numel() for p in layer.parameters()) for layer in backbone.layers] + [head])


def chunk_specs(model: HybridLM, num_chunks: int, split: str = "layers") -> list[ChunkSpec]:
    """The VPP chunks of `model` under `split` (CHUNK_SPLITS)."""
    if split not in CHUNK_SPLITS:
        raise ValueError(f"chunk_split={split!r}, expected one of {CHUNK_SPLITS}")
    numels = unit_numels(model) if split == "params" else None
    return split_chunks(model.config.num_hidden_layers, num_chunks, numels)


class ChunkedModel:
    """A HybridLM seen as VPP chunks. Holds no tensors of its own beyond the model's."""

    def __init__(self, model: HybridLM, num_chunks: int, split: str = "layers") -> None:
        self.model = model
        self.specs = chunk_specs(model, num_chunks, split)

    def chunk_parameters(self, chunk: int) -> list[tuple[str, nn.Parameter]]:
        """(name, parameter) pairs owned by `chunk`, in model order; every parameter is in exactly one chunk."""
        spec, backbone = self.specs[chunk], self.model.model
        owned: list[tuple[str, nn.Parameter]] = []
        if spec.has_embedding:
            owned += [(f"model.embed_tokens.{n}", p) for n, p in backbone.embed_tokens.named_parameters()]
        for i in spec.layers:
            owned += [(f"model.layers.{i}.{n}", p) for n, p in backbone.layers[i].named_parameters()]
        if spec.has_head:
            owned += [(f"model.norm.{n}", p) for n, p in backbone.norm.named_parameters()]
            if self.model.lm_head is not None:
                owned += [(f"lm_head.{n}", p) for n, p in self.model.lm_head.named_parameters()]
        return owned

    def chunk_numel(self, chunk: int) -> int:
        return sum(p.numel() for _, p in self.chunk_parameters(chunk))

    def _run_chunk(self, chunk: int, hidden: torch.Tensor, mixer: Mixer) -> torch.Tensor:
        for index in self.specs[chunk].layers:
            hidden = self.model.run_layer(index, hidden, mixer)
        return hidden

    @torch.no_grad()
    def forward_logprobs(self, token_ids: torch.Tensor, seq_lens: Sequence[int], targets: torch.Tensor,
                         logprob_chunk_len: int = 1024) -> torch.Tensor:
        """Per-token log p(targets | prefix) [N] float32 through the same chunk path as training
        (old-policy and reference logprobs). Unfused (models/fused.py): the same ops as the
        reference streamed through the gradient slots, which may build no weight copy."""
        if not len(seq_lens):  # an expert-parallel rank without rows still joins the exchanges
            if self.model.expert_parallel is not None:
                self.model.join_experts()
            return torch.zeros(0, dtype=torch.float32, device=token_ids.device)
        with unfused():
            return self._forward_logprobs(token_ids, seq_lens, targets, logprob_chunk_len)

    def _forward_logprobs(self, token_ids: torch.Tensor, seq_lens: Sequence[int], targets: torch.Tensor,
                          logprob_chunk_len: int) -> torch.Tensor:
        mixer = self.model.whole_sequence_mixer(seq_lens).stage(token_ids.device)
        hidden = self.model.model.embed_tokens(token_ids)
        for c in range(len(self.specs)):
            hidden = self._run_chunk(c, hidden, mixer)
        return self.model.packed_logprobs(self.model.model.norm(hidden), targets, logprob_chunk_len)

    def forward_backward(self, token_ids: torch.Tensor, seq_lens: Sequence[int], targets: torch.Tensor,
                         loss_fn: Callable[[torch.Tensor], torch.Tensor],
                         on_chunk_done: Callable[[int], None] | None = None, logprob_chunk_len: int = 1024,
                         on_chunk_start: Callable[[int], None] | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """Packed sequences -> (loss, per-token logprobs [N] detached); accumulates parameter .grad.

        token_ids, targets: [N] packed (sequence i owns `seq_lens[i]` consecutive rows);
        loss_fn maps the per-token logprobs [N] (float32, differentiable) to a scalar.
        `on_chunk_start(c)` runs right before chunk c's backward (bind its gradient buffer there),
        `on_chunk_done(c)` right after its gradients are final, for c = last .. 0.
        """
        (loss, logprobs), = self.forward_backward_batches([MicroBatch(token_ids, seq_lens, targets, loss_fn)],
                                                          on_chunk_done, logprob_chunk_len, on_chunk_start)
        return loss, logprobs

    def forward_backward_batches(self, batches: Sequence[MicroBatch], on_chunk_done: Callable[[int], None] | None = None,
                                 logprob_chunk_len: int = 1024, on_chunk_start: Callable[[int], None] | None = None
                                 ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Several micro-batches, chunk-major: each runs its graph-free forward (keeping its chunk
        inputs), then for each chunk, last to first, every micro-batch's recompute + backward
        accumulates into the chunk's gradients before `on_chunk_done(c)`: one call per chunk per
        step whatever the number of micro-batches (so one gradient reduction), at the price of every
        micro-batch's chunk inputs held between the forward and the backward. `on_chunk_start(c)`
        runs before chunk c's first backward. With no batch (a data-parallel rank without work) the
        callbacks still run, on zero gradients. Under expert parallelism every rank of the group runs
        as many micro-batches as the one with most (one all-reduce): the missing ones join the MoE
        layers' exchanges with zero tokens (`HybridLM.join_experts`), forward and backward, in the
        order a real one would. Returns each batch's (loss, logprobs), detached."""
        ep = self.model.expert_parallel
        idle = ep.max_count(len(batches)) - len(batches) if ep is not None else 0
        staged = [self._staged_forward(b) for b in batches]
        for _ in range(idle):  # an expert-parallel peer runs more micro-batches: join their exchanges
            with torch.no_grad():
                self.model.join_experts([i for spec in self.specs[:-1] for i in spec.layers])
        grads_out: list[torch.Tensor | None] = [None] * len(batches)
        results: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(batches)
        for c in reversed(range(len(self.specs))):
            if on_chunk_start is not None:
                on_chunk_start(c)
            for m, (batch, (inputs, packed)) in enumerate(zip(batches, staged)):
                x = inputs[c].detach().requires_grad_(c > 0)
                if c == 0:
                    x = self.model.model.embed_tokens(batch.token_ids)
                out = self._run_chunk(c, x, packed)
                if self.specs[c].has_head:
                    logp = self.model.packed_logprobs(self.model.model.norm(out), batch.targets, logprob_chunk_len)
                    loss = batch.loss_fn(logp)
                    results[m] = (loss.detach(), logp.detach())
                    loss.backward()
                else:
                    out.backward(grads_out[m])
                grads_out[m] = x.grad if c > 0 else None
                inputs[c] = None  # this chunk's input is no longer needed
            for _ in range(idle):  # the chunk's recompute and backward exchanges, with zero tokens
                with torch.enable_grad():
                    self.model.join_experts(self.specs[c].layers).sum().backward()
            if on_chunk_done is not None:
                on_chunk_done(c)
        return results

    def _staged_forward(self, batch: MicroBatch) -> tuple[list[torch.Tensor], Mixer]:
        """One micro-batch's forward without a graph: (the hidden state entering each chunk, its
        staged mixer). Whole sequences from position 0: the batched mixer (its index tensors reach
        the device in one copy, before any layer runs); keep_attention: the graph-free pass keeps
        each MLA layer's attention output (O(L)) so the recompute does not run the quadratic
        forward twice (models.mla.causal_attention; CPU). Unfused (models/fused.py), as the
        recompute under autograd is: the chunk inputs must be exactly what a plain forward makes
        (in bf16 the fused projections round differently). The last chunk is not run: its output
        is only needed with a graph, and its recompute comes first in the backward walk."""
        token_ids, seq_lens, targets = batch.token_ids, batch.seq_lens, batch.targets
        if token_ids.shape != targets.shape or token_ids.dim() != 1:
            raise ValueError(f"token_ids {tuple(token_ids.shape)} and targets {tuple(targets.shape)} must be "
                             f"the same 1-D packed shape")
        if sum(seq_lens) != token_ids.numel() or any(n < 1 for n in seq_lens):
            raise ValueError(f"seq_lens {list(seq_lens)} must be positive and sum to {token_ids.numel()} tokens")
        packed = self.model.whole_sequence_mixer(seq_lens, keep_attention=True).stage(token_ids.device)
        inputs = []
        with torch.no_grad(), unfused():
            hidden = self.model.model.embed_tokens(token_ids)  # [N, D]
            for c in range(len(self.specs)):
                inputs.append(hidden)
                if c + 1 < len(self.specs):
                    hidden = self._run_chunk(c, hidden, packed)
        return inputs, packed
