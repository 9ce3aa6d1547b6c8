"""The GPU suite: does a saved and resumed run continue bit for bit on a real GPU, over the tiers,
update paths and masters a user can pick, and do the CUDA unit tests pass? One PASS/FAIL line per
case, then a summary; run by ``bash benchmarks/run_gpu.sh gpu_suite`` (gpu_suite.sh says how).

Every run uses the default attention (torch SDPA) under --deterministic-mode, except two cases: one
with --attention-backend local (deterministic without the mode), and one without the mode, whose
resume cannot be exact and passes when the resume check (the saved state's digest against the loaded
one) reports a match and the run goes on.

A case passes when the resumed run continues the case's own uninterrupted run bit for bit (each
iteration's loss, lr and grad norm): the uninterrupted run saves at 2 and trains on, and the resume
starts from a copy of that save alone; a killed case has an uninterrupted run without saves. Beside
each verdict: whether the uninterrupted run equals megatron-core's own DistributedOptimizer without
offload (fp32 master: ``--no-store-param-remainders``; the default 16-bit remainders against the same
with its bf16 copy rounded half away from zero, tests/integration/half_away_megatron.py).

Part 1 (one GPU): the tiers {gpu,host,nvme; gpu,host; gpu; host,nvme} x update {device on the model's
buffers; device through copies; cpu; split} x master {remainders; fp32}, four cases drawn so that
every value appears (the seed is printed: SEED=N draws them again); --async-save;
--offload-overlap-forward; --offload-read-ahead-gb; a rank SIGKILLed during the update and during an
async save, then resumed from the last complete checkpoint; params in host memory (--offload-params host)
saved and resumed, and killed in the backward and resumed; params and grads in host memory saved and resumed (also by
--async-save); killed after a non-persistent checkpoint later than the persistent one, resumed from it; the gpu
tier's auto size (subgroups
promoted after iteration 1) across a save; 8-bit moments (fp8) saved and resumed (not held to
megatron-core's losses: it has no such format without transformer-engine); the unit tests that run on CUDA. Launches run PAR at a
time on the one GPU (each is small).
Part 2 (two GPUs): data-parallel resharding with the gpu tier (DP2 saves, DP1 loads and saves at
once, DP2 loads that and must continue as the uninterrupted DP2 run), MoE at EP2 saved and resumed, and params
and grads in host memory at DP2, with MoE at EP2 and over two pipeline stages (the layer-major step), saved and
resumed. CASES=a,b runs only those cases of either part (with the references they need).
DRY_RUN=1: the same cases with tiny shapes on the CPU (the gpu tier's stand-in), two at a time.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import json
import os
import re
import random
import shutil
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

REPO = Path(__file__).resolve().parents[2]
DRY = os.environ.get("DRY_RUN") == "1"
PART = os.environ.get("PART", "1")
OUT = Path(os.environ.get("OUT", "/tmp/out"))
WORK = Path(os.environ.get("DISK", "/var/tmp/gpu_suite"))
SEED = int(os.environ.get("SEED") or random.SystemRandom().randrange(1, 10**6))
PAR = int(os.environ.get("PAR", "2" if DRY else "6"))
LIMIT = int(os.environ.get("LIMIT", "400" if DRY else "200"))  # seconds per launch
ITERS = 4

if DRY:
    SHAPE = ("--num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 --group-query-attention "
             "--num-query-groups 2 --seq-length 64 --max-position-embeddings 64 --vocab-size 1024 --device cpu")
    SUB, GPU_GB, HOST_GB, READ_AHEAD_GB, ALL_GPU_GB = "6000", "0.0004", "0.0005", "0.0002", "0.01"
else:  # about 110 M params: 28 subgroups of 4 M, about 10 in HBM, 8 in host memory, the rest on disk
    SHAPE = ("--num-layers 4 --hidden-size 1024 --ffn-hidden-size 2816 --num-attention-heads 16 "
             "--group-query-attention --num-query-groups 4 --seq-length 512 --max-position-embeddings 512 "
             "--vocab-size 32000 --device cuda")
    SUB, GPU_GB, HOST_GB, READ_AHEAD_GB, ALL_GPU_GB = "4000000", "0.4", "0.45", "0.15", "4"
DETERMINISTIC = "--deterministic-mode"  # every run but the cases that set ``deterministic=False``
COMMON = (SHAPE + " --swiglu --normalization RMSNorm --position-embedding-type rope"
          " --untie-embeddings-and-output-weights --disable-bias-linear --hidden-dropout 0 --attention-dropout 0"
          " --micro-batch-size 1 --global-batch-size 4 --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine"
          " --lr-warmup-iters 1 --adam-beta2 0.95 --weight-decay 0.1 --clip-grad 1.0 --bf16 --mock-data"
          f" --seed 1234 --log-interval 1 --train-iters {ITERS}").split()

TIERS = {"gpu,host,nvme": f"--offload-gpu-cache-gb {GPU_GB} --offload-host-cache-gb {HOST_GB}",
         "gpu,host": f"--offload-gpu-cache-gb {GPU_GB}",
         "gpu": f"--offload-gpu-cache-gb {ALL_GPU_GB}",
         "host,nvme": f"--offload-host-cache-gb {HOST_GB}"}
UPDATES = {"device-model-buffers": "--offload-update gpu",
           "device-copies": "--offload-update gpu --offload-no-update-in-model-buffers",
           "cpu": "--offload-update cpu",
           "split": "--offload-update auto"}
MASTERS = {"remainders": "", "fp32": "--no-store-param-remainders"}
LAYER_MAJOR = "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1"
ONLY = [n for n in os.environ.get("CASES", "").split(",") if n]  # CASES=a,b: only these (a dry run of new cases)


@dataclass
class Case:
    name: str
    tiers: str
    update: str
    master: str
    extra: str = ""
    kind: str = "resume"  # resume: save at 2 and exit, then resume; kill: a fault stops it, then resume
    fault: str = ""  # MLP_OFFLOAD_FAULT of the killed run
    delay: str = ""  # MLP_OFFLOAD_DELAY of the killed run
    save_every: int = 2
    nproc: int = 1
    reference: str = ""  # another reference than the master's own (part 2)
    must_log: str = ""  # on the device, the saving run's log must show this (what the case is about happened)
    deterministic: bool = True  # run under --deterministic-mode
    resume_only_checked: bool = False  # no determinism: passes on the resume check's match, not bit identity
    resume_from: int = 0  # where set, the iteration the resume must start after (which checkpoint it chose)
    saving_extra: str = ""  # flags of the killed run and its resume only (they need --save)
    result: str = "FAIL"
    detail: str = ""
    launches: List[str] = field(default_factory=list)

    def offload_flags(self, home: Path) -> List[str]:
        flags = ["--offload-tiers", self.tiers, "--offload-subgroup-size", SUB, "--offload-probe-mb", "64",
                 "--offload-io-threads", "4", *TIERS[self.tiers].split(), *UPDATES[self.update].split(),
                 *MASTERS[self.master].split(), *self.extra.split(), *(DETERMINISTIC.split() if self.deterministic else [])]
        if "nvme" in self.tiers:
            (home / "nvme").mkdir(parents=True, exist_ok=True)
            flags += ["--offload-nvme-path", str(home / "nvme")]
        return flags


_port_lock = threading.Lock()


def free_port() -> int:
    """A port no one listens on now (another suite or job on the machine may hold fixed ones)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(name: str, args: List[str], nproc: int = 1, env: Optional[Dict[str, str]] = None,
           script: str = "pretrain_gpt.py", _retried: bool = False) -> dict:
    """One torchrun of ``script``; its loss records and the tail of its output."""
    if "--save" not in args:  # a run that saves nothing takes no save flags (refused without --save)
        args = [a for a in args if a != "--async-save"]
    with _port_lock:
        port = free_port()
    loss_log = WORK / f"{name}.jsonl"
    loss_log.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port", str(port),
           script, *COMMON, *args, "--loss-log", str(loss_log)]
    started = time.time()
    try:
        proc = subprocess.run(cmd, cwd=REPO, env={**os.environ, **(env or {})}, capture_output=True, text=True,
                              timeout=LIMIT)
        code, output = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as err:
        code, output = "timeout", (err.stdout or b"").decode(errors="replace") + (err.stderr or b"").decode(errors="replace")
    if code != 0 and "EADDRINUSE" in output and not _retried:  # another launch took the port meanwhile
        return launch(name, args, nproc, env, script, _retried=True)
    (WORK / f"{name}.log").write_text(output)
    records = [json.loads(line) for line in loss_log.read_text().splitlines()] if loss_log.exists() else []
    return {"name": name, "code": code, "records": records, "seconds": time.time() - started, "output": output}


