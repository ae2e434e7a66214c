#!/usr/bin/python3
"""Files written by Hugging Face's own libraries for troupe's checkpoint tests (models/hf/*.test.cpp).

Writes tests/fixtures/hf/:

  dtypes.safetensors    by safetensors.torch.save_file, one tensor per dtype, with metadata
                        {"format": "pt", "source": "troupe fixture"}. Tensor values follow
                        value(k) = (k % 13 - 6) / 4 (k the flat row-major index), cast to the dtype
                        (integers: k % 13 - 6; u8: k % 13):
                          f32    F32  [2, 3]
                          bf16   BF16 [4]
                          f16    F16  [2, 2]
                          f64    F64  [3]
                          i32    I32  [2]
                          i64    I64  [5]
                          u8     U8   [3]
                          scalar F32  []
                          empty  F32  [0, 4]
  gpt2/                 a tiny GPT2LMHeadModel by save_pretrained (F32, one model.safetensors)
  gpt2_sharded/         the same model in bfloat16, save_pretrained with a small max_shard_size
                        (model-0000N-of-0000M.safetensors + model.safetensors.index.json)
  gpt2_bare/            the same model in float16, written like the original GPT-2 files on the
                        hub: names without "transformer.", plus the h.N.attn.bias causal-mask
                        buffers, and no lm_head.weight.

The GPT-2 weights follow a formula the tests recompute: with the HF names (prefix "transformer.",
lm_head excluded) sorted, the tensor at position s has, at flat index k of its HF layout,
value = ((31 s + 7 k) % 97 - 48) / 64, exact in bfloat16 and float16.

Run from anywhere with torch, safetensors and transformers installed:
  /usr/bin/python3 scripts/reference/make_safetensors_fixture.py
"""

import os
import shutil

import torch
import transformers
from safetensors.torch import save_file

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "fixtures",
                   "hf")


def pattern(shape, dtype):
    n = 1
    for d in shape:
        n *= d
    k = torch.arange(n, dtype=torch.int64)
    if dtype == torch.uint8:
        v = k % 13
    elif dtype in (torch.int32, torch.int64):
        v = k % 13 - 6
    else:
        v = (k % 13 - 6).to(torch.float64) / 4
    return v.to(dtype).reshape(shape)


def write_dtypes():
    tensors = {
        "f32": pattern([2, 3], torch.float32),
        "bf16": pattern([4], torch.bfloat16),
        "f16": pattern([2, 2], torch.float16),
        "f64": pattern([3], torch.float64),
        "i32": pattern([2], torch.int32),
        "i64": pattern([5], torch.int64),
        "u8": pattern([3], torch.uint8),
        "scalar": pattern([], torch.float32),
        "empty": pattern([0, 4], torch.float32),
    }
    save_file(tensors, os.path.join(OUT, "dtypes.safetensors"),
              metadata={"format": "pt", "source": "troupe fixture"})


def gpt2_model():
    cfg = transformers.GPT2Config(vocab_size=16, n_positions=8, n_embd=8, n_layer=2, n_head=2,
                                  layer_norm_epsilon=1e-5, activation_function="gelu_new")
    model = transformers.GPT2LMHeadModel(cfg)
    names = sorted(n for n, _ in model.named_parameters() if not n.startswith("lm_head"))
    with torch.no_grad():
        params = dict(model.named_parameters())
        for s, name in enumerate(names):
            p = params[name]
            k = torch.arange(p.numel(), dtype=torch.int64)
            v = ((31 * s + 7 * k) % 97 - 48).to(torch.float32) / 64
            p.copy_(v.reshape(p.shape))
    return model


def fresh(name):
    path = os.path.join(OUT, name)
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    return path


def write_gpt2():
    model = gpt2_model()
    model.save_pretrained(fresh("gpt2"), safe_serialization=True)
    model.to(torch.bfloat16).save_pretrained(fresh("gpt2_sharded"), safe_serialization=True,
                                             max_shard_size="2KB")

    model = gpt2_model().to(torch.float16)
    bare = fresh("gpt2_bare")
    model.config.save_pretrained(bare)
    tensors = {}
    for name, p in model.named_parameters():
        if name.startswith("lm_head"):
            continue
        tensors[name.removeprefix("transformer.")] = p.detach().clone()
    n = model.config.n_positions
    for i in range(model.config.n_layer):
        mask = torch.tril(torch.ones(n, n, dtype=torch.bool)).view(1, 1, n, n)
        tensors[f"h.{i}.attn.bias"] = mask.to(torch.float16)
    save_file(tensors, os.path.join(bare, "model.safetensors"), metadata={"format": "pt"})


def main():
    os.makedirs(OUT, exist_ok=True)
    write_dtypes()
    write_gpt2()
    for root, _, files in sorted(os.walk(OUT)):
        for f in sorted(files):
            p = os.path.join(root, f)
            print(os.path.relpath(p, OUT), os.path.getsize(p))


if __name__ == "__main__":
    main()
