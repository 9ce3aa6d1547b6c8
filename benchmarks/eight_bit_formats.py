"""Which 8-bit formats for the Adam moments: a measured comparison on CPU (no downloads).

A small GPT-like byte-level LM (2 layers) trains on the Python standard library's own source with
the same fp32 AdamW arithmetic (``blockwise8.adamw_fp32``) and the moments stored in each
candidate form between steps: fp32, bf16, and 8-bit with one scale per block (first moment e4m3
or int8; second moment e4m3, e5m2, e4m3 of sqrt(v), uint8 of sqrt(v), or a uint8
dynamic-exponent map as bitsandbytes' 8-bit Adam keeps it; blocks of 128 and 256). Every run sees
the same initial weights and batches. It prints, per scheme, the train loss (mean of the last 50
steps), the held-out loss, their distance from fp32's, and along the fp32 run, how far each
scheme's stored moments move the update (relative error of m/(sqrt(v)+eps), and the share of
nonzero v elements stored as 0).

    python benchmarks/eight_bit_formats.py [--steps 250] [--all]

26 minutes on 2 CPU cores shared under a load average near 7 (fewer unshared). Results and the
choice: docs/design.md, "Adam moments in 8 bits".
"""

from __future__ import annotations

import argparse
import glob
import math
import os
import sys
import sysconfig
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from mlp_offload import AdamHyper, blockwise8 as b8  # noqa: E402


