"""rl.export: an RL run's checkpoint as a transformers kimi_linear directory (logits, shards, errors)."""
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from models.checkpoint import INDEX_FILE, SINGLE_FILE, load_checkpoint
from rl.export import KEEP_FP32_ON_DISK, ExportError, export_checkpoint, parse_size
from rl.export.cli import main
from rl.train import run
from tests.models.conftest import rel_err
from tests.rl.test_config import composed

sys.modules.setdefault("fla", None)  # transformers' torch fallbacks, not fla's kernels (tests/models/hf_reference.py)
from transformers import AutoTokenizer, KimiLinearForCausalLM  # noqa: E402

SMALL = ["tracking.wandb_mode=disabled", "tracking.progress=false", "rollout.groups_per_iteration=2",
         "algo.group_size=2", "rollout.max_new_tokens=2", "experiment.num_threads=1"]
LAST = "iter_000001"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """Two iterations of the single-turn tiny run (the tiny model maps to kimi_linear), exporting each."""
    path = tmp_path_factory.mktemp("run")
    run(composed(f"run_dir={path}", "experiment.iterations=2", "checkpoint.export_every=1", *SMALL))
    return path


def tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an exported directory by name, checking the index when there is one."""
    if (path / INDEX_FILE).exists():
        weight_map = json.loads((path / INDEX_FILE).read_text())["weight_map"]
    else:
        with safe_open(path / SINGLE_FILE, "pt") as f:
            weight_map = {name: SINGLE_FILE for name in f.keys()}
    out = {}
    for file in sorted(set(weight_map.values())):
        with safe_open(path / file, "pt") as f:
            assert sorted(f.keys()) == sorted(n for n, v in weight_map.items() if v == file)
            out.update({name: f.get_tensor(name) for name in f.keys()})
    return out


def batch(vocab_size: int) -> torch.Tensor:
    return torch.randint(0, vocab_size, (3, 41), generator=torch.Generator().manual_seed(0))


def test_fp32_export_loads_into_transformers_with_our_logits(run_dir, tmp_path, capsys):
    assert main([f"run_dir={run_dir}", "dtype=fp32", f"out={tmp_path / 'fp32'}"]) == 0
    out = tmp_path / "fp32"
    assert "byte tokenizer" in capsys.readouterr().out  # the log says which tokenizer was written
    assert {"README.txt", "config.json", "generation_config.json", SINGLE_FILE, "tokenizer.json",
            "tokenizer_config.json"} <= {p.name for p in out.iterdir()}
    tok = AutoTokenizer.from_pretrained(out)  # the byte tokenizer, as transformers loads it
    assert tok("héllo").input_ids == [256, *"héllo".encode()] and tok.decode([256, *"héllo".encode(), 257],
                                                                               skip_special_tokens=True) == "héllo"
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert tok(text, add_special_tokens=False).input_ids == [256, *b"hi"]  # the run's plain rendering
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (256, 257, 258)
    ours = load_checkpoint(run_dir / "checkpoints" / LAST)  # the default iteration: the newest
    hf = KimiLinearForCausalLM.from_pretrained(out).eval()
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "kimi_linear" and config["architectures"] == ["KimiLinearForCausalLM"]
    assert config["dtype"] == config["torch_dtype"] == "float32" and hf.dtype == torch.float32
    ids = batch(ours.config.vocab_size)
    with torch.no_grad():
        expected, actual = ours(ids), hf(input_ids=ids).logits
    assert rel_err(actual, expected) <= 1e-5  # the parity tests' unit (tests/models/test_hf_parity.py)
    assert torch.allclose(actual, expected, atol=1e-4, rtol=0)  # logits of magnitude ~1: fp32 summation order
    gen = json.loads((out / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"], gen["pad_token_id"]) == (256, 257, 258)
    assert (gen["temperature"], gen["top_p"], gen["top_k"]) == (1.0, 1.0, 0)
    assert hf.generation_config.eos_token_id == 257


def test_bf16_export_is_our_weights_rounded_and_close_in_logits(run_dir, tmp_path):
    assert main([f"run_dir={run_dir}", "iteration=0", f"out={tmp_path / 'bf16'}"]) == 0  # bf16 is the default
    source, exported = tensors(run_dir / "checkpoints" / "iter_000000"), tensors(tmp_path / "bf16")
    assert sorted(source) == sorted(exported)
    kept = [name for name in source if name.endswith(KEEP_FP32_ON_DISK)]
    config = load_checkpoint(run_dir / "checkpoints" / "iter_000000").config
    # A_log and dt_bias of each KDA layer, the router's weight and correction bias of each MoE layer
    assert len(kept) == 2 * len(config.kda_layers) + 2 * config.mlp_layer_types.count("moe")
    for name, tensor in source.items():
        assert torch.equal(exported[name], tensor.to(torch.float32 if name in kept else torch.bfloat16)), name
    fp32 = load_checkpoint(run_dir / "checkpoints" / "iter_000000")
    rounded = load_checkpoint(tmp_path / "bf16", dtype=torch.float32)  # the exported weights, computed in fp32
    hf = KimiLinearForCausalLM.from_pretrained(tmp_path / "bf16").eval()
    hf_fp32 = KimiLinearForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.float32).eval()
    assert hf.dtype == torch.bfloat16  # config.json's dtype
    ids = batch(fp32.config.vocab_size)
    with torch.no_grad():
        assert rel_err(hf_fp32(input_ids=ids).logits, rounded(ids)) <= 1e-5  # the same weights read back
        # bf16 tolerance: what our own bf16 run of these weights is off fp32 (this tiny random model is
        # sensitive: ~0.3; transformers' bf16 run ~0.2)
        tolerance = rel_err(load_checkpoint(tmp_path / "bf16", dtype=torch.bfloat16)(ids).float(), fp32(ids))
        assert rel_err(hf(input_ids=ids).logits.float(), fp32(ids)) <= 1.5 * tolerance


def test_a_small_shard_size_writes_several_shards_and_a_correct_index(run_dir, tmp_path):
    assert main([f"run_dir={run_dir}", "dtype=fp32", "max_shard_size=40KB", f"out={tmp_path / 's'}"]) == 0
    out = tmp_path / "s"
    index = json.loads((out / INDEX_FILE).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 3 and not (out / SINGLE_FILE).exists()
    assert files == [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))]
    assert sorted(p.name for p in out.glob("*.safetensors")) == files
    exported = tensors(out)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in exported.values())
    for file in files:  # each shard under the limit, or one tensor larger than it
        with safe_open(out / file, "pt") as f:
            sizes = [f.get_tensor(n).numel() * 4 for n in f.keys()]
        assert sum(sizes) <= 40_000 or len(sizes) == 1
    source = tensors(run_dir / "checkpoints" / LAST)
    assert sorted(exported) == sorted(source) and all(torch.equal(exported[n], source[n]) for n in source)
    hf = KimiLinearForCausalLM.from_pretrained(out).eval()
    ids = batch(259)
    with torch.no_grad():
        assert rel_err(hf(input_ids=ids).logits, load_checkpoint(run_dir / "checkpoints" / LAST)(ids)) <= 1e-5


def test_the_loop_exports_every_n_iterations(run_dir, tmp_path):
    """checkpoint.export_every=1: each published iteration also lies in run_dir/export, in bf16, with
    the bytes the command writes."""
    assert sorted(p.name for p in (run_dir / "export").iterdir()) == ["iter_000000", LAST]
    assert main([f"run_dir={run_dir}", f"out={tmp_path / 'cli'}"]) == 0
    hook, cli = tensors(run_dir / "export" / LAST), tensors(tmp_path / "cli")
    assert sorted(hook) == sorted(cli) and all(torch.equal(hook[n], cli[n]) for n in cli)
    assert json.loads((run_dir / "export" / LAST / "config.json").read_text())["dtype"] == "bfloat16"
    assert not list(run_dir.glob("export/.tmp_*"))


def test_a_hugging_face_tokenizer_directory_is_copied_without_its_model_files(run_dir, tmp_path):
    from tokenizers import Tokenizer, models
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "a": 1, "b": 2}
    fast = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")),
                                   unk_token="<unk>")
    source = tmp_path / "tok"
    fast.save_pretrained(source)
    (source / "config.json").write_text("{}")  # a model directory's own files are not the tokenizer's
    (source / SINGLE_FILE).write_bytes(b"not copied")
    out = tmp_path / "out"
    export_checkpoint(run_dir / "checkpoints" / LAST, out, tokenizer=str(source))
    copied = sorted(p.name for p in source.iterdir() if p.name not in ("config.json", SINGLE_FILE))
    assert sorted(p.name for p in out.iterdir()) == sorted(
        copied + ["README.txt", "config.json", "generation_config.json", SINGLE_FILE])
    assert json.loads((out / "config.json").read_text())["model_type"] == "kimi_linear"
    assert AutoTokenizer.from_pretrained(out).convert_tokens_to_ids("b") == 2


def refused(capsys, *argv: str) -> str:
    assert main(list(argv)) == 2
    return capsys.readouterr().err


def test_bad_arguments_are_refused_naming_the_value(run_dir, tmp_path, capsys):
    assert "run_dir is missing" in refused(capsys, "dtype=fp32")
    assert "run_dir='/no/such/run' is not a directory" in refused(capsys, "run_dir=/no/such/run")
    assert "holds no complete checkpoint" in refused(capsys, f"run_dir={tmp_path}")
    assert "iteration=7: no checkpoint iter_000007" in (err := refused(capsys, f"run_dir={run_dir}", "iteration=7"))
    assert "available: 0, 1" in err
    assert "iteration='two', expected an integer" in refused(capsys, f"run_dir={run_dir}", "iteration=two")
    assert "dtype='fp16', expected one of ['bf16', 'fp32']" in refused(capsys, f"run_dir={run_dir}", "dtype=fp16")
    assert "max_shard_size='5XB', expected a positive size" in refused(capsys, f"run_dir={run_dir}",
                                                                       "max_shard_size=5XB")
    assert "argument 'shard=5GB', expected key=value with key one of" in refused(capsys, f"run_dir={run_dir}",
                                                                               "shard=5GB")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    assert "exists and is not an empty directory" in refused(capsys, f"run_dir={run_dir}", f"out={tmp_path / 'full'}")
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine"
    (tmp_path / "empty").mkdir()  # an empty directory is filled
    assert main([f"run_dir={run_dir}", f"out={tmp_path / 'empty'}"]) == 0 and (tmp_path / "empty/config.json").exists()


def test_sizes_parse_like_transformers_max_shard_size():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 * 2**30 and parse_size("500mb") == 5 * 10**8
    assert parse_size("1.5KB") == 1500 and parse_size("123") == 123
    for bad in ("0", "-1GB", "GB", "5 XB", ""):
        with pytest.raises(ExportError, match="max_shard_size"):
            parse_size(bad)


def test_a_damaged_checkpoint_is_refused_and_a_failed_export_leaves_nothing(run_dir, tmp_path, capsys):
    copy = tmp_path / "run"
    shutil.copytree(run_dir / "checkpoints", copy / "checkpoints")
    weights = copy / "checkpoints" / LAST / SINGLE_FILE
    weights.write_bytes(weights.read_bytes()[:-4] + b"\0\0\0\0")
    err = refused(capsys, f"run_dir={copy}", "iteration=1", f"out={tmp_path / 'o'}")
    assert f"iteration=1: checkpoint {copy / 'checkpoints' / LAST} does not verify" in err and SINGLE_FILE in err
    # the default is the newest that verifies: iteration 0, the damaged one named on stderr
    assert main([f"run_dir={copy}", f"out={tmp_path / 'o'}"]) == 0
    assert f"skipping checkpoint {copy / 'checkpoints' / LAST}" in capsys.readouterr().err
    with pytest.raises(ExportError, match="tokenizer='/no/tok'"):  # fails after the temporary directory exists
        export_checkpoint(run_dir / "checkpoints" / LAST, tmp_path / "x", tokenizer="/no/tok")
    assert not (tmp_path / "x").exists() and not list(tmp_path.glob(".tmp_*"))


def test_models_transformers_would_compute_differently_are_refused(run_dir, tmp_path):
    checkpoint = tmp_path / "gated"
    shutil.copytree(run_dir / "checkpoints" / LAST, checkpoint)
    config = json.loads((checkpoint / "config.json").read_text())
    for key, value, message in (("mla_output_gate", True, "mla_output_gate=True"),
                                ("mla_use_nope", False, "mla_use_nope=False")):
        (checkpoint / "config.json").write_text(json.dumps({**config, key: value}))
        with pytest.raises(ExportError, match=message):
            export_checkpoint(checkpoint, tmp_path / "out")
        assert not (tmp_path / "out").exists()


def test_export_every_must_be_positive():
    with pytest.raises(ValueError, match=r"checkpoint\.export_every=0, expected >= 1 or null"):
        composed("checkpoint.export_every=0")


def test_an_export_carries_its_tokenizers_ids_and_transformers_generate_stops_at_its_eos(run_dir, tmp_path):
    """A run with a Hugging Face tokenizer (bos 0, eos 1, pad 2, <|im_end|> 4 ending a chat turn): the export's
    config.json and generation_config.json carry those ids, not the byte tokenizer's 256/257/258, so
    transformers' generate stops when the model emits eos (forced here after two new tokens)."""
    from transformers import LogitsProcessor, LogitsProcessorList

    from tests.tokenizer_dirs import BOS, EOS, IM_END, PAD, build_bpe_tokenizer

    source = build_bpe_tokenizer(tmp_path / "tok")
    out = export_checkpoint(run_dir / "checkpoints" / LAST, tmp_path / "out", dtype="fp32", tokenizer=str(source))
    config, gen = (json.loads((out / name).read_text()) for name in ("config.json", "generation_config.json"))
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (BOS, EOS, PAD)
    assert (gen["bos_token_id"], gen["pad_token_id"]) == (BOS, PAD) and set(gen["eos_token_id"]) == {EOS, IM_END}

    class EosAfterTwo(LogitsProcessor):
        def __call__(self, input_ids, scores):
            if input_ids.shape[1] >= 5:
                scores = torch.full_like(scores, float("-inf"))
                scores[:, EOS] = 0.0
            return scores

    hf = KimiLinearForCausalLM.from_pretrained(out).eval()
    prompt = torch.tensor([[BOS, 10, 11]])
    with torch.no_grad():
        ids = hf.generate(prompt, max_new_tokens=12, do_sample=False, logits_processor=LogitsProcessorList([EosAfterTwo()]))
    assert ids.shape[1] == 6 and ids[0, -1].item() == EOS  # two tokens, then eos, then it stopped
    assert AutoTokenizer.from_pretrained(out).eos_token_id == EOS
