"""examples/slurm without SLURM: the batch scripts run with SLURM's variables set as sbatch sets them
and stand-ins for srun (one copy of the command per node, each with its own SLURM_PROCID and
node-local TMPDIR), scontrol and squeue. Checked: the srun and torchrun commands and environment
they produce, the node-local files' removal, errors surfacing from per-rank logs, and two "nodes"
on this machine training bit-identically to one torchrun launch with the same ranks."""

import json
import os
import re
import sys
from pathlib import Path

from conftest import BASELINE_ITERS
from launch import REPO, TINY_MODEL, free_port, losses, pretrain_env, read_loss_log, run_group
from megatron.training.args.arguments import parse_args
from megatron.training.runtime.slurm_env import job_port

SCRIPTS = REPO / "examples" / "slurm"
# srun, scontrol and squeue stand-ins, shared with benchmarks/experiments/two_nodes_gpu.sh
FAKE_SLURM = Path(__file__).parent / "fake_slurm"

FAKE_TORCHRUN = r'''
import json, os, sys
node = os.environ["SLURM_PROCID"]
local = sys.argv[sys.argv.index("--offload-nvme-path") + 1]
with open(os.path.join(os.environ["FAKE_SLURM_LOG"], f"torchrun-node{node}.json"), "w") as f:
    json.dump({"argv": sys.argv[1:], "env": dict(os.environ), "local_dir_existed": os.path.isdir(local)}, f)
code = int(os.environ.get("FAKE_TORCHRUN_EXIT", "0"))
if code:  # as a rank's one-line error lands in its own log under torchrun --log-dir
    log_dir = sys.argv[sys.argv.index("--log-dir") + 1]
    os.makedirs(os.path.join(log_dir, "run_x", "attempt_0", "0"), exist_ok=True)
    with open(os.path.join(log_dir, "run_x", "attempt_0", "0", "stderr.log"), "w") as f:
        f.write(f"error: --offload-host-cache-gb: node {node} has too little memory\n")
sys.exit(code)
'''


def _fake_bin(tmp_path, with_torchrun):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if with_torchrun:
        path = bin_dir / "torchrun"
        path.write_text(f"#!{sys.executable}\n{FAKE_TORCHRUN}")
        path.chmod(0o755)
    return bin_dir


def _job_env(tmp_path, with_torchrun, nodes=2, **extra):
    (tmp_path / "log").mkdir()
    env = pretrain_env()
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID", "SLURM_STEP_ID"):
        env.pop(var, None)
    path = os.pathsep.join([str(_fake_bin(tmp_path, with_torchrun)), os.path.dirname(sys.executable),
                            str(FAKE_SLURM), env.get("PATH", "")])
    env.update({"PATH": path, "MLP_OFFLOAD_NO_SETUP": "1", "MLP_OFFLOAD_REPO": str(REPO),
                "SLURM_SUBMIT_DIR": str(tmp_path / "submit"), "SLURM_JOB_ID": "4242",
                "SLURM_JOB_NAME": "gpt-offload", "SLURM_JOB_NUM_NODES": str(nodes), "SLURM_NNODES": str(nodes),
                "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_GPUS_ON_NODE": "8", "SLURM_CPUS_PER_TASK": "32",
                "PFS_ROOT": str(tmp_path / "pfs"), "DATA_PATH": "/data/corpus_text_document",
                "FAKE_SLURM_LOG": str(tmp_path / "log"), "FAKE_NODE_ROOT": str(tmp_path / "nodes"),
                "FAKE_RUNNING_JOBS": "4242,555"})
    env.update(extra)
    return env


def _namespace(pfs, run_id, host):
    path = pfs / "mlp_offload" / run_id / "rank00000"
    path.mkdir(parents=True)
    (path / "OWNER.json").write_text(json.dumps({"host": host, "pid": 1, "started": 0}))
    (path / "sg000000.state").write_bytes(b"x" * 4096)
    return path


def _sbatch_lead_time(script: Path) -> int:
    return int(re.search(r"^#SBATCH --signal=TERM@(\d+)$", script.read_text(), re.M).group(1))


def test_sbatch_headers_chain_and_signal():
    for name in ("single_node.sbatch", "multi_node.sbatch"):
        text = (SCRIPTS / name).read_text()
        for header in ("--dependency=singleton", "--ntasks-per-node=1", "--gpus-per-node="):
            assert f"#SBATCH {header}" in text, (name, header)
        assert re.search(r'SIGNAL_LEAD_S:-(\d+)', text).group(1) == str(_sbatch_lead_time(SCRIPTS / name))


