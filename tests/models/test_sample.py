"""The current main job (`make run`): random init -> HF checkpoint -> load -> stateful sampling."""
import subprocess
import sys

import torch

from models.sample import main, sample_next


def test_main_job_samples_and_checks_stepwise_against_full_pass(tmp_path, capsys):
    diff = main(["--save-dir", str(tmp_path / "ckpt"), "--max-new-tokens", "12", "--seed", "3"])
    assert diff <= 1e-5
    assert (tmp_path / "ckpt" / "config.json").exists() and (tmp_path / "ckpt" / "model.safetensors").exists()
    out = capsys.readouterr().out
    assert "decoded" in out and "tok/s" in out and "8 layers (KKKMKKKM)" in out


def test_sampling_controls():
    gen = torch.Generator().manual_seed(0)
    logits = torch.tensor([0.0, 5.0, 4.9, -3.0])
    assert sample_next(logits, 0.0, 0, 1.0, gen) == 1  # greedy
    assert {sample_next(logits, 1.0, 1, 1.0, gen) for _ in range(20)} == {1}  # top-k 1
    assert {sample_next(logits, 1.0, 0, 0.3, gen) for _ in range(20)} == {1}  # top-p keeps the head
    assert {sample_next(logits, 1.0, 2, 1.0, gen) for _ in range(200)} == {1, 2}


def test_bad_cli_values_name_the_flag():
    proc = subprocess.run([sys.executable, "-m", "models.sample", "--max-new-tokens", "0"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "--max-new-tokens=0, expected >= 1" in proc.stderr
