"""The PyTorch + gymnasium side of ``benchmarks/cartpole.py``: PPO on CartPole-v1 as the classic
tutorial code writes it (CleanRL's ``ppo.py`` shape: a Python loop over steps, a
``SyncVectorEnv``, GAE in a reversed Python loop, epochs of shuffled minibatches), with the same
hyper-parameters and the same algorithm as ``ppojax.classic.ppo``:

Table: the PyTorch column of docs/classic.md, "Figures" (run by ``benchmarks/cartpole.py``).

* actor and critic: 2 tanh layers of 64, orthogonal init (√2; heads 0.01 and 1), no sharing;
* N environments × T steps; GAE with γ, λ; a truncated episode (the 500-step limit) bootstraps
  from V(final observation) (gymnasium's same-step autoreset gives it), a terminated one does
  not; advantages whitened per minibatch with the unbiased variance, eps inside the root;
* clipped surrogate, clipped value loss ½·max(...), entropy bonus; global-norm clip 0.5; Adam
  (eps 1e-5) with the rate annealed linearly to 0 over every optimizer step.

    python benchmarks/peers/cartpole_torch.py [--seed 0] [--total-timesteps 500000] [--threads 1]

``--threads`` sets ``torch.set_num_threads`` (1 by default: on the 2-core CPU of docs/classic.md
torch's default of one thread per core made each iteration about 8x slower, its tiny ops
contending for the cores).

Prints one JSON line: ``seconds``, ``returns`` (per iteration: the mean over environments of the
last finished episode's return, as ppojax reports it) and ``seconds_at`` (wall time after each
iteration).
"""

from __future__ import annotations

import argparse
import json
import time

import gymnasium as gym
import numpy as np
import torch
from torch import nn

DEFAULTS = dict(num_envs=4, num_steps=128, total_timesteps=500_000, lr=2.5e-4, num_epochs=4,
                num_minibatches=4, gamma=0.99, lam=0.95, clip_eps=0.2, value_clip=0.2,
                ent_coef=0.01, vf_coef=0.5, max_grad_norm=0.5, hidden=64)


def _mlp(sizes, out_gain):
  layers = []
  for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
    last = i == len(sizes) - 2
    layer = nn.Linear(a, b)
    nn.init.orthogonal_(layer.weight, out_gain if last else np.sqrt(2))
    nn.init.zeros_(layer.bias)
    layers += [layer] if last else [layer, nn.Tanh()]
  return nn.Sequential(*layers)


class Agent(nn.Module):

  def __init__(self, obs_dim, num_actions, hidden):
    super().__init__()
    self.actor = _mlp([obs_dim, hidden, hidden, num_actions], 0.01)
    self.critic = _mlp([obs_dim, hidden, hidden, 1], 1.0)

  def value(self, x):
    return self.critic(x).squeeze(-1)


