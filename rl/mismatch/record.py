"""The engine's side of the comparison: sequences sampled by the real rollout engine, with what the
replay and the head swap need from it.

`record_rollout` runs `Engine.generate` under rollout/step_record.py's `record_steps`, which changes
nothing the engine computes and writes down each step's sequences, their first new position and
their new tokens (the *schedule*: which prefill chunks and decode steps the engine ran, in which
batches), and the final hidden rows the engine's head turned into the logits it sampled from. The schedule must cover every sequence's tokens exactly once,
from position 0 (no recompute after a preemption, no prefix hit): the replay reruns those steps from
empty states, so anything else is refused.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from rollout.engine import Engine
from rollout.sampling import SamplingParams
from rollout.step_record import record_steps

Entry = tuple[int, int, int]
"""One sequence in one engine step: (sequence index, position of its first new token, new tokens)."""


@dataclass
class Rollout:
    """Sampled sequences as the trainer scores them and as the engine produced them.

    Sequence i is prompt i followed by its generated tokens; the trainer's forward takes all but the
    last token ([prompt + generated][:-1], what the engine computed) and scores each next token.
    Tensors are on the model's device."""

    prompts: list[list[int]]
    generated: list[list[int]]
    behaviour: torch.Tensor
    """[G] float32: the engine's logprob of each generated token, sequence-major (what a trajectory stores)."""
    engine_hidden: torch.Tensor
    """[G, D] in the model dtype: the final-normed hidden row the engine sampled each token from."""
    schedule: list[list[Entry]]
    """Per engine step, its sequences in the step's order."""
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def seq_lens(self) -> list[int]:
        return [len(p) + len(g) - 1 for p, g in zip(self.prompts, self.generated)]

    @property
    def offsets(self) -> list[int]:
        """Packed row of each sequence's first token (sequences back to back)."""
        return [0, *itertools.accumulate(self.seq_lens)][:-1]

    @property
    def token_ids(self) -> torch.Tensor:
        """[N] int64 packed inputs."""
        return torch.tensor([t for p, g in zip(self.prompts, self.generated) for t in (p + g)[:-1]],
                            dtype=torch.long, device=self.device)

    @property
    def targets(self) -> torch.Tensor:
        """[N] int64 packed next tokens."""
        return torch.tensor([t for p, g in zip(self.prompts, self.generated) for t in (p + g)[1:]],
                            dtype=torch.long, device=self.device)

    @property
    def policy_rows(self) -> torch.Tensor:
        """[G] int64: the packed row whose target is each generated token, in `behaviour`'s order."""
        return torch.tensor([o + len(p) - 1 + j for o, p, g in zip(self.offsets, self.prompts, self.generated)
                             for j in range(len(g))], dtype=torch.long, device=self.device)

    @property
    def num_tokens(self) -> int:
        """Generated tokens scored."""
        return sum(len(g) for g in self.generated)


def random_prompts(num_seqs: int, prompt_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    """`num_seqs` distinct prompts of byte ids (< min(256, vocab)), drawn from `seed` (distinct: no prefix hit)."""
    gen = torch.Generator().manual_seed(seed)
    high = min(256, vocab_size)
    prompts: list[list[int]] = []
    while len(prompts) < num_seqs:
        prompt = torch.randint(0, high, (prompt_len,), generator=gen).tolist()
        if prompt not in prompts:
            prompts.append(prompt)
    return prompts


def record_rollout(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> tuple[Rollout, str]:
    """Sample one continuation of each prompt with `engine` (which must hold no other request; n=1)
    and return it with the engine's logprobs, sampled-from hidden rows and schedule, and the kernel
    implementation its steps ran. RuntimeError when the schedule cannot be replayed (module docstring)."""
    if engine.has_unfinished:
        raise RuntimeError("the engine holds requests: the recorded schedule would include them")
    if params.n != 1:
        raise ValueError(f"n={params.n}: record one sample per prompt (forks share their prompt's steps)")
    with record_steps(engine) as record:
        outputs = engine.generate(prompts, params)
    index = {out.request_id: i for i, out in enumerate(outputs)}
    generated = [list(out.samples[0].tokens) for out in outputs]
    schedule = [[(index[r], start, n) for r, start, n in step] for step in record.steps]
    check_schedule(schedule, [len(p) + len(g) - 1 for p, g in zip(prompts, generated)])
    device = engine.model.output_weight.device
    hidden = [h for out in outputs for h in record.sampled[out.request_id]]
    if len(hidden) != sum(map(len, generated)):
        raise RuntimeError(f"recorded {len(hidden)} sampled rows for {sum(map(len, generated))} generated tokens")
    behaviour = torch.tensor([lp for out in outputs for lp in out.samples[0].logprobs], dtype=torch.float32,
                             device=device)
    return Rollout(prompts, generated, behaviour, torch.stack(hidden), schedule, device), record.impl


def check_schedule(schedule: list[list[Entry]], seq_lens: list[int]) -> None:
    """RuntimeError unless the steps compute each sequence's tokens [0, seq_len) exactly once, in order."""
    done = [0] * len(seq_lens)
    for number, step in enumerate(schedule):
        for seq, start, new_len in step:
            if start != done[seq]:
                raise RuntimeError(
                    f"engine step {number} computed sequence {seq} from position {start}, after {done[seq]} tokens "
                    f"(a recompute after preemption or a prefix hit): the replay needs each token computed once "
                    f"from an empty state; raise engine.pool_mb or turn the prefix cache off (engine.prefix_cache=null)")
            done[seq] += new_len
    if done != seq_lens:
        raise RuntimeError(f"engine steps computed {done} tokens per sequence, expected {seq_lens}")
