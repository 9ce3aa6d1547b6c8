"""``pretrain_gpt.py`` with the state broken on purpose after a load, before the resume check (a
test's variant of it). $RESUME_CHECK_BREAK lists ``what@rank`` items: ``param@R`` adds one to the
first element of rank R's first model param; ``step@R`` takes one Adam step from rank R's engines."""

import os
import runpy
import sys


def _break_before_the_check():
    import torch

    from megatron.training.checkpoint.resume_check import ResumeCheck

    breaks = [item.split("@") for item in os.environ["RESUME_CHECK_BREAK"].split(",")]
    finish = ResumeCheck.finish

    def broken_finish(self, model, optimizer_loaded):
        for what, rank in breaks:
            if int(rank) != torch.distributed.get_rank():
                continue
            if what == "param":
                with torch.no_grad():
                    next(model[0].parameters()).view(-1)[0] += 1
            elif what == "step":
                for shard, _ in self.observed.values():
                    shard.engine.steps_done -= 1
        return finish(self, model, optimizer_loaded)

    ResumeCheck.finish = broken_finish


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    _break_before_the_check()
    runpy.run_path(os.path.join(sys.path[0], "pretrain_gpt.py"), run_name="__main__")
