"""List (and with --delete remove) offload swap-file namespaces left by dead runs.

    python tools/offload_clean.py /local/nvme/$USER /lustre/$USER/offload [--delete]
    python tools/offload_clean.py --slurm --delete /lustre/$USER/offload   # after a crashed SLURM job

Namespaces of live processes are never touched. Those owned by another host are only listed, since
their owner's liveness cannot be seen from here; with --slurm, one whose run id names a SLURM job
(<job>.<step>) that squeue no longer lists counts as dead whichever host owned it (on a shared
file system, the nodes of a crashed job).
"""

import argparse
import os
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mlp_offload import scan_namespaces as scan  # noqa: E402


def running_slurm_jobs() -> set:
    """This user's job ids that SLURM still lists (pending, running, completing)."""
    try:
        done = subprocess.run(["squeue", "-h", "-o", "%A", "-u", str(os.getuid())], capture_output=True,
                              text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise SystemExit(f"error: --slurm: cannot ask squeue which jobs are running: {err}")
    if done.returncode:
        raise SystemExit(f"error: --slurm: squeue failed (exit {done.returncode}): {done.stderr.strip()}")
    return set(done.stdout.split())


def dead(ns, running) -> bool:
    if ns.alive is not None or running is None:
        return ns.alive is False  # on this host a live process is never touched, whatever SLURM says
    job = ns.run_id.split(".")[0]
    return job.isdigit() and job not in running


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("paths", nargs="+", help="offload tier directories (what --offload-NAME-path was)")
    p.add_argument("--delete", action="store_true", help="remove namespaces whose owner is dead")
    p.add_argument("--slurm", action="store_true",
                   help="namespaces of SLURM jobs that squeue no longer lists are dead, on any host")
    args = p.parse_args(argv)
    running = running_slurm_jobs() if args.slurm else None
    for root in args.paths:
        for ns in scan(root):
            gone = dead(ns, running)
            status = "dead" if gone else {True: "live", False: "dead", None: "other host"}[ns.alive]
            print(f"{status:10s} {ns.describe()}")
            if args.delete and gone:
                shutil.rmtree(ns.path, ignore_errors=True)
                for parent in (os.path.dirname(ns.path), os.path.dirname(os.path.dirname(ns.path))):
                    try:
                        os.rmdir(parent)
                    except OSError:
                        pass
                print(f"{'':10s} removed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
