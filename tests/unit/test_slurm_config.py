"""The Slurm keys of `cluster`: defaults, overrides of the env map, derived counts, and every validation rule."""

from __future__ import annotations

import pytest

from trainctl.config.compose import compose
from trainctl.config.errors import ConfigError
from trainctl.config.slurm import SlurmClusterConfig, cpus_per_task, gpus_per_node
from trainctl.config.validate import resolve

SLURM_CPU = ["recipe=tiny_cpu", "cluster=slurm", "cluster.device=cpu", "cluster.gpu=", "cluster.procs_per_node=2"]


def problems_of(overrides: list[str]) -> list[str]:
    with pytest.raises(ConfigError) as info:
        resolve(compose(overrides))
    return info.value.problems


def test_slurm_group_sets_the_preemption_defaults():
    c = resolve(compose(["recipe=llama7b_fsdp"])).cluster
    preemption = (c.preemption.signal, c.preemption.lead_s, c.preemption.requeue, c.preemption.max_requeues)
    assert preemption == ("SIGUSR2", 120, True, 3)
    assert c.exclusive and gpus_per_node(c) == 8


def test_env_accepts_new_names_with_or_without_plus():
    overrides = ["cluster.env.NCCL_DEBUG=WARN", "+cluster.env.FOO='a b'", "cluster.setup=[module load x]"]
    cfg = resolve(compose([*SLURM_CPU, *overrides]))
    assert cfg.cluster.env == {"NCCL_DEBUG": "WARN", "FOO": "a b"}
    assert cfg.cluster.setup == ["module load x"]


def test_unknown_cluster_key_still_fails():
    assert problems_of([*SLURM_CPU, "cluster.partitoin=gpu"])[0].startswith("cluster.partitoin: unknown key")


@pytest.mark.parametrize(
    ("fields", "gpus", "cpus"),
    [
        ({"device": "cuda", "procs_per_node": 8}, 8, 8),
        ({"device": "cpu", "procs_per_node": 2}, 0, 2),
        ({"device": "cuda", "procs_per_node": 4, "gpus_per_node": 8, "exclusive": True}, 8, 0),
        ({"device": "cpu", "procs_per_node": 2, "cpu_threads": 3}, 0, 6),
        ({"device": "cpu", "procs_per_node": 2, "cpu_threads": 3, "cpus_per_task": 16}, 0, 16),
    ],
)
def test_derived_resources(fields, gpus, cpus):
    c = SlurmClusterConfig(**fields)
    assert (gpus_per_node(c), cpus_per_task(c)) == (gpus, cpus)


BAD = [
    (["cluster.job_name='a b'"], "cluster.job_name='a b': an #SBATCH value cannot contain spaces"),
    (["cluster.partition='gpu\n#SBATCH --qos=high'"], "cluster.partition="),
    (["cluster.mem=lots"], "cluster.mem='lots': use a size per node"),
    (["cluster.time_limit=3h"], "cluster.time_limit='3h': use Slurm's format"),
    (["cluster.extra_directives=['--mail-type=END\necho hi']"], "cluster.extra_directives[0]="),
    (["cluster.extra_directives=['reservation=big']"],
     "cluster.extra_directives[0]='reservation=big': an sbatch option"),
    (["+cluster.env.1BAD=x"], None),  # Hydra's own grammar refuses the key
    (["cluster.env.A-B=x"], "cluster.env.A-B: not a valid environment variable name"),
    (["cluster.preemption.signal=SIGKILL"], "cluster.preemption.signal='SIGKILL': not a valid choice"),
    (["cluster.preemption.lead_s=70000"], "cluster.preemption.lead_s=70000: must be in [0, 65535]"),
    (["cluster.preemption.max_requeues=-1"], "cluster.preemption.max_requeues=-1: must be >= 0"),
    (["cluster.gpus_per_node=2"], "cluster.gpus_per_node=2: cluster.device=cpu runs no GPU workers"),
    (["cluster.device=cuda", "cluster.gpu=h100", "cluster.gpus_per_node=1"],
     "cluster.gpus_per_node=1: fewer GPUs than cluster.procs_per_node=2"),
    (["cluster.cpus_per_task=-2"], "cluster.cpus_per_task=-2: must be >= 0"),
]


@pytest.mark.parametrize(("overrides", "start"), BAD, ids=[b[0][0] for b in BAD])
def test_bad_slurm_values_are_one_line_each(overrides, start):
    problems = problems_of([*SLURM_CPU, *overrides])
    assert len(problems) == 1 and "\n" not in problems[0].replace("\\n", ""), problems
    if start:
        assert problems[0].startswith(start), problems


def test_every_slurm_problem_at_once():
    problems = problems_of([*SLURM_CPU, "cluster.mem=x", "cluster.time_limit=y", "cluster.preemption.signal=KILL",
                            "cluster.gpus_per_node=1"])
    assert len(problems) == 4
