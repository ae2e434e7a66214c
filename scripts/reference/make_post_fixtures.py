"""Reference fixtures for models/post/ (SFT chat data, DPO / IPO / reward-model losses).

Run from the repository root with the reference venv (torch, transformers 4.44.2):
    /tmp/llama3_venv/bin/python scripts/reference/make_post_fixtures.py
Writes tests/fixtures/post/chat_cases.json and tests/fixtures/post/preference_losses.json.

Chat: HF's apply_chat_template with the Llama-3 and ChatML templates, written as TRL writes them
for assistant-only loss ({% generation %} around the assistant content and its end-of-turn
token), on the GPT-2 BPE fixture tokenizer with the templates' special tokens added (HF gives them
the ids vocab_size, vocab_size + 1, ... in the order added).

Reward models: tiny random LlamaForSequenceClassification and GPT2ForSequenceClassification
(num_labels 1, pad_token_id 0) saved with save_pretrained into tests/fixtures/post/<name>/, with
reward.json: the rewards of rows padded at the end (HF pools the score at the token before the
first pad), the Bradley-Terry loss of (row 0 over row 1, row 2 over row 3) and its gradient in a
few parameters, in float32 as HF computes them.

Losses: written here from the published formulas as TRL's DPOTrainer.dpo_loss implements them
(sigmoid with label smoothing, IPO) and the reward trainer's -logsigmoid(r_c - r_r), in float64,
with gradients from autograd.
"""
import json
import os

import torch
from transformers import GPT2TokenizerFast

OUT = os.path.join("tests", "fixtures", "post")
TOK = os.path.join("tests", "fixtures", "tokenizers", "gpt2")

LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}"
    "{{ message['content'] | trim + '<|eot_id|>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] | trim + '<|eot_id|>' }}{% endif %}{% endfor %}"
)
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}"
    "{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}{{ '\n' }}{% endfor %}"
)
SPECIALS = {
    "llama3": ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
    "chatml": ["<|im_start|>", "<|im_end|>"],
}
CONVERSATIONS = [
    [{"role": "user", "content": "Hello, who are you?"},
     {"role": "assistant", "content": "I am a small model.\nNice to meet you!"}],
    [{"role": "system", "content": "  You answer briefly. "},
     {"role": "user", "content": "What is 2+2?"},
     {"role": "assistant", "content": " 4 "},
     {"role": "user", "content": "And 3+3?"},
     {"role": "assistant", "content": "6, of course."}],
    [{"role": "user", "content": "Say nothing."}, {"role": "assistant", "content": ""}],
]


def chat_cases():
    cases = []
    for fmt, template in (("llama3", LLAMA3), ("chatml", CHATML)):
        tok = GPT2TokenizerFast(os.path.join(TOK, "vocab.json"), os.path.join(TOK, "merges.txt"))
        vocab = len(tok)
        tok.add_special_tokens({"additional_special_tokens": SPECIALS[fmt]})
        if fmt == "llama3":
            tok.bos_token = "<|begin_of_text|>"
        tok.chat_template = template
        for msgs in CONVERSATIONS:
            text = tok.apply_chat_template(msgs, tokenize=False)
            out = tok.apply_chat_template(msgs, tokenize=True, return_dict=True,
                                          return_assistant_tokens_mask=True)
            cases.append({"format": fmt, "vocab": vocab, "messages": msgs, "text": text,
                          "ids": out["input_ids"], "assistant_mask": out["assistant_masks"],
                          "specials": {s: tok.convert_tokens_to_ids(s) for s in SPECIALS[fmt]}})
    return cases


