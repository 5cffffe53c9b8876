"""Hung environment calls leak nothing: a call past env.timeout_s is ended (interrupted in its thread), so
20 hung calls leave no thread beyond the pool's own workers (none once it is closed); a call blocked inside C, which Python cannot interrupt, is counted and
bounded, and the calls behind it fail at once instead of waiting forever."""
import os
import threading
import time

from rl.episodes.env_runner import EnvRunner, EnvTimeout, call_with_timeout

HUNG = [  # Python-level hangs, each a different shape
    "while True:\n    pass",
    "import time\nwhile True:\n    time.sleep(0.01)",
    "while True:\n    try:\n        sum(range(1000))\n    except Exception:\n        pass",  # swallows Exception
    "import threading\nwhile True:\n    threading.Event().wait(0.02)",
]


def hang(i: int):
    return lambda: exec(HUNG[i % len(HUNG)], {})


def threads_now() -> tuple[int, int]:
    """(Python threads, OS threads of this process)."""
    return threading.active_count(), len(os.listdir("/proc/self/task"))


def settled(baseline: tuple[int, int], timeout_s: float = 10.0) -> bool:
    """True once this process has no more threads than at `baseline` (waiting up to `timeout_s`)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        now = threads_now()
        if now[0] <= baseline[0] and now[1] <= baseline[1]:
            return True
        time.sleep(0.05)
    return False


def collect_all(runner: EnvRunner, timeout_s: float = 30.0) -> dict:
    done, end = {}, time.monotonic() + timeout_s
    while runner.pending and time.monotonic() < end:
        runner.wait(0.1)
        done.update(runner.collect())
    return done


def test_twenty_hung_calls_on_the_pool_leave_no_thread():
    baseline = threads_now()
    runner = EnvRunner(workers=4, timeout_s=0.2)
    for i in range(20):
        runner.submit(i, hang(i))
    runner.submit("fine", lambda: 6 * 7)
    done = collect_all(runner)
    assert sorted(k for k in done if k != "fine") == list(range(20))
    assert all(isinstance(done[i], EnvTimeout) for i in range(20)) and done["fine"] == 42
    assert runner.num_timeouts == 20
    for _ in range(30):  # the caller keeps collecting (as the driver does): timed-out calls are interrupted again
        runner.collect()
        if runner.num_stuck == 0:
            break
        time.sleep(0.1)
    pool = (baseline[0] + 4, baseline[1] + 4)  # the pool's own 4 idle workers
    assert runner.num_stuck == 0 and settled(pool)  # every hung call ended, its thread gone
    runner.close()
    assert settled(baseline)


def test_twenty_hung_inline_calls_leave_no_thread():
    baseline = threads_now()
    for i in range(20):
        try:
            call_with_timeout(hang(i), 0.1, f"step {i}")
            raise AssertionError("a hung call returned")
        except EnvTimeout as err:
            assert f"step {i}" in str(err)
    assert settled(baseline)
    assert call_with_timeout(lambda: "ok", 1.0, "step") == "ok"


def test_a_call_blocked_in_c_is_bounded_and_the_calls_behind_it_fail_at_once():
    baseline = threads_now()
    release = threading.Event()
    runner = EnvRunner(workers=2, timeout_s=0.2)
    for i in range(2):
        runner.submit(f"blocked {i}", lambda: release.wait(30))  # one C call: not interruptible
    done = collect_all(runner)
    assert all(isinstance(v, EnvTimeout) for v in done.values()) and len(done) == 2
    time.sleep(1.3)  # past the grace an interrupted Python-level call gets to end
    runner.collect()
    assert runner.num_stuck == 2  # reported
    runner.submit("behind", lambda: 1)
    start = time.monotonic()
    behind = collect_all(runner)["behind"]
    assert isinstance(behind, EnvTimeout) and "cannot interrupt" in str(behind)
    assert time.monotonic() - start < 5.0  # failed at once, not after its own timeout or never
    assert threads_now()[0] <= baseline[0] + 4  # bounded: 2 workers and the 2 stuck, at most twice the pool
    release.set()  # the C call returns: the interrupt lands, the threads end
    assert settled((baseline[0] + 2, baseline[1] + 2))  # back to the pool's 2 workers
    runner.collect()
    assert runner.num_stuck == 0
    runner.submit("after", lambda: 2)
    assert collect_all(runner) == {"after": 2}
    runner.close()
    assert settled(baseline)
