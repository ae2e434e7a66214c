#!/usr/bin/env python3
"""The PyTorch side of `troupe bench train`: the same GPT-2 model trained the same way in PyTorch.

GPT-2 architecture as troupe's models/gpt.hpp (HF GPT2LMHeadModel semantics): learned positions,
pre-LN blocks, fused qkv projection, causal softmax attention, GELU-tanh MLP of width 4C, biases
everywhere but the head, head tied to the token embedding. f32, torch.optim.AdamW
(lr 3e-4, betas 0.9/0.95, eps 1e-8, weight decay 0.1 on every parameter), clip_grad_norm_ 1.0,
mean next-token cross-entropy over B x (T-1) positions, uniform random token ids (seeded).

Its best configuration on this kind of machine (docs/performance.md): PyTorch 1.13 sizes
OpenBLAS's thread pool from OPENBLAS_NUM_THREADS when OpenBLAS loads (at `import torch`), so this
script sets the environment before importing torch: OPENBLAS_NUM_THREADS and OMP_NUM_THREADS to
--threads; OMP_WAIT_POLICY=PASSIVE unless set (else its spinning OpenMP workers fight OpenBLAS's
threads); OPENBLAS_CORETYPE=SkylakeX on CPUs with AVX-512 unless --coretype names another
(OpenBLAS 0.3.21 does not know recent Xeons and falls back to SSE3 kernels; an inherited
OPENBLAS_CORETYPE=Haswell would keep it on AVX2); ATEN_CPU_CAPABILITY=avx512 on such CPUs unless
--aten-capability says otherwise (ATen's own vectorized kernels: GELU, softmax, layer norm, the
optimizer; PyTorch 1.13 picks AVX2 by default, and AVX-512 was ~10% faster for this model here).
torch.optim.AdamW runs with foreach=True (--foreach off: the per-parameter loop; no difference in
speed measured here). The JSON says which OpenBLAS core and ATen capability ran.

--device cuda trains on the GPU instead (scripts/gpu/check.sh): the same f32 model and step, with
PyTorch's defaults there (no TF32 in matmuls); the CPU settings above still apply to the host side.
--precision bf16 runs the forward and backward under torch.autocast(bfloat16) with f32 parameters,
gradients and AdamW moments (troupe's bf16 keeps f32 master weights the same way). --fast is
PyTorch's strongest configuration for the step: F.scaled_dot_product_attention (flash attention
on a GPU), the fused AdamW (foreach on the CPU) and torch.compile of the model.

Prints one JSON object: tokens/s over the timed steps, seconds per step, peak RSS (and peak device
memory on a GPU), the settings.
"""
import argparse
import json
import math
import os
import resource
import sys
import time

MODELS = {  # vocab, positions, width, layers, heads
    "bench-small": (8192, 256, 384, 6, 6),
    "gpt2-small": (50257, 1024, 768, 12, 12),
}


def has_avx512():
    try:
        with open("/proc/cpuinfo") as f:
            return "avx512f" in f.read()
    except OSError:
        return False


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="bench-small", choices=sorted(MODELS))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--coretype", default=None,
                   help="OPENBLAS_CORETYPE (default: SkylakeX on AVX-512 CPUs, else OpenBLAS's)")
    p.add_argument("--aten-capability", default="auto",
                   choices=["auto", "default", "avx2", "avx512"],
                   help="ATEN_CPU_CAPABILITY for ATen's vectorized kernels (auto: avx512 on CPUs "
                   "with AVX-512; default: PyTorch's own choice)")
    p.add_argument("--foreach", choices=["on", "off"], default="on",
                   help="torch.optim.AdamW(foreach=...): the multi-tensor update (default on)")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--device", default="cpu", help="cpu, or cuda for the GPU")
    p.add_argument("--precision", choices=["f32", "bf16"], default="f32",
                   help="bf16: autocast forward and backward, f32 master weights")
    p.add_argument("--fast", action="store_true",
                   help="SDPA attention, fused AdamW (GPU), torch.compile")
    return p.parse_args()


def set_environment(a):
    n = str(a.threads)
    os.environ["OPENBLAS_NUM_THREADS"] = n
    os.environ["OMP_NUM_THREADS"] = n
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if a.coretype:
        os.environ["OPENBLAS_CORETYPE"] = a.coretype
    elif has_avx512():
        os.environ["OPENBLAS_CORETYPE"] = "SkylakeX"
    else:
        os.environ.pop("OPENBLAS_CORETYPE", None)  # OpenBLAS's own detection
    capability = a.aten_capability
    if capability == "auto":
        capability = "avx512" if has_avx512() else "default"
    if capability != "default":
        os.environ["ATEN_CPU_CAPABILITY"] = capability


def openblas_core():
    """The core and thread count of the OpenBLAS that torch loaded (None when not found)."""
    import ctypes
    try:
        lib = ctypes.CDLL("libopenblas.so.0", mode=os.RTLD_NOLOAD)
        lib.openblas_get_corename.restype = ctypes.c_char_p
        return lib.openblas_get_corename().decode(), lib.openblas_get_num_threads()
    except (OSError, AttributeError):
        return None, None


def aten_capability(torch):
    for line in torch.__config__.show().split("\n"):
        if "CPU capability usage:" in line:
            return line.split(":")[-1].strip()
    return None


