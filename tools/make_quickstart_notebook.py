"""Writes colabs/quickstart.ipynb (outputs stripped). Run from the repository root after editing the cells here."""
import nbformat as nbf
nb = nbf.v4.new_notebook()
md = nbf.v4.new_markdown_cell
code = nbf.v4.new_code_cell
nb.cells = [
md("""# tltjax quick start: a tiny policy, trained here, then sampled

This notebook trains (or loads from the cache) the tiny Qwen2-style policy that every tltjax demo
starts from: supervised fine-tuning on `longtail_arith`, a synthetic multi-step arithmetic task with
verifiable answers and a long-tailed response length. It then generates from the policy and scores
the answers. It runs on a CPU runtime (Colab's free tier is enough).

Set `TINY = True` for a one-minute run on a micro model (what CI executes); the default config
trains the real tiny policy in a few minutes."""),
code("""# tltjax must be installed in this runtime. On Colab: upload the repository (or mount it from
# Drive), then run `!pip install -e tltjax` in a cell. A local checkout with `pip install -e .` has it.
import importlib.util
if importlib.util.find_spec("tltjax") is None:
    raise RuntimeError("tltjax is not installed here: run `pip install -e <path to the tltjax checkout>` first")"""),
code("""import os
TINY = os.environ.get("TLTJAX_NOTEBOOK_TINY", "0") == "1"

from tltjax.config import load_config
from tltjax.default_config import get_config

config = get_config()
if TINY:
    config = load_config("configs/micro.py", ["--config.sft.steps=20", "--config.task.num_train=256"])
print("model:", dict(config.model), "\\nsft steps:", config.sft.steps)"""),
md("""## The task and its long tail
Each problem is a start value and a chain of operations; the worked solution writes one line per
step, so response length grows with the number of steps, which is heavy-tailed."""),
code("""from tltjax import tiny_policy
from tltjax.rl import tasks

task = tasks.get_task(config.task.name)
examples = tiny_policy.task_examples(config, 5000, seed=config.seed)
print(tasks.length_stats(examples))
print("prompt:  ", examples[0].prompt)
print("response:", examples[0].response.replace("\\n", " | "))"""),
md("## Train (or load) the tiny policy\nThe trained model is saved in Hugging Face format and cached; a second run loads it."),
code("""from tltjax import tiny_policy

path = tiny_policy.get_tiny_policy(config)
model, tokenizer = tiny_policy.load_policy(path)
print(path, f"{model.config.num_params() / 1e6:.2f}M parameters")"""),
md("## Generate and score"),
code("""held_out = tiny_policy.task_examples(config, 32, seed=config.seed + 1_000_003)
acc, texts = tiny_policy.accuracy(model, tokenizer, held_out, task, max_new_tokens=config.generate.max_new_tokens)
print(f"greedy accuracy on {len(held_out)} held-out problems: {acc:.1%}")
for e, t in list(zip(held_out, texts))[:3]:
    print(f"\\n{e.prompt!r} -> expected {e.answer}\\n{t}")"""),
md("## Sampling at temperature 1 with log-probs"),
code("""from tltjax import data
from tltjax.rollout.dense import generate
from tltjax.rollout.sampling import SamplingParams

prompt_ids = data.encode_prompts([held_out[0].prompt], tokenizer)
gens = generate(model, prompt_ids * 4, max_new_tokens=config.generate.max_new_tokens,
                params=SamplingParams(temperature=1.0), stop_ids=(tokenizer.eos_id,), seed=0)
for g in gens:
    print(g.finish_reason, f"sum log-prob {sum(g.logprobs):.2f}", repr(tokenizer.decode(g.tokens, skip_special_tokens=True)))"""),
]
nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
nbf.write(nb, "colabs/quickstart.ipynb")
