"""Imports that cost seconds at every rank's start and serve nothing in the run, avoided before
megatron-core is imported (so ``pretrain_gpt.py`` calls ``avoid_unused_imports`` first).

- megatron-core imports wandb wherever it is installed (its timers and inference contexts try it
  at import time), seconds of CPU per process. It is imported on first use instead (as
  ``--wandb-project`` uses it); megatron-core only keeps the name at import.
- On a CPU device megatron-core's fused kernels are off (``model.kernels``), yet its ``jit_fuser``
  decorator is ``torch.compile``, which imports TorchDynamo and Inductor as each fused function is
  defined: seconds of CPU per process for nothing. There its ``megatron.core.jit`` is replaced by
  one whose ``jit_fuser`` leaves functions as they are (its own ``disable_jit_fuser`` state).
On a machine of few cores this is a large part of a small CPU run's start-up (each test launch starts
two or more such processes; docs/design.md, "The Megatron adapter").
"""

from __future__ import annotations

import importlib.util
import sys
import types
from typing import Sequence

LAZY_OPTIONAL = ("wandb",)


def avoid_unused_imports(argv: Sequence[str]) -> None:
    if "megatron.core" in sys.modules:  # too late: it imported what it imports
        return
    for name in LAZY_OPTIONAL:
        _load_lazily(name)
    if not _runs_on_cuda(argv):
        sys.modules.setdefault("megatron.core.jit", _jit_without_compile())


def _load_lazily(name: str) -> None:
    """``import name`` gives a stand-in that imports the module on its first use and hands every
    attribute over from it. Not ``importlib.util.LazyLoader``: torch's import-time
    ``inspect.getmodule`` scans ``__file__`` of every loaded module, which would load it at once."""
    if name in sys.modules:
        return
    spec = importlib.util.find_spec(name)
    if spec is None:  # not installed: megatron-core takes its own ImportError path
        return
    sys.modules[name] = _Deferred(name, spec)


class _Deferred(types.ModuleType):
    def __init__(self, name: str, spec):
        super().__init__(name)
        self.__spec__, self.__file__ = spec, spec.origin
        self.__path__ = list(spec.submodule_search_locations or [])

    def __getattr__(self, attr: str):  # only for names this stand-in lacks: load the real module
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        if sys.modules.get(self.__name__) is self:
            del sys.modules[self.__name__]
        return getattr(importlib.import_module(self.__name__), attr)


def _runs_on_cuda(argv: Sequence[str]) -> bool:
    """What ``--device`` (default auto) will resolve to, read before the arguments are parsed."""
    device = "auto"
    for i, arg in enumerate(argv):
        if arg == "--device" and i + 1 < len(argv):
            device = argv[i + 1]
        elif arg.startswith("--device="):
            device = arg.split("=", 1)[1]
    if device != "auto":
        return device == "cuda"
    import torch

    return torch.cuda.is_available()


def _jit_without_compile() -> types.ModuleType:
    """megatron-core's ``megatron.core.jit`` in its disabled state: the same names, no compile."""
    module = types.ModuleType("megatron.core.jit", "megatron-core's jit_fuser, disabled on a CPU run")

    def noop_decorator(func):
        return func

    module.noop_decorator = noop_decorator
    module.jit_fuser = noop_decorator
    module.enable_jit_fuser = lambda: None  # stays off: nothing here is compiled on a CPU device
    module.disable_jit_fuser = lambda: None
    return module