def peak_rss_bytes():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def build(torch, vocab, positions, dim, layers, heads, sdpa=False):
    nn, F = torch.nn, torch.nn.functional

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_attn = nn.Linear(dim, 3 * dim)
            self.c_proj = nn.Linear(dim, dim)
            mask = torch.tril(torch.ones(positions, positions, dtype=torch.bool))
            self.register_buffer("mask", mask.view(1, 1, positions, positions), persistent=False)

        def forward(self, x):
            b, t, c = x.shape
            q, k, v = self.c_attn(x).split(dim, dim=2)
            q, k, v = (z.view(b, t, heads, c // heads).transpose(1, 2) for z in (q, k, v))
            if sdpa:
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(c // heads))
            att = att.masked_fill(~self.mask[:, :, :t, :t], float("-inf"))
            y = F.softmax(att, dim=-1) @ v
            return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1, self.ln_2 = nn.LayerNorm(dim, eps=1e-5), nn.LayerNorm(dim, eps=1e-5)
            self.attn = Attention()
            self.c_fc, self.c_proj = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
            self.gelu = nn.GELU(approximate="tanh")

        def forward(self, x):
            x = x + self.attn(self.ln_1(x))
            return x + self.c_proj(self.gelu(self.c_fc(self.ln_2(x))))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(positions, dim)
            self.h = nn.ModuleList(Block() for _ in range(layers))
            self.ln_f = nn.LayerNorm(dim, eps=1e-5)
            self.register_buffer("pos", torch.arange(positions), persistent=False)
            for name, p in self.named_parameters():  # GPT-2 initialisation
                if "ln_" in name:
                    nn.init.ones_(p) if name.endswith("weight") else nn.init.zeros_(p)
                elif name.endswith("bias"):
                    nn.init.zeros_(p)
                else:
                    std = 0.02 / math.sqrt(2 * layers) if name.endswith("c_proj.weight") else 0.02
                    nn.init.normal_(p, 0.0, std)

        def forward(self, ids, targets):
            t = ids.shape[1]
            x = self.wte(ids) + self.wpe(self.pos[:t])
            for block in self.h:
                x = block(x)
            logits = self.ln_f(x) @ self.wte.weight.t()  # tied head
            return F.cross_entropy(logits.view(-1, vocab), targets.view(-1), ignore_index=-100)

    return GPT()


def main():
    a = parse()
    set_environment(a)
    import torch  # after the environment: OpenBLAS reads it when it loads

    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    rss_import = peak_rss_bytes()
    vocab, positions, dim, layers, heads = MODELS[a.model]
    if a.seq > positions:
        sys.exit(f"--seq {a.seq} exceeds the model's {positions} positions")
    device = torch.device(a.device)
    model = build(torch, vocab, positions, dim, layers, heads, sdpa=a.fast).to(device)
    params = sum(p.numel() for p in model.parameters())
    fused = a.fast and device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=0.1, **({"fused": True} if fused else
                                                 {"foreach": a.foreach == "on"}))
    run = torch.compile(model) if a.fast else model
    autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) \
        if a.precision == "bf16" else None
    gen = torch.Generator().manual_seed(a.seed)

    def step():
        ids = torch.randint(0, vocab, (a.batch, a.seq), generator=gen)
        targets = torch.full_like(ids, -100)
        targets[:, :-1] = ids[:, 1:]
        ids, targets = ids.to(device), targets.to(device)
        opt.zero_grad(set_to_none=True)
        if autocast is not None:
            with autocast():
                loss = run(ids, targets)
        else:
            loss = run(ids, targets)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss.item(), norm.item()

    losses, times = [], []
    for _ in range(a.warmup):
        losses.append(step()[0])
    t_all, cpu_all = time.perf_counter(), time.process_time()
    for _ in range(a.steps):
        t0 = time.perf_counter()
        losses.append(step()[0])
        times.append(time.perf_counter() - t0)
    total, cpu = time.perf_counter() - t_all, time.process_time() - cpu_all
    core, blas_threads = openblas_core()
    tokens = a.batch * a.seq * a.steps
    times.sort()
    gpu = {}
    if device.type == "cuda":
        gpu = {"gpu": torch.cuda.get_device_name(device),
               "peak_device_bytes": torch.cuda.max_memory_allocated(device)}
    print(json.dumps({
        "impl": "pytorch",
        "torch": torch.__version__,
        "device": a.device, **gpu,
        "precision": a.precision, "fast": a.fast,
        "model": a.model, "params": params, "batch": a.batch, "seq": a.seq,
        "steps": a.steps, "warmup": a.warmup, "threads": a.threads,
        "tokens_per_s": tokens / total,
        "step_s": {"mean": total / a.steps, "min": times[0], "median": times[len(times) // 2],
                   "max": times[-1]},
        "cpu_s_per_step": cpu / a.steps,
        "peak_rss_bytes": peak_rss_bytes(),
        "rss_after_import_bytes": rss_import,
        "loss_first": losses[0], "loss_last": losses[-1],
        "env": {k: os.environ.get(k) for k in
                ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "OMP_WAIT_POLICY",
                 "OPENBLAS_CORETYPE", "ATEN_CPU_CAPABILITY")},
        "openblas_core": core, "openblas_threads": blas_threads,
        "aten_capability": aten_capability(torch),
        "adamw_foreach": a.foreach == "on" and not fused, "adamw_fused": fused,
        "torch_threads": torch.get_num_threads(),
    }))


if __name__ == "__main__":
    main()
