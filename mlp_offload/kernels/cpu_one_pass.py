"""One pass per element for the CPU update: merge/widen the stored state, AdamW, round back and
split, block by block in the cache, in a small C++ extension built at run time (``load_inline``,
cached under the user's torch extensions directory, one build per CPU model and source).

The multi-pass path (``update.Fp32Working`` around ``update.AdamKernel``) makes about eight full
passes over a subgroup; this kernel reads the stored state, the fp32 gradient and the bf16 high
halves once and writes them once. ``fused_update`` is its GPU twin and defines the arithmetic; on
the CPU, torch's own kernels differ from it in three ways, measured on torch 2.13's CPU build and
covered by ``CpuVariant``:

* operand order: ``addcmul_`` computes ``v + (w2 * g) * g`` and ``addcdiv_`` ``p + (s * m) / d``
  (``torch_order``), where the CUDA foreach kernels compute ``w2 * (g * g)`` and ``s * (m / d)``;
* the square root: torch's vectorised CPU ``sqrt`` (MKL's ``vsSqrt`` in that build) is not
  correctly rounded (about one element in five is an ulp off); ``torch_sqrt`` runs torch's own
  ``sqrt`` on each block (elementwise and position-independent, so a block gives the bits a whole
  tensor gets), otherwise ``std::sqrt`` (IEEE);
* the FMA contractions and the reciprocal division, as ``fused_update.Variant``.

``verified_cpu_one_pass`` picks, at start-up, the first variant bit-identical to the multi-pass
path with the engine's kernel on a random sample (as ``fused_update.verified_fused_update`` does on
the device), or None: the multi-pass path always remains. ``cpu_one_pass_like`` gives the kernel
in the arithmetic of a device ``Variant`` (so CPU-updated subgroups can carry the device's bits).
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from .cpu_one_pass_source import SOURCE as _SOURCE
from .fused_update import AdamHyper, Variant, f32, unhandled, matches, one_pass_handles

log = logging.getLogger("mlp_offload")

BLOCK = 4096  # elements per block: each thread's working set (p, m, v, sqrt) stays in L1/L2

CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-fno-math-errno"]


@dataclass(frozen=True)
class CpuVariant:
    """How the CPU kernel rounds: ``arith`` as the device kernel's ``Variant`` (FMA contractions,
    reciprocal division); ``torch_order``: torch's CPU operand order in addcmul ((w2*g)*g) and
    addcdiv ((s*m)/d; there is no FMA to contract, ``arith.fma_addcdiv`` is unused);
    ``torch_sqrt``: torch's CPU sqrt instead of the IEEE one."""

    arith: Variant
    torch_order: bool
    torch_sqrt: bool

    def flags(self, small: bool) -> int:
        a = self.arith
        return (small | a.fma_lerp << 1 | a.fma_addcmul << 2 | (a.fma_addcdiv and not self.torch_order) << 3
                | a.reciprocal_div << 4 | self.torch_order << 5 | self.torch_sqrt << 6)

    def describe(self) -> str:
        a = self.arith
        fma = [name for name, on in (("lerp", a.fma_lerp), ("addcmul", a.fma_addcmul),
                                     ("addcdiv", a.fma_addcdiv and not self.torch_order)) if on]
        return (f"{'torch CPU' if self.torch_order else 'CUDA foreach'} operand order, "
                f"fma in {'/'.join(fma) or 'none'}, {'reciprocal' if a.reciprocal_div else 'true'} division, "
                f"{'torch' if self.torch_sqrt else 'IEEE'} sqrt")


def device_variant(variant: Variant) -> CpuVariant:
    """The CPU kernel in a device kernel's (``fused_update``'s) arithmetic."""
    return CpuVariant(variant, torch_order=False, torch_sqrt=False)


def cpu_variants(torch_sqrt_first: bool = True) -> Tuple[CpuVariant, ...]:
    """Every distinct variant, torch's CPU forms first (its kernels contract lerp and addcmul into
    FMAs and divide truly in torch 2.13's AVX2/AVX512 code)."""
    out: List[CpuVariant] = []
    for order, sqrt_, lerp, cmul, recip, cdiv in itertools.product(
            (True, False), (torch_sqrt_first, not torch_sqrt_first), (True, False), (True, False), (False, True),
            (True, False)):
        if order and cdiv:  # no FMA in torch's addcdiv order: one variant, not two
            continue
        out.append(CpuVariant(Variant(lerp, cmul, cdiv, recip), order, sqrt_))
    return tuple(out)


def cpu_fingerprint() -> str:
    """The CPU model and flags: a -march=native build must not run on another CPU (a shared home)."""
    text = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "flags")):
                    text += line
                if line.startswith("flags"):
                    break
    except OSError:
        import platform
        text = platform.processor() + platform.machine()
    return hashlib.sha1(text.encode()).hexdigest()[:10]


