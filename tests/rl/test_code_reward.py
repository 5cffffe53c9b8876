"""The code_reward task in real sandbox processes: answers scored by the row's tests, failures of every
kind scored 0 with their reason and never raised, forged summary lines ignored, one shared pool
scoring environments from several threads."""
from concurrent.futures import ThreadPoolExecutor

import pytest
import yaml

from rl.envs.tools import python_exec
from rl.envs.tasks.base import make_task
from rl.envs.tasks.code_reward import CodeReward, extract_code, harness_program, parse_summary, parse_tests
from rl.envs.tools.python_exec import close_sandboxes, shared_sandbox

FAST = dict(wall_time_s=2.0, test_time_s=0.5, memory_mb=256, max_output_bytes=4096, workers=2)
TESTS = ["assert add1(1) == 2", "assert add1(-1) == 0", "assert add1(41) == 42"]
GOOD = "def add1(x):\n    return x + 1\n"
ROW = {"prompt": "Write add1(x) returning x + 1.", "label": TESTS}


@pytest.fixture(scope="module", autouse=True)
def pools():
    yield
    close_sandboxes()


def score(answer: str, label=TESTS, **params):
    env = make_task("code_reward", **FAST | params)
    assert env.reset(0, row={"prompt": "p", "label": label}) == "p"
    return env.step(answer)


def test_a_correct_solution_scores_one_and_a_wrong_one_zero_or_its_partial_credit():
    right = score(GOOD)
    assert (right.reward, right.done, right.is_correct, right.observation) == (1.0, True, True, "")
    assert right.components == {"tests_passed_frac": 1.0, "exec_ok": 1.0, "timeout": 0.0}
    wrong = "def add1(x):\n    return 2\n"  # passes the first test only
    miss = score(wrong)
    assert (miss.reward, miss.is_correct) == (0.0, False)
    assert miss.components == {"tests_passed_frac": pytest.approx(1 / 3), "exec_ok": 1.0, "timeout": 0.0}
    assert score(wrong, partial_credit=0.6).reward == pytest.approx(0.2)
    assert score(GOOD, partial_credit=0.6).reward == 1.0


def test_chat_prompts_are_returned_as_they_are():
    messages = [{"role": "user", "content": "Write add1."}]
    env = CodeReward(**FAST)
    assert env.reset(3, row={"prompt": messages, "label": TESTS}) == messages


def test_the_last_python_or_untagged_fence_is_the_code():
    assert extract_code("Here:\n```python\nA\n```\nthen better:\n```py\nB\n```\nDone.") == "B\n"
    assert extract_code("```\nA\n```\n```bash\nls\n```\nbye") == "A\n"  # another language's block is skipped
    assert extract_code("```Python3 title\nA\n```") == "A\n"
    assert extract_code("x = 1\nprint(x)") == "x = 1\nprint(x)"  # no fence: the whole answer
    assert extract_code("Sure.\n```python\ndef f():\n    return 1") == "def f():\n    return 1"  # cut at the limit
    assert extract_code("text\n```\n") == "text\n```\n"  # a bare opening fence with nothing after it
    answer = (f"First try:\n```python\ndef add1(x):\n    return x\n```\nOops, that is wrong. Fixed:\n\n"
              f"```python\n{GOOD}```\nThis adds one.")
    assert score(answer).reward == 1.0
    assert score(answer.replace("```\nThis", "```\n```python\nadd1 = None\n```\nThis")).reward == 0.0


def test_an_endless_loop_scores_zero_with_the_timeout_component_within_the_wall_bound():
    out = score("def add1(x):\n    return x + 1\nwhile True:\n    pass\n")  # returns: the wall limit ended it
    assert (out.reward, out.is_correct) == (0.0, False)
    assert out.components == {"tests_passed_frac": 0.0, "exec_ok": 0.0, "timeout": 1.0}

