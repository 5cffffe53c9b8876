"""A user's first day: a jsonl of arithmetic problems, a reward.py in verl's
convention, a tokenizer directory with a chat template; train 3 iterations with 2 PPO epochs and a
validation at every iteration, resume for one more, export, reload the export with transformers and
compare logits."""
import json
import random
import sys

import torch

from models.checkpoint import load_checkpoint
from rl.evaluate import main as evaluate_main
from rl.export.cli import main as export_main
from rl.train import run
from tests.models.conftest import rel_err
from tests.rl.test_config import composed
from tests.tokenizer_dirs import build_bpe_tokenizer

sys.modules.setdefault("fla", None)  # transformers' torch fallbacks, not fla's kernels
from transformers import AutoTokenizer, KimiLinearForCausalLM  # noqa: E402

REWARD = '''def compute_score(solution_str, ground_truth, extra_info=None):
    ok = solution_str.strip()[:1] == ground_truth[:1]
    return {"score": 1.0 if ok else 0.0, "acc": float(ok), "digit": float(solution_str.strip()[:1].isdigit())}
'''


def write_day_one(tmp_path):
    rng = random.Random(0)
    with open(tmp_path / "train.jsonl", "w") as f:
        for _ in range(64):
            a, b = rng.randint(0, 4), rng.randint(0, 4)
            f.write(json.dumps({"prompt": f"What is {a}+{b}?", "label": str(a + b), "level": 1}) + "\n")
    (tmp_path / "reward.py").write_text(REWARD)
    return build_bpe_tokenizer(tmp_path / "tokenizer")


def test_data_reward_tokenizer_train_resume_export(tmp_path):
    tok = write_day_one(tmp_path)
    args = ["experiment=single_turn", "task=scored", f"data.train_files=[{tmp_path / 'train.jsonl'}]",
            f"task.params.reward_path={tmp_path / 'reward.py'}", f"tokenizer.path={tok}", "model.vocab_size=320",
            "algo.ppo_epochs=2", f"data.val_files=[{tmp_path / 'train.jsonl'}]", "eval.every=1", "eval.n=2",
            "eval.num_prompts=4", "rollout.groups_per_iteration=2", "algo.group_size=4", "rollout.max_new_tokens=3",
            "tracking.wandb_mode=disabled", "tracking.progress=false", "tracking.plots=false",
            f"run_dir={tmp_path / 'run'}"]
    history = run(composed(*args, "experiment.iterations=3"))
    assert len(history) == 3 and all(h["optimizer_steps"] == 2 for h in history if "optimizer_steps" in h)
    assert all("reward/acc" in h and "reward/digit" in h for h in history)
    assert all(0 <= h["val/pass@2"] <= 1 and h["val/num_prompts"] == 4 for h in history[1:])  # every=1: from 1 on
    assert (tmp_path / "run" / "val" / "iter_1.jsonl").exists()
    more = run(composed(*args, "experiment.iterations=4", "resume=true"))
    assert len(more) == 1  # iteration 3 only: the resume continued after the last checkpoint
    # a checkpoint evaluated on its own equals the run's evaluation of the same weights (iteration 2's
    # update is what the resumed iteration 3's evaluation saw): the same generations, rewards and metrics
    assert evaluate_main([f"run_dir={tmp_path / 'run'}", "iteration=2", f"out={tmp_path / 'eval'}"]) == 0
    alone = [json.loads(line) for line in (tmp_path / "eval" / "val" / "iter_2.jsonl").read_text().splitlines()]
    in_run = [json.loads(line) for line in (tmp_path / "run" / "val" / "iter_3.jsonl").read_text().splitlines()]
    assert [r["samples"] for r in alone] == [r["samples"] for r in in_run] and len(alone) == 4
    metrics = json.loads((tmp_path / "eval" / "metrics_iter_2.json").read_text())
    assert metrics["val/pass@2"] == more[0]["val/pass@2"] and metrics["val/reward_mean"] == more[0]["val/reward_mean"]
    out = tmp_path / "export"
    assert export_main([f"run_dir={tmp_path / 'run'}", "dtype=fp32", f"out={out}"]) == 0
    assert AutoTokenizer.from_pretrained(out).chat_template  # the run's tokenizer travels with the export
    ours = load_checkpoint(tmp_path / "run" / "checkpoints" / "iter_000003")
    hf = KimiLinearForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, 320, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert rel_err(hf(input_ids=ids).logits, ours(ids)) <= 1e-5


def test_the_run_ends_when_its_data_is_exhausted(tmp_path):
    """data.epochs=1 over 8 rows at 2 groups per iteration: 4 iterations train every row once and the
    run stops after the fourth (no empty fifth), however many iterations were asked for, saving the
    fourth as its last checkpoint whatever checkpoint.every says."""
    with open(tmp_path / "train.jsonl", "w") as f:
        for i in range(8):
            f.write(json.dumps({"prompt": f"{i}+0=", "label": str(i)}) + "\n")
    (tmp_path / "reward.py").write_text(REWARD)
    history = run(composed("experiment=single_turn", "task=scored", f"data.train_files=[{tmp_path / 'train.jsonl'}]",
                           f"task.params.reward_path={tmp_path / 'reward.py'}", "data.epochs=1",
                           "rollout.groups_per_iteration=2", "algo.group_size=2", "rollout.max_new_tokens=2",
                           "experiment.iterations=20", "tracking.wandb_mode=disabled", "tracking.progress=false",
                           "tracking.plots=false", "checkpoint.every=10", f"run_dir={tmp_path / 'run'}"))
    assert len(history) == 4 and all(h["groups_trained"] == 2 for h in history)
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("iter_*")) == ["iter_000000", "iter_000003"]