_build_error: Optional[str] = None
_warned = False


def _name() -> str:
    """One extension per CPU, source and flags: a cached build is never stale, so a process that
    finds it built imports it without asking ninja (about a second per process otherwise)."""
    key = f"{cpu_fingerprint()}\n{_SOURCE}\n{BLOCK}\n{CFLAGS}\n{torch.__version__}"
    return f"mlp_offload_cpu_one_pass_{hashlib.sha1(key.encode()).hexdigest()[:12]}"


def import_built(name: str):
    """The extension from an earlier build, or None (not built, or a build under way: its lock)."""
    import importlib.util
    from torch.utils.cpp_extension import _get_build_directory

    folder = _get_build_directory(name, verbose=False)
    path = os.path.join(folder, f"{name}.so")
    if not os.path.exists(path) or os.path.exists(os.path.join(folder, "lock")):
        return None
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_background: Optional[threading.Thread] = None


def build_in_background() -> None:
    """Start building (or importing) the extension on a thread of its own: on a node that has not
    built it yet the compile takes tens of seconds, which then run while
    the caller builds its model."""
    global _background
    if _background is None:
        _background = threading.Thread(target=_extension, name="mlp_offload cpu kernel build", daemon=True)
        _background.start()


def extension():
    """The compiled extension, built once per CPU (cached under torch's extensions directory; its
    build directory is locked while a process builds, so concurrent processes build it once), or
    None where it cannot be built (the reason in ``build_error()``). Waits for a background build."""
    if _background is not None and _background is not threading.current_thread():
        _background.join()
    return _extension()


def forget_extension() -> None:
    """Forget the built (or failed) kernel: the next use imports or builds it again (tests of the build)."""
    _extension.cache_clear()


@functools.lru_cache(maxsize=None)
def _extension():
    global _build_error
    name = _name()
    try:
        try:
            built = import_built(name)
        except Exception:  # a half-written file from a build that died: build it again
            built = None
        return built or _build(name)
    except Exception as err:  # no compiler, no ninja, a failed build: the multi-pass path remains
        lines = str(err).strip().splitlines()
        _build_error = f"{type(err).__name__}: {lines[-1] if lines else ''}"
        return None


def _build(name: str):
    from torch.utils.cpp_extension import load_inline

    started = time.perf_counter()
    quiet = logging.getLogger("torch.utils.cpp_extension")  # its compiler notes: our one warning says it
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        ext = load_inline(name=name, cpp_sources=_SOURCE % {"block": BLOCK}, functions=["adamw"],
                          extra_cflags=CFLAGS, extra_ldflags=["-fopenmp"], verbose=False)
    finally:
        quiet.setLevel(level)
    seconds = time.perf_counter() - started
    if seconds > 2:
        log.info("CPU one-pass AdamW kernel ready after %.1f s (built, or another process built it)", seconds)
    return ext


def build_error() -> Optional[str]:
    return _build_error


class CpuOnePass:
    """AdamW in one pass over CPU state stored in ``codecs`` (``fused_update.one_pass_handles``:
    param or int16 remainders, exp_avg, exp_avg_sq), with the signature of
    ``fused_update.FusedAdamW``; ``variant`` says how it rounds. (The C++ side dispatches on the
    stored tensors' dtypes, which each handled format's storage dtype names one to one.)"""

    def __init__(self, variant: CpuVariant, codecs: Sequence, ext=None):
        if not one_pass_handles(codecs):
            raise ValueError(unhandled(codecs))
        self.variant = variant
        self.remainders = codecs[0].kernel_key == "rem16"
        self.ext = ext if ext is not None else extension()
        if self.ext is None:
            raise RuntimeError(f"the CPU one-pass kernel could not be built ({build_error()})")

    def __call__(self, stored: Sequence[torch.Tensor], grad: torch.Tensor, high: Optional[torch.Tensor],
                 hyper: AdamHyper, step: int) -> None:
        """``stored``: (param or remainders, exp_avg, exp_avg_sq), updated in place; ``grad`` fp32;
        ``high``: the bf16 high halves of a remainders master (read and updated in place)."""
        p, m, v = stored
        if p.numel() == 0:
            return
        if self.remainders and high is None:
            raise ValueError("a master stored as remainders needs its bf16 high halves")
        # The scalars as torch rounds them for its fp32 kernels (as fused_update.FusedAdamW does).
        bc1 = 1 - hyper.beta1 ** step
        bc2_sqrt = (1 - hyper.beta2 ** step) ** 0.5
        w1 = f32(1 - hyper.beta1)
        divisor = f32(1.0 / f32(bc2_sqrt)) if self.variant.arith.reciprocal_div else f32(bc2_sqrt)
        decay = f32(1 - hyper.lr * hyper.weight_decay) if hyper.weight_decay != 0 else 1.0
        scalars = [decay, w1, f32(1.0 - w1), f32(hyper.beta2), f32(1 - hyper.beta2), divisor, f32(hyper.eps),
                   f32((hyper.lr / bc1) * -1)]
        self.ext.adamw(p, high if high is not None else p, grad, m, v, scalars,
                       self.variant.flags(abs(w1) < 0.5))