def test_multi_node_script_commands_and_environment(tmp_path):
    pfs = tmp_path / "pfs"
    crashed = _namespace(pfs, "999.0", "othernode")  # a job of the chain that died: squeue lists it no more
    running = _namespace(pfs, "555.0", "othernode")  # another job still running
    # Each node's GPUs as SLURM binds them (CUDA_VISIBLE_DEVICES per node): node.sh and torchrun keep them.
    env = _job_env(tmp_path, with_torchrun=True, FAKE_NODE_GPUS="0,1,2,3 4,5,6,7")
    code, output = run_group([(["bash", str(SCRIPTS / "multi_node.sbatch"), "--train-iters", "700"], env)], 120,
                             tmp_path / "job.out")
    assert code == 0, output
    assert not crashed.exists() and running.exists()

    srun = json.loads((tmp_path / "log" / "srun.json").read_text())
    assert {"--nodes=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1"} <= set(srun["options"])
    assert srun["command"][:2] == ["bash", "examples/slurm/node.sh"]
    assert srun["env"]["SRUN_CPUS_PER_TASK"] == "32"  # srun does not inherit --cpus-per-task
    assert int(srun["env"]["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"]) > _sbatch_lead_time(SCRIPTS / "multi_node.sbatch")

    ckpt = str(pfs / "ckpt" / "gpt-offload")
    local_dirs = []
    for node in (0, 1):
        run = json.loads((tmp_path / "log" / f"torchrun-node{node}.json").read_text())
        argv = run["argv"]
        script = argv.index("pretrain_gpt.py")
        launcher = dict(zip(argv[:script:2], argv[1:script:2]))
        assert launcher == {"--nnodes": "2", "--node_rank": str(node), "--nproc_per_node": "8",
                            "--master_addr": "gpu07", "--master_port": str(job_port(4242, 15)),
                            "--log-dir": str(tmp_path / "submit" / "logs" / "4242" / f"node{node}"),
                            "--tee": "3", "--local-ranks-filter": "0" if node == 0 else "8"}
        args = parse_args(argv[script + 1:])  # pretrain_gpt.py accepts what the script passes
        assert args.save == args.load == ckpt and args.exit_signal_handler and args.train_iters == 700
        assert args.offload_tiers == ["host", "nvme", "pfs"] and args.offload_paths["pfs"] == str(pfs)
        assert args.offload_token_scope == {"pfs": "node"}
        local = args.offload_paths["nvme"]
        assert local == str(tmp_path / "nodes" / f"node{node}" / "mlp_offload.4242")  # the node's scratch
        assert run["local_dir_existed"] and not os.path.exists(local)  # made before, removed after
        assert run["env"]["SLURM_JOB_ID"] == "4242" and run["env"]["SLURM_STEP_ID"] == "0"
        assert run["env"]["CUDA_VISIBLE_DEVICES"] == ("0,1,2,3", "4,5,6,7")[node]
        local_dirs.append(local)
    assert len(set(local_dirs)) == 2


def test_a_failed_rank_error_reaches_the_job_output(tmp_path):
    env = _job_env(tmp_path, with_torchrun=True, FAKE_TORCHRUN_EXIT="2", SLURM_JOB_NUM_NODES="1")
    code, output = run_group([(["bash", str(SCRIPTS / "single_node.sbatch")], env)], 120, tmp_path / "job.out")
    assert code == 2
    assert "error: --offload-host-cache-gb: node 0 has too little memory" in output
    assert "tools/offload_clean.py --slurm --delete" in output
    assert not (tmp_path / "nodes" / "node0" / "mlp_offload.4242").exists()


