"""The prepared GPU check (tools/gpu_check.sh, tools/gpu_check.py) on a CPU: its Python sections under
the Triton interpreter at small sizes, the pass/fail summary, the shell script's options, refusals,
time boxes and plumbing, and the rule that the package and the test environment never see fla.

The figures a GPU would give cannot be checked here; the check has never run on a GPU."""
import ast
import json
import os
import shutil
import subprocess
import sys
import tomllib
from importlib.util import find_spec
from pathlib import Path

import pytest

from tools.check_system import rl_overrides, variant_figures
from tools.gpu_check import ACCEPTANCE, main, summarize

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "gpu_check.sh"
KERNEL_SECTIONS = ("mla_decode", "kda_chunk", "kda_backward", "kda_decode", "mla_weights", "mla_prefill")
CUDA_SECTIONS = ("fla", "flashinfer", "compile_stats", "engine_syncs", "pinned_host", "rl_run")
EXPECTED_ERRORS = {
    "mla_decode": ("err_o_fp32_B5_ctx200", "err_lse_fp32_B5_ctx200"),
    "kda_chunk": ("err_o_fp32_B2_T40", "err_final_state_fp32_B2_T40", "err_position_states_fp32_B2_T40"),
    "kda_backward": tuple(f"err_{g}_fp32" for g in ("dq", "dk", "dv", "dg", "dbeta", "dh0")),
    "kda_decode": ("err_o_fp32", "err_state_fp32"),
    "mla_weights": ("err_weights_fp32_B5_ctx200",),
    "mla_prefill": ("err_o_fp32", "err_lse_fp32"),
}


