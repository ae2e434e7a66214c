"""Reference fixture for models/post/grpo_loss (GRPO's group advantages, loss and gradient).

Run from the repository root with the reference venv (torch):
    /tmp/llama3_venv/bin/python scripts/reference/make_grpo_fixture.py
Writes tests/fixtures/post/grpo_losses.json.

Written here from the published formulas as TRL's GRPOTrainer implements them (TRL 0.14 to 0.16;
loss_type "grpo" of later TRL), independently of the C++ code:
    advantages = (r - mean_group(r)) / (std_group(r) + 1e-4)   (torch.std: unbiased)
    coef_1 = exp(logp - old); coef_2 = clamp(coef_1, 1 - eps, 1 + eps)
    per_token_loss = -min(coef_1 * A, coef_2 * A) + beta * (exp(ref - logp) - (ref - logp) - 1)
    loss = mean_i( sum_t(per_token_loss * mask) / sum_t(mask) )
in float64, with logp = log_softmax(logits)[target] and the gradient d loss / d logits from
autograd. old and ref are the policy's log-probabilities plus noise, large enough that some ratios
fall outside the clip range on both sides.
"""
import json
import os

import torch

OUT = os.path.join("tests", "fixtures", "post")


def case(seed, groups, group, seq, vocab, eps, beta, scale_rewards):
    g = torch.Generator().manual_seed(seed)
    b = groups * group
    logits = torch.randn(b, seq, vocab, generator=g, dtype=torch.float64) * 2
    targets = torch.randint(0, vocab, (b, seq), generator=g)
    # Prompt positions first (ignored), then completions of different lengths (padding ignored).
    mask = torch.zeros(b, seq, dtype=torch.bool)
    for i in range(b):
        start = int(torch.randint(1, 3, (1,), generator=g))
        length = int(torch.randint(1, seq - start + 1, (1,), generator=g))
        mask[i, start:start + length] = True
    targets = torch.where(mask, targets, torch.full_like(targets, -100))
    rewards = torch.randint(0, 3, (b,), generator=g).to(torch.float64) / 2
    logits.requires_grad_(True)
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = torch.gather(logp_all, 2, targets.clamp(min=0).unsqueeze(2)).squeeze(2)
    logp = torch.where(mask, logp, torch.zeros_like(logp))
    old = (logp.detach() + torch.randn(b, seq, generator=g, dtype=torch.float64) * 0.3) * mask
    ref = (logp.detach() + torch.randn(b, seq, generator=g, dtype=torch.float64) * 0.5) * mask

    grouped = rewards.view(-1, group)
    mean = grouped.mean(dim=1).repeat_interleave(group)
    std = grouped.std(dim=1).repeat_interleave(group)
    adv = rewards - mean
    if scale_rewards:
        adv = adv / (std + 1e-4)

    coef_1 = torch.exp(logp - old)
    coef_2 = torch.clamp(coef_1, 1 - eps, 1 + eps)
    loss1 = coef_1 * adv.unsqueeze(1)
    loss2 = coef_2 * adv.unsqueeze(1)
    per_token = -torch.min(loss1, loss2)
    m = mask.to(torch.float64)
    kl = torch.exp(ref - logp) - (ref - logp) - 1
    if beta != 0:
        per_token = per_token + beta * kl
    loss = ((per_token * m).sum(dim=1) / m.sum(dim=1)).mean()
    loss.backward()
    mean_kl = ((kl.detach() * m).sum(dim=1) / m.sum(dim=1)).mean()
    clipped = ((loss2 < loss1) & mask).sum().item() / mask.sum().item()
    return {
        "seed": seed, "group": group, "rows": b, "seq": seq, "vocab": vocab, "epsilon": eps,
        "beta": beta, "scale_rewards": scale_rewards,
        "logits": logits.detach().flatten().tolist(), "targets": targets.flatten().tolist(),
        "old_logp": old.flatten().tolist(), "ref_logp": ref.flatten().tolist(),
        "rewards": rewards.tolist(), "advantages": adv.tolist(),
        "logp": logp.detach().flatten().tolist(), "loss": loss.item(),
        "dlogits": logits.grad.flatten().tolist(), "kl": mean_kl.item(), "clip_ratio": clipped,
    }


def main():
    cases = [
        case(1, groups=2, group=4, seq=6, vocab=7, eps=0.2, beta=0.04, scale_rewards=True),
        case(2, groups=3, group=3, seq=5, vocab=5, eps=0.2, beta=0.0, scale_rewards=True),
        case(3, groups=2, group=4, seq=6, vocab=7, eps=0.1, beta=0.1, scale_rewards=False),
    ]
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "grpo_losses.json"), "w") as f:
        json.dump(cases, f, indent=1)


if __name__ == "__main__":
    main()
