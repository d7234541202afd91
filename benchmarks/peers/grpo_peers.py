"""The peers' side of ``grpo_step.py``: trl's ``GRPOTrainer`` under each version of
``--trl-versions`` (trl 0.17 and trl 1.16 by default, ``trl_grpo.py`` in each version's own
environment, ``trl_ppo.TRL_VERSIONS``) and, with ``--tunix``, tunix's ``GRPOLearner``
(``tunix_grpo.py``), each in a process of its own, run before ppojax builds anything; and the
flat keys of ``grpo_step.py``'s JSON line that report them.

Table: the peers' rows of docs/performance/peers.md, "GRPO iteration vs trl:
`benchmarks/grpo_step.py`" and "GRPO vs tunix: `benchmarks/grpo_step.py --tunix`".

Each peer has a key (``trl_ppo.TRL_VERSIONS``: "trl" for trl 0.17, "trl116" for trl 1.16; and
"tunix") that names its results: ``PEER_seconds_per_iteration``, ``PEER_peak_rss_mb``,
``PEER_mean_reward``, the peer's whole JSON under ``PEER`` and, from ``ppo_step.comparisons``,
``ratio_vs_PEER_default`` / ``ratio_vs_PEER_equal_work`` and ``memory_vs_PEER_...``. The ratio
to ppojax's default row also has a flat key: ``speedup`` for trl 0.17 (the key its figures were
reported under), ``trl116_ratio`` and ``tunix_ratio``.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile

import numpy as np

# this folder (benchmarks/peers) and benchmarks/ (ppo_step.py): grpo_step.py, the one importer,
# puts both on sys.path; so does this module, for a test or a shell that imports it alone
_HERE = pathlib.Path(__file__).resolve().parent
for _folder in (_HERE, _HERE.parent):
  if str(_folder) not in sys.path:
    sys.path.insert(0, str(_folder))
# pylint: disable=wrong-import-position
import trl_grpo  # noqa: E402
import trl_ppo  # noqa: E402
import tunix_grpo  # noqa: E402
import tunix_ppo  # noqa: E402
from ppo_step import run_json, tunix_rss_limit  # noqa: E402

from ppojax.models import save_model

RATIO_KEYS = {"trl": "speedup", "trl116": "trl116_ratio",
              "trl116_shipped": "trl116_shipped_ratio", "tunix": "tunix_ratio"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
  """The peers' options: --[no-]trl, --trl-versions, an environment folder per trl version
  (``--trl-env`` for 0.17, ``--trl116-env`` for 1.16), --[no-]tunix and --tunix-env."""
  parser.add_argument("--trl", action=argparse.BooleanOptionalAction, default=True,
                      help="time trl's GRPOTrainer on the same task in this run (default)")
  parser.add_argument("--trl-versions", nargs="+", choices=list(trl_ppo.TRL_VERSIONS),
                      default=list(trl_ppo.TRL_VERSIONS),
                      help="which trl versions, each in its own environment (default: all)")
  for version, (key, _, _) in trl_ppo.TRL_VERSIONS.items():
    if version.endswith("-shipped"):  # the environment of the version it names
      continue
    parser.add_argument(f"--{key}-env", type=pathlib.Path, default=None,
                        help=f"trl {version}'s virtual environment (default "
                        f"{trl_ppo.default_env_dir(version)})")
  parser.add_argument("--tunix", action=argparse.BooleanOptionalAction, default=False,
                      help="time tunix's GRPOLearner on the same task in this run "
                      "(benchmarks/peers/tunix_grpo.py; its docstring lists what differs)")
  parser.add_argument("--tunix-env", type=pathlib.Path, default=None,
                      help=f"its virtual environment (default {tunix_ppo.default_env_dir()})")


def trl_peers(args) -> dict[str, str]:
  """{peer key: trl version} of the versions this run times, in ``--trl-versions``' order
  (none with ``--no-trl``)."""
  if not args.trl:
    return {}
  return {trl_ppo.TRL_VERSIONS[v][0]: v for v in dict.fromkeys(args.trl_versions)}


def peer_names(args) -> list[str]:
  """The keys of the peers this run times."""
  return [*trl_peers(args), *(["tunix"] if args.tunix else [])]


def run_side(script, python: pathlib.Path, policy_dir: str, tokens: np.ndarray,
             answers: list[str], args, what: str, skip: str = "--no-trl",
             options: tuple[str, ...] = ()) -> dict:
  """Another framework's GRPO iteration on the same weights and prompts (``script``, a module
  of this folder with ``trl_grpo.arguments``' options, and ``options`` beyond them, run in
  that framework's own environment ``python``): the JSON object it prints last."""
  cmd = [str(python), str(pathlib.Path(script.__file__)), "--policy", policy_dir,
         "--num-generations", str(args.samples), "--response-length", str(args.response_length),
         "--temperature", str(args.temperature), "--beta", str(args.kl_coef), "--iterations",
         str(args.iterations), "--warmup", str(args.warmup), "--lr", str(args.lr), *options]
  return run_json(cmd, what, skip, prompts={"token_ids": tokens.tolist(), "answers": answers})


