"""HF checkpoint directories: round trip with transformers' files, sharding, and strict errors."""
import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from models.checkpoint import INDEX_FILE, SINGLE_FILE, CheckpointError, load_checkpoint, save_checkpoint
from models.config import ModelConfig


def read_all(path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory, single-file or sharded, by on-disk name."""
    if (path / INDEX_FILE).exists():
        files = set(json.loads((path / INDEX_FILE).read_text())["weight_map"].values())
    else:
        files = {SINGLE_FILE}
    out = {}
    for f in files:
        out.update(load_file(path / f))
    return out


def assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert a[name].shape == b[name].shape, name
        assert torch.equal(a[name], b[name]), name


def test_transformers_checkpoint_round_trips_with_identical_tensors(hf_checkpoint, tmp_path):
    src, _ = hf_checkpoint(True, None, 4)
    model = load_checkpoint(src)
    save_checkpoint(model, tmp_path / "ours")
    assert_same_tensors(read_all(tmp_path / "ours"), read_all(src))
    # and our config.json describes the same model
    assert load_checkpoint(tmp_path / "ours").config == model.config


def test_our_checkpoint_loads_into_transformers(hf_checkpoint, tmp_path):
    from transformers import KimiLinearForCausalLM

    src, hf = hf_checkpoint(True, None, 4)
    save_checkpoint(load_checkpoint(src), tmp_path / "ours")
    reloaded = KimiLinearForCausalLM.from_pretrained(tmp_path / "ours").eval()
    ids = torch.randint(3, 97, (1, 9))
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=ids).logits, hf(input_ids=ids).logits)


def test_sharded_save_and_load(hf_checkpoint, tmp_path):
    src, _ = hf_checkpoint(True, None, 4)
    model = load_checkpoint(src)
    out = save_checkpoint(model, tmp_path / "sharded", max_shard_bytes=20_000)
    index = json.loads((out / INDEX_FILE).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 3 and not (out / SINGLE_FILE).exists()
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in read_all(src).values())
    assert_same_tensors(read_all(out), read_all(src))
    # saving the same model unsharded into the same directory removes the stale shards and index
    save_checkpoint(load_checkpoint(out), out)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", SINGLE_FILE]
    assert_same_tensors(read_all(out), read_all(src))


def copy_with_tensors(src, dst, edit) -> None:
    shutil.copytree(src, dst)
    tensors = load_file(dst / SINGLE_FILE)
    edit(tensors)
    save_file(tensors, dst / SINGLE_FILE)


def test_missing_tensor_is_named_with_its_shape(hf_checkpoint, tmp_path):
    src, _ = hf_checkpoint(True, None, 4)
    name = "model.layers.1.block_sparse_moe.experts.3.w2.weight"
    copy_with_tensors(src, tmp_path / "c", lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=r"missing tensors \(1\): " + name.replace(".", r"\.") + r" \(expected shape \[48, 24\]\)"):
        load_checkpoint(tmp_path / "c")


def test_extra_tensor_is_named(hf_checkpoint, tmp_path):
    src, _ = hf_checkpoint(True, None, 4)
    copy_with_tensors(src, tmp_path / "c", lambda t: t.update({"model.layers.0.self_attn.bogus": torch.zeros(3, 2)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensors \(1\): model\.layers\.0\.self_attn\.bogus \(shape \[3, 2\]\)"):
        load_checkpoint(tmp_path / "c")


def test_misshaped_tensor_reports_expected_and_actual(hf_checkpoint, tmp_path):
    src, _ = hf_checkpoint(True, None, 4)
    name = "model.layers.0.self_attn.A_log"

    def edit(t):
        t[name] = torch.zeros(2)

    copy_with_tensors(src, tmp_path / "c", edit)
    with pytest.raises(CheckpointError, match=r"A_log: expected shape \[1, 1, 2, 1\], found \[2\]"):
        load_checkpoint(tmp_path / "c")


def test_unknown_layer_type_is_a_clear_error(hf_checkpoint, tmp_path):
    src, _ = hf_checkpoint(True, None, 4)
    shutil.copytree(src, tmp_path / "c")
    cfg = json.loads((tmp_path / "c/config.json").read_text())
    cfg["layer_types"][2] = "sliding_attention"
    (tmp_path / "c/config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"unknown layer type 'sliding_attention' for layer 2"):
        load_checkpoint(tmp_path / "c")
    with pytest.raises(ValueError, match=r"unknown layer type 'mamba' at mlp_layer_types\[1\]"):
        ModelConfig(**{**ModelConfig.from_hf_dict(json.loads((src / "config.json").read_text())).to_dict(),
                       "mlp_layer_types": ["dense", "mamba", "moe", "moe"]})


def test_missing_shard_is_reported(hf_checkpoint, tmp_path):
    src, _ = hf_checkpoint(True, None, 4)
    out = save_checkpoint(load_checkpoint(src), tmp_path / "s", max_shard_bytes=20_000)
    victim = sorted(out.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=victim.name):
        load_checkpoint(out)


def test_dtype_conversion_keeps_precision_sensitive_tensors_fp32(hf_checkpoint):
    src, _ = hf_checkpoint(True, None, 4)
    model = load_checkpoint(src, dtype=torch.bfloat16)
    sd = model.state_dict()
    assert sd["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    for name in ("model.layers.0.self_attn.dt_bias", "model.layers.0.self_attn.A_log",
                 "model.layers.1.mlp.gate.weight", "model.layers.1.mlp.gate.e_score_correction_bias"):
        assert sd[name].dtype == torch.float32, name
    with safe_open(src / SINGLE_FILE, "pt") as f:
        assert torch.equal(sd["model.layers.0.self_attn.dt_bias"], f.get_tensor("model.layers.0.self_attn.dt_bias"))


def test_bf16_model_runs_with_fp32_recurrent_state(hf_checkpoint):
    """bf16 weights: logits stay near fp32 (bf16 rounding only), KDA states stay float32."""
    src, _ = hf_checkpoint(True, None, 4)
    fp32, bf16 = load_checkpoint(src), load_checkpoint(src, dtype=torch.bfloat16)
    ids = torch.randint(3, 97, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = fp32(ids)
        out = bf16.forward_with_state([ids[0]])
    assert out.logits[0].dtype == torch.bfloat16
    err = ((out.logits[0].float() - expected[0]).norm() / expected[0].norm()).item()
    assert err < 0.15  # transformers' own bf16 run of these weights is ~5e-2 off its fp32 run
    assert out.states[0].kda[0].recurrent.dtype == torch.float32
    assert out.states[0].mla[3].dtype == torch.bfloat16


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600)])
def test_weight_files_get_the_mode_the_umask_gives(hf_checkpoint, tmp_path, umask, mode):
    import os
    import stat

    src, _ = hf_checkpoint(True, None, 4)
    before = os.umask(umask)
    try:
        out = save_checkpoint(load_checkpoint(src), tmp_path / "out", max_shard_bytes=20_000)
    finally:
        os.umask(before)
    files = sorted(out.iterdir())
    assert any(f.suffix == ".safetensors" for f in files)
    assert {f.name: stat.S_IMODE(f.stat().st_mode) for f in files} == {f.name: mode for f in files}