def lines_of(result: dict, *needles: str) -> str:
    return " | ".join(line.strip()[:200] for line in result["output"].splitlines()
                      if any(n in line for n in needles) and "Warn" not in line)[:600]


REFERENCES: Dict[str, dict] = {}


def reference(name: str, nproc: int = 1, extra: str = "") -> dict:
    """megatron-core's own optimizer, no offload: fp32 ('fp32') or with half-away bf16 params ('remainders')."""
    script = "tests/integration/half_away_megatron.py" if name.startswith("remainders") else "pretrain_gpt.py"
    return launch(f"ref_{name}", ["--use-distributed-optimizer", DETERMINISTIC, *extra.split()], nproc, script=script)


def run_case(case: Case) -> None:
    """resume: one run saves at 2 (and 4) and trains on: the uninterrupted run; a second resumes from
    the save at 2. kill: an uninterrupted run without saves, a run stopped by the fault, its resume."""
    home = WORK / case.name
    shutil.rmtree(home, ignore_errors=True)
    home.mkdir(parents=True)
    ckpt = home / "ckpt"
    flags = case.offload_flags(home)
    if case.kind == "resume":
        whole = launch(f"{case.name}_whole", [*flags, "--save", str(ckpt), "--save-interval", "2"], case.nproc)
        runs = [whole]
        if whole["code"] == 0:
            at2 = only_iteration(ckpt, 2, home / "ckpt_at_2")
            runs.append(launch(f"{case.name}_resume", [*flags, "--load", str(at2)], case.nproc))
    else:
        whole = launch(f"{case.name}_whole", flags, case.nproc)
        env = {"MLP_OFFLOAD_FAULT": case.fault, **({"MLP_OFFLOAD_DELAY": case.delay} if case.delay else {})}
        saving = [*flags, "--save", str(ckpt), "--load", str(ckpt), "--save-interval", str(case.save_every),
                  *case.saving_extra.split()]
        killed = launch(f"{case.name}_killed", saving, case.nproc, env)
        runs = [whole, killed]
        if killed["code"] == 0:
            case.detail = f"the fault {case.fault} did not stop the run"
            return
        runs.append(launch(f"{case.name}_resume", saving, case.nproc))
    case.launches = [f"{r['name']} {r['seconds']:.0f} s exit {r['code']}" for r in runs]
    bad = [r for r in runs if r["code"] != 0 and not r["name"].endswith("_killed")]
    if bad:
        case.detail = f"{bad[0]['name']} exited {bad[0]['code']}: {tail(bad[0])}"
        (OUT / f"failed_{bad[0]['name']}.log").write_text(bad[0]["output"])  # the whole log comes back
        return
    case.whole, case.resumed = whole["records"], runs[-1]["records"]
    case.resume_line = lines_of(runs[-1], "resuming", "loaded checkpoint", "removed incomplete", "resume check")
    case.placement = lines_of(whole, "placement", "gpu tier auto:", "update split")
    case.saw_log = not case.must_log or DRY or case.must_log in whole["output"]


