#!/usr/bin/python3
"""Reference numbers from Hugging Face for troupe's model tests (models/hf_reference.test.cpp).

Builds tiny random GPT2LMHeadModel, LlamaForCausalLM, MixtralForCausalLM and Qwen2MoeForCausalLM
models in float32 with a fixed seed and
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
                                   rope_cos      f32 [8, D]      Llama only: HF's cos and sin at
                                   rope_sin      f32 [8, D]      positions 0..7
                                   step_logits   f32 [6, 2, V]   Llama and MoE only: the last
                                                                 position's logits of cached
                                                                 decoding (a prompt of 3, then 5
                                                                 one-token steps), before the
                                                                 AdamW steps
                                   aux           f32 [1]         MoE only: HF's aux_loss (the load
                                   aux_f64       f64 [1]          balancing loss, before its
                                                                 coefficient), f32 and float64
                                   route_gap     f64 [1]         MoE only: the smallest gap between
                                                                 a token's top_k-th and next
                                                                 router probability, over every
                                                                 forward above (f32 and float64)

The MoE models are made with output_router_logits=True, so HF's loss (and so the gradients and the
AdamW run) includes router_aux_loss_coef times the aux loss. Their routing is checked to be far from
ties (route_gap >= 1e-4, 100 times the f32 runs' rounding of the probabilities) so that an f32 implementation routes every token as HF does.

AdamW: torch.optim.AdamW(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1) on every
parameter, no clipping, the same batch every step. Tied weights appear once (under the embedding's
name), as in model.named_parameters().

Weights are drawn larger than HF's init (std 0.3 for matrices, norms 1 + N(0, 0.1), biases
N(0, 0.1)) so that attention is far from uniform and every path (RoPE, masks, norms) shows in the
outputs. Dropout is off (eval mode for the forward; dropout probabilities 0 for training).

RoPE scaling (rope_scaling linear, dynamic, llama3) and mlp_bias need transformers >= 4.43; the
fixtures llama3_scaled, llama_linear and llama_dynamic were made with torch 1.13 (Debian's
python3-torch) and transformers 4.44.2, the older ones with transformers 4.38.2 (before rope_cos,
rope_sin and step_logits were written). Dynamic scaling is made to trigger: that model has
max_position_embeddings 4 < T = 8.

Run from the repository root with torch and transformers installed; names select fixtures (all
by default):
  /usr/bin/python3 scripts/reference/make_model_fixtures.py [name ...]
"""

import math
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


def rope_settings(module):
    """head_dim, rope_theta, rope_scaling and max_position_embeddings of a LlamaRotaryEmbedding."""
    cfg = getattr(module, "config", None)
    if cfg is None:  # transformers 4.38: no config, no scaling
        return module.dim, module.base, None, module.max_position_embeddings
    return (cfg.hidden_size // cfg.num_attention_heads, cfg.rope_theta, cfg.rope_scaling,
            cfg.max_position_embeddings)


def exact_inv_freq(module, seq_len):
    """The inverse frequencies of transformers' modeling_rope_utils.py for seq_len positions, in
    float64 (HF computes them in float32)."""
    d, base, scaling, max_pos = rope_settings(module)
    rope_type = "default" if scaling is None else scaling.get("rope_type", scaling.get("type"))
    if rope_type == "dynamic" and seq_len > max_pos:
        factor = scaling["factor"]
        base = base * ((factor * seq_len / max_pos) - (factor - 1)) ** (d / (d - 2))
    inv = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    if rope_type == "linear":
        inv = inv / scaling["factor"]
    elif rope_type == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = (old / wavelen - low) / (high - low)
        inv = torch.where(wavelen > old / low, inv / factor,
                          torch.where(wavelen < old / high, inv,
                                      (1 - smooth) * inv / factor + smooth * inv))
    else:
        assert rope_type in ("default", "dynamic"), rope_type
    return inv


def exact_rope(self, x, position_ids, seq_len=None):
    """LlamaRotaryEmbedding.forward with the angles in float64 (HF computes them in float32)."""
    inv_freq = exact_inv_freq(self, int(position_ids.max()) + 1)
    freqs = position_ids[:, :, None].double() * inv_freq[None, None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def hf_rope_tables(model, ids):
    """HF's own float32 cos and sin at positions 0..T-1 [T, D], after checking that its inverse
    frequencies are exact_inv_freq's to float32 rounding (so that the float64 reference computes
    HF's function)."""
    rotary = getattr(model.model, "rotary_emb", None)  # the one forward uses (>= 4.44)
    if rotary is None:
        rotary = model.model.layers[0].self_attn.rotary_emb
    t = ids.shape[1]
    positions = torch.arange(t, dtype=torch.int64)[None, :]
    with torch.no_grad():
        cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions)
    exact = exact_inv_freq(rotary, t)
    rel = ((rotary.inv_freq.double() - exact).abs() / exact).max().item()
    assert rel < 1e-5, f"HF's inverse frequencies differ from exact_inv_freq by {rel} relative"
    return cos[0].clone(), sin[0].clone()


