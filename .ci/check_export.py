"""The policy a run exported loads in transformers and greedy-decodes what ppojax decoded.

    python .ci/check_export.py WORKDIR [--limit N]

Reads WORKDIR/policy (the Hugging Face directory the run exported) with transformers'
``AutoModelForCausalLM`` / ``AutoTokenizer`` (PyTorch, float32), renders every held-out prompt
of WORKDIR/eval_samples_after.jsonl through the exported chat template, decodes greedily as
many new tokens as the run did, and compares the text with the completion ppojax wrote. Exits
1 on any difference, naming the prompts. Needs torch (the test extra installs it).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import torch
import transformers


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("workdir", type=pathlib.Path)
  parser.add_argument("--limit", type=int, default=0, help="check only the first N prompts")
  args = parser.parse_args()
  policy = args.workdir / "policy"
  rows = [json.loads(line) for line in
          (args.workdir / "eval_samples_after.jsonl").read_text().splitlines()]
  if args.limit:
    rows = rows[:args.limit]
  config = json.loads((args.workdir / "config.json").read_text())
  new_tokens = config["eval"]["max_new_tokens"] or config["sampling"]["max_new_tokens"]

  tokenizer = transformers.AutoTokenizer.from_pretrained(policy)
  model = transformers.AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32).eval()
  differ = []
  for row in rows:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": row["prompt"]}],
                                        add_generation_prompt=True, return_tensors="pt",
                                        return_dict=True)
    with torch.no_grad():
      out = model.generate(**ids, do_sample=False, max_new_tokens=new_tokens,
                           eos_token_id=tokenizer.eos_token_id,
                           pad_token_id=tokenizer.pad_token_id)
    text = tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    if text != row["completion"]:
      differ.append((row["prompt"], row["completion"], text))
  print(f"{policy}: transformers {transformers.__version__} greedy-decoded {len(rows)} held-out "
        f"prompts; {len(rows) - len(differ)} equal ppojax's completions")
  for prompt, ours, theirs in differ[:10]:
    print(f"  {prompt!r}:\n    ppojax       {ours!r}\n    transformers {theirs!r}")
  return 1 if differ else 0


if __name__ == "__main__":
  sys.exit(main())
