"""``srun -n 2 python pretrain_gpt.py ...`` without torchrun: ranks, world, master and port come
from SLURM's variables (megatron/training/runtime/slurm_env.py); the run is the torchrun run, bit for bit."""

import random
import socket
import sys

import pytest

from conftest import BASELINE_ITERS
from launch import PRETRAIN, TEST_PORTS, TINY_MODEL, losses, pretrain_env, read_loss_log, run_group
from megatron.training.runtime import slurm_env
from megatron.training.errors import UserError
from helpers import offload_args

SRUN_TASK = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "3", "SLURM_NTASKS": "2", "SLURM_PROCID": "1",
             "SLURM_LOCALID": "1", "SLURM_NODEID": "0", "SLURM_NODELIST": "gpu[007-008,012]",
             "SLURM_TASKS_PER_NODE": "2"}


@pytest.mark.parametrize("nodelist, host", [("gpu[007-008,012]", "gpu007"), ("a1,b2", "a1"), ("n[3]", "n3"),
                                            ("rack2-n[01-04],login", "rack2-n01"), ("x-1.cluster", "x-1.cluster")])
def test_first_host_of_a_slurm_host_list(nodelist, host):
    assert slurm_env.first_host(nodelist) == host


def test_tasks_per_node_expands_repeats():
    assert slurm_env.tasks_per_node("2(x3),1") == [2, 2, 2, 1]


def test_srun_task_gets_torch_variables():
    derived = slurm_env.torch_env_from_slurm(SRUN_TASK)
    assert derived == {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                       "MASTER_ADDR": "gpu007", "MASTER_PORT": str(slurm_env.job_port(4242, 3))}
    # Uneven nodes: this node's own count.
    uneven = {**SRUN_TASK, "SLURM_NTASKS": "5", "SLURM_TASKS_PER_NODE": "3,2", "SLURM_NODEID": "1"}
    assert slurm_env.torch_env_from_slurm(uneven)["LOCAL_WORLD_SIZE"] == "2"
    # What is set already wins (torchrun's variables, or a MASTER_PORT given by the user).
    assert "MASTER_PORT" not in slurm_env.torch_env_from_slurm({**SRUN_TASK, "MASTER_PORT": "1234"})
    assert slurm_env.torch_env_from_slurm({**SRUN_TASK, "RANK": "0", "WORLD_SIZE": "8"}) == {}
    # The batch script itself (no step id) is one process, not task 0 of SLURM_NTASKS.
    assert slurm_env.torch_env_from_slurm({k: v for k, v in SRUN_TASK.items() if k != "SLURM_STEP_ID"}) == {}


def test_steps_and_jobs_get_distinct_ports():
    ports = {slurm_env.job_port(job, step) for job in range(1000, 1000 + slurm_env.PORT_JOBS)
             for step in range(slurm_env.PORT_STEPS)}
    assert len(ports) == slurm_env.PORT_JOBS * slurm_env.PORT_STEPS
    assert min(ports) >= 1024 and max(ports) < 32768


@pytest.mark.parametrize("change, named", [({"SLURM_NTASKS": None}, "SLURM_NTASKS"),
                                           ({"SLURM_NODELIST": None}, "SLURM_NODELIST"),
                                           ({"SLURM_NODELIST": "[1-2]"}, "SLURM_NODELIST='[1-2]'"),
                                           ({"SLURM_PROCID": "2"}, "SLURM_PROCID=2"),
                                           ({"SLURM_JOB_ID": "12x"}, "SLURM_JOB_ID='12x'")])
def test_incomplete_or_bad_slurm_variables_name_the_variable(change, named):
    env = {k: v for k, v in {**SRUN_TASK, **change}.items() if v is not None}
    with pytest.raises(UserError, match=named.replace("[", r"\[")):
        slurm_env.torch_env_from_slurm(env)


def test_the_test_launches_ports_are_above_every_job_port():
    highest = max(slurm_env.job_port(job, step) for job in range(slurm_env.PORT_JOBS)
                  for step in range(slurm_env.PORT_STEPS))
    assert highest < TEST_PORTS[0]


def _job_id_with_free_port() -> int:
    for _ in range(100):
        job = random.randrange(10**6, 10**7)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", slurm_env.job_port(job, 0)))
                return job
            except OSError:
                continue
    raise AssertionError("no free port in the job-port range")


def test_two_srun_tasks_train_like_torchrun(tmp_path, offload_baseline):
    loss_log = tmp_path / "srun-loss.jsonl"
    job = _job_id_with_free_port()
    base = pretrain_env()
    for var in slurm_env.TORCH_VARS + ("TORCHELASTIC_RUN_ID",):
        base.pop(var, None)
    tasks = []
    for procid in range(2):
        env = {**base, "SLURM_JOB_ID": str(job), "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2",
               "SLURM_PROCID": str(procid), "SLURM_LOCALID": str(procid), "SLURM_NODEID": "0",
               "SLURM_NODELIST": "localhost", "SLURM_TASKS_PER_NODE": "2"}
        tasks.append(([sys.executable, str(PRETRAIN), *TINY_MODEL, "--train-iters", str(BASELINE_ITERS),
                       "--loss-log", str(loss_log), "--mock-data", *offload_args(tmp_path)], env))
    code, output = run_group(tasks, 240, tmp_path / "srun.out")
    assert code == 0, output[-4000:]
    assert "DP=2" in output and output.count("torch.distributed from SLURM") == 1, output[-4000:]
    assert losses(read_loss_log(loss_log)) == losses(offload_baseline)
