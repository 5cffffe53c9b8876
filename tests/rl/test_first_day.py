"""A user's first day, the verl way: a parquet in verl's layout (data_source, chat-message prompts, ability,
reward_model.ground_truth, extra_info), verl's compute_score(data_source, solution_str, ground_truth,
extra_info), a Hugging Face tokenizer of their own with a chat template. Checked with rl.data, trained with
validation (before, during, after the last update), resumed, evaluated on its own, exported; transformers
loads the export's model and tokenizer, renders the chat prompt, gives our logits, and its generate stops
at the export's eos."""
import json
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from models.checkpoint import load_checkpoint
from rl.data import preview
from rl.evaluate import main as evaluate_main
from rl.export.cli import main as export_main
from rl.train import run
from tests.models.conftest import rel_err
from tests.rl.test_config import composed
from tests.tokenizer_dirs import EOS, IM_END, build_bpe_tokenizer

sys.modules.setdefault("fla", None)  # transformers' torch fallbacks, not fla's kernels
from transformers import AutoTokenizer, KimiLinearForCausalLM, LogitsProcessor, LogitsProcessorList  # noqa: E402

REWARD = '''def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    assert data_source == "sums" and extra_info["split"] in ("train", "test"), (data_source, extra_info)
    ok = solution_str.strip()[:1] == ground_truth[:1]
    return {"score": 1.0 if ok else 0.0, "acc": float(ok), "digit": float(solution_str.strip()[:1].isdigit())}
'''


def write_verl_day(tmp_path):
    """verl's gsm8k preprocessing layout, sums of two digits: 48 training rows, 8 test rows."""
    for name, split, count in (("train.parquet", "train", 48), ("test.parquet", "test", 8)):
        rows = [{"data_source": "sums", "prompt": [{"role": "user", "content": f"What is {i % 5}+{i // 5 % 5}?"}],
                 "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(i % 5 + i // 5 % 5)},
                 "extra_info": {"split": split, "index": i}} for i in range(count)]
        pq.write_table(pa.Table.from_pylist(rows), tmp_path / name)
    (tmp_path / "reward.py").write_text(REWARD)
    return build_bpe_tokenizer(tmp_path / "tokenizer")


class EosAfter(LogitsProcessor):
    """Greedy's own choice for `free` tokens, then eos: the export's generate must stop there."""

    def __init__(self, prompt_len: int, free: int) -> None:
        self.at = prompt_len + free

    def __call__(self, input_ids, scores):
        if input_ids.shape[1] >= self.at:
            scores = torch.full_like(scores, float("-inf"))
            scores[:, EOS] = 0.0
        return scores