def test_a_hanging_test_fails_alone_at_its_time_limit():
    # The other tests still run and count; the code's own SIGALRM handler does not stop the alarm.
    label = ["assert add1(1) == 2", "while True: pass", "assert add1(2) == 3", "assert slow()"]
    code = GOOD + "import signal, time\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\n" \
                  "def slow():\n    time.sleep(5)\n    return True\n"
    out = score(code, label=label, partial_credit=1.0)  # each hanging test ends at its own limit: 2 of 4 counted
    assert out.reward == 0.5 and not out.is_correct
    assert out.components == {"tests_passed_frac": 0.5, "exec_ok": 1.0, "timeout": 0.0, "tests_timed_out_frac": 0.5}


@pytest.mark.parametrize("answer, reason", [
    ("def add1(x):\n    return x +\n", "syntax_error"),
    ("def add1(x):\n    return x + 1\nraise RuntimeError('top level')\n", "error"),
    ("import sys\ndef add1(x):\n    return x + 1\nsys.exit(3)\n", "error"),
    ("def add1(x):\n    return x + 1\nb = bytearray(10 ** 10)\n", "memory"),
    ("def add1(x):\n    return x + 1\nwhile True:\n    print('x' * 100)\n", "output_limit"),
    ("import os\ndef add1(x):\n    return x + 1\nos._exit(0)\n", "no_summary"),
    ("\0", "syntax_error"),
])
def test_failures_score_zero_with_their_reason_and_never_raise(answer, reason):
    out = score(answer, partial_credit=1.0)
    assert (out.reward, out.is_correct, out.done) == (0.0, False, True)
    assert out.components == {"tests_passed_frac": 0.0, "exec_ok": 0.0, "timeout": 0.0, reason: 1.0}


def test_printed_summary_lines_and_an_early_exit_do_not_fake_a_pass():
    forged = ("import sys\ndef add1(x):\n    return -5\n"
              "for tag in ('rl.code_reward-0', 'rl.code_reward-' + '0' * 32, 'T'):\n"
              "    print(tag, 'ok', 3, 3, 0)\n    print('\\n' + tag + ' ok 3 3 0', file=sys.stderr)\n"
              "sys.exit(0)\n")  # exiting 0 before the tests does not skip them
    out = score(forged)
    assert (out.reward, out.is_correct) == (0.0, False)
    assert out.components == {"tests_passed_frac": 0.0, "exec_ok": 1.0, "timeout": 0.0}
    rebinds = ("import builtins, sys\nbuiltins.exec = lambda *a, **k: None\nbuiltins.compile = lambda *a, **k: 0\n"
               "builtins.len = lambda x: 0\nsys.stdout = open('log', 'w')\ndef add1(x):\n    return -5\n")
    assert score(rebinds).components == {"tests_passed_frac": 0.0, "exec_ok": 1.0, "timeout": 0.0}
    assert parse_summary("T ok 3 3 0\nT ok 3 3 0\n", "T", 3) is None  # a second tagged line: no summary
    assert parse_summary("T ok 3 3 0\n", "T", 4) is None and parse_summary("T ok 5 3 0\n", "T", 3) is None
    assert parse_summary("T ok 2 3 2\n", "T", 3) is None and parse_summary("T ok 3 3\n", "T", 3) is None
    assert parse_summary("out\nT ok 2 3 1\n", "T", 3) == ("ok", 2, 1)


def test_network_and_host_files_fail_the_tests_without_a_crash():
    assert score("import socket\nsocket.socket()\n").components["error"] == 1.0
    snoop = ("def add1(x):\n    return len(open('/etc/passwd').read()) * 0 + x + 1\n"
             "def sock():\n    import socket\n    return socket.create_connection(('127.0.0.1', 22), timeout=1)\n")
    out = score(snoop, label=["assert add1(1) == 2", "sock()"], partial_credit=1.0)
    assert (out.reward, out.is_correct) == (0.0, False)
    assert out.components == {"tests_passed_frac": 0.0, "exec_ok": 1.0, "timeout": 0.0}