def test_two_nodes_train_like_one_launch(tmp_path, offload_baseline):
    """Two torchrun launches as two nodes (node ranks 0 and 1, a node-local directory each, one
    shared PFS path), started by the multi-node script, against one launch of the same 2 ranks."""

    pfs = tmp_path / "pfs"
    pfs.mkdir()
    # As offload_args, but the nvme path is each node's own (node.sh adds it); job-wide PFS tokens.
    offload = ["--offload-tiers", "host,nvme,pfs", "--offload-host-cache-gb", "0.0005", "--offload-subgroup-size",
               "6000", "--offload-adam-kernel", "single", "--offload-io-block-mb", "1", "--offload-io-threads", "2",
               "--offload-bandwidths", "nvme=2:1,pfs=2:1", "--offload-pfs-path", str(pfs),
               "--offload-token-scope", "pfs=job", "--no-store-param-remainders"]
    loss_log = tmp_path / "two-loss.jsonl"
    env = _job_env(tmp_path, with_torchrun=False, SLURM_JOB_NODELIST="localhost", GPUS_PER_NODE="1",
                   MASTER_PORT=str(free_port()), MODEL_ARGS=" ".join(TINY_MODEL + ["--mock-data"]),
                   OFFLOAD_ARGS=" ".join(offload))
    code, output = run_group([(["bash", str(SCRIPTS / "multi_node.sbatch"), "--train-iters", str(BASELINE_ITERS),
                                "--loss-log", str(loss_log)], env)], 300, tmp_path / "job.out")
    assert code == 0, output[-5000:]
    assert losses(read_loss_log(loss_log)) == losses(offload_baseline)
    # Rank 0 alone speaks for the job and both nodes; rank 1's own lines are in its per-rank log.
    assert output.count("> job: 2 ranks on 2 node(s) | offload swap namespace: mlp_offload/4242.0/") == 1
    assert "> node 0 " in output and "> node 1 " in output and "I/O token(s) per job" in output
    assert "[offload rank 1]" not in output
    rank1_logs = list((tmp_path / "submit" / "logs" / "4242" / "node1").rglob("stderr.log"))
    assert any("[offload rank 1]" in p.read_text() for p in rank1_logs)
    # Both nodes' scratch directories went with their torchrun; the PFS namespace with the ranks.
    assert not any((tmp_path / "nodes").rglob("mlp_offload.4242"))
    assert not (pfs / "mlp_offload").exists()
    assert (pfs / "ckpt" / "gpt-offload" / "latest_checkpointed_iteration.txt").exists()


def test_usr1_from_the_batch_shell_saves_and_exits(tmp_path):
    """torch < 2.12: SLURM warns the batch shell alone (--signal=B:USR1); job.sh passes SIGUSR1 to
    the ranks (not torchrun) through node_signal.sh; they save a complete checkpoint and the job ends 0."""
    import signal
    import subprocess
    import time

    pfs = tmp_path / "pfs"
    pfs.mkdir()
    offload = ["--offload-tiers", "host,nvme,pfs", "--offload-host-cache-gb", "0.0005", "--offload-subgroup-size",
               "6000", "--offload-io-block-mb", "1", "--offload-io-threads", "2",
               "--offload-bandwidths", "nvme=2:1,pfs=2:1", "--offload-pfs-path", str(pfs)]
    loss_log = tmp_path / "loss.jsonl"
    env = _job_env(tmp_path, with_torchrun=False, nodes=1, SLURM_JOB_NODELIST="localhost", GPUS_PER_NODE="2",
                   MASTER_PORT=str(free_port()), MODEL_ARGS=" ".join(TINY_MODEL + ["--mock-data"]),
                   OFFLOAD_ARGS=" ".join(offload), EXIT_SIGNAL="USR1")
    with open(tmp_path / "job.out", "w") as out:
        job = subprocess.Popen(["bash", str(SCRIPTS / "single_node.sbatch"), "--train-iters", "40",
                                "--loss-log", str(loss_log)], env=env, cwd=REPO, stdout=out,
                               stderr=subprocess.STDOUT)
        try:
            deadline = time.time() + 240
            while time.time() < deadline and job.poll() is None:
                if loss_log.exists() and len(read_loss_log(loss_log)) >= 2:
                    break
                time.sleep(0.2)
            job.send_signal(signal.SIGUSR1)  # what #SBATCH --signal=B:USR1@N does
            code = job.wait(timeout=180)
        finally:
            if job.poll() is None:
                job.kill()
    output = (tmp_path / "job.out").read_text()
    assert code == 0, output[-4000:]
    ckpt = pfs / "ckpt" / "gpt-offload"
    saved = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    assert 2 <= saved < 40 and (ckpt / f"iter_{saved:07d}" / "COMPLETE.json").exists()
    assert f"exiting at iteration {saved} after receiving SIGUSR1 (--exit-signal-handler)" in output
