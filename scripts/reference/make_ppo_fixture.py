"""Reference fixture for models/post/ppo_advantages and ppo_loss (PPO with a critic).

Run from the repository root with the reference venv (torch):
    /tmp/llama3_venv/bin/python scripts/reference/make_ppo_fixture.py
Writes tests/fixtures/post/ppo_losses.json.

Written here from the published formulas as TRL's PPOTrainer (TRL 0.11 and later) implements them,
independently of the C++ code, in float64 with gradients from autograd. Rows are laid out as TRL
lays out the responses: [B, L], each row's response tokens first (its eos included), then padding.
    logr = ref_logprobs - logprobs; kl = -logr (kl_estimator "k1") or exp(logr) - 1 - logr ("k3")
    rewards = -kl_coef * kl, zero on padding; rewards[i, last token of row i] += score_i
    (whiten_rewards: masked_whiten(rewards, mask, shift_mean=False), zero on padding)
    GAE, TRL's loop over t = L-1 .. 0 with values zero on padding:
        nextvalues = values[:, t + 1] if t < L - 1 else 0
        delta = rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam = delta + gamma * lam * lastgaelam
    returns = advantages + values; advantages = masked_whiten(advantages, mask), zero on padding
    masked_whiten: (x - mean) * rsqrt(var + 1e-8), mean and unbiased var over the masked entries
    policy: ratio = exp(new - old); pg = max(-A ratio, -A clamp(ratio, 1 - c, 1 + c));
            pg_loss = masked_mean(pg); pg_clipfrac = masked_mean(pg2 > pg1);
            approxkl = 0.5 * masked_mean((new - old)^2)
    value:  vclip = clamp(v, v_old - cv, v_old + cv);
            vf_loss = 0.5 * masked_mean(max((v - R)^2, (vclip - R)^2)); vf_clipfrac likewise
    entropy = logsumexp(logits) - sum(softmax(logits) * logits), its masked mean (reported)
(TRL's value mask reaches one token past the response when pad_token_id differs from eos, and its
score then lands on that pad position; with pad == eos, as here, the two masks are one.)
new log-probabilities come from logits (log_softmax, gathered at the targets), so the fixture also
carries d pg_loss / d logits; the old values are random and the current ones near the returns or
the old values, so that both branches of both clips are reached.
"""
import json
import os

import torch

OUT = os.path.join("tests", "fixtures", "post")


def masked_mean(x, m):
    return (x * m).sum() / m.sum()


def masked_var(x, m):
    mean = masked_mean(x, m)
    var = masked_mean((x - mean) ** 2, m)
    n = m.sum()
    return var * n / (n - 1)