def preference_cases():
    g = torch.Generator().manual_seed(19)
    n = 6
    cases = []
    for loss_type, beta, ls in (("sigmoid", 0.1, 0.0), ("sigmoid", 0.5, 0.2), ("ipo", 0.1, 0.0),
                                ("ipo", 0.3, 0.0)):
        pc, pr, rc, rr = (torch.randn(n, generator=g, dtype=torch.float64) * 5 - 20
                          for _ in range(4))
        pc.requires_grad_(True)
        pr.requires_grad_(True)
        # TRL DPOTrainer.dpo_loss: logits = (pi_c - pi_r) - (ref_c - ref_r)
        logits = (pc - pr) - (rc - rr)
        if loss_type == "sigmoid":
            losses = (-torch.nn.functional.logsigmoid(beta * logits) * (1 - ls)
                      - torch.nn.functional.logsigmoid(-beta * logits) * ls)
        else:  # ipo: (logits - 1/(2 beta))^2 (TRL divides the log-probs by the lengths first)
            losses = (logits - 1 / (2 * beta)) ** 2
        loss = losses.mean()
        loss.backward()
        rewards_c = beta * (pc - rc).detach()
        rewards_r = beta * (pr - rr).detach()
        cases.append({"kind": "dpo", "loss_type": loss_type, "beta": beta, "label_smoothing": ls,
                      "policy_chosen": pc.tolist(), "policy_rejected": pr.tolist(),
                      "reference_chosen": rc.tolist(), "reference_rejected": rr.tolist(),
                      "loss": loss.item(), "d_policy_chosen": pc.grad.tolist(),
                      "d_policy_rejected": pr.grad.tolist(),
                      "rewards_chosen": rewards_c.mean().item(),
                      "rewards_rejected": rewards_r.mean().item(),
                      "accuracy": (rewards_c > rewards_r).double().mean().item(),
                      "margin": (rewards_c - rewards_r).mean().item()})
    rc = (torch.randn(n, generator=g, dtype=torch.float64) * 3).requires_grad_(True)
    rr = (torch.randn(n, generator=g, dtype=torch.float64) * 3).requires_grad_(True)
    loss = -torch.nn.functional.logsigmoid(rc - rr).mean()
    loss.backward()
    cases.append({"kind": "reward", "chosen": rc.tolist(), "rejected": rr.tolist(),
                  "loss": loss.item(), "d_chosen": rc.grad.tolist(), "d_rejected": rr.grad.tolist(),
                  "accuracy": (rc > rr).double().mean().item()})
    return cases


def reward_model(kind):
    import transformers
    torch.manual_seed(23)
    if kind == "llama_rm":
        cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=24,
                                       num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, max_position_embeddings=16,
                                       attention_dropout=0.0, attn_implementation="eager",
                                       num_labels=1, pad_token_id=0)
        model = transformers.LlamaForSequenceClassification(cfg)
        probe = ["score.weight", "model.layers.0.mlp.up_proj.weight", "model.embed_tokens.weight",
                 "model.norm.weight"]
    else:
        cfg = transformers.GPT2Config(vocab_size=32, n_positions=16, n_embd=16, n_layer=2,
                                      n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                      num_labels=1, pad_token_id=0)
        model = transformers.GPT2ForSequenceClassification(cfg)
        probe = ["score.weight", "transformer.h.0.attn.c_attn.weight", "transformer.wte.weight",
                 "transformer.wpe.weight", "transformer.ln_f.weight"]
    with torch.no_grad():  # away from init's symmetries (zero biases, unit norms)
        for p in model.parameters():
            p.add_(torch.randn(p.shape) * 0.05)
    model.eval()
    folder = os.path.join(OUT, kind)
    os.makedirs(folder, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(1, 32, (4, 9), generator=g)
    for row, length in enumerate((9, 6, 4, 7)):  # padded at the end with pad_token_id 0
        ids[row, length:] = 0
    rewards = model(input_ids=ids).logits[:, 0]
    loss = -torch.nn.functional.logsigmoid(rewards[0::2] - rewards[1::2]).mean()
    loss.backward()
    named = dict(model.named_parameters())
    grads = {name: named[name].grad.flatten().tolist() for name in probe}
    with open(os.path.join(folder, "reward.json"), "w") as f:
        json.dump({"ids": ids.tolist(), "rewards": rewards.tolist(), "loss": loss.item(),
                   "grads": grads}, f)


def main():
    for kind in ("llama_rm", "gpt2_rm"):
        reward_model(kind)
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "chat_cases.json"), "w") as f:
        json.dump(chat_cases(), f, indent=1)
    with open(os.path.join(OUT, "preference_losses.json"), "w") as f:
        json.dump(preference_cases(), f, indent=1)


if __name__ == "__main__":
    main()
