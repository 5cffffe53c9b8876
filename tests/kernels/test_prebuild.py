"""JIT-built ops: built once ahead of a run (`python -m kernels.prebuild`, the Makefile's install), and
any build that still happens at run time is announced before it starts."""
import os

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
    assert "building DeepSpeed's cpu_adam op (host optimizer) (cpu_adam, not built yet; ~45 s" in err
    assert "python -m kernels.prebuild" in err
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "other"))
    (tmp_path / "other" / "cpu_adam").mkdir(parents=True)
    (tmp_path / "other" / "cpu_adam" / "cpu_adam.so").write_bytes(b"")
    assert announce_build("cpu_adam", "x") is True and capsys.readouterr().err == ""


def test_a_stale_library_is_announced_as_stale(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    directory = tmp_path / "hybridrl_kda_cpu"
    directory.mkdir()
    source = tmp_path / "kda.cpp"
    source.write_text("// v1")
    (directory / "build.ninja").write_text(f"build kda.o: compile {source}\nbuild hybridrl_kda_cpu.so: link kda.o\n")
    (directory / "hybridrl_kda_cpu.so").write_bytes(b"")
    os.utime(source, (1, 1))
    os.utime(directory / "build.ninja", (1, 1))
    assert is_built("hybridrl_kda_cpu")
    os.utime(source, None)  # edited after the build: torch's ninja compiles again
    assert announce_build("hybridrl_kda_cpu", "the fused CPU kernels") is False
    assert f"stale: {source} changed since the last build" in capsys.readouterr().err


def test_a_build_killed_midway_leaves_no_lock_that_hangs_the_next(tmp_path, monkeypatch, capsys):
    """A real kill: a child takes the holder lock and torch's own build lock (FileBaton) as a build does,
    and is SIGKILLed midway; the next load frees the dead build's lock at once, and torch's baton works."""
    import signal
    import subprocess
    import sys
    import time

    from torch.utils.file_baton import FileBaton

    from kernels.jit import building

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    code = ("import sys, time\nfrom torch.utils.file_baton import FileBaton\nfrom kernels.jit import building\n"
            "with building('cpu_adam', 'x'):\n    assert FileBaton(sys.argv[1]).try_acquire()\n"
            "    print('building', flush=True)\n    time.sleep(60)\n")
    lock = tmp_path / "cpu_adam" / "lock"
    child = subprocess.Popen([sys.executable, "-c", code, str(lock)], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)})
    assert child.stdout.readline() == "building\n" and lock.exists()
    child.send_signal(signal.SIGKILL)
    child.wait()
    start = time.monotonic()
    with building("cpu_adam", "DeepSpeed's cpu_adam op") as built:
        assert not built and not lock.exists()
        assert FileBaton(str(lock)).try_acquire()  # what torch's load does next: it no longer waits forever
    assert time.monotonic() - start < 10
    assert f"removed the stale build lock {lock}" in capsys.readouterr().err


def test_a_run_started_by_hand_uses_the_projects_build_cache_unless_told_otherwise(tmp_path):
    """Without $TORCH_EXTENSIONS_DIR (`python -m rl.train` typed after `make install`), the ops resolve to the
    checkout's `.cache/torch_extensions`, where the install built them, not to ~/.cache (a rebuild of
    minutes); a directory set in the environment is kept."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    code = "from kernels.jit import build_directory; print(build_directory('async_io'))"
    env = {k: v for k, v in os.environ.items() if k != "TORCH_EXTENSIONS_DIR"} | {"HOME": str(tmp_path)}
    by_hand = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True,
                             timeout=120)
    assert by_hand.returncode == 0, by_hand.stderr
    assert Path(by_hand.stdout.strip()) == root / ".cache" / "torch_extensions" / "async_io"
    told = subprocess.run([sys.executable, "-c", code], env=env | {"TORCH_EXTENSIONS_DIR": str(tmp_path / "x")},
                          cwd=root, capture_output=True, text=True, timeout=120)
    assert Path(told.stdout.strip()) == tmp_path / "x" / "async_io", told.stderr