def test_verl_parquet_and_reward_data_train_validate_resume_evaluate_export_generate(tmp_path):
    tok = write_verl_day(tmp_path)
    # what verl's users pass: the files, the reward; then their tokenizer and the sizes of a CPU run
    args = ["experiment=single_turn", "task=scored", f"data.train_files=[{tmp_path / 'train.parquet'}]",
            f"data.val_files=[{tmp_path / 'test.parquet'}]", f"task.params.reward_path={tmp_path / 'reward.py'}",
            f"tokenizer.path={tok}", "model.vocab_size=320", "algo.ppo_epochs=2", "eval.every=1", "eval.n=2",
            "eval.temperature=1.0", "rollout.groups_per_iteration=2", "algo.group_size=4",
            "tracking.wandb_mode=disabled", "tracking.progress=false", "tracking.plots=false",
            f"run_dir={tmp_path / 'run'}"]
    figures = preview(args, say=lambda *_: None)
    assert figures["train"]["rows"] == 48 and figures["val"]["rows"] == 8
    assert figures["train"]["reward_of_label_as_answer"] == 1.0  # the label reached verl's ground_truth
    cfg = composed(*args, "experiment.iterations=3")
    assert cfg.eval.before_train and cfg.rollout.max_new_tokens == 8  # on with val files; from the labels
    history = run(cfg)
    assert len(history) == 3 and all(h["optimizer_steps"] == 2 and h["trajectories_dropped"] == 0 for h in history)
    assert all("reward/acc" in h and "reward/digit" in h and "entropy" in h for h in history)
    assert all(h["val/num_prompts"] == 8 and 0 <= h["val/pass@2"] <= 1 for h in history)  # before, then every 1
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["final_val/iteration"] == 3 and summary["final_val/num_samples"] == 16  # after the last update
    more = run(composed(*args, "experiment.iterations=4", "resume=true"))
    assert len(more) == 1  # iteration 3 only: the resume continued after the last checkpoint
    # a checkpoint evaluated on its own equals the run's evaluation of the same weights (iteration 2's
    # update is what the resumed iteration 3's evaluation saw): the same generations, rewards and metrics
    assert evaluate_main([f"run_dir={tmp_path / 'run'}", "iteration=2", f"out={tmp_path / 'eval'}"]) == 0
    alone = [json.loads(line) for line in (tmp_path / "eval" / "val" / "iter_2.jsonl").read_text().splitlines()]
    in_run = [json.loads(line) for line in (tmp_path / "run" / "val" / "iter_3.jsonl").read_text().splitlines()]
    assert [r["samples"] for r in alone] == [r["samples"] for r in in_run] and len(alone) == 8
    metrics = json.loads((tmp_path / "eval" / "metrics_iter_2.json").read_text())
    assert metrics["val/pass@2"] == more[0]["val/pass@2"] and metrics["val/reward_mean"] == more[0]["val/reward_mean"]
    out = tmp_path / "export"
    assert export_main([f"run_dir={tmp_path / 'run'}", "dtype=fp32", f"out={out}"]) == 0
    hf_tok = AutoTokenizer.from_pretrained(out)  # the run's tokenizer travels with the export
    messages = [{"role": "user", "content": "What is 2+3?"}]
    text = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"
    prompt = hf_tok(text, return_tensors="pt", add_special_tokens=False).input_ids
    ours = load_checkpoint(tmp_path / "run" / "checkpoints" / "iter_000003")
    hf = KimiLinearForCausalLM.from_pretrained(out).eval()
    assert set(hf.generation_config.eos_token_id) == {EOS, IM_END}  # eos and the chat template's end of turn
    ids = torch.randint(0, 320, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert rel_err(hf(input_ids=ids).logits, ours(ids)) <= 1e-5
        free = hf.generate(prompt, max_new_tokens=3, do_sample=False)
        stopped = hf.generate(prompt, max_new_tokens=12, do_sample=False,
                              logits_processor=LogitsProcessorList([EosAfter(prompt.shape[1], 2)]))
    n = prompt.shape[1]
    assert stopped.shape[1] == n + 3 and stopped[0, -1].item() == EOS  # two of greedy's tokens, eos, and it stopped
    assert stopped[0, n:n + 2].tolist() == free[0, n:n + 2].tolist()


def test_the_run_ends_when_its_data_is_exhausted(tmp_path):
    """data.epochs=1 over 8 rows at 2 groups per iteration: 4 iterations train every row once and the
    run stops after the fourth (no empty fifth), however many iterations were asked for, saving the
    fourth as its last checkpoint whatever checkpoint.every says."""
    with open(tmp_path / "train.jsonl", "w") as f:
        for i in range(8):
            f.write(json.dumps({"prompt": f"{i}+0=", "label": str(i)}) + "\n")
    (tmp_path / "reward.py").write_text("def compute_score(solution_str, ground_truth):\n    return 1.0\n")
    history = run(composed("experiment=single_turn", "task=scored", f"data.train_files=[{tmp_path / 'train.jsonl'}]",
                           f"task.params.reward_path={tmp_path / 'reward.py'}", "data.epochs=1",
                           "rollout.groups_per_iteration=2", "algo.group_size=2", "rollout.max_new_tokens=2",
                           "experiment.iterations=20", "tracking.wandb_mode=disabled", "tracking.progress=false",
                           "tracking.plots=false", "checkpoint.every=10", f"run_dir={tmp_path / 'run'}"))
    assert len(history) == 4 and all(h["groups_trained"] == 2 for h in history)
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("iter_*")) == ["iter_000000", "iter_000003"]
