"""Data rows from files (rl/envs/data.py): formats, load errors, the sampler's order and resume position."""
import json
import re

import pytest

from rl.envs.data import DataConfig, DataExhausted, RowSampler, load_rows


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


RECORDS = [{"question": f"q{i}?", "answer": str(i), "source": "s"} for i in range(5)]


def test_jsonl_rows_take_the_configured_columns(tmp_path):
    config = DataConfig(train_files=[write_jsonl(tmp_path / "a.jsonl", RECORDS)], prompt_key="question",
                        label_key="answer", extra_keys=["source"])
    rows = load_rows(config.train_files, config).rows
    assert rows == [{"prompt": f"q{i}?", "label": str(i), "source": "s"} for i in range(5)]


def test_chat_prompts_and_no_label(tmp_path):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]
    path = write_jsonl(tmp_path / "c.jsonl", [{"prompt": messages}])
    rows = load_rows([path], DataConfig(train_files=[path], label_key=None)).rows
    assert rows == [{"prompt": messages, "label": None}]


def test_jsonl_parquet_and_dataset_directories_give_the_same_rows(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq
    records = [{"question": [{"role": "user", "content": f"{i}+1?"}], "answer": str(i + 1), "source": "s",
                "unused": i} for i in range(4)]
    config = DataConfig(train_files=["x"], prompt_key="question", label_key="answer", extra_keys=["source"])
    jsonl = write_jsonl(tmp_path / "a.jsonl", records)
    parquet = str(tmp_path / "a.parquet")
    pq.write_table(pa.Table.from_pylist(records), parquet)
    saved = str(tmp_path / "saved")
    datasets.Dataset.from_list(records).save_to_disk(saved)
    expected = [{"prompt": r["question"], "label": r["answer"], "source": "s"} for r in records]
    for path in (jsonl, parquet, saved):
        assert load_rows([path], config).rows == expected, path
    assert load_rows([jsonl, parquet], config).rows == expected + expected
    datasets.DatasetDict(train=datasets.Dataset.from_list(records)).save_to_disk(str(tmp_path / "splits"))
    with pytest.raises(ValueError, match=r"holds splits \['train'\].*splits/<split>"):
        load_rows([str(tmp_path / "splits")], config)
    pq.write_table(pa.Table.from_pylist([{"question": "q"}]), str(tmp_path / "b.parquet"))
    with pytest.raises(ValueError, match=r"b\.parquet, row 0: no key 'answer'"):
        load_rows([str(tmp_path / "b.parquet")], config)


def test_parquet_and_dataset_directories_name_their_missing_library(tmp_path, monkeypatch):
    for name, library in (("a.parquet", "pyarrow.parquet"), ("saved", "datasets")):
        monkeypatch.setitem(__import__("sys").modules, library, None)  # import fails as if not installed
        path = tmp_path / name
        path.mkdir() if name == "saved" else path.write_bytes(b"PAR1")
        with pytest.raises(ValueError, match=library.split(".")[0]):
            load_rows([str(path)], DataConfig(train_files=[str(path)]))


def test_load_errors_name_the_file_row_and_key(tmp_path):
    good = write_jsonl(tmp_path / "g.jsonl", [{"prompt": "p", "label": 1}])
    config = DataConfig(train_files=[good])
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_rows([str(tmp_path / "nope.jsonl")], config)
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match=r"x\.csv.*unknown extension"):
        load_rows([str(tmp_path / "x.csv")], config)
    bad = write_jsonl(tmp_path / "b.jsonl", [{"prompt": "p", "label": 1}, {"prompt": "p"}])
    with pytest.raises(ValueError, match=r"b\.jsonl, line 2: no key 'label'"):
        load_rows([bad], config)
    extra = DataConfig(train_files=[good], extra_keys=["source"])
    with pytest.raises(ValueError, match=r"g\.jsonl, line 1: no key 'source'"):
        load_rows([good], extra)
    (tmp_path / "e.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="no rows"):
        load_rows([str(tmp_path / "e.jsonl")], config)
    wrong = write_jsonl(tmp_path / "w.jsonl", [{"prompt": 3, "label": 1}])
    with pytest.raises(ValueError, match=r"w\.jsonl, line 1: prompt=3, expected a string"):
        load_rows([wrong], config)


@pytest.mark.parametrize("bad, match", [({"epochs": 0}, "epochs=0"), ({"max_prompt_tokens": -1}, "max_prompt_tokens=-1"),
                                        ({"train_files": 3}, "train_files=3"), ({"val_files": [""]}, "val_files=\[''\]"),
                                        ({"extra_keys": ["label"]}, "extra_keys"), ({"prompt_key": ""}, "prompt_key")])
def test_config_rejects_bad_values_by_name(bad, match):
    with pytest.raises(ValueError, match=match):
        DataConfig(**bad)


def test_max_prompt_tokens_drops_and_counts(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "x" * n, "label": n} for n in (1, 5, 2, 9)])
    config = DataConfig(train_files=[path], max_prompt_tokens=3)
    with pytest.raises(ValueError, match="encode"):
        load_rows([path], config)
    loaded = load_rows([path], config, encode=lambda p: list(p.encode()))
    assert [r["label"] for r in loaded.rows] == [1, 2] and loaded.num_dropped_too_long == 2