def exact_rms_norm(self, hidden_states):
    """LlamaRMSNorm.forward without HF's cast to float32 (kept for float64 too)."""
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def exact_cached_rope(self, x, seq_len=None):
    """The rotary embedding of Mixtral / Qwen2-MoE in transformers 4.44 (a cos/sin cache built in
    float32, indexed by position later) with the cache in float64."""
    d = self.dim
    inv = 1.0 / (self.base ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    t = torch.arange(seq_len, dtype=torch.float64)
    emb = torch.cat((torch.outer(t, inv),) * 2, dim=-1)
    return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def is_moe(model):
    return hasattr(model.config, "num_experts_per_tok")


def num_experts(config):
    return getattr(config, "num_local_experts", None) or config.num_experts


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
        elif type(module).__name__.endswith("RotaryEmbedding"):  # Mixtral's, Qwen2-MoE's
            module.forward = types.MethodType(exact_cached_rope, module)
        if type(module).__name__.endswith("RMSNorm"):
            module.forward = types.MethodType(exact_rms_norm, module)
    softmax = torch.nn.functional.softmax

    def softmax_keeping_float64(x, dim=None, dtype=None, **kw):  # Llama asks for float32
        return softmax(x, dim=dim, dtype=torch.float64 if x.dtype == torch.float64 else dtype, **kw)

    moe = is_moe(model)
    torch.nn.functional.softmax = softmax_keeping_float64
    try:
        with torch.no_grad():
            out = m64.base_model(input_ids=ids, **({"output_router_logits": True} if moe else {}))
    finally:
        torch.nn.functional.softmax = softmax
    extra = {}
    with torch.no_grad():
        logits = m64.get_output_embeddings()(out.last_hidden_state)
        assert logits.dtype == torch.float64
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)),
                                                 ids[:, 1:].reshape(-1))
        if moe:
            lb = sys.modules[type(model).__module__].load_balancing_loss_func
            aux = lb(out.router_logits, num_experts(model.config), model.config.num_experts_per_tok)
            assert aux.dtype == torch.float64
            loss = loss + model.config.router_aux_loss_coef * aux
            extra["aux_f64"] = aux.reshape(1).clone()
            extra["router_logits_f64"] = torch.cat(out.router_logits)
    return logits.clone(), loss.reshape(1).clone(), extra


def route_gap(router_logits, top_k):
    """The smallest gap between a token's top_k-th and (top_k + 1)-th router probability."""
    p = torch.softmax(router_logits.double(), dim=-1).sort(dim=-1, descending=True).values
    return (p[:, top_k - 1] - p[:, top_k]).min().item()


PROMPT = 3


def cached_logits(model, ids):
    """Incremental decoding with HF's kv cache: the prompt ids[:, :PROMPT], then one token at a
    time; the last position's logits of each step, [T - PROMPT + 1, B, V]. With dynamic RoPE
    scaling this is not the full forward's logits: each step's keys are rotated with the theta of
    the length so far (max(position_ids) + 1), and the cache keeps them."""
    cache = transformers.DynamicCache()
    steps = []
    with torch.no_grad():
        for lo, hi in [(0, PROMPT)] + [(t, t + 1) for t in range(PROMPT, ids.shape[1])]:
            r = model(input_ids=ids[:, lo:hi], past_key_values=cache, use_cache=True)
            steps.append(r.logits[:, -1].clone())
    return torch.stack(steps)


