"""What Megatron-LM does around each training iteration besides training: --profile (torch.profiler
over a window of iterations), --manual-gc, --empty-unused-memory-level."""

from __future__ import annotations

import gc
import os
from typing import Optional

import torch


class IterationHooks:
    def __init__(self, args, rank: int, device: torch.device):
        self.args = args
        self.rank = rank
        self.cuda = device.type == "cuda"
        self.profiler: Optional[torch.profiler.profile] = None
        self.profiling = args.profile and rank in args.profile_ranks
        if args.manual_gc:
            # Python's collector pauses ranks at different times; collect together instead.
            gc.disable()
            gc.collect()

    def before(self, iteration: int) -> None:
        """``iteration`` is the number of iterations already done (Megatron-LM counts the same)."""
        if self.profiling and iteration == self.args.profile_step_start:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.cuda:
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities, record_shapes=False)
            self.profiler.start()

    def after_forward_backward(self) -> None:
        if self.cuda and self.args.empty_unused_memory_level >= 2:
            torch.cuda.empty_cache()

    def after(self, iteration: int) -> None:
        """``iteration``: the count including the one just done."""
        if self.cuda and self.args.empty_unused_memory_level >= 1:
            torch.cuda.empty_cache()
        if self.args.manual_gc and self.args.manual_gc_interval and iteration % self.args.manual_gc_interval == 0:
            gc.collect()
        if self.profiler is not None and iteration >= self.args.profile_step_end:
            self.stop()

    def stop(self) -> None:
        """Write the trace under --profile-dir or --tensorboard-dir (as Megatron-LM's torch profiler does);
        without either, print the busiest operators."""
        if self.profiler is None:
            return
        self.profiler.stop()
        window = f"iterations {self.args.profile_step_start + 1}..{self.args.profile_step_end}"
        directory = getattr(self.args, "profile_dir", None) or getattr(self.args, "tensorboard_dir", None)
        if directory:
            os.makedirs(directory, exist_ok=True)
            path = os.path.join(directory, f"profile_rank{self.rank}.json")
            self.profiler.export_chrome_trace(path)
            print(f"> profile of {window} written to {path}", flush=True)
        else:
            table = self.profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=10)
            print(f"> profile of {window} (rank {self.rank}):\n{table}", flush=True)
        self.profiler = None
