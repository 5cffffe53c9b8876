"""Host-DRAM ledger: refusals name who holds what and change nothing; events replay to the holdings."""
import threading

import pytest

from memory.host_ledger import HostBudgetExceeded, HostLedger, LedgerEvent, mem_available_bytes


def test_over_lease_names_consumer_asked_free_and_holdings_and_changes_nothing():
    ledger = HostLedger(budget_bytes=1000)
    ledger.lease("train_states", 600)
    ledger.lease("reference", 150)
    before = (ledger.holdings(), ledger.held(), ledger.free, list(ledger.events))
    with pytest.raises(HostBudgetExceeded) as err:
        ledger.lease("kv_pool", 300)
    message = str(err.value)
    for words in ("'kv_pool'", "asked 300 B", "only 250 B", "1000 B", "reference=150 B", "train_states=600 B"):
        assert words in message, message
    assert (err.value.consumer, err.value.asked, err.value.free) == ("kv_pool", 300, 250)
    assert err.value.holdings == {"train_states": 600, "reference": 150}
    assert (ledger.holdings(), ledger.held(), ledger.free, list(ledger.events)) == before
    assert not ledger.try_lease("kv_pool", 251)
    assert (ledger.holdings(), list(ledger.events)) == (before[0], before[3])
    assert ledger.try_lease("kv_pool", 250) and ledger.free == 0
    ledger.check_integrity()


def test_release_more_than_held_is_an_error_and_changes_nothing():
    ledger = HostLedger(budget_bytes=100)
    ledger.lease("kv_pool", 40)
    with pytest.raises(ValueError, match="'kv_pool' releases 41 B but holds only 40 B"):
        ledger.release("kv_pool", 41)
    with pytest.raises(ValueError, match="'nobody' releases 1 B but holds only 0 B"):
        ledger.release("nobody", 1)
    assert ledger.holdings() == {"kv_pool": 40} and len(ledger.events) == 1
    ledger.release("kv_pool", 40)
    assert ledger.holdings() == {} and ledger.held("kv_pool") == 0 and ledger.free == 100
    ledger.check_integrity()


@pytest.mark.parametrize("call, args, words", [
    ("lease", ("kv_pool", -1), "nbytes=-1"),
    ("release", ("kv_pool", -5), "nbytes=-5"),
    ("try_lease", ("kv_pool", -1), "nbytes=-1"),
    ("lease", ("", 10), "non-empty string"),
    ("lease", (None, 10), "non-empty string"),
    ("lease", ("kv_pool", 1.5), "nbytes=1.5"),
    ("lease", ("kv_pool", True), "nbytes=True"),
])
def test_bad_arguments_are_clear_errors(call, args, words):
    ledger = HostLedger(budget_bytes=100)
    with pytest.raises(ValueError, match=words.replace("(", r"\(")):
        getattr(ledger, call)(*args)
    assert ledger.events == []


def test_bad_budget_and_reserve():
    with pytest.raises(ValueError, match="budget_bytes=-1"):
        HostLedger(budget_bytes=-1)
    with pytest.raises(ValueError, match="reserve_fraction=1.0"):
        HostLedger(reserve_fraction=1.0)


def test_events_are_recorded_in_order_with_running_totals():
    ledger = HostLedger(budget_bytes=10_000)
    ledger.lease("train_states", 4000)
    ledger.release("train_states", 3000)
    ledger.lease("kv_pool", 5000)
    ledger.lease("train_states", 0)  # a no-op records nothing
    ledger.release("kv_pool", 5000)
    got = [(e.consumer, e.delta, e.held_after, e.total_after) for e in ledger.events]
    assert got == [("train_states", 4000, 4000, 4000), ("train_states", -3000, 1000, 1000),
                   ("kv_pool", 5000, 5000, 6000), ("kv_pool", -5000, 0, 1000)]
    times = [e.time_s for e in ledger.events]
    assert times == sorted(times) and times[0] >= 0
    assert ledger.holdings() == {"train_states": 1000} and ledger.held() == 1000
    ledger.check_integrity()
    ledger.events[1] = LedgerEvent(times[1], "train_states", -3000, 999, 1000)  # a corrupted record
    with pytest.raises(RuntimeError, match="event 1"):
        ledger.check_integrity()


def _meminfo_available_bytes() -> int:
    with open("/proc/meminfo") as f:
        fields = dict(line.split(":", 1) for line in f)
    value, unit = fields["MemAvailable"].split()
    assert unit == "kB"
    return int(value) * 1024


def test_default_budget_is_mem_available_less_the_reserve(monkeypatch):
    """Deterministic: MemAvailable is read from a fixed /proc/meminfo stand-in (the real one moves
    while other processes run), and the real file parses to a positive number."""
    import memory.host_ledger as hl

    read = []
    monkeypatch.setattr(hl, "mem_available_bytes", lambda *a: read.append(a) or 8 << 30)
    ledger = HostLedger(reserve_fraction=0.25)
    assert read and ledger.budget_bytes == int((8 << 30) * 0.75)
    monkeypatch.undo()
    assert mem_available_bytes() > 0 and _meminfo_available_bytes() > 0


def test_meminfo_parse_and_missing_file(tmp_path):
    fake = tmp_path / "meminfo"
    fake.write_text("MemTotal:       2048 kB\nMemFree:  100 kB\nMemAvailable:   1024 kB\n")
    assert mem_available_bytes(fake) == 1024 * 1024
    fake.write_text("MemTotal:       2048 kB\n")
    with pytest.raises(RuntimeError, match="no MemAvailable line"):
        mem_available_bytes(fake)
    with pytest.raises(RuntimeError, match="pass budget_bytes"):
        mem_available_bytes(tmp_path / "missing")


def test_concurrent_leases_and_releases_keep_totals_exact():
    ledger = HostLedger(budget_bytes=1 << 40)
    num_threads, rounds = 8, 2000
    barrier = threading.Barrier(num_threads)

    def work(t: int) -> None:
        barrier.wait()
        for i in range(rounds):
            ledger.lease(f"c{t % 3}", i + 1)
            if i % 2:
                ledger.release(f"c{t % 3}", i)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(num_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    per_thread = sum(i + 1 for i in range(rounds)) - sum(i for i in range(rounds) if i % 2)
    expected = {f"c{c}": per_thread * sum(1 for t in range(num_threads) if t % 3 == c) for c in range(3)}
    assert ledger.holdings() == expected and ledger.held() == sum(expected.values())
    assert len(ledger.events) == num_threads * (rounds + rounds // 2)
    assert [e.total_after for e in ledger.events][-1] == ledger.held()
    ledger.check_integrity()  # the replay of the interleaved events matches every running figure


def test_concurrent_leases_never_exceed_the_budget():
    ledger = HostLedger(budget_bytes=1000)
    granted = []

    def work() -> None:
        granted.append(sum(ledger.try_lease("kv_pool", 7) for _ in range(100)))

    threads = [threading.Thread(target=work) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert sum(granted) == 1000 // 7 and ledger.held() == 7 * (1000 // 7)
    ledger.check_integrity()