def cpu_one_pass_like(variant: Variant, codecs: Sequence) -> Optional[CpuOnePass]:
    """The CPU kernel in the device kernel's arithmetic (``variant``, as ``verified_fused_update``
    chose it), so CPU-updated subgroups get the device-updated ones' bits; None without a build."""
    ext = extension()
    return CpuOnePass(device_variant(variant), codecs, ext) if ext is not None else None


def torch_sqrt_is_ieee(numel: int = 1 << 18) -> bool:
    """Whether torch's CPU sqrt gives the correctly rounded fp32 square root on a random sample
    (through float64: sqrt rounded twice is still correctly rounded for fp32 operands)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(numel, generator=gen) * torch.exp2(torch.randint(-40, 10, (numel,), generator=gen).float())
    return torch.equal(x.sqrt(), x.double().sqrt().float())


def verified_cpu_one_pass(codecs: Sequence, adam_kernel,
                          variants: Optional[Sequence[CpuVariant]] = None) -> Tuple[Optional[CpuOnePass], str]:
    """The CPU kernel in the first variant bit-identical to the multi-pass path with ``adam_kernel``
    on this CPU, or None (the multi-pass path stays); and a phrase for the log."""
    if adam_kernel.kind == "fused":  # torch's fused CPU kernel: span-dependent vector/scalar paths
        return None, "multi-pass (torch's fused kernel)"
    if not one_pass_handles(codecs):
        return None, unhandled(codecs)
    global _warned
    ext = extension()
    if ext is None:
        if not _warned:  # once per process, not per engine
            log.warning("CPU one-pass AdamW unavailable (%s); using the multi-pass path", build_error())
            _warned = True
        return None, "multi-pass (one-pass kernel failed to build)"
    if variants is None:
        variants = cpu_variants(torch_sqrt_first=not torch_sqrt_is_ieee())
    for variant in variants:
        kernel = CpuOnePass(variant, codecs, ext)
        try:
            if matches(kernel, adam_kernel, codecs, "cpu", numel=1 << 18):
                return kernel, f"one pass ({variant.describe()}; bit-identical to the multi-pass path on a sample)"
        except Exception as err:  # never a crash: the multi-pass path is always there
            log.warning("CPU one-pass AdamW failed (%s: %s); using the multi-pass path", type(err).__name__, err)
            return None, "multi-pass (one-pass kernel failed)"
    return None, f"multi-pass (no CPU one-pass variant was bit-identical: tried {len(variants)})"


def cpu_one_pass_for_device(fused, codecs: Sequence, device, numel: int = 1 << 18,
                            steps: int = 3) -> Tuple[Optional[CpuOnePass], str]:
    """On a GPU run: the CPU kernel in the arithmetic of the device's verified one-pass kernel
    ``fused`` (``fused_update.FusedAdamW``), checked on a sample to give its bits, so a subgroup
    updated by the CPU gets the bits the GPU would have given it (and so megatron-core's, where the
    device kernel reproduces them); None where it does not (then the CPU keeps its own kernel)."""
    from .fused_update import SAMPLE_HYPERS, sample_state

    kernel = cpu_one_pass_like(fused.variant, codecs)
    if kernel is None:
        return None, "multi-pass (one-pass kernel failed to build)"
    for seed, hyper in enumerate(SAMPLE_HYPERS):
        cpu_state, grad, high = sample_state(codecs, numel, "cpu", seed)
        dev_state = [t.to(device, copy=True) for t in cpu_state]
        dev_grad, dev_high = grad.to(device, copy=True), high.to(device, copy=True)
        for step in range(1, steps + 1):
            kernel(cpu_state, grad, high, hyper, step)
            fused(dev_state, dev_grad, dev_high, hyper, step)
        same = all(torch.equal(a.view(torch.uint8), b.cpu().view(torch.uint8)) for a, b in zip(cpu_state, dev_state))
        if not same or not torch.equal(high.view(torch.int16), dev_high.cpu().view(torch.int16)):
            return None, "its own arithmetic (the device kernel's was not reproduced on a sample)"
    return kernel, f"one pass in the device kernel's arithmetic ({fused.variant.describe()}; same bits on a sample)"