def masked_whiten(x, m, shift_mean=True):
    mean, var = masked_mean(x, m), masked_var(x, m)
    w = (x - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        w = w + mean
    return w


def case(seed, rows, length, vocab, kl_coef, k3, whiten_rewards, gamma, lam, cliprange,
         cliprange_value):
    g = torch.Generator().manual_seed(seed)
    f64 = torch.float64
    lengths = [int(torch.randint(1, length + 1, (1,), generator=g)) for _ in range(rows)]
    lengths[0] = length  # one row with no padding
    mask = torch.zeros(rows, length, dtype=f64)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    pad = mask == 0
    logits = torch.randn(rows, length, vocab, generator=g, dtype=f64) * 2
    targets = torch.randint(0, vocab, (rows, length), generator=g)
    old = torch.gather(torch.log_softmax(logits, -1), 2, targets.unsqueeze(2)).squeeze(2)
    old = old + torch.randn(rows, length, generator=g, dtype=f64) * 0.3  # the sampling policy
    old = old.masked_fill(pad, 0)
    ref = (old + torch.randn(rows, length, generator=g, dtype=f64) * 0.4).masked_fill(pad, 0)
    scores = torch.randn(rows, generator=g, dtype=f64)
    old_values = (torch.randn(rows, length, generator=g, dtype=f64) * 0.5).masked_fill(pad, 0)

    # Rewards: the KL penalty per token, the score on the last response token.
    logr = ref - old
    kl = (logr.exp() - 1) - logr if k3 else -logr  # TRL: kl_estimator "k3" or "k1"
    kl = kl.masked_fill(pad, 0)
    non_score = -kl_coef * kl
    rewards = non_score.clone()
    last = torch.tensor([n - 1 for n in lengths])
    rewards[torch.arange(rows), last] += scores
    if whiten_rewards:
        rewards = masked_whiten(rewards, mask, shift_mean=False).masked_fill(pad, 0)

    values = old_values  # TRL: values of the rollout, zero on padding
    lastgaelam = torch.zeros(rows, dtype=f64)
    rev = []
    for t in reversed(range(length)):
        nextvalues = values[:, t + 1] if t < length - 1 else 0.0
        delta = rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam = delta + gamma * lam * lastgaelam
        rev.append(lastgaelam)
    advantages = torch.stack(rev[::-1], dim=1)
    returns = advantages + values
    advantages = masked_whiten(advantages, mask).masked_fill(pad, 0)

    # Policy loss in the new log-probabilities (from logits), its gradient by autograd.
    lg = logits.clone().requires_grad_(True)
    new_all = torch.log_softmax(lg, -1)
    new = torch.gather(new_all, 2, targets.unsqueeze(2)).squeeze(2)
    new_leaf = new.detach().clone().requires_grad_(True)
    def pg_of(newlp):
        ratio = torch.exp(newlp - old)
        pg1 = -advantages * ratio
        pg2 = -advantages * torch.clamp(ratio, 1 - cliprange, 1 + cliprange)
        return masked_mean(torch.max(pg1, pg2), mask), pg1, pg2
    pg_loss, pg1, pg2 = pg_of(new_leaf)
    pg_loss.backward()
    pg_logits, _, _ = pg_of(new)
    pg_logits.backward()
    clipfrac = masked_mean((pg2 > pg1).to(f64), mask)
    approxkl = 0.5 * masked_mean((new.detach() - old) ** 2, mask)
    probs = torch.softmax(logits, -1)
    entropy = masked_mean(torch.logsumexp(logits, -1) - (probs * logits).sum(-1), mask)

    # Value loss: current values near the returns or the old values, some beyond the clip range.
    near_returns = torch.rand(rows, length, generator=g, dtype=f64) < 0.5
    noise = torch.randn(rows, length, generator=g, dtype=f64) * 0.3
    v = torch.where(near_returns, returns, old_values) + noise
    v = v.masked_fill(pad, 0)
    v = v.clone().requires_grad_(True)
    vclip = torch.clamp(v, old_values - cliprange_value, old_values + cliprange_value)
    vf1 = (v - returns) ** 2
    vf2 = (vclip - returns) ** 2
    vf_loss = 0.5 * masked_mean(torch.max(vf1, vf2), mask)
    vf_loss.backward()
    vf_clipfrac = masked_mean((vf2 > vf1).to(f64), mask)

    flat = lambda x: x.detach().flatten().tolist()
    return {
        "seed": seed, "rows": rows, "length": length, "vocab": vocab, "kl_coef": kl_coef,
        "k3": k3, "whiten_rewards": whiten_rewards, "gamma": gamma, "lam": lam,
        "cliprange": cliprange, "cliprange_value": cliprange_value,
        "mask": [int(x) for x in flat(mask)], "logits": flat(logits),
        "targets": targets.flatten().tolist(), "old_logp": flat(old), "ref_logp": flat(ref),
        "scores": scores.tolist(), "old_values": flat(old_values),
        "kl_mean": (kl.sum(1)).mean().item(), "rewards": flat(rewards),
        "advantages": flat(advantages), "returns": flat(returns),
        "new_logp": flat(new), "pg_loss": pg_loss.item(), "dlogp": flat(new_leaf.grad),
        "dlogits": flat(lg.grad), "pg_clipfrac": clipfrac.item(), "approxkl": approxkl.item(),
        "entropy": entropy.item(), "values": flat(v), "vf_loss": vf_loss.item(),
        "dvalues": flat(v.grad), "vf_clipfrac": vf_clipfrac.item(),
    }


def main():
    cases = [
        case(1, rows=4, length=6, vocab=7, kl_coef=0.05, k3=False, whiten_rewards=False,
             gamma=1.0, lam=0.95, cliprange=0.2, cliprange_value=0.2),
        case(2, rows=5, length=5, vocab=5, kl_coef=0.2, k3=True, whiten_rewards=False,
             gamma=0.9, lam=0.8, cliprange=0.1, cliprange_value=0.1),
        case(3, rows=3, length=7, vocab=6, kl_coef=0.1, k3=False, whiten_rewards=True,
             gamma=0.99, lam=0.95, cliprange=0.3, cliprange_value=0.3),
    ]
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "ppo_losses.json"), "w") as f:
        json.dump(cases, f, indent=1)


if __name__ == "__main__":
    main()
