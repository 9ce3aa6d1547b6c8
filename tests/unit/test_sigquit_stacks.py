"""SIGQUIT prints every thread's Python stack and the process goes on (megatron/training/runtime/signals.py):
from the signal watcher, holding the GIL (faulthandler's C-level dump of running threads crashed a rank with
SIGSEGV in a CI run), also while a stop signal waits for the loop's next iteration, and in a forked helper
from its main thread. Each in a process of its own: the watcher takes the process's signal dispositions."""

import os
import subprocess
import sys

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))

SCRIPT = r"""
import os, signal, sys, threading, time
from megatron.training.runtime.signals import SigtermWatcher
SigtermWatcher(save_on=None)
started = threading.Event()

def parked_in_a_lock():
    started.set()
    lock = threading.Lock(); lock.acquire(); lock.acquire()  # blocked here for good (a stuck collective's wait)

def busy_in_python():
    x = 0
    while True:
        x += 1  # frames changing all the while: what the C-level dump read unsafely

threading.Thread(target=parked_in_a_lock, daemon=True).start()
threading.Thread(target=busy_in_python, daemon=True).start()
started.wait()
for _ in range(20):
    os.kill(os.getpid(), signal.SIGQUIT)
    time.sleep(0.02)
time.sleep(0.5)
pid = os.fork()
if pid == 0:  # a forked helper: its own stacks, from its main thread
    def writer_loop():
        os.kill(os.getpid(), signal.SIGQUIT)
        time.sleep(0.3)
    writer_loop()
    os._exit(0)
os.waitpid(pid, 0)
print("went on", flush=True)
"""


def test_sigquit_prints_every_threads_stack_and_the_process_goes_on():
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": REPO, "RANK": "3"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "went on"
    dumps = done.stderr.split("[rank 3] ")
    watcher = [d for d in dumps if d.startswith("SIGQUIT: ")]
    # a dump a signal; two SIGQUITs pending at once are one (standard signals do not queue), so a loaded
    # machine may see fewer than 20
    assert 10 <= len(watcher) <= 20, done.stderr[-3000:]
    for dump in watcher:
        assert "Thread 0x" in dump and "(MainThread; most recent call first)" in dump
        assert "in parked_in_a_lock\n" in dump and "in busy_in_python\n" in dump
        assert "signal-watcher" not in dump  # the dumping thread leaves itself out
    helper = [d for d in dumps if d.startswith("SIGQUIT (a forked helper): ")]
    assert len(helper) == 1 and helper[0].count("Thread 0x") == 1  # a fork keeps one thread: the one that forked
    assert "in writer_loop\n" in helper[0], helper[0]


STOPPING = r"""
import os, signal, sys, time
from megatron.training.runtime.signals import SigtermWatcher
watcher = SigtermWatcher(save_on=signal.SIGUSR1)
watcher.iteration_done(1.0)  # a loop under way: the stop waits for its next iteration boundary
os.kill(os.getpid(), signal.SIGUSR1)
assert watcher.requested.wait(10), "the save signal was not seen"
def the_loop_between_iterations():
    os.kill(os.getpid(), signal.SIGQUIT)
    time.sleep(1.0)
the_loop_between_iterations()
print("stop requested, stacks printed", flush=True)
os._exit(0)
"""


def test_sigquit_still_prints_stacks_while_a_stop_waits_for_the_loop():
    done = subprocess.run([sys.executable, "-c", STOPPING], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": REPO, "RANK": "1"})
    assert done.returncode == 0 and done.stdout.strip() == "stop requested, stacks printed", done.stderr[-3000:]
    assert "[rank 1] SIGUSR1 received: saving a checkpoint after the current iteration" in done.stderr
    dump = done.stderr[done.stderr.index("[rank 1] SIGQUIT: "):]
    assert "in the_loop_between_iterations\n" in dump and "(signal-stop; most recent call first)" in dump