def stdlib_bytes(limit: int) -> torch.Tensor:
    """The standard library's .py files, sorted by path, as bytes (``limit`` of them)."""
    out, size = [], 0
    for path in sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py"))):
        with open(path, "rb") as f:
            data = f.read()
        out.append(data)
        size += len(data)
        if size >= limit:
            break
    return torch.frombuffer(bytearray(b"".join(out)[:limit]), dtype=torch.uint8).long()


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        bsz, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(bsz, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(bsz, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyLM(nn.Module):
    def __init__(self, d: int, layers: int = 2, heads: int = 4, ctx: int = 128):
        super().__init__()
        self.tok, self.pos = nn.Embedding(256, d), nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, 256, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


# ---- stored forms of one moment: encode(fp32) -> stored, decode(stored) -> fp32 ----

class Plain:
    def __init__(self, dtype):
        self.dtype, self.name = dtype, {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]

    def encode(self, x, layout):
        return x.to(self.dtype)

    def decode(self, stored, layout):
        return stored.float()


class Blockwise:
    def __init__(self, fmt: b8.CodeFormat):
        self.fmt, self.name = fmt, fmt.name

    def encode(self, x, layout):
        return b8.quantize(x, layout, self.fmt)

    def decode(self, stored, layout):
        return b8.dequantize(stored, layout)


def dynamic_map() -> torch.Tensor:
    """256 non-negative values: a decimal exponent 10**-e coded by e leading zero bits, the bits
    after the first one a linear fraction in [0.1, 1] (bitsandbytes' dynamic tree map, unsigned),
    plus 0 and 1."""
    values = [0.0, 1.0]
    for e in range(7):
        n = 2 ** (7 - e)
        edges = torch.linspace(0.1, 1.0, n + 1)
        values += (((edges[:-1] + edges[1:]) / 2) * 10.0 ** -e).tolist()
    return torch.tensor(sorted(values), dtype=torch.float32)


class DynamicUint8:
    """v / blockwise absmax coded as the nearest value of ``dynamic_map`` (uint8 index)."""

    name = "dyn-uint8"

    def __init__(self):
        self.table = dynamic_map()
        self.mids = (self.table[1:] + self.table[:-1]) / 2

    def encode(self, x, layout):
        scales = b8.block_scales(x, layout, 1.0)
        per = scales[layout.block_index(x.device)]
        normed = torch.where(per > 0, x / per, 0.0)
        return torch.bucketize(normed, self.mids).to(torch.uint8), scales

    def decode(self, stored, layout):
        codes, scales = stored
        return self.table[codes.long()] * scales[layout.block_index(codes.device)]


class Scheme:
    def __init__(self, m, v, block=None):
        self.m, self.v, self.block = m, v, block
        self.name = m.name if m.name == v.name and block is None else f"m {m.name}, v {v.name}, B {block}"

    def layout(self, p):
        return b8.BlockLayout.whole(p.numel(), self.block or p.numel())


# Trained by default (the rest are probed along the fp32 run only; --all trains every one).
TRAINED = {("e4m3", "e4m3", 128), ("e4m3", "e5m2", 128), ("e4m3", "sqrt-e4m3", 128), ("e4m3", "sqrt-uint8", 128),
           ("e4m3", "dyn-uint8", 128), ("int8", "sqrt-e4m3", 128), ("int8", "sqrt-uint8", 128),
           ("int8", "dyn-uint8", 128), ("e4m3", "sqrt-e4m3", 256), ("int8", "sqrt-uint8", 256)}


def schemes():
    out = [Scheme(Plain(torch.float32), Plain(torch.float32)), Scheme(Plain(torch.bfloat16), Plain(torch.bfloat16))]
    f = b8.FORMATS
    v_forms = [Blockwise(f["e4m3"]), Blockwise(f["e5m2"]), Blockwise(f["sqrt-e4m3"]), Blockwise(f["sqrt-uint8"]),
               DynamicUint8()]
    for block in (128, 256):
        for m in (Blockwise(f["e4m3"]), Blockwise(f["int8"])):
            for v in v_forms:
                out.append(Scheme(m, v, block))
    return out


class StoredAdamW:
    """AdamW (``blockwise8.adamw_fp32``) whose moments live in ``scheme``'s stored form between steps."""

    def __init__(self, params, scheme: Scheme, hyper: AdamHyper):
        self.params, self.scheme, self.hyper, self.t = list(params), scheme, hyper, 0
        self.layouts = [scheme.layout(p) for p in self.params]
        zero = [torch.zeros(p.numel()) for p in self.params]
        self.m = [scheme.m.encode(z, lay) for z, lay in zip(zero, self.layouts)]
        self.v = [scheme.v.encode(z, lay) for z, lay in zip(zero, self.layouts)]

    def step(self, lr: float):
        self.t += 1
        hyper = AdamHyper(lr, self.hyper.beta1, self.hyper.beta2, self.hyper.eps, self.hyper.weight_decay)
        s = b8.step_scalars(hyper, self.t)
        for k, (p, lay) in enumerate(zip(self.params, self.layouts)):
            master = p.data.view(-1)
            m, v, _ = b8.adamw_fp32(master, p.grad.view(-1), self.scheme.m.decode(self.m[k], lay),
                                    self.scheme.v.decode(self.v[k], lay), s, hyper.weight_decay != 0)
            self.m[k], self.v[k] = self.scheme.m.encode(m, lay), self.scheme.v.encode(v, lay)

    def moments(self):
        return [(self.scheme.m.decode(m, lay), self.scheme.v.decode(v, lay))
                for m, v, lay in zip(self.m, self.v, self.layouts)]


def update_error(moments, scheme: Scheme, eps: float):
    """Relative error of m/(sqrt(v)+eps) (norm over all params) with ``moments`` stored in ``scheme``,
    and the share of nonzero v elements that come back as 0."""
    num = den = 0.0
    lost = nonzero = 0
    for m, v in moments:
        lay = scheme.layout(m)
        mq, vq = scheme.m.decode(scheme.m.encode(m, lay), lay), scheme.v.decode(scheme.v.encode(v, lay), lay)
        u, uq = m / (v.sqrt() + eps), mq / (vq.sqrt() + eps)
        num += float(((uq - u) ** 2).sum())
        den += float((u ** 2).sum())
        lost += int(((v > 0) & (vq == 0)).sum())
        nonzero += int((v > 0).sum())
    return math.sqrt(num / den), lost / max(nonzero, 1)


def batches(data: torch.Tensor, steps: int, batch: int, ctx: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, data.numel() - ctx - 1, (batch,), generator=gen)
        idx = starts[:, None] + torch.arange(ctx + 1)
        yield data[idx[:, :-1]], data[idx[:, 1:]]


def run(scheme, args, train, held_out, probe=None):
    torch.manual_seed(0)
    model = TinyLM(args.dim, ctx=args.ctx)
    hyper = AdamHyper(args.lr, 0.9, 0.95, 1e-8, 0.1)
    opt = StoredAdamW(model.parameters(), scheme, hyper)
    losses, probes = [], []
    for t, (x, y) in enumerate(batches(train, args.steps, args.batch, args.ctx, seed=1), start=1):
        lr = args.lr * min(1.0, t / 30) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t / args.steps)))
        loss = F.cross_entropy(model(x).view(-1, 256), y.reshape(-1))
        model.zero_grad(set_to_none=False)
        loss.backward()
        opt.step(lr)
        losses.append(loss.item())
        if probe is not None and t % 25 == 0:
            moments = opt.moments()
            probes.append({s.name: update_error(moments, s, hyper.eps) for s in probe})
    with torch.no_grad():
        held = [F.cross_entropy(model(x).view(-1, 256), y.reshape(-1)).item()
                for x, y in batches(held_out, 8, args.batch, args.ctx, seed=2)]
    return sum(losses[-50:]) / 50, sum(held) / len(held), probes


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=250)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--ctx", type=int, default=64)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--all", action="store_true", help="train every scheme (else those in TRAINED)")
    args = parser.parse_args()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    data = stdlib_bytes(3 << 20)
    split = int(data.numel() * 0.95)
    train, held_out = data[:split], data[split:]
    all_schemes = schemes()
    started = time.time()
    base_train, base_held, probes = run(all_schemes[0], args, train, held_out, probe=all_schemes[1:])
    print(f"{len(data)} bytes of stdlib source; d {args.dim}, 2 layers; {args.steps} steps, batch {args.batch} x {args.ctx}, "
          f"lr {args.lr}, betas (0.9, 0.95), wd 0.1; torch {torch.__version__}")
    print(f"{'scheme':36s} {'train':>7s} {'d train':>8s} {'held':>7s} {'d held':>8s} "
          f"{'upd err':>8s} {'v->0':>8s}")
    print(f"{all_schemes[0].name:36s} {base_train:7.4f} {0:8.4f} {base_held:7.4f} {0:8.4f}")
    for scheme in all_schemes[1:]:
        err = sum(p[scheme.name][0] for p in probes) / len(probes)
        lost = sum(p[scheme.name][1] for p in probes) / len(probes)
        key = (scheme.m.name, scheme.v.name, scheme.block)
        if scheme.block is None or args.all or key in TRAINED:
            tr, held, _ = run(scheme, args, train, held_out)
            trained = f"{tr:7.4f} {tr - base_train:+8.4f} {held:7.4f} {held - base_held:+8.4f}"
        else:
            trained = f"{'-':>7s} {'':8s} {'-':>7s} {'':8s}"
        print(f"{scheme.name:36s} {trained} {err:8.4f} {lost:8.2e}", flush=True)
    print(f"({time.time() - started:.0f} s)")


if __name__ == "__main__":
    main()