def run_trl(key: str, version: str, policy_dir: str, tokens: np.ndarray, answers: list[str],
            args) -> dict:
  """trl ``version``'s GRPO iteration (``trl_grpo.py`` in that version's environment, made on
  first use), printed: the JSON object it prints last."""
  shipped = version.endswith("-shipped")  # 1.16's LM head on every position, as on a CPU
  python = trl_ppo.ensure_env(getattr(args, f"{key.removesuffix('_shipped')}_env"), version,
                              "grpo_step.py --no-trl (or --trl-versions without it)")
  print(f"trl {version}: {args.iterations} iterations after {args.warmup} warm-up ...",
        flush=True)
  side = run_side(trl_grpo, python, policy_dir, tokens, answers, args,
                  f"trl {version}'s GRPOTrainer", options=("--all-positions-lm-head",) * shipped)
  print(f"trl {side['trl']} GRPOTrainer (transformers {side['transformers']}, torch "
        f"{side['torch']}, {side['threads']} threads; LM head on the "
        f"{side['lm_head_positions']} positions): {side['seconds_per_iteration']:.2f} "
        f"s/iteration (median of {', '.join(f'{x:.2f}' for x in side['iterations'])}; "
        f"warm-up {', '.join(f'{x:.1f}' for x in side['warmup_seconds'])} s); peak RSS "
        f"{side['peak_rss_mb']:.0f} MB", flush=True)
  return side


def run_tunix(policy_dir: str, tokens: np.ndarray, answers: list[str], args) -> dict:
  """tunix's GRPO iteration (``tunix_grpo.py`` in ``tunix_ppo.ensure_env``'s environment),
  printed: the JSON object it prints last."""
  python = tunix_ppo.ensure_env(args.tunix_env)
  print(f"tunix: {args.iterations} iterations after {args.warmup} warm-up ...", flush=True)
  tunix = run_side(tunix_grpo, python, policy_dir, tokens, answers, args,
                   "tunix's GRPOLearner", "--no-tunix", tuple(tunix_rss_limit()))
  print(f"tunix {tunix['tunix']} GRPOLearner (jax {tunix['jax']}, flax "
        f"{tunix['flax']}): {tunix['seconds_per_iteration']:.2f} s/iteration (median of "
        f"{', '.join(f'{x:.2f}' for x in tunix['iterations'])}; warm-up "
        f"{', '.join(f'{x:.1f}' for x in tunix['warmup_seconds'])} s); peak RSS "
        f"{tunix['peak_rss_mb']:.0f} MB; shortest completion "
        f"{tunix['min_completion_length']} tokens", flush=True)
  return tunix


def run_peers(args, policy, tokens: np.ndarray, answers: list[str]) -> dict[str, dict]:
  """{peer key: its JSON} of every peer this run times, each run in turn on ``policy`` (saved to
  a temporary Hugging Face directory) and the prompt ids ``tokens``."""
  peers = {}
  if not peer_names(args):
    return peers
  with tempfile.TemporaryDirectory() as tmp:
    save_model(f"{tmp}/policy", policy)
    for key, version in trl_peers(args).items():
      peers[key] = run_trl(key, version, f"{tmp}/policy", tokens, answers, args)
    if args.tunix:  # likewise, in its own process and environment
      peers["tunix"] = run_tunix(f"{tmp}/policy", tokens, answers, args)
  return peers


def mean_reward(key: str, side: dict):
  """A peer's mean reward over its timed and warm-up iterations, as it logs it."""
  return side["mean_reward"] if key == "tunix" else side["metrics"].get("reward")


def summary(peers: dict[str, dict], seconds: float, rss: float) -> dict:
  """The flat JSON keys of every peer that can run (None where it did not; see the module's
  docstring), against ppojax's default row (``seconds`` per iteration, ``rss`` MB peak), with
  each ratio printed; and ``versions``' entries of the peers (trl 0.17's flat, as before)."""
  out, versions = {}, {}
  for key, ratio_key in RATIO_KEYS.items():
    side = peers.get(key)
    out[f"{key}_seconds_per_iteration"] = side and side["seconds_per_iteration"]
    out[ratio_key] = side and side["seconds_per_iteration"] / seconds
    out[f"{key}_peak_rss_mb"] = side and side["peak_rss_mb"]
    out[f"{key}_mean_reward"] = side and mean_reward(key, side)
    out[key] = side
    if side is None:
      continue
    print(f"{key} / ppojax = {side['seconds_per_iteration']:.2f} / {seconds:.2f} = "
          f"{out[ratio_key]:.2f}x; peak RSS {key} / ppojax = {side['peak_rss_mb']:.0f} / "
          f"{rss:.0f} MB")
    if key == "trl":
      versions.update({k: side[k] for k in ("trl", "transformers", "torch")})
    elif key == "tunix":
      versions["tunix"] = side["tunix"]
    else:
      versions[key] = {k: side[k] for k in ("trl", "transformers", "torch")}
  out["versions"] = versions
  return out