def sh(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


@pytest.mark.triton
def test_python_sections_run_on_cpu_and_write_their_figures(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "tools/gpu_check.py", "--device", "cpu", "--small", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    sections = results["sections"]
    assert list(sections) == ["env", *KERNEL_SECTIONS, "fla", "flashinfer", "compile_stats", "engine_syncs",
                              "pinned_host", "rl_run"]
    assert results["meta"]["native_triton"] is False and results["meta"]["device"] == "cpu"
    for name in ("env", *KERNEL_SECTIONS):
        assert sections[name]["status"] == "ok", (name, sections[name])
        assert not [k for k in sections[name]["figures"] if k.startswith("error_")], name
    for name in CUDA_SECTIONS:  # said, not silently left out
        assert sections[name]["status"] == "skipped" and sections[name]["reason"].startswith("needs CUDA"), name
    for name, keys in EXPECTED_ERRORS.items():
        figures = sections[name]["figures"]
        for key in keys:
            assert figures[key] <= 1e-5, (name, key, figures[key])  # fp32, interpreter: the kernel tests' bound
        assert any(k.startswith("ms_") or k.startswith("fwd_bwd_ms_") for k in figures), name
    assert sections["kda_decode"]["figures"]["other_pages_untouched_fp32"] is True
    found = sections["env"]["figures"]["kernels"]
    for kernel in ("kda.chunk.kda_chunk_intra", "kda.chunk.kda_chunk_grad_a", "kda.chunk.kda_chunk_grad_k",
                   "kda.decode._kda_decode_kernel", "mla.paged.mla_decode", "mla.paged.mla_decode_combine", "mla.weights._paged_mla_weights_kernel"):
        assert kernel in found
    assert sections["env"]["figures"]["anchors_importable_here"]["fla"].startswith("unavailable")
    assert sections["compile_stats"]["figures"]["kernels"] == found
    config = sections["rl_run"]["figures"]["config"]  # the run's overrides composed here, every key checked
    assert config["reference"] == "stream" and config["spill_dir"] and config["kl_coef"] > 0
    assert config["iterations"] == 3
    lines = summarize(results)
    assert sum(line.startswith("CHECK PASS") for line in lines) == sum(map(len, EXPECTED_ERRORS.values()))
    assert not any("FAIL" in line for line in lines)


def _results(**sections) -> dict:
    return {"meta": {"gpu": "NVIDIA H200", "torch": "2.13.0"}, "steps": {"pytest": {"rc": 1, "wall_s": 80.0}},
            "sections": {name: {"status": status, "reason": reason, "figures": figures}
                         for name, (status, reason, figures) in sections.items()}}


def test_summary_says_pass_fail_and_why_a_figure_is_missing():
    results = _results(
        fla=("ok", "", {"kda_chunk_vs_fla_bf16_B1_T8192": 0.95, "err_fla_o_bf16_B1_T8192": 0.05}),
        mla_decode=("ok", "", {"hbm_fraction_bf16_B64_ctx8192": 0.55, "err_o_fp32_B64_ctx8192": 2e-7}),
        rl_run=("running", "", {}),
        compile_stats=("ok", "", {"specializations_kda.chunk.kda_chunk_intra": 1,
                                  "specializations_mla.paged.mla_decode": 4}))
    lines = summarize(results)
    assert lines[0] == "RUN gpu=NVIDIA H200 torch=2.13.0"
    assert lines[1].startswith("PASS     kda_chunk_vs_fla: 0.95 (need >= 0.9)")
    assert lines[2].startswith("FAIL     mla_decode_hbm: 0.55 (need >= 0.7)")
    assert lines[3].startswith("UNKNOWN  rl_run_completes: section rl_run running: killed (time box?)")
    assert "CHECK FAIL fla.err_fla_o_bf16_B1_T8192 = 5.00e-02 (<= 0.02)" in lines
    assert "CHECK PASS mla_decode.err_o_fp32_B64_ctx8192 = 2.00e-07 (<= 0.0001)" in lines
    assert "CHECK PASS compile_stats.specializations_kda.chunk.kda_chunk_intra = 1 (<= 2 over the T sweep)" in lines
    assert any(line.startswith("CHECK FAIL compile_stats.specializations_mla.paged") for line in lines)
    assert "SECTION rl_run: running: killed (time box?)" in lines
    assert lines[-1] == "STEP pytest: rc=1 wall_s=80.0"
    missing = summarize(_results(mla_decode=("skipped", "needs CUDA: x", {})))
    assert any(line.startswith("UNKNOWN  mla_decode_hbm: section mla_decode skipped: needs CUDA: x")
               for line in missing)
    assert any(line.startswith("UNKNOWN  kda_chunk_vs_fla: section fla did not run") for line in missing)
    assert len(ACCEPTANCE) == 3


def test_record_step_adds_to_an_existing_results_file(tmp_path):
    path = tmp_path / "results.json"
    assert main(["--record-step", str(path), "install", "0", "12.5", "--note", "fresh"]) == 0
    assert main(["--record-step", str(path), "pytest", "124", "240", "--note", "killed"]) == 0
    steps = json.loads(path.read_text())["steps"]
    assert steps == {"install": {"rc": 0, "wall_s": 12.5, "note": "fresh"},
                     "pytest": {"rc": 124, "wall_s": 240.0, "note": "killed"}}
    with pytest.raises(SystemExit, match="unknown section"):
        main(["--device", "cpu", "--sections", "kda_chunk,nope", "--out", str(tmp_path)])


def test_a_failing_part_is_recorded_and_the_next_part_still_runs():
    from tools.check_common import Parts

    figures, ran = {}, []
    parts = Parts(figures)
    parts.run("bf16", lambda: 1 / 0)
    assert parts.run("fp32", lambda: ran.append("fp32") or 7) == 7
    assert ran == ["fp32"] and figures == {"error_bf16": "ZeroDivisionError: division by zero"}
    with pytest.raises(RuntimeError, match=r"parts failed: \['bf16'\]"):
        parts.done()


def test_variant_figures_count_specializations_not_autotune_configs():
    import triton
    from triton.runtime.jit import JITFunction

    def body(x):
        return x

    def fake_jit(num_binaries: int) -> JITFunction:
        jit = JITFunction(body)
        jit.device_caches[0] = ({f"key{i}": object() for i in range(num_binaries)}, None, None, None, None)
        return jit

    assert variant_figures("k", fake_jit(0)) == {}
    assert variant_figures("k", fake_jit(3)) == {"variants_k": 3, "specializations_k": 3}
    configs = [triton.Config({}, num_warps=w) for w in (2, 4, 8, 16)]
    tuned = triton.autotune(configs=configs, key=[])(fake_jit(5))  # 4 configs, then one more specialization
    assert variant_figures("t", tuned) == {"variants_t": 5, "specializations_t": 2, "autotune_configs_t": 4,
                                           "autotune_keys_t": 0}


def test_rl_overrides_ask_for_bf16_on_cuda_and_compose():
    from rl.config.compose import compose_run_config

    cuda = rl_overrides("cuda", Path("/scratch/rl_run"))
    assert cuda[:2] == ["experiment.device=cuda", "experiment.dtype=bf16"] and "experiment.iterations=3" in cuda
    assert cuda[-1] == "run_dir=/scratch/rl_run"
    cfg = compose_run_config(rl_overrides("cpu", Path("/scratch/rl_run")))
    assert cfg.experiment.iterations == 3 and cfg.experiment.dtype == "fp32" and cfg.tracking.wandb_mode == "disabled"
    assert cfg.memory.reference == "stream" and cfg.memory.spill_dir and cfg.algo.loss.kl_coef > 0


def test_shell_script_parses_and_lints():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (the Makefile's apt step installs it when root): bash -n only")
    proc = subprocess.run(["shellcheck", str(SCRIPT)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


def test_help_and_dry_run_name_every_step_and_touch_nothing(tmp_path):
    steps = [line.split(":")[0] for line in SCRIPT.read_text().split('PLAN="', 1)[1].split('"', 1)[0].splitlines()]
    assert steps[:2] == ["gpu", "install"] and "pytest" in steps and "rl_run" in steps and len(steps) == 16
    helped = sh("--help")
    assert helped.returncode == 0 and all(f"  {s} " in helped.stdout for s in steps)
    planned = sh("--dry-run", "--steps", "env,mla_decode", env={"OUT": str(tmp_path / "out")})
    assert planned.returncode == 0, planned.stderr
    assert "run   mla_decode (<= 60s)" in planned.stdout and "skip  kda_chunk" in planned.stdout
    assert "run   gpu" in planned.stdout  # always
    assert not (tmp_path / "out").exists()
    for args, message in ((["--install", "nope"], "--install must be 'fresh' or 'none'"),
                          (["--steps", "env,nope"], "unknown step 'nope'"),
                          (["--budget-s", "soon"], "--budget-s must be a whole number"),
                          (["--device", "cpu"], "--device cpu goes with --install none"),
                          (["--frobnicate"], "unknown option '--frobnicate'")):
        proc = sh(*args)
        assert proc.returncode == 2 and message in proc.stderr, (args, proc.stderr)


def _fake_nvidia_smi(bin_dir: Path, rc: int) -> dict:
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text(f"#!/bin/sh\necho 'name, memory.total'\necho 'Fake, 1 MiB'\nexit {rc}\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}"}


def test_refuses_without_a_gpu_and_without_a_cuda_torch(tmp_path):
    out = tmp_path / "out"
    no_gpu = sh("--install", "none", "--python", sys.executable, env={"OUT": str(out), "SCRATCH": str(tmp_path / "s"),
                                                                       **_fake_nvidia_smi(tmp_path / "bin1", 9)})
    assert no_gpu.returncode == 2 and "no NVIDIA GPU visible here" in no_gpu.stdout
    assert not (out / "results.json").exists()  # nothing ran
    if find_spec("torch") and __import__("torch").cuda.is_available():
        pytest.skip("this host's torch has CUDA: the refusal below cannot happen here")
    no_cuda = sh("--install", "none", "--python", sys.executable, env={"OUT": str(out), "SCRATCH": str(tmp_path / "s"),
                                                                        **_fake_nvidia_smi(tmp_path / "bin2", 0)})
    assert no_cuda.returncode == 1 and "this torch has no CUDA or sees no GPU" in no_cuda.stdout
    results = json.loads((out / "results.json").read_text())
    assert results["steps"]["install"]["rc"] == 1 and results["sections"] == {}
    assert "UNKNOWN  mla_decode_hbm: section mla_decode did not run" in (out / "summary.txt").read_text()


@pytest.mark.triton
def test_cpu_plumbing_run_time_boxes_each_step_and_records_it(tmp_path):
    out = tmp_path / "out"
    env = {"OUT": str(out), "SCRATCH": str(tmp_path / "s")}
    proc = sh("--device", "cpu", "--install", "none", "--python", sys.executable, "--small",
              "--steps", "env,kda_decode,fla,rl_run", env=env, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    results = json.loads((out / "results.json").read_text())
    assert [results["steps"][s]["rc"] for s in ("env", "fla", "rl_run", "kda_decode")] == [0, 0, 0, 0]
    assert results["sections"]["kda_decode"]["status"] == "ok"
    assert results["sections"]["fla"]["status"] == results["sections"]["rl_run"]["status"] == "skipped"
    log = (out / "log.txt").read_text()
    assert log.index("start fla") < log.index("start rl_run") < log.index("start kda_decode")  # priority order
    assert "start kda_chunk" not in log and "CHECK PASS kda_decode.err_o_fp32" in (out / "summary.txt").read_text()
    late = sh("--device", "cpu", "--install", "none", "--python", sys.executable, "--steps", "env",
              "--budget-s", "20", env={"OUT": str(tmp_path / "late"), "SCRATCH": str(tmp_path / "s2")})
    assert late.returncode == 0 and "skip env: out of time" in late.stdout
    steps = json.loads((tmp_path / "late" / "results.json").read_text())["steps"]
    assert steps["env"] == {"rc": -1, "wall_s": 0.0, "note": "skipped: out of time"}


def _imports(path: Path) -> list[tuple[str, bool]]:
    """(top-level package imported, at module level?) for every import in `path`."""
    tree = ast.parse(path.read_text())
    top = {id(node) for node in tree.body}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name.split(".")[0], id(node) in top) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.module.split(".")[0], id(node) in top))
    return out


def test_fla_and_flashinfer_stay_out_of_the_package_and_the_test_environment():
    anchors = {"fla", "flashinfer"}
    for pkg in ("kernels", "models", "memory", "rollout", "trainer", "rl"):
        for path in (ROOT / pkg).rglob("*.py"):
            assert not anchors & {name for name, _ in _imports(path)}, path
    for path in [*(ROOT / "benchmarks").glob("*.py"), *(ROOT / "tools").glob("*.py")]:
        assert not any(name in anchors and top for name, top in _imports(path)), f"{path}: import inside functions"
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert "fla-core==0.6.0" in extras["gpu"] and "flashinfer-python" in extras["gpu"]
    assert not any(dep.startswith(("fla", "flashinfer")) for dep in extras["dev"])
    assert find_spec("fla") is None, "fla is installed in the test environment: transformers binds its kernels"
