"""List (and with --delete remove) offload swap-file namespaces left by dead runs.

    python tools/offload_clean.py /local/nvme/$USER /lustre/$USER/offload [--delete]

Namespaces of live processes are never touched; those owned by another host are only listed.
"""

import argparse
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mlp_offload.tiers.housekeeping import scan  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("paths", nargs="+", help="offload tier directories (what --offload-NAME-path was)")
    p.add_argument("--delete", action="store_true", help="remove namespaces whose owner is dead")
    args = p.parse_args(argv)
    for root in args.paths:
        for ns in scan(root):
            status = {True: "live", False: "dead", None: "other host"}[ns.alive]
            print(f"{status:10s} {ns.describe()}")
            if args.delete and ns.alive is False:
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
