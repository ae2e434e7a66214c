#!/usr/bin/env python3
"""The two ceilings of the GPU in hand, measured through PyTorch (docs/gpu.md).

Device memory bandwidth: a device-to-device copy of 1 GiB, counting bytes read plus bytes written.
Matrix rate: 8192 x 8192 x 8192 products in bf16 and in f32 (TF32 off, as troupe's f32 GEMMs
through cuBLAS), 2 M N K operations each, on uniform random data. Each figure is the mean of ten
timed runs after three warm-ups, timed with CUDA events.

Prints one JSON object per line: {"ceiling", "value", "unit", "gpu"}.
"""
import json
import sys


def timed(torch, fn, warmup=3, runs=10):
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(runs):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / runs  # seconds per run


def main():
    import torch
    if not torch.cuda.is_available():
        sys.exit("ceilings.py: no CUDA device")
    torch.backends.cuda.matmul.allow_tf32 = False
    gpu = torch.cuda.get_device_name(0)

    def emit(name, value, unit):
        print(json.dumps({"ceiling": name, "value": value, "unit": unit, "gpu": gpu}), flush=True)

    n_bytes = 1 << 30
    src = torch.empty(n_bytes, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    s = timed(torch, lambda: dst.copy_(src))
    emit("device copy (read + write)", 2 * n_bytes / s / 1e9, "GB/s")
    del src, dst

    n = 8192
    for name, dtype in (("bf16", torch.bfloat16), ("f32", torch.float32)):
        a = torch.rand(n, n, device="cuda", dtype=dtype)
        b = torch.rand(n, n, device="cuda", dtype=dtype)
        s = timed(torch, lambda: torch.mm(a, b))
        emit(f"{name} matmul {n}^3", 2 * n**3 / s / 1e12, "TFLOP/s")
        del a, b


if __name__ == "__main__":
    main()