def test_tests_as_one_string_split_at_each_top_level_assert():
    source = ("import math\nx = add1(1)\nassert x == 2\ny = add1(math.floor(2.5))\nassert y == 3\n"
              "assert add1(0) == 99; z = 1\n")
    tests = parse_tests(source)
    assert len(tests) == 3 and "x = add1(1)" in tests[0] and "math.floor" in tests[1] and "z = 1" in tests[2]
    out = score(GOOD, label=source, partial_credit=0.9)
    assert out.components["tests_passed_frac"] == pytest.approx(2 / 3) and out.reward == pytest.approx(0.6)
    assert score(GOOD, label="\n".join(TESTS)).reward == 1.0 == score(GOOD, label=TESTS).reward
    check = "def check(f):\n    assert f(1) == 2\n    assert f(2) == 3\ncheck(add1)\n"  # HumanEval style
    assert parse_tests(check) == [check] and score(GOOD, label=check).reward == 1.0
    assert score("def add1(x):\n    return 2\n", label=check).reward == 0.0


def test_rows_without_tests_raise_naming_what_is_expected():
    env = CodeReward(**FAST)
    with pytest.raises(ValueError, match="label=None: expected a list of Python assert statements"):
        env.reset(0, row={"prompt": "p", "label": None})
    with pytest.raises(ValueError, match="label=None"):
        env.reset(0, row={"prompt": "p"})
    with pytest.raises(ValueError, match="needs a data row: set data.train_files"):
        env.reset(0)
    for label, words in ((42, "label=42 \\(int\\)"), ([], "label=\\[\\]"), ("  ", "label='  ': no tests"),
                         (["assert add1(1) == 2", 7], "label\\[1\\]=7"),
                         (["assert (add1(1)"], "label\\[0\\]=.*does not parse"),
                         ("assert (", "label='assert \\(': the tests do not parse"),
                         ('["assert add1(1) == 2"]', "list literal")):
        with pytest.raises(ValueError, match=words):
            parse_tests(label)
    with pytest.raises(RuntimeError, match="before reset"):
        CodeReward(**FAST).step(GOOD)


def test_params_are_validated_naming_the_bad_value_and_building_starts_no_pool():
    for params, words in (({"wall_time_s": -1}, "wall_time_s=-1"), ({"cpu_time_s": "5"}, "cpu_time_s='5'"),
                          ({"memory_mb": 1}, "memory_mb=1"), ({"workers": -2}, "workers=-2"),
                          ({"max_output_bytes": 0}, "max_output_bytes=0"),
                          ({"partial_credit": 1.5}, "partial_credit=1.5, expected a number in \\[0, 1\\]"),
                          ({"partial_credit": True}, "partial_credit=True"), ({"max_turns": 2}, "max_turns=2"),
                          ({"test_time_s": 0}, "test_time_s=0, expected a positive number")):
        with pytest.raises(ValueError, match=words):
            CodeReward(**params)
    before = dict(python_exec._SANDBOXES)
    envs = [CodeReward(wall_time_s=3.0 + i) for i in range(3)]
    assert python_exec._SANDBOXES == before and envs[0].sandbox_config.wall_time_s == 3.0
    with open("configs/task/code_reward.yaml") as f:
        task = yaml.safe_load(f)
    assert task["name"] == "code_reward" and CodeReward(**task.get("params", {})).partial_credit == 0.0


def test_environments_on_four_threads_share_one_pool_and_are_all_scored_right():
    answers = [GOOD, "def add1(x):\n    return x\n", f"```python\n{GOOD}```", "while True: pass"]
    jobs = [(i, answers[i % 4]) for i in range(16)]

    def run(job):
        i, answer = job
        env = CodeReward(**FAST)  # one environment per trajectory, as the driver builds them
        env.reset(i, row=ROW)
        return env.step(answer)

    pool = shared_sandbox(CodeReward(**FAST).sandbox_config)
    calls = pool.stats().num_calls
    with ThreadPoolExecutor(4) as executor:
        results = list(executor.map(run, jobs))
    assert [r.reward for r in results] == [1.0, 0.0, 1.0, 0.0] * 4
    assert [r.components["timeout"] for r in results] == [0.0, 0.0, 0.0, 1.0] * 4
    assert pool.stats().num_calls - calls == 16  # every call went to the one shared pool
    assert shared_sandbox(CodeReward(**FAST | {"partial_credit": 0.5}).sandbox_config) is pool


def test_harness_program_compiles_for_awkward_code_and_tests():
    program = harness_program("s = '''\\n'''  # \"\"\" ' \\\\", ["assert s == '\\n'"], "T")
    compile(program, "<harness>", "exec")
