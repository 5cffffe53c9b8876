"""A spill directory belongs to one live store: the lock file, its holder, and per-run subdirectories."""
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from memory.nvme_store import LOCK_FILE, NvmeStore, NvmeStoreConfig, SpillDirLocked, owner_directory

CFG = NvmeStoreConfig(backend="buffered", chunk_bytes=1 << 20)
REPO = Path(__file__).resolve().parents[2]


def test_a_second_store_on_a_held_directory_is_refused_naming_the_holder(tmp_path):
    first = NvmeStore(tmp_path, CFG, owner="run A")
    first.spill("g", {"x": torch.arange(10.0)})
    (tmp_path / "g2.tmp").write_bytes(b"half written")  # as if A were in the middle of a spill
    with pytest.raises(SpillDirLocked, match="in use by another store .*run A") as err:
        NvmeStore(tmp_path, CFG, owner="run B")
    assert "run A" in err.value.holder
    assert (tmp_path / "g2.tmp").exists(), "the refused store must not clean the holder's temp files"
    assert torch.equal(first.restore("g")["x"], torch.arange(10.0))
    first.close()
    second = NvmeStore(tmp_path, CFG, owner="run B")  # released: taken, and the stale temp file removed
    assert not (tmp_path / "g2.tmp").exists() and second.names() == ["g"]
    assert "run B" in (tmp_path / LOCK_FILE).read_text()
    second.close()


def test_the_lock_of_a_dead_process_is_free(tmp_path):
    """A crashed run leaves its lock file, not its lock: the next run takes the directory."""
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(REPO)!r})
        from memory.nvme_store import NvmeStore, NvmeStoreConfig
        store = NvmeStore({str(tmp_path)!r}, NvmeStoreConfig(backend="buffered", chunk_bytes=1 << 20), owner="child")
        print("held", flush=True)
        time.sleep(60)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "held"
        with pytest.raises(SpillDirLocked, match=f"pid {child.pid} .*child"):
            NvmeStore(tmp_path, CFG)
    finally:
        child.kill()
        child.wait()
    NvmeStore(tmp_path, CFG).close()


def test_each_owner_gets_its_own_subdirectory(tmp_path):
    a, b = owner_directory(tmp_path, "runs/a"), owner_directory(tmp_path, "runs/b")
    assert a != b and a.parent == b.parent == tmp_path and a.name.startswith("a-")
    assert owner_directory(tmp_path, "runs/a") == a  # the same run finds its own again (resume)
    with NvmeStore(a, CFG), NvmeStore(b, CFG):  # two runs sharing the root: no conflict
        pass
