#!/usr/bin/python3
"""Reference numbers from Hugging Face for troupe's model tests (models/hf_reference.test.cpp).

Builds tiny random GPT2LMHeadModel and LlamaForCausalLM models in float32 with a fixed seed and
writes, for each, tests/fixtures/models/<name>/:

  config.json, model.safetensors   the model, by save_pretrained(safe_serialization=True)
  reference.safetensors            input_ids     i64 [2, 8]
                                   logits        f32 [2, 8, V]   (labels=input_ids forward)
                                   loss          f32 [1]         (HF's shifted mean over B x (T-1))
                                   logits_f64    f64 [2, 8, V]   (the same model in float64
                                   loss_f64      f64 [1]          throughout: float64_reference)
                                   grad.<name>   f32             d loss / d parameter, HF names
                                   losses        f32 [10]        loss before each of 10 AdamW steps
                                   final.<name>  f32             parameters after the 10 steps

AdamW: torch.optim.AdamW(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1) on every
parameter, no clipping, the same batch every step. Tied weights appear once (under the embedding's
name), as in model.named_parameters().

Weights are drawn larger than HF's init (std 0.3 for matrices, norms 1 + N(0, 0.1), biases
N(0, 0.1)) so that attention is far from uniform and every path (RoPE, masks, norms) shows in the
outputs. Dropout is off (eval mode for the forward; dropout probabilities 0 for training).

Run from the repository root with torch and transformers installed:
  /usr/bin/python3 scripts/reference/make_model_fixtures.py
"""

import os
import sys
import types

import torch
import transformers
from safetensors.torch import save_file

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "fixtures",
                   "models")
B, T = 2, 8
STEPS = 10


def perturb(model, seed):
    """Draws every parameter afresh: matrices N(0, 0.3), norm weights 1 + N(0, 0.1), biases and
    norm biases N(0, 0.1). Names decide: HF's init leaves too little signal for a test."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if p.dim() == 1 and ("ln_" in name or "norm" in name) and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * noise)
            elif p.dim() == 1:
                p.copy_(0.1 * noise)
            else:
                p.copy_(0.3 * noise)


def exact_rope(self, x, position_ids, seq_len=None):
    """LlamaRotaryEmbedding.forward with the angles in float64 (HF computes them in float32)."""
    inv_freq = 1.0 / (self.base ** (torch.arange(0, self.dim, 2, dtype=torch.float64) / self.dim))
    freqs = position_ids[:, :, None].double() * inv_freq[None, None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def exact_rms_norm(self, hidden_states):
    """LlamaRMSNorm.forward without HF's cast to float32 (kept for float64 too)."""
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def float64_reference(model, ids):
    """Logits and loss of the model's function in float64 throughout. HF casts to float32 in
    places even in a float64 model (Llama's RoPE angles, RMSNorm, attention softmax,
    logits.float()); those are
    patched out here, so the float64 reference is the exact function and a float64 implementation
    can be held to rounding-level agreement."""
    llama = transformers.models.llama.modeling_llama
    m64 = type(model)(model.config).double()
    m64.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    m64.eval()
    for module in m64.modules():
        if isinstance(module, llama.LlamaRotaryEmbedding):
            module.forward = types.MethodType(exact_rope, module)
        if isinstance(module, llama.LlamaRMSNorm):
            module.forward = types.MethodType(exact_rms_norm, module)
    softmax = torch.nn.functional.softmax

    def softmax_keeping_float64(x, dim=None, dtype=None, **kw):  # Llama asks for float32
        return softmax(x, dim=dim, dtype=torch.float64 if x.dtype == torch.float64 else dtype, **kw)

    torch.nn.functional.softmax = softmax_keeping_float64
    try:
        with torch.no_grad():
            hidden = m64.base_model(input_ids=ids).last_hidden_state
    finally:
        torch.nn.functional.softmax = softmax
    with torch.no_grad():
        logits = m64.get_output_embeddings()(hidden)
        assert logits.dtype == torch.float64
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)),
                                                 ids[:, 1:].reshape(-1))
    return logits.clone(), loss.reshape(1).clone()


def reference(model, ids):
    """Forward, backward and 10 AdamW steps; returns the tensors of reference.safetensors."""
    out = {"input_ids": ids.clone()}
    model.eval()  # no dropout (all probabilities are 0 as well)

    out["logits_f64"], out["loss_f64"] = float64_reference(model, ids)

    model.zero_grad()
    r = model(input_ids=ids, labels=ids)
    r.loss.backward()
    out["logits"] = r.logits.detach().clone()
    out["loss"] = r.loss.detach().reshape(1).clone()
    for name, p in model.named_parameters():
        out["grad." + name] = p.grad.detach().clone()

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=0.1)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        losses.append(loss.item())
        loss.backward()
        opt.step()
    out["losses"] = torch.tensor(losses, dtype=torch.float32)
    for name, p in model.named_parameters():
        out["final." + name] = p.detach().clone()
    return {k: v.contiguous() for k, v in out.items()}


def write(name, model, seed):
    folder = os.path.join(OUT, name)
    os.makedirs(folder, exist_ok=True)
    perturb(model, seed)
    model.save_pretrained(folder, safe_serialization=True)
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, model.config.vocab_size, (B, T), generator=g, dtype=torch.int64)
    save_file(reference(model, ids), os.path.join(folder, "reference.safetensors"),
              metadata={"generator": f"scripts/reference/make_model_fixtures.py with torch "
                                      f"{torch.__version__}, transformers {transformers.__version__}"})
    size = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))
    print(f"{name}: {size / 1024:.0f} KiB in {folder}")


def gpt2(**kw):
    cfg = transformers.GPT2Config(vocab_size=96, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **kw)
    return transformers.GPT2LMHeadModel(cfg)


def llama(**kw):
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=24, intermediate_size=40,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=32,
                                   attention_dropout=0.0, attn_implementation="eager", **kw)
    return transformers.LlamaForCausalLM(cfg)


def main():
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    # GPT-2 with its defaults (n_inner 4 C, eps 1e-5), and with n_inner and eps changed.
    write("gpt2", gpt2(), 1)
    write("gpt2_inner", gpt2(n_inner=24, layer_norm_epsilon=1e-3), 2)
    # Llama: untied with theta 1e4; tied; untied with theta 5e5, attention biases and eps 1e-5.
    write("llama", llama(tie_word_embeddings=False, rope_theta=10000.0, rms_norm_eps=1e-6), 3)
    write("llama_tied", llama(tie_word_embeddings=True, rope_theta=10000.0, rms_norm_eps=1e-6), 4)
    write("llama_theta_bias", llama(tie_word_embeddings=False, rope_theta=500000.0,
                                    attention_bias=True, rms_norm_eps=1e-5), 5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
