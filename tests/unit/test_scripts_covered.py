"""Every script under scripts/ has a smoke test that runs it, so none can rot unnoticed (issue 13).

A new script without an entry here fails this test; an entry whose test is gone fails it too.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import EXTENDED_TIER, is_listed, tier_lines

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.unit

# script -> the test that runs it ("file::function"), or the CI entry that does (".ci/run").
COVERED = {
    "_setup.sh": "tests/dist/test_quickstart.py::test_quickstart_trains_and_keeps_its_promise",  # sourced by it
    "quickstart.sh": "tests/dist/test_quickstart.py::test_quickstart_trains_and_keeps_its_promise",
    "test.sh": ".ci/run",  # the suite itself
    "test_torch.sh": ".ci/run",  # the worker's dist tests under torch 2.11
    "test_parity_paths.sh": ".ci/run",  # the parity tests on a second CPU code path
    "_requirements.py": "tests/unit/test_requirements_script.py::test_the_dependencies_and_the_named_extras_once_each",
    "bench_loop.py": "tests/dist/test_bench_scripts.py::test_bench_loop_runs_the_worker_loop_next_to_a_bare_one",
    "bench_checkpoint.py": "tests/dist/test_bench_scripts.py::test_bench_checkpoint_reports_every_figure",
    "bench_variants.py": "tests/dist/test_bench_variants.py::test_bench_variants_reports_each_variant_from_its_metrics",
    "bench_memory.py": "tests/dist/test_plan_memory.py::test_bench_memory_script_measures_against_the_plan",
    "code_health.py": "tests/unit/test_code_health.py::test_runs_on_this_repository",
    "slurm-local-cluster.sh":
        "tests/slurm/test_slurm_cluster.py::test_one_node_job_completes_with_its_logs_and_records",
    "gpu_proof.sh": "tests/dist/test_bench_scripts.py::test_gpu_proof_checks_the_box_and_refuses_unknown_stages",
    "gpu_wheels.sh": "tests/dist/test_bench_scripts.py::test_gpu_wheels_names_what_the_gpu_box_lacks",
    "_gpu_common.sh": "tests/dist/test_bench_scripts.py::test_gpu_wheels_names_what_the_gpu_box_lacks",  # sourced
    "gpu_tables.py": "tests/unit/test_gpu_tables.py::test_the_committed_h200_tables_render_from_the_raw_results",
    "gpu_out_check.py": "tests/unit/test_gpu_out_check.py::test_the_proofs_own_layout_comes_back",
    "hostile_probe.py": "tests/dist/test_hostile_probe.py::test_one_case_of_every_area_is_ok",
    "bench_loss_head.py":
        "tests/dist/test_bench_loss_head.py::test_bench_loss_head_reports_time_and_peak_of_both_heads",
    "bench_titan.py":
        "tests/dist/test_bench_scripts.py::test_bench_titan_writes_torchtitan_s_config_and_compares_results",
    # its torchtitan side; the run itself: `gpu_proof.sh --rehearse` (the titan stage), before a device call
    "titan_worker.py":
        "tests/dist/test_bench_scripts.py::test_bench_titan_writes_torchtitan_s_config_and_compares_results",
    "config_reference.py":
        "tests/unit/test_config_reference.py::test_the_committed_reference_is_what_the_schema_renders",
    "bench_prepare.py":
        "tests/dist/test_bench_scripts.py::test_bench_prepare_compares_data_prepare_with_tokenizers_alone",
}


def test_every_script_has_a_smoke_test():
    scripts = {p.name for p in (REPO / "scripts").iterdir() if p.suffix in (".py", ".sh")}
    assert scripts - COVERED.keys() == set(), "scripts without a smoke test: add one and an entry in COVERED"
    assert COVERED.keys() - scripts == set(), "entries for scripts that no longer exist"


@pytest.mark.parametrize("script", sorted(COVERED))
def test_the_named_test_exists_and_runs_the_script(script):
    target = COVERED[script]
    if target == ".ci/run":
        assert script in (REPO / ".ci" / "run").read_text()
        return
    assert not is_listed(target, tier_lines(EXTENDED_TIER)), f"{target} is {script}'s smoke test: CI must run it"
    path, function = target.split("::")
    source = (REPO / path).read_text()
    assert re.search(rf"^def {function}\(", source, re.MULTILINE), target
    # The test's module names the script it runs (slurm's conftest starts the cluster script for its tests).
    conftest = (REPO / path).parent / "conftest.py"
    text = source + (conftest.read_text() if conftest.exists() else "")
    named = "quickstart.sh" if script == "_setup.sh" else script  # _setup.sh is sourced by quickstart.sh
    assert named in text, target


def test_no_two_test_modules_share_a_file_name():
    # pytest imports test modules by their file name (rootdir import mode, no packages): a second
    # test_x.py in another folder is an "import file mismatch" error for the whole run, not one test.
    seen: dict[str, Path] = {}
    for path in sorted((REPO / "tests").rglob("test_*.py")):
        other = seen.setdefault(path.name, path)
        assert other == path, f"{path.relative_to(REPO)} and {other.relative_to(REPO)} share a name: rename one"