def test_sampler_order_is_deterministic_and_each_epoch_a_permutation():
    rows = [{"prompt": str(i), "label": i} for i in range(7)]
    a, b = RowSampler(rows, seed=3), RowSampler(rows, seed=3)
    first = [a[i]["label"] for i in range(21)]
    assert first == [b.take()["label"] for _ in range(21)]
    for epoch in range(3):
        assert sorted(first[7 * epoch:7 * epoch + 7]) == list(range(7))
    assert first[:7] != first[7:14]  # reshuffled per epoch
    assert first[:7] != [RowSampler(rows, seed=4)[i]["label"] for i in range(7)]
    assert [RowSampler(rows, shuffle=False)[i]["label"] for i in range(9)] == [0, 1, 2, 3, 4, 5, 6, 0, 1]


def test_sampler_resume_continues_the_epoch_and_stops_after_the_last():
    rows = [{"prompt": str(i), "label": i} for i in range(5)]
    a = RowSampler(rows, seed=1, epochs=2)
    head = [a.take()["label"] for _ in range(7)]
    state = a.state_dict()
    assert state == {"epoch": 1, "index": 2}
    b = RowSampler(rows, seed=1, epochs=2)
    b.load_state_dict(state)
    tail = [b.take()["label"] for _ in range(3)]
    assert head + tail == [RowSampler(rows, seed=1)[i]["label"] for i in range(10)]
    with pytest.raises(DataExhausted, match="2 epoch"):
        b.take()
    assert b.position == 10
    with pytest.raises(ValueError, match="index"):
        b.load_state_dict({"epoch": 0, "index": 5})


def test_the_data_command_previews_each_split_and_scores_the_labels(tmp_path, monkeypatch, capsys):
    from rl.data import main
    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "train.jsonl", [{"q": f"{i}+1", "a": str(i + 1)} for i in range(5)])
    write_jsonl(tmp_path / "val.jsonl", [{"q": "9+1", "a": "10"}])
    (tmp_path / "reward.py").write_text("def compute_score(solution_str, ground_truth, extra_info=None):\n"
                                        "    return float(solution_str == ground_truth and ground_truth != '3')\n")
    args = ["experiment=single_turn", "task=scored", "data.train_files=[train.jsonl]", "data.val_files=[val.jsonl]",
            "data.prompt_key=q", "data.label_key=a", "task.params.reward_path=reward.py", "data.max_prompt_tokens=4"]
    assert main(args) == 0
    out = capsys.readouterr().out
    # byte tokenizer: bos + the text; "0+1".."4+1" are 4 tokens, "9+1" too; label "3" scores 0 (1 row in 5)
    assert "rows=5  dropped_too_long=0  prompt_tokens_min=4" in out and "reward_of_label_as_answer=0.8" in out
    assert "val: val.jsonl" in out and "| 9+1" in out and "its label: '10'" in out
    assert main([*args, "data.max_prompt_tokens=3"]) == 2
    assert "no rows in ['train.jsonl'] (5 longer than max_prompt_tokens=3)" in capsys.readouterr().err
    assert main(["experiment=single_turn"]) == 2
    assert "data.train_files and data.val_files are empty" in capsys.readouterr().err


def test_the_data_command_refuses_a_tokenizer_larger_than_the_model_as_the_run_does(tmp_path, monkeypatch, capsys):
    from rl.data import main
    from tests.tokenizer_dirs import build_bpe_tokenizer

    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "train.jsonl", [{"prompt": "1+1", "label": "2"}])
    (tmp_path / "reward.py").write_text("def compute_score(solution_str, ground_truth):\n    return 1.0\n")
    tok = build_bpe_tokenizer(tmp_path / "tok")  # ~310 tokens; the tiny model embeds 259
    assert main(["experiment=single_turn", "task=scored", "data.train_files=[train.jsonl]",
                 "task.params.reward_path=reward.py", f"tokenizer.path={tok}"]) == 2
    assert re.search(r"has 3\d\d tokens but the model's vocab_size is 259", capsys.readouterr().err)
