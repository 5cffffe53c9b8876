"""Engine vs trainer logprobs: how far the rollout engine's behaviour logprobs are from the trainer's
recomputation of the same tokens, and which piece of the model makes the difference.

- `record.py` — `record_rollout`: sequences sampled by the real `Engine`, with its logprobs, the hidden
  rows it sampled from and its schedule of steps; `Rollout` holds them in the trainer's packed layout.
- `replay.py` — `EngineMixer`: the engine's KDA and MLA computation replayed, step by step, through its
  own `PagedMixer`, inside a whole-sequence forward.
- `swaps.py` — `side_logprobs` (the trainer's forward with chosen pieces from the engine), `Figures`
  (k3, max |d|, ratio quantiles), `diagnose` (one swap at a time).
- `cli.py` — `python -m rl.mismatch` (the command's arguments and its report).
"""