def train(seed: int = 0, **overrides) -> dict:
  hp = dict(DEFAULTS, **overrides)
  n, t_len = hp["num_envs"], hp["num_steps"]
  batch = n * t_len
  num_updates = hp["total_timesteps"] // batch
  mb_size = batch // hp["num_minibatches"]
  torch.manual_seed(seed)
  np.random.seed(seed)
  start = time.perf_counter()
  envs = gym.vector.SyncVectorEnv([lambda: gym.make("CartPole-v1") for _ in range(n)],
                                  autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
  agent = Agent(4, 2, hp["hidden"])
  opt = torch.optim.Adam(agent.parameters(), lr=hp["lr"], eps=1e-5)
  total_opt_steps = num_updates * hp["num_epochs"] * hp["num_minibatches"]
  sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: max(0.0, 1.0 - k / total_opt_steps))

  obs_buf = torch.zeros((t_len, n, 4))
  act_buf = torch.zeros((t_len, n), dtype=torch.long)
  logp_buf, val_buf, rew_buf, next_val_buf = (torch.zeros((t_len, n)) for _ in range(4))
  term_buf, trunc_buf = (torch.zeros((t_len, n), dtype=torch.bool) for _ in range(2))
  obs, _ = envs.reset(seed=seed)
  obs = torch.as_tensor(obs, dtype=torch.float32)
  ep_ret, last_ret = np.zeros(n), np.zeros(n)
  returns, seconds_at = [], []

  for _ in range(num_updates):
    for t in range(t_len):  # rollout
      with torch.no_grad():
        logits = agent.actor(obs)
        dist = torch.distributions.Categorical(logits=logits)
        action = dist.sample()
        obs_buf[t], act_buf[t], logp_buf[t] = obs, action, dist.log_prob(action)
        val_buf[t] = agent.value(obs)
      next_obs, reward, term, trunc, info = envs.step(action.numpy())
      final = next_obs.copy()
      if "_final_obs" in info:
        for i in np.flatnonzero(info["_final_obs"]):
          final[i] = info["final_obs"][i]
      with torch.no_grad():
        next_val_buf[t] = agent.value(torch.as_tensor(final, dtype=torch.float32))
      rew_buf[t] = torch.as_tensor(reward, dtype=torch.float32)
      term_buf[t] = torch.as_tensor(term)
      trunc_buf[t] = torch.as_tensor(trunc & ~term)
      done = term | trunc
      ep_ret += reward
      last_ret = np.where(done, ep_ret, last_ret)
      ep_ret = np.where(done, 0.0, ep_ret)
      obs = torch.as_tensor(next_obs, dtype=torch.float32)

    with torch.no_grad():  # GAE: d = γ(1 − terminal), the trace cut at every episode end
      adv = torch.zeros((t_len, n))
      last = torch.zeros(n)
      for t in reversed(range(t_len)):
        d = hp["gamma"] * (~term_buf[t]).float()
        cont = (~(term_buf[t] | trunc_buf[t])).float()
        delta = rew_buf[t] + d * next_val_buf[t] - val_buf[t]
        last = delta + hp["lam"] * d * cont * last
        adv[t] = last
      ret = adv + val_buf

    b_obs, b_act = obs_buf.reshape(-1, 4), act_buf.reshape(-1)
    b_logp, b_adv, b_ret, b_val = (x.reshape(-1) for x in (logp_buf, adv, ret, val_buf))
    for _ in range(hp["num_epochs"]):
      perm = torch.randperm(batch)
      for k in range(hp["num_minibatches"]):
        idx = perm[k * mb_size:(k + 1) * mb_size]
        logits = agent.actor(b_obs[idx])
        dist = torch.distributions.Categorical(logits=logits)
        logp, entropy = dist.log_prob(b_act[idx]), dist.entropy().mean()
        mb_adv = b_adv[idx]
        mb_adv = (mb_adv - mb_adv.mean()) / torch.sqrt(mb_adv.var() + 1e-8)
        ratio = torch.exp(logp - b_logp[idx])
        pg = torch.max(-mb_adv * ratio,
                       -mb_adv * torch.clamp(ratio, 1 - hp["clip_eps"], 1 + hp["clip_eps"]))
        v = agent.value(b_obs[idx])
        v_clip = b_val[idx] + torch.clamp(v - b_val[idx], -hp["value_clip"], hp["value_clip"])
        v_loss = 0.5 * torch.max((v - b_ret[idx]) ** 2, (v_clip - b_ret[idx]) ** 2).mean()
        loss = pg.mean() + hp["vf_coef"] * v_loss - hp["ent_coef"] * entropy
        opt.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(agent.parameters(), hp["max_grad_norm"])
        opt.step()
        sched.step()
    returns.append(float(last_ret.mean()))
    seconds_at.append(time.perf_counter() - start)
  envs.close()
  return {"seconds": time.perf_counter() - start, "returns": returns, "seconds_at": seconds_at,
          "torch": torch.__version__, "gymnasium": gym.__version__,
          "torch_threads": torch.get_num_threads()}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--total-timesteps", type=int, default=DEFAULTS["total_timesteps"])
  parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
  args = parser.parse_args()
  torch.set_num_threads(args.threads)
  print(json.dumps(train(args.seed, total_timesteps=args.total_timesteps)), flush=True)


if __name__ == "__main__":
  main()
