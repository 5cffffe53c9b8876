"""JIT-built ops: built once ahead of a run (`python -m kernels.prebuild`, the Makefile's install), and
any build that still happens at run time is announced before it starts."""
from kernels import prebuild
from kernels.jit import announce_build, is_built


def test_prebuild_leaves_every_op_built_in_the_projects_cache():
    # (no capsys here: DeepSpeed's compatibility probe needs the real stderr file descriptor)
    assert prebuild.main() == 0
    assert [name for name, _, _ in prebuild.OPS if not is_built(name)] == []


def test_a_build_at_run_time_is_announced_first(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # an empty cache: nothing built here
    assert not is_built("cpu_adam")
    assert announce_build("cpu_adam", "DeepSpeed's cpu_adam op (host optimizer)") is False
    err = capsys.readouterr().err
    assert "building DeepSpeed's cpu_adam op (host optimizer) (cpu_adam, once: ~45 s" in err
    assert "python -m kernels.prebuild" in err
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "other"))
    (tmp_path / "other" / "cpu_adam").mkdir(parents=True)
    (tmp_path / "other" / "cpu_adam" / "cpu_adam.so").write_bytes(b"")
    assert announce_build("cpu_adam", "x") is True and capsys.readouterr().err == ""