def only_iteration(ckpt: Path, iteration: int, into: Path) -> Path:
    """A checkpoint directory holding only ``iteration`` (hard links): what a resume from it finds."""
    name = f"iter_{iteration:07d}"
    into.mkdir()
    subprocess.run(["cp", "-al", str(ckpt / name), str(into / name)], check=True)
    (into / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return into


def tail(result: dict) -> str:
    """The failure's own words: the first error line a rank printed (torchrun's summary comes last and says
    only that a rank failed), else the last lines."""
    lines = [ln for ln in result["output"].splitlines() if ln.strip() and "Warn" not in ln]
    errors = [ln.strip() for ln in lines if re.search(r"(Error|Exception)\b.*:|^error:|> error", ln)
              and "elastic/errors" not in ln and "ChildFailedError" not in ln]
    return " / ".join(errors[:2] or lines[-4:])[-500:]


def judge(case: Case, ref: List[dict]) -> None:
    """PASS: the resumed iterations equal the uninterrupted run's bit for bit (and the case's log
    shows what it is about). Beside it: whether the uninterrupted run equals megatron-core's."""
    if not hasattr(case, "resumed"):
        return
    whole = {r["iteration"]: r for r in case.whole}
    diffs = []
    if sorted(whole) != list(range(1, ITERS + 1)):
        diffs.append(f"the uninterrupted run has iterations {sorted(whole)}")
    resumed_at = case.resumed[0]["iteration"] - 1 if case.resumed else ITERS
    its = [r["iteration"] for r in case.resumed]
    if its != list(range(resumed_at + 1, ITERS + 1)) or resumed_at < 1:
        diffs.append(f"resumed iterations {its}")
    if case.resume_from and resumed_at != case.resume_from:
        diffs.append(f"resumed after iteration {resumed_at}, not {case.resume_from}")
    if case.resume_only_checked:  # no determinism: the resume check must have compared and matched
        if not resume_check_matched(getattr(case, "resume_line", "")):
            diffs.append(f"the resumed run's log shows no matching resume check: {case.resume_line!r}")
    else:
        diffs += [f"iteration {r['iteration']}: loss {r['loss']!r} resumed vs {whole.get(r['iteration'], {}).get('loss')!r}"
                  for r in case.resumed if r != whole.get(r["iteration"])]
    if not getattr(case, "saw_log", True):
        diffs.append(f"the uninterrupted run's log never says {case.must_log!r}")
    want = {r["iteration"]: r for r in ref}
    apart = [it for it in sorted(whole) if whole[it] != want.get(it)]
    case.megatron = ("= megatron-core" if not apart and sorted(want) == sorted(whole) else
                     f"differs from megatron-core from iteration {apart[0] if apart else '?'}")
    if not case.deterministic or "--attention-backend local" in case.extra:
        case.megatron = "not compared (megatron-core's reference runs SDPA under --deterministic-mode)"
    case.result = "PASS" if not diffs else "FAIL"
    held = ("the resume check matched the saved state" if case.resume_only_checked else
            f"iterations {resumed_at + 1}-{ITERS} equal the uninterrupted run's bit for bit")
    case.detail = (f"resumed after iteration {resumed_at}: " + ("; ".join(diffs[:3]) if diffs else held) +
                   f"; uninterrupted run {case.megatron}")


def part1_cases() -> List[Case]:
    rng = random.Random(SEED)
    tiers, updates = list(TIERS), list(UPDATES)
    rng.shuffle(tiers)
    rng.shuffle(updates)
    masters = ["remainders", "fp32"] * 2
    rng.shuffle(masters)
    cases = [Case(f"m{k}_{t.replace(',', '-')}_{u}_{m}", t, u, m) for k, (t, u, m) in
             enumerate(zip(tiers, updates, masters))]
    master = rng.choice(list(MASTERS))
    cases += [
        Case("async_save", "gpu,host,nvme", "split", master, "--async-save"),
        Case("overlap_forward", "gpu,host,nvme", "device-model-buffers", rng.choice(list(MASTERS)),
             "--offload-overlap-forward"),
        Case("read_ahead", "host,nvme", "device-model-buffers", rng.choice(list(MASTERS)),
             f"--offload-read-ahead-gb {READ_AHEAD_GB}"),
        Case("kill_in_update", "gpu,host,nvme", rng.choice(list(UPDATES)), rng.choice(list(MASTERS)),
             kind="kill", fault="update#3", save_every=2),
        # The save of iteration 1 completes when the next one starts; the second one's background write
        # is slowed and killed just after it starts, so the resume must take iteration 1's.
        Case("kill_in_async_save", "gpu,host,nvme", "split", rng.choice(list(MASTERS)), "--async-save",
             kind="kill", fault="save-scheduled#2", delay="save-offload=0.05", save_every=1),
        Case("gpu_auto", "gpu,host,nvme", rng.choice(list(UPDATES)), rng.choice(list(MASTERS))),
        # 8-bit moments: codes and block scales in every tier, saved and resumed
        Case("fp8_moments", "gpu,host,nvme", rng.choice(list(UPDATES)), rng.choice(list(MASTERS)),
             "--use-precision-aware-optimizer --exp-avg-dtype fp8 --exp-avg-sq-dtype fp8"),
        # megatron-core's unfused attention: deterministic without the mode
        Case("local_attention", rng.choice(list(TIERS)), rng.choice(list(UPDATES)), rng.choice(list(MASTERS)),
             "--attention-backend local", deterministic=False),
        # the default attention without the mode: no exact resume; the digest of the state must match
        Case("resume_check", "gpu,host,nvme", rng.choice(list(UPDATES)), rng.choice(list(MASTERS)),
             deterministic=False, resume_only_checked=True),
        # params in host memory, each layer streamed in by the layer-major step (inputs in host memory too)
        Case("params_host", "gpu,host,nvme", rng.choice(list(UPDATES)), rng.choice(list(MASTERS)),
             f"{LAYER_MAJOR} --offload-params host --offload-activations host", must_log="in pinned host memory"),
        # the grads in host memory too: each layer's summed in a device slot during its backward
        # (remainders: a load then gathers the params set from the masters, through the device here)
        Case("params_grads_host", "gpu,host,nvme", rng.choice(list(UPDATES)), "remainders",
             f"{LAYER_MAJOR} --offload-params host --offload-grads host", must_log="of grads there too"),
        # saved by --async-save: the params it writes copied aside (the forked writer does not get the pinned buffers)
        Case("params_grads_host_async", "gpu,host,nvme", rng.choice(list(UPDATES)), rng.choice(list(MASTERS)),
             f"{LAYER_MAJOR} --offload-params host --offload-grads host --async-save",
             must_log="of params in host memory copied aside in"),
        # the same in passes of 1 or 2 of the step's 4 micro-batches: each pass's partial grad sums out to
        # host memory and back in the next, each layer's params in once per pass
        Case("params_grads_host_passes", "gpu,host,nvme", rng.choice(list(UPDATES)), rng.choice(list(MASTERS)),
             f"{LAYER_MAJOR} --offload-params host --offload-grads host --offload-activations host"
             f" --offload-microbatch-group {rng.choice([1, 2])}", must_log="micro-batches at a time"),
        # with 8-bit moments: the streamed grads' update into codes and block scales in every tier, saved and resumed
        Case("params_grads_host_fp8", "gpu,host,nvme", rng.choice(list(UPDATES)), rng.choice(list(MASTERS)),
             f"{LAYER_MAJOR} --offload-params host --offload-grads host --use-precision-aware-optimizer "
             f"--exp-avg-dtype fp8 --exp-avg-sq-dtype fp8", must_log="of grads there too"),
        # killed as the head's gradient of step 2's second micro-batch arrives, before any layer's backward
        Case("kill_params_host_in_backward", "gpu,host,nvme", rng.choice(list(UPDATES)), rng.choice(list(MASTERS)),
             f"{LAYER_MAJOR} --offload-params host", kind="kill", fault="backward#6", save_every=1),
    ]
    # Non-persistent checkpoints (persistent at 2, non-persistent at 3), killed in iteration 4's first forward
    # (4 micro-batches a step): the resume must take the later, non-persistent one.
    cases.append(Case("non_persistent", "gpu,host,nvme", rng.choice(list(UPDATES)), rng.choice(list(MASTERS)),
                      kind="kill", fault="forward#13", save_every=2, resume_from=3,
                      saving_extra="--non-persistent-save-interval 3 --non-persistent-ckpt-type global"))
    # After TIERS' fixed size (the later flag wins); a small start, so that the peak measured after
    # iteration 1 promotes subgroups (this model's state would all fit the default start at once).
    gpu_auto = next(c for c in cases if c.name == "gpu_auto")
    gpu_auto.extra = "--offload-gpu-cache-gb auto --offload-gpu-start-gb 0.1"
    gpu_auto.must_log = "promoted"
    return [c for c in cases if c.name in ONLY] if ONLY else cases


def resume_check_matched(line: str) -> bool:
    """The resume check's log line says the loaded state matches its save."""
    return "resume check" in line and " match" in line and "differ" not in line


MOE = ("--num-experts 4 --moe-router-topk 2 --moe-aux-loss-coeff 1e-2 --expert-model-parallel-size 2"
       " --moe-token-dispatcher-type alltoall")
# Part 2's references (megatron-core's own optimizer on two GPUs): name -> their flags beside COMMON.
PART2_REFERENCES = {"fp32_dp2": "", "fp32_moe": MOE, "fp32_pp2": "--pipeline-model-parallel-size 2"}
RESHARD = "dp2_dp1_dp2"


def part2_cases() -> List[Case]:
    streamed = f"{LAYER_MAJOR} --offload-params host --offload-grads host"
    cases = [Case("moe_ep2", "gpu,host,nvme", "device-model-buffers", "fp32", MOE, nproc=2, reference="fp32_moe"),
             # params and grads in host memory at DP2: each layer's grad slot summed over the ranks on the GPUs
             Case("params_grads_host_dp2", "gpu,host,nvme", "device-model-buffers", "fp32", streamed, nproc=2,
                  reference="fp32_dp2", must_log="of grads there too"),
             # MoE at EP2 with params and grads in host memory: each layer's slot, dense params' grads summed over
             # DP 2 and the experts' scaled for expert-DP 1, over NCCL (reference: megatron-core's MoE run)
             Case("moe_params_grads_host_ep2", "gpu,host,nvme", "device-model-buffers", "fp32", f"{MOE} {streamed}",
                  nproc=2, reference="fp32_moe", must_log="of grads there too"),
             # the layer-major step over two pipeline stages, params and grads in host memory (reference: 1F1B)
             Case("params_grads_host_pp2", "gpu,host,nvme", "split", "fp32",
                  f"{streamed} --pipeline-model-parallel-size 2", nproc=2, reference="fp32_pp2",
                  must_log="of grads there too")]
    return [c for c in cases if c.name in ONLY] if ONLY else cases


def unit_tests() -> dict:
    """The unit tests that run on CUDA where it is: whole files, and the CUDA cases of kernel files."""
    runs = [["tests/unit/test_resume_state.py", "tests/unit/test_sdpa_attention.py", "tests/unit/test_determinism.py",
             "tests/unit/test_async_save_memory.py", "tests/unit/test_kept_inputs.py",
             "tests/unit/test_host_params.py", "tests/unit/test_copy_back.py", "tests/unit/test_pin_in_place.py",
             "tests/unit/test_update_copies.py", "tests/unit/test_background_save.py",
             "tests/unit/test_async_save_host_params.py", "tests/unit/test_to_host.py",
             "tests/unit/test_checkpoint_worker.py"],
            ["tests/unit/test_cpu_one_pass.py", "tests/unit/test_fused_update.py", "tests/unit/test_model_buffers.py",
             "tests/unit/test_state_digest.py", "-k", "cuda"],
            ["tests/unit/test_blockwise8.py", "tests/unit/test_eight_bit_engine.py",
             "tests/unit/test_eight_bit_model_buffers.py", "-k", "cuda or device"]]  # 8-bit moments
    started, code, summaries, log = time.time(), 0, [], ""
    for args in runs:
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore", "--durations", "8", *args]
        if importlib.util.find_spec("pytest_timeout"):  # a hung test shows its stacks, the others still run
            cmd += ["--timeout", str(LIMIT // 2)]
        try:
            proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=LIMIT)
            out, rc = proc.stdout + proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as err:
            partial = err.stdout.decode(errors="replace") if isinstance(err.stdout, bytes) else (err.stdout or "")
            out, rc = f"timed out after {LIMIT} s\n{partial}", "timeout"
        log += out
        code = code or rc
        summary = [ln for ln in out.splitlines() if " passed" in ln or " failed" in ln or "timed out" in ln]
        failed = [ln.split(" - ")[0] for ln in out.splitlines() if ln.startswith(("FAILED ", "ERROR "))]
        summaries.append(" ".join([(summary or ["no summary"])[-1].strip("= ")] + failed))  # which, not only how many
    (WORK / "unit_tests.log").write_text(log)
    if code:  # the failures' tracebacks come back with the summary
        (OUT / "failed_unit_tests.log").write_text(log)
    summaries = [f"{' '.join(a for a in r if a.endswith('.py') or a.startswith('cuda'))}: {m}" for r, m in zip(runs, summaries)]
    return {"files": [a for r in runs for a in r if a.endswith(".py")], "code": code,
            "summary": "; ".join(summaries), "seconds": time.time() - started}


def dp_reshard() -> Case:
    """DP2 trains 4 iterations saving at 2; DP1 loads the save and saves at once; DP2 loads that and must
    go on as the uninterrupted DP2 run did."""
    case = Case(RESHARD, "gpu,host,nvme", "device-model-buffers", "fp32", nproc=2, reference="fp32_dp2")
    home = WORK / case.name
    shutil.rmtree(home, ignore_errors=True)
    home.mkdir(parents=True)
    runs = []
    steps = (("dp2_whole", 2, lambda: ["--save", str(home / "a"), "--save-interval", "2"]),
             ("dp1_load_save", 1, lambda: ["--load", str(only_iteration(home / "a", 2, home / "a2")),
                                           "--save", str(home / "b"), "--train-iters", "2"]),
             ("dp2_resume", 2, lambda: ["--load", str(home / "b")]))
    for name, nproc, extra in steps:
        result = launch(f"{case.name}_{name}", [*case.offload_flags(home / name), *extra()], nproc)
        runs.append(result)
        if result["code"] != 0:
            case.detail = f"{name} exited {result['code']}: {tail(result)}"
            return case
    case.launches = [f"{r['name']} {r['seconds']:.0f} s exit {r['code']}" for r in runs]
    case.whole, case.resumed = runs[0]["records"], runs[2]["records"]
    case.resume_line = lines_of(runs[2], "resuming", "loaded checkpoint")
    case.placement = lines_of(runs[0], "placement")
    return case


def _fingerprint() -> str:
    """benchmarks/tree_fingerprint.py's, of the tree this ran: names the code where git metadata may be stale."""
    spec = importlib.util.spec_from_file_location("tree_fingerprint", REPO / "benchmarks" / "tree_fingerprint.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.fingerprint(REPO)


def main() -> int:
    if WORK.exists():
        shutil.rmtree(WORK)
    WORK.mkdir(parents=True)
    OUT.mkdir(parents=True, exist_ok=True)
    commit = f"{os.environ.get('SUITE_COMMIT', 'unknown')} (code fingerprint {_fingerprint()})"
    header = (f"gpu_suite part {PART} at commit {commit}, seed {SEED} (SEED={SEED} draws the same cases), "
              f"{'DRY RUN on the CPU' if DRY else 'device'}, {PAR} launches at a time, {time.strftime('%Y-%m-%d %H:%M:%S')}")
    print(header, flush=True)
    started = time.time()
    with concurrent.futures.ThreadPoolExecutor(PAR) as pool:
        if PART == "1":
            cases = part1_cases()
            units = pool.submit(unit_tests)  # first: queued behind the launches it ran out of time
            refs = {m: pool.submit(reference, m) for m in MASTERS}
            done = pool.map(run_case, cases)
            for case, _ in zip(cases, done):
                print(f"  ran {case.name}: {', '.join(case.launches) or case.detail}", flush=True)
            refs = {m: f.result() for m, f in refs.items()}
            unit = units.result()
        else:
            cases = part2_cases()
            resharding = not ONLY or RESHARD in ONLY
            wanted = {c.reference for c in cases} | ({"fp32_dp2"} if resharding else set())
            refs = {name: pool.submit(reference, name, 2, extra) for name, extra in PART2_REFERENCES.items()
                    if name in wanted}
            reshard = pool.submit(dp_reshard) if resharding else None
            list(pool.map(run_case, cases))
            if reshard is not None:
                cases.append(reshard.result())
            refs = {m: f.result() for m, f in refs.items()}
            unit = None
    for name, ref in refs.items():
        print(f"  reference {name}: exit {ref['code']}, {ref['seconds']:.0f} s, "
              f"losses {[r['loss'] for r in ref['records']]}", flush=True)
    lines = [header]
    for case in cases:
        judge(case, refs[case.reference or case.master]["records"])
        what = f"tiers {case.tiers}, update {case.update}, master {case.master}" + "".join(
            f", {flags}" for flags in (case.extra, case.saving_extra) if flags)
        if case.fault:
            what += f", fault {case.fault}"
        lines.append(f"{case.result} {case.name} ({what}): {case.detail}")
        if case.launches:
            lines.append(f"     launches: {', '.join(case.launches)}")
        for attr in ("placement", "resume_line"):
            if getattr(case, attr, ""):
                lines.append(f"     {attr}: {getattr(case, attr)}")
    if unit is not None:
        ok = unit["code"] == 0
        cases.append(Case("unit", "", "", "", result="PASS" if ok else "FAIL"))
        lines.append(f"{'PASS' if ok else 'FAIL'} cuda_unit_tests ({len(unit['files'])} files, {unit['seconds']:.0f} s): "
                     f"{unit['summary']}")
    passed = sum(c.result == "PASS" for c in cases)
    same = sum(getattr(c, "megatron", "") == "= megatron-core" for c in cases)
    lines.append(f"SUMMARY gpu_suite part {PART}: {passed}/{len(cases)} PASS"
                 f"{'' if passed == len(cases) else ' -- FAILED: ' + ', '.join(c.name for c in cases if c.result != 'PASS')}"
                 f" in {time.time() - started:.0f} s, seed {SEED}, commit {commit}; {same} uninterrupted runs"
                 f" bit-identical to megatron-core's")
    text = "\n".join(lines) + "\n"
    print(text, end="")
    (OUT / f"gpu_suite_part{PART}.txt").write_text(text)
    # The cases' checkpoints (about 30 GB) would leave the next call on this warm machine short of disk.
    for home in WORK.iterdir():
        if home.is_dir():
            shutil.rmtree(home, ignore_errors=True)
    return 0 if passed == len(cases) else 1


if __name__ == "__main__":
    sys.exit(main())
