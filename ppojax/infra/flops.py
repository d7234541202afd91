"""Model FLOPs of one PPO iteration, counted from the model config (multiply-add = 2 FLOPs).

d = hidden_size, f = intermediate_size, L = num_layers, H / H_kv = num_heads / num_kv_heads,
D = head_dim, V = vocab_size; B rows, P prompt slots (padding included: it is computed), R
response tokens, T = P + R.

    N_body   = L·(d·H·D + 2·d·H_kv·D + H·D·d + 3·d·f)   matmul parameters per token (q, k, v, o,
                                                          gate, up, down; GPT-2: 2·d·f, fc, proj)
    N_lm     = d·V (the LM head),  N_score = d (the 1-wide value/score head)
    attn(c)  = 4·L·H·D·c  per token that attends to c positions (q·kᵀ and probs·v)

    full(head, n_head) = B·[2·N_body·T + 2·head·n_head + Σ_{i<T} attn(i + 1)]
    generation = B·[2·N_body·P + 2·N_lm + Σ_{i<P} attn(i + 1)]       prefill (LM head on the
                                                                      last prompt slot only)
               + Σ_{t<R−1} B·[2·(N_body + N_lm) + attn(P + t + 1)]  R − 1 decode steps
    policy     = full(N_lm, R),  value = full(N_score, T)
    iteration  = generation + [policy] + policy + [value] + value   rollout and scoring (the
                                                                    bracketed passes: not in
                                                                    the single-pass update)
               + E·(3·policy + 3·value)                             update (backward = 2×fwd)

A prefix of C tokens shared by every row runs once for the batch: B·T token rows become
C + B·(T − C). Rematerialisation recomputes forwards; model FLOPs do not count that (the usual
MFU convention). ``benchmarks/ppo_step.py`` and ``ppojax.run.aot`` report these counts.
"""

from __future__ import annotations


def body_params(cfg) -> int:
  """N_body: the matmul parameters each token passes through in the layers (above)."""
  d, f, h, hk, hd = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads,
                     cfg.head_dim)
  mlp = 2 if cfg.model_type == "gpt2" else 3  # fc, proj; or SwiGLU's gate, up, down
  return cfg.num_layers * (d * h * hd + 2 * d * hk * hd + h * hd * d + mlp * d * f)


def model_flops(cfg, batch: int, prompt_len: int, response_len: int, lm_head: str = "ppojax",
                old_logp_fwd: bool = True, critic_fwd: bool = True, shared: int = 0,
                epochs: int = 1, samples: int = 1, critic: bool = True, reference: bool = True,
                reward_model: bool = True, lora: bool = False) -> dict[str, float]:
  """Model FLOPs of one PPO iteration by part (the formulas above). ``lm_head``: where the
  policy's LM head runs — "ppojax" (the last prompt slot in the prefill, the R response
  positions in scoring passes), "all" (every position, as a plain Hugging Face forward) or
  "none" (2 × non-embedding parameters per token). ``old_logp_fwd`` / ``critic_fwd``: the
  rollout runs the policy / critic forward (not in the single-pass update). ``shared``: the
  length C of a prefix run once for the batch. ``epochs``: the update's passes over the batch.
  ``samples``: responses per prompt (the prefill runs over the ``batch`` prompts, everything
  after over batch × samples rows). ``critic`` / ``reference`` / ``reward_model`` False: the
  iteration has none (a critic-free estimator; no KL penalty; a reward function). ``lora``:
  the update trains adapters only (policy and critic), so its backward pass computes the
  activations' gradients (1× the forward) and no weight gradients: fwd+bwd = 2× the forward
  instead of 3× (the rank-r adapters' own matmuls, ~2r/d of the layer's, are not counted)."""
  d, n_layers, h, hd = cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.head_dim
  n_body = body_params(cfg)
  n_lm, n_score = (0 if lm_head == "none" else d * cfg.vocab_size), d
  attn = lambda c: 4 * n_layers * h * hd * c  # noqa: E731
  p, r = prompt_len, response_len
  t = p + r
  everywhere = lm_head == "all"

  c = shared
  once = 2 * n_body * c + sum(attn(i + 1) for i in range(c))  # the prefix, for the batch

  prompts, batch = batch, batch * samples

  def full(head, n_head):
    return batch * (2 * n_body * (t - c) + 2 * head * n_head
                    + sum(attn(i + 1) for i in range(c, t))) + once

  prefill = prompts * (2 * n_body * (p - c) + 2 * n_lm * (p if everywhere else 1)
                     + sum(attn(i + 1) for i in range(c, p))) + once + (2 * n_lm if c else 0)
  # decode step k feeds token k (slot p + k) and gives token k + 1; the last token is never fed
  decode = sum(batch * (2 * (n_body + n_lm) + attn(p + k + 1)) for k in range(r - 1))
  policy, value = full(n_lm, t if everywhere else r), full(n_score, t - c)
  train = 2 if lora else 3  # forward + backward (+ weight gradients unless LoRA)
  parts = {
      "generation (prefill)": prefill, "generation (decode)": decode,
      "old log-probs (policy fwd)": policy if old_logp_fwd else 0,
      "reference log-probs (fwd)": policy if reference else 0,
      "critic values (fwd)": value if critic_fwd and critic else 0,
      "reward model (fwd)": value if reward_model else 0,
      "policy fwd+bwd": train * epochs * policy,
      "critic fwd+bwd": train * epochs * value if critic else 0,
  }
  return {k: float(v) for k, v in parts.items()}
