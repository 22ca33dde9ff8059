#!/usr/bin/python3
"""How many wire elements change per RL step (issue 35 groundwork: the densities a delta sync sees).

Trains a qwen3-shaped model (qwen3-0.6b dimensions: hidden 1024, intermediate 3072, 16 q heads /
8 kv heads of 128, q/k RMSNorm, SwiGLU, tied 151936-token embedding; `--layers` of its 28 decoder
layers) with AdamW on fp32 masters, on random tokens, for `--steps` steps per learning rate, and
after every step compares the wire image of the new weights with the previous step's:

* bf16 wire: fp32 -> bf16, round to nearest even (torch's cast, as the project's CastF32ToBF16);
  every tensor.
* block FP8 wire (docs/fp8.md, include/shardsync/fp8.h): the 2-d linear weights (q/k/v/o,
  gate/up/down) as e4m3 codes + one fp32 scale per 128x128 block: amax = max(max|x|, 1e-4),
  scale = amax / 448, inv = 1 / scale (fp32), q = e4m3(x * inv) (round half to even, saturate:
  `e4m3` below, since Debian's torch 1.13 has no float8 dtype); embedding and norms stay bf16 as
  the engines keep them. Codes count 1 byte each on the wire whatever this script holds them in.

Wire bytes: each tensor is one bucket (codes and scales separate buckets), encoded by the size
rule of include/shardsync/delta.h (DeltaEncodedBytes), reimplemented here (delta_bytes below: the
same formulas; calling the C++ codec would need the Python module built for one formula).

Run: /usr/bin/python3 bench/delta/density.py [--layers 4] [--vocab 151936] [--steps 10] [--lrs 1e-6,1e-5] [--json out]
"""
import argparse
import json
import math
import time

import torch
import torch.nn.functional as F

HEADER = 48  # kDeltaHeaderBytes
TILE_BYTES = 16384  # kDeltaTileBytes


