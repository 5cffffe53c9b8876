"""The trainer's logprobs of engine-generated trajectories equal what the engine returned."""
import torch

from models.config import load_model_config
from models.model import HybridLM
from rollout.engine import Engine, EngineConfig
from rollout.sampling import SamplingParams
from trainer.chunks import ChunkedModel


def test_trainer_logprobs_match_engine_logprobs():
    model = HybridLM(load_model_config("configs/model/tiny.yaml")).init_weights(seed=5, std=0.1).eval()
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (5, 40, 77)]
    engine = Engine(model, EngineConfig(num_pages=64, max_model_len=128, max_num_batched_tokens=32,
                                        show_progress=False))
    outs = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=20, seed=3, n=2,
                                                   ignore_eos=True))
    seqs, engine_logp, spans = [], [], []
    for prompt, out in zip(prompts, outs):
        for sample in out.samples:
            tokens = prompt + sample.tokens
            spans.append((sum(len(s) for s in seqs) + len(prompt) - 1, len(sample.tokens)))
            seqs.append(tokens)
            engine_logp += sample.logprobs
    token_ids = torch.tensor([t for s in seqs for t in s])
    targets = torch.cat([torch.tensor(s[1:] + [0]) for s in seqs])  # next token (last one unused)
    logp = ChunkedModel(model, 3).forward_logprobs(token_ids, [len(s) for s in seqs], targets)
    ours = torch.cat([logp[start:start + n] for start, n in spans])
    expected = torch.tensor(engine_logp)
    assert ((ours - expected).norm() / expected.norm()).item() <= 1e-5