def reference(model, ids):
    """Forward, backward and 10 AdamW steps; returns the tensors of reference.safetensors."""
    out = {"input_ids": ids.clone()}
    model.eval()  # no dropout (all probabilities are 0 as well)

    out["logits_f64"], out["loss_f64"], extra = float64_reference(model, ids)
    moe = is_moe(model)
    gaps = []
    if moe:
        top_k = model.config.num_experts_per_tok
        out["aux_f64"] = extra["aux_f64"]
        gaps.append(route_gap(extra["router_logits_f64"], top_k))

    if isinstance(model, transformers.LlamaForCausalLM) or moe:
        out["step_logits"] = cached_logits(model, ids)

    model.zero_grad()
    r = model(input_ids=ids, labels=ids)
    r.loss.backward()
    out["logits"] = r.logits.detach().clone()
    out["loss"] = r.loss.detach().reshape(1).clone()
    if moe:
        out["aux"] = r.aux_loss.detach().reshape(1).clone()
        gaps.append(route_gap(torch.cat(r.router_logits).detach(), top_k))
    for name, p in model.named_parameters():
        out["grad." + name] = p.grad.detach().clone()

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=0.1)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        r = model(input_ids=ids, labels=ids)
        loss = r.loss
        losses.append(loss.item())
        if moe:
            gaps.append(route_gap(torch.cat(r.router_logits).detach(), top_k))
        loss.backward()
        opt.step()
    out["losses"] = torch.tensor(losses, dtype=torch.float32)
    for name, p in model.named_parameters():
        out["final." + name] = p.detach().clone()
    if isinstance(model, transformers.LlamaForCausalLM):
        out["rope_cos"], out["rope_sin"] = hf_rope_tables(model, ids)
    if moe:
        out["route_gap"] = torch.tensor([min(gaps)], dtype=torch.float64)
        print(f"smallest routing gap {min(gaps):.2e} over {len(gaps)} forwards")
        # The f32 runs' router probabilities differ from exact ones by ~1e-6 (rounding of the
        # logits, and of the weights after the AdamW steps): 1e-4 leaves a factor 100.
        assert min(gaps) >= 1e-4, "routing too close to a tie; pick another seed"
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
    sizes = dict(vocab_size=96, hidden_size=24, intermediate_size=40, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    sizes.update(kw)
    cfg = transformers.LlamaConfig(attention_dropout=0.0, attn_implementation="eager", **sizes)
    return transformers.LlamaForCausalLM(cfg)


def moe_sizes(kw):
    sizes = dict(vocab_size=64, hidden_size=24, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=32, num_experts_per_tok=2,
                 output_router_logits=True, router_aux_loss_coef=0.05, rope_theta=10000.0,
                 rms_norm_eps=1e-6, attention_dropout=0.0, attn_implementation="eager")
    sizes.update(kw)
    return sizes


def mixtral(**kw):
    cfg = transformers.MixtralConfig(**moe_sizes(dict(intermediate_size=16, num_local_experts=4,
                                                      sliding_window=None, **kw)))
    return transformers.MixtralForCausalLM(cfg)


def qwen2_moe(**kw):
    cfg = transformers.Qwen2MoeConfig(**moe_sizes(dict(
        intermediate_size=40, moe_intermediate_size=16, shared_expert_intermediate_size=24,
        num_experts=4, norm_topk_prob=False, use_sliding_window=False, **kw)))
    return transformers.Qwen2MoeForCausalLM(cfg)


FIXTURES = {
    # GPT-2 with its defaults (n_inner 4 C, eps 1e-5), and with n_inner and eps changed.
    "gpt2": lambda: gpt2(),
    "gpt2_inner": lambda: gpt2(n_inner=24, layer_norm_epsilon=1e-3),
    # Llama: untied with theta 1e4; tied; untied with theta 5e5, attention biases and eps 1e-5.
    "llama": lambda: llama(tie_word_embeddings=False, rope_theta=10000.0, rms_norm_eps=1e-6),
    "llama_tied": lambda: llama(tie_word_embeddings=True, rope_theta=10000.0, rms_norm_eps=1e-6),
    "llama_theta_bias": lambda: llama(tie_word_embeddings=False, rope_theta=500000.0,
                                      attention_bias=True, rms_norm_eps=1e-5),
    # Llama 3.1's RoPE scaling (factor 8, low 1, high 4) with biases on the attention and the MLP;
    # tied, as Llama 3.2's small models are.
    # head_dim 8 and theta 100 give the wavelengths 6.3, 19.9, 62.8 and 199 positions; against
    # original_max_position_embeddings 32 (bands at 32 / 4 = 8 and 32 / 1 = 32) the first is kept,
    # the second smoothed (s = 0.2) and the last two divided by 8.
    "llama3_scaled": lambda: llama(hidden_size=32, max_position_embeddings=64, rope_theta=100.0,
                                   tie_word_embeddings=True,
                                   rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                 "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                 "original_max_position_embeddings": 32},
                                   attention_bias=True, mlp_bias=True, rms_norm_eps=1e-5),
    # Linear scaling under the key of transformers < 4.43 ("type").
    "llama_linear": lambda: llama(tie_word_embeddings=False, rope_theta=10000.0, rms_norm_eps=1e-6,
                                  rope_scaling={"type": "linear", "factor": 4.0}),
    # Dynamic NTK scaling that triggers: T = 8 > max_position_embeddings 4, so theta becomes
    # 100 (4 * 8 / 4 - 3)^(6 / 4) = 1118.
    "llama_dynamic": lambda: llama(max_position_embeddings=4, rope_theta=100.0, rms_norm_eps=1e-6,
                                   rope_scaling={"rope_type": "dynamic", "factor": 4.0}),
    # Sparse MoE, 4 experts top-2, the aux loss in the loss (coefficient 0.05): Mixtral (weights
    # renormalised over the chosen experts) and Qwen2-MoE (not renormalised, norm_topk_prob false;
    # q, k, v biases; a shared expert behind its sigmoid gate).
    "mixtral_tiny": lambda: mixtral(),
    "qwen2_moe_tiny": lambda: qwen2_moe(),
}
SEEDS = {"gpt2": 1, "gpt2_inner": 2, "llama": 3, "llama_tied": 4, "llama_theta_bias": 5,
         "llama3_scaled": 6, "llama_linear": 7, "llama_dynamic": 8, "mixtral_tiny": 9,
         "qwen2_moe_tiny": 11}


def main(names):
    unknown = [n for n in names if n not in FIXTURES]
    if unknown:
        print(f"unknown fixtures {unknown}; known: {', '.join(FIXTURES)}")
        return 1
    torch.manual_seed(0)  # HF's init; perturb() then draws every parameter from the fixture's seed
    torch.use_deterministic_algorithms(True)
    for name in names or FIXTURES:
        write(name, FIXTURES[name](), SEEDS[name])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