def delta_bytes(elements, esize, changed, escapes=0):
    """DeltaEncodedBytes of delta.h (delta_rule.h DeltaSizeRule, format 3): (kind, bytes).
    `escapes`: the 2-byte changes whose difference is out of a byte (the packed form's)."""
    full = elements * esize
    changed = min(changed, elements)
    escapes = min(escapes, changed) if esize == 2 else 0
    tiles = -(-elements // (TILE_BYTES // esize))
    # index: a u32 running count per tile, a u16 offset per change, padding to 4, the values
    index_before_values = (4 * tiles + 2 * changed + 3) // 4 * 4
    index = index_before_values + changed * esize
    bitmap = (elements + 7) // 8 + changed * esize
    kind, payload = ("index", index) if index <= bitmap else ("bitmap", bitmap)
    # packed (element sizes 1 and 2, while the index form is not larger than the bitmap form):
    # u32 running counts per tile (and escapes' for 2-byte elements), a u8 count per 128-element
    # subtile, a u8 offset and a u8 value byte per change, for 2-byte elements padding to an even
    # length and a u16 per escape
    if esize in (1, 2) and index_before_values <= (elements + 7) // 8:
        subtiles = -(-elements // 128)
        before = (8 if esize == 2 else 4) * tiles + subtiles + 2 * changed
        packed = (before + 1) // 2 * 2 + 2 * escapes if esize == 2 else before
        if packed < payload:
            kind, payload = "packed", packed
    size = HEADER + payload
    if size >= full:
        return "full", full
    return kind, size


class RMSNorm(torch.nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


def rope(x, theta=1e6):
    # x: [b, h, t, d]; rotate-half form of HF Qwen3.
    t, d = x.shape[-2], x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d)
    ang = torch.outer(torch.arange(t, dtype=torch.float32, device=x.device), inv)
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class Layer(torch.nn.Module):
    def __init__(self, h=1024, inter=3072, nq=16, nkv=8, hd=128):
        super().__init__()
        self.nq, self.nkv, self.hd = nq, nkv, hd
        L = lambda i, o: torch.nn.Linear(i, o, bias=False)  # noqa: E731
        self.q_proj, self.k_proj, self.v_proj = L(h, nq * hd), L(h, nkv * hd), L(h, nkv * hd)
        self.o_proj = L(nq * hd, h)
        self.q_norm, self.k_norm = RMSNorm(hd), RMSNorm(hd)
        self.gate_proj, self.up_proj, self.down_proj = L(h, inter), L(h, inter), L(inter, h)
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(h), RMSNorm(h)

    def forward(self, x):
        b, t, _ = x.shape
        y = self.input_layernorm(x)
        q = self.q_norm(self.q_proj(y).view(b, t, self.nq, self.hd)).transpose(1, 2)
        k = self.k_norm(self.k_proj(y).view(b, t, self.nkv, self.hd)).transpose(1, 2)
        v = self.v_proj(y).view(b, t, self.nkv, self.hd).transpose(1, 2)
        q, k = rope(q), rope(k)
        # Debian's torch 1.13 has no scaled_dot_product_attention: causal GQA by hand.
        k = k.repeat_interleave(self.nq // self.nkv, dim=1)
        v = v.repeat_interleave(self.nq // self.nkv, dim=1)
        s = (q @ k.transpose(-1, -2)) / math.sqrt(self.hd)
        s = s.masked_fill(torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
        a = s.softmax(-1) @ v
        x = x + self.o_proj(a.transpose(1, 2).reshape(b, t, -1))
        y = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(y)) * self.up_proj(y))


class Model(torch.nn.Module):
    def __init__(self, layers, vocab, h=1024):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(vocab, h)
        self.layers = torch.nn.ModuleList(Layer() for _ in range(layers))
        self.norm = RMSNorm(h)

    def forward(self, tokens):
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x) @ self.embed_tokens.weight.t()  # tied lm_head


def init_(model, std=0.02):
    # HF initializer_range 0.02 for linears and the embedding; norms at 1.
    for name, p in model.named_parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=std)


def e4m3(y):
    """float8_e4m3fn rounding of fp32 y (|y| <= 448 after the clamp), returned as fp32 values.

    Debian's torch 1.13 has no float8 dtypes, so this is the format's rule: 3 mantissa bits,
    normal exponents from 2^-6, subnormal step 2^-9, round half to even (torch.round), saturate
    at 448. The value's fp32 bits stand for the code (one code per value, -0 distinct).
    """
    y = y.clamp(-448, 448)
    _, e = torch.frexp(y)  # |y| = m 2^e, m in [0.5, 1): the leading bit is 2^(e-1)
    step = torch.pow(2.0, (e.clamp(min=-5) - 4).float())  # 2^(e-1-3); subnormals 2^-9
    return (torch.round(y / step) * step).clamp(-448, 448)


def fp8_block(w):
    """(codes uint8 [r, c], scales fp32 [ceil(r/128), ceil(c/128)]) per docs/fp8.md."""
    r, c = w.shape
    R, C = math.ceil(r / 128), math.ceil(c / 128)
    x = F.pad(w, (0, C * 128 - c, 0, R * 128 - r)).view(R, 128, C, 128)
    amax = x.abs().amax(dim=(1, 3)).clamp(min=1e-4)
    scale = amax / 448.0
    inv = 1.0 / scale
    q = e4m3(x * inv[:, None, :, None])
    codes = q.view(torch.int32).reshape(R * 128, C * 128)[:r, :c]
    return codes.contiguous(), scale.contiguous()


def wire(model):
    """{name: [(kind, esize, tensor as an integer view)]}: the bf16 and FP8 wire images."""
    bf16, fp8 = {}, {}
    for name, p in model.named_parameters():
        w = p.detach()
        bf16[name] = w.to(torch.bfloat16).view(torch.int16).clone()
        if w.dim() == 2 and "embed" not in name:
            codes, scale = fp8_block(w)
            fp8[name + ".codes"] = (1, codes)
            fp8[name + ".scale"] = (4, scale.view(torch.int32).clone())
        else:
            fp8[name] = (2, bf16[name])
    return bf16, fp8


def compare(old, new, esize_of):
    """Totals over buckets: elements, changed, full bytes, delta wire bytes, kinds."""
    tot = dict(elements=0, changed=0, full=0, wire=0, kinds={}, classes={})
    for name in new:
        esize, a = esize_of(old[name])
        _, b = esize_of(new[name])
        n, ch = a.numel(), int((a != b).sum())
        esc = 0
        if esize == 2:  # the packed form's escapes: differences of the bit patterns out of a byte
            d = (b.to(torch.int32) - a.to(torch.int32)) & 0xFFFF
            d = torch.where(d >= 0x8000, d - 0x10000, d)
            esc = int(((d < -127) | (d > 127)).sum())
        kind, nbytes = delta_bytes(n, esize, ch, esc)
        tot["elements"] += n
        tot["changed"] += ch
        tot["full"] += n * esize
        tot["wire"] += nbytes
        tot["kinds"][kind] = tot["kinds"].get(kind, 0) + 1
        cls = "embed" if "embed" in name else "norm" if "norm" in name else "linear"
        e, c = tot["classes"].get(cls, (0, 0))
        tot["classes"][cls] = (e + n, c + ch)
    return tot


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--lrs", default="1e-6,1e-5")
    ap.add_argument("--vocab", type=int, default=151936,
                    help="qwen3's 151936; smaller to fit a run in CPU minutes (the embedding's "
                    "per-element update under Adam is ~lr whatever the vocabulary)")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(2)
    results = []
    for lr in [float(s) for s in args.lrs.split(",")]:
        torch.manual_seed(args.seed)
        model = Model(args.layers, args.vocab)
        init_(model)
        nparams = sum(p.numel() for p in model.parameters())
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=args.weight_decay)
        prev = wire(model)
        print(f"lr {lr:g}: {args.layers} layers, {nparams} parameters (fp32 masters)", flush=True)
        for step in range(1, args.steps + 1):
            t0 = time.time()
            tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1))
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            cur = wire(model)
            b = compare(prev[0], cur[0], lambda t: (2, t))
            codes = {k: v for k, v in cur[1].items() if k.endswith(".codes")}
            scales = {k: v for k, v in cur[1].items() if k.endswith(".scale")}
            c = compare(prev[1], codes, lambda t: t)
            s = compare(prev[1], scales, lambda t: t)
            f = compare(prev[1], cur[1], lambda t: t)
            row = dict(lr=lr, step=step, loss=float(loss), seconds=time.time() - t0,
                       bf16=b, fp8_codes=c, fp8_scales=s, fp8_all=f)
            results.append(row)
            print(f"  step {step:2d} loss {float(loss):.4f}  bf16 changed {b['changed'] / b['elements']:.4%}"
                  f" wire {b['wire'] / b['full']:.2%} of full {b['kinds']} | e4m3 codes "
                  f"{c['changed'] / c['elements']:.4%} scales {s['changed'] / s['elements']:.2%}"
                  f" fp8 wire {f['wire'] / f['full']:.2%} of full ({time.time() - t0:.1f} s)",
                  flush=True)
            print("           bf16 by class: " + ", ".join(
                f"{k} {ch / n:.4%} of {n}" for k, (n, ch) in sorted(b["classes"].items())), flush=True)
            prev = cur
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(args=vars(args), results=results), fh, indent=1)


if __name__ == "__main__":
    main()
