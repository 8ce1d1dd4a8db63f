"""The federation benchmark: how far each strategy's final aggregate is from the pooled model, per site,
on real text nobody tuned on (benchmarks/federation_sets.py holds the sets and their fixed split).

    python benchmarks/federation_bench.py prepare                          # the sites' text (Debian)
    python benchmarks/federation_bench.py run --regime scratch --half confirmation
    python benchmarks/federation_bench.py run --regime finetune --half confirmation
    python benchmarks/federation_bench.py run --regime lora --half confirmation
    python benchmarks/federation_bench.py bound --half tuning --sets de-fr   # one model, 60 steps
    python benchmarks/federation_bench.py run --regime scratch --half tuning --strategies fedavg default \\
        --server '{"name": "fedadam", "lr": 0.05}'                         # one more candidate, by hand

Regimes:
- scratch: the demo (config/config.yaml): a tiny Llama and a byte-level BPE tokenizer built from the
  set's own training text, 8 rounds of 8 steps of 16 blocks of 128 tokens.
- finetune / lora: SmolLM2-135M-Instruct (scripts/fetch-smollm2, converted once into --cache), the
  examples' settings (config/examples/smollm2-it-cs*.yaml) cut down to 4 rounds of 3 steps of 4 blocks
  of 64 tokens, full weights or LoRA.

Every run of a set is built from a fedtune config (the regime's example with the set's sites) through
fedtune.core.config.build_run_config, so the train, aggregate and pooled options, and the schema's
defaults, are the pipeline's own. The stages then run in this process, with the pipeline's own pieces:
the tokenize stage's encoder and packing, the training loop's data order (BlockOrder), round plan and
learning-rate schedule, AdamW with the loop's settings and clipping, aggregate's token weights, its vocab
rows (fedtune.core.token_counts: each site's token counts of the round, as training writes them) and
their step (aggregate.vocab_step), server
optimizers (fedtune.aggregate.server_optimizers.step, tensor by tensor, with their state across rounds),
exact LoRA aggregation (sum_i w_i s_i B_i A_i, merged into the model) and evaluate's windows and scoring.
What it leaves out is what the figures do not depend on: processes, files, Slurm. (tests/test_demo.py
runs the demo through the real workflow and holds it to the same bar.)

Strategies: `fedavg` (plain FedAvg: server sgd at lr 1, every row with the sites' weights), `default` (the
schema's aggregate section as it stands), and `knob-half` / `knob-double` (the default with its main
knob, the server optimizer's lr, moved by half either way), plus `--server JSON` for a candidate. The pooled model of a set (every site's blocks in one
order, as many steps as the federation trains in all) is trained once per set and regime, and cached.

Prints, per set, a Markdown table of the final aggregate's perplexity and gap (aggregate / pooled) on
each site, per strategy, and writes every figure (every round) to --out/<regime>-<half>.csv.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import federation_sets as sets  # noqa: E402
from federation_exchange import Exchange  # noqa: E402

from fedtune.aggregate import server_optimizers  # noqa: E402
from fedtune.aggregate.merge import normalised, resolve_weights  # noqa: E402
from fedtune.core import config as fconfig  # noqa: E402
from fedtune.core import models, token_counts  # noqa: E402
from fedtune.evaluate.scores import build_stream, score  # noqa: E402
from fedtune.tokenize.blocks import BlockOrder  # noqa: E402
from fedtune.tokenize.shards import encode_documents, pack  # noqa: E402
from fedtune.train.backends import ADAM_EPS  # noqa: E402
from fedtune.train.loop import RoundPlan  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TEST_DOCUMENTS = {"scratch": 40, "finetune": 8, "lora": 8}
GGUF = ROOT / ".cache" / "models" / "smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def regime_config(regime: str, set_name: str, rounds: int | None = None, steps: int | None = None) -> dict:
    """The regime's fedtune config with the set's sites (their data files are set later, in memory)."""
    example = {"scratch": "config/config.yaml", "finetune": "config/examples/smollm2-it-cs.yaml",
               "lora": "config/examples/smollm2-it-cs-lora.yaml"}[regime]  # fmt: skip
    config = yaml.safe_load((ROOT / example).read_text())
    template = next(iter(config["sites"].values()))
    half = sets.half_of(set_name)
    config["sites"] = {site.key: copy.deepcopy(template) for site in sets.HALVES[half][set_name]}
    config.pop("aggregate", None)  # the strategy's, over the schema's defaults
    config["federation"] = {"rounds": config["federation"]["rounds"], "pooled_baseline": True}
    if regime != "scratch":
        sets.cut_for_fine_tuning(config)
    else:  # its figures were measured with one lr for every row, before the demo's factor of 16
        config["train"]["embedding_lr_factor"] = 1.0
    if rounds:
        config["federation"]["rounds"] = rounds
    if steps:
        config["train"]["max_steps"] = steps
    return config


def strategy_config(base: dict, strategy: str, candidate: dict | None) -> dict:
    """The config of one strategy: the aggregate section over the base config."""
    config = copy.deepcopy(base)
    defaults = fconfig.validate_section({}, "aggregate.schema.yaml", source="schema")["server_optimizer"]
    if strategy == "fedavg":
        config["aggregate"] = {"server_optimizer": {"name": "sgd", "lr": 1.0}, "vocab_rows": "weights"}
    elif strategy == "default":
        config["aggregate"] = {}
    elif strategy in ("knob-half", "knob-double"):
        factor = 0.5 if strategy == "knob-half" else 2.0
        config["aggregate"] = {"server_optimizer": {**defaults, "lr": defaults["lr"] * factor}}
    elif strategy == "candidate":  # a config overlay: aggregate, federation or train keys
        config = fconfig.deep_merge(config, candidate)
    else:
        raise SystemExit(f"error: unknown strategy {strategy!r}")
    return config


class Bench:
    """One set in one regime: its text, tokens, base model and pooled model, shared by its strategies."""

    def __init__(self, regime: str, set_name: str, text_dir: Path, cache: Path, rounds=None, steps=None):
        self.regime, self.set_name, self.cache = regime, set_name, cache
        self.half = sets.half_of(set_name)
        self.specs = {site.key: site for site in sets.HALVES[self.half][set_name]}
        self.text_dir = text_dir
        self.base_config = regime_config(regime, set_name, rounds, steps)
        self.run = fconfig.build_run_config(self._with_files(self.base_config), base_dir=ROOT)
        self.sites = list(self.run.sites)
        self.texts = {
            key: sets.site_documents(text_dir, site, self.half, TEST_DOCUMENTS[regime])
            for key, site in self.specs.items()
        }
        self.model, self.tokenizer = self._base()
        self.base_state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        block_size = self.run.tokenize.block_size
        self.blocks = {}
        for site, (train, _) in self.texts.items():
            flat, _, _ = encode_documents(train, self.tokenizer, "{text}", self.run.tokenize.add_bos)
            self.blocks[site] = pack(flat, block_size)[0]
        self.test_ids = {
            site: build_stream(test, self.tokenizer, add_bos=self.run.tokenize.add_bos).ids
            for site, (_, test) in self.texts.items()
        }
        self.round_one: dict[str, dict] = {}
        # Tied embeddings appear under both names in a state dict (one tensor; the saved model has one).
        state = self.model.state_dict()
        shared = {state[name].data_ptr() for name in token_counts.vocab_tensors(self.model)}
        self.vocab_tensors = tuple(name for name, t in state.items() if t.data_ptr() in shared)
        self.vocab = self.model.get_input_embeddings().num_embeddings

    def _with_files(self, config: dict) -> dict:
        config = copy.deepcopy(config)
        for key, site in config["sites"].items():  # the text itself comes from federation_sets
            folder = self.text_dir / f"{self.specs[key].source}-{self.specs[key].language}"
            site["dataset"]["data_files"] = {
                split: str(folder / f"{split}.jsonl") for split in ("train", "test")
            }
        if config["model"]["source"] == "gguf":
            config["model"]["path"] = str(GGUF)
        return config

    def _base(self):
        if self.regime == "scratch":
            spec = self.run.model
            corpus = [t for train, _ in self.texts.values() for t in train]
            tokenizer = models.train_tokenizer(
                corpus, spec.tokenizer.vocab_size, spec.tokenizer.min_frequency
            )
            model = models.build_model(fconfig.thaw(spec.architecture), tokenizer, seed=spec.seed)
            return model, tokenizer
        folder = self.cache / "smollm2"
        if not (folder / "model.safetensors").is_file():
            from fedtune.download.gguf import convert

            convert(GGUF, folder)
        return models.load_causal_lm(folder), models.load_tokenizer(folder)

    # -- the stages ---------------------------------------------------------------------------------
    def train(
        self,
        start: dict,
        blocks: np.ndarray,
        options,
        plan: RoundPlan,
        steps: int,
        moments: dict | None = None,
        correction: dict | None = None,
        control: dict | None = None,
    ) -> dict:
        """`steps` steps of one site (or the pooled model) from `start`: the training loop's data order,
        schedule, AdamW and clipping, in one process. Returns the trained weights. `moments`: the site's
        AdamW state of its previous round (federation.site_optimizer: keep), updated in place.
        `correction` (--scaffold): added to each step's gradient before clipping; `control`: filled with
        the mean raw gradient of the round's steps (the site's next control variate)."""
        model = self.model
        model.load_state_dict(start)
        torch.manual_seed(options.seed)  # as the training loop: before the adapter's A is drawn
        if options.adapter:
            from fedtune.core.adapters import wrap

            model = wrap(model, options.adapter, "causal-lm")
        model.train()
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(
            params, lr=options.lr, betas=options.betas, weight_decay=options.weight_decay, eps=ADAM_EPS
        )
        if moments is not None and "state" in moments:
            optimizer.load_state_dict(moments)
        order = BlockOrder(len(blocks), options.global_batch, options.micro_batch, 1, options.seed)
        first = plan.first_step(steps)
        # --scaffold only: the gradients it records and corrects, by name.
        scaffold = control is not None or correction is not None
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad] if scaffold else []
        if control is not None:
            control.update({n: torch.zeros_like(p) for n, p in named})
        for step in range(steps):
            for group in optimizer.param_groups:
                group["lr"] = plan.learning_rate(step, steps, options)
            for indices in order.micro_batches(first + step, 0):
                ids = torch.from_numpy(blocks[indices].astype(np.int64))
                (model(input_ids=ids, labels=ids).loss / order.accumulation).backward()
            for n, p in named:
                if control is not None:
                    control[n].add_(p.grad, alpha=1 / steps)
                if correction is not None:
                    p.grad.add_(correction[n])
            torch.nn.utils.clip_grad_norm_(params, options.grad_clip if options.grad_clip > 0 else math.inf)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if moments is not None:
            moments.update(copy.deepcopy(optimizer.state_dict()))
        if options.adapter:
            model = model.merge_and_unload()  # base + s B A, exactly the adapter's update
            self.model = model
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    def perplexity(self, state: dict) -> dict[str, float]:
        self.model.load_state_dict(state)
        self.model.eval()
        options = self.run.evaluate
        result = {}
        for site, ids in self.test_ids.items():
            nll, scored, _ = score(self.model, ids, options.max_length, options.stride, options.batch_size,
                                   desc=f"evaluate {site}")  # fmt: skip
            result[site] = math.exp(nll / scored)
        return result

    def pooled(self) -> dict[str, float]:
        options = self.run.pooled
        budget = f"{options.max_steps}x{options.global_batch}-lr{options.lr}"
        path = self.cache / f"pooled-{self.regime}-{self.set_name}-{budget}.json"
        if path.is_file():
            return json.loads(path.read_text())
        blocks = np.concatenate([self.blocks[s] for s in self.sites])
        started = time.time()
        state = self.train(self.base_state, blocks, options, RoundPlan(), options.max_steps)
        result = self.perplexity(state)
        print(f"  pooled {self.set_name}: {_fmt(result)} ({time.time() - started:.0f} s)", flush=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result))
        return result

    def federate(
        self, config: dict, label: str, scaffold: float = 0.0, work: Path | None = None
    ) -> list[dict]:
        """Every round of one strategy: rows (round, site, perplexity) of each round's aggregate.
        With federation.exchange compressed (--exchange), each round's models cross through the
        product's codec both ways, as files in `work` (benchmarks/federation_exchange.py).
        `scaffold` > 0: SCAFFOLD's control variates (Karimireddy et al. 2020), a prototype that is no
        pipeline setting: site i's c_i is the mean raw gradient of its previous round's steps, c = sum_i
        w_i c_i, and every local step adds scaffold x (c - c_i) to the gradient."""
        run = fconfig.build_run_config(self._with_files(config), base_dir=ROOT)
        aggregate = run.aggregate
        tokens = {s: self.blocks[s].size for s in self.sites}
        weights = normalised(resolve_weights(aggregate.weights, self.sites, tokens)[1])
        state, server_state, rows = self.base_state, {}, []
        keep = run.site_optimizer == "keep"
        moments = {site: {} for site in self.sites}
        controls = {site: {} for site in self.sites}
        exchange = start_dir = None
        if run.exchange.compressed:
            if work is None:
                raise SystemExit("error: a compressed federation.exchange needs a work folder for its files")
            exchange = Exchange(run.exchange, self.model, self.tokenizer, work)
            start_dir = exchange.save(self.base_state, Path(work) / "base")
        self.exchange = exchange
        started = time.time()
        for r in range(1, run.rounds + 1):
            plan = RoundPlan(r, run.rounds, run.lr_schedule)
            trained = {}
            mean_control = None
            if scaffold and r > 1:
                names = controls[self.sites[0]]
                mean_control = {n: sum(w * controls[s][n] for s, w in weights.items()) for n in names}
            for site in self.sites:
                options = run.sites[site].train
                key = json.dumps([site, options.to_json(), keep])
                if scaffold:
                    correction = None
                    if mean_control is not None:
                        correction = {n: scaffold * (c - controls[site][n]) for n, c in mean_control.items()}
                    trained[site] = self.train(state, self.blocks[site], options, plan, options.max_steps,
                                               None, correction, controls[site])  # fmt: skip
                    continue
                if r == 1 and key in self.round_one:  # round 1 starts from the base for every strategy
                    trained[site], moments[site] = self.round_one[key]
                    moments[site] = copy.deepcopy(moments[site])
                    continue
                trained[site] = self.train(state, self.blocks[site], options, plan, options.max_steps,
                                           moments[site] if keep else None)  # fmt: skip
                if r == 1:
                    self.round_one[key] = (trained[site], copy.deepcopy(moments[site]))
            counts = None
            if aggregate.rows_by_counts:
                counts = {}
                for site in self.sites:
                    options = run.sites[site].train
                    counts[site] = round_counts(
                        self.blocks[site], options, plan, options.max_steps, self.vocab
                    )
            if exchange is not None:  # what the merge rebuilds from each site's compressed update
                trained = {site: exchange.site(r, site, trained[site], start_dir) for site in self.sites}
            state, server_state = merge(state, trained, weights, aggregate.server_optimizer, server_state,
                                        counts, self.vocab_tensors, aggregate.vocab_factor(len(weights)))  # fmt: skip
            if exchange is not None:  # the aggregate back, compressed: every site continues from it
                state, start_dir = exchange.aggregate(r, state, start_dir)
            # Scored after rounds 1, R/2 and R from scratch; only after R in the slow fine-tuning regimes.
            if r == run.rounds or (self.regime == "scratch" and r in (1, run.rounds // 2)):
                for site, value in self.perplexity(state).items():
                    rows.append({"round": r, "site": site, "perplexity": value})
        print(f"  {label}: {time.time() - started:.0f} s", flush=True)
        return rows


def round_counts(blocks: np.ndarray, options, plan: RoundPlan, steps: int, vocab: int) -> np.ndarray:
    """How often each token id occurs in the blocks one site trains on in this round (as training's
    token_counts.json)."""
    order = BlockOrder(len(blocks), options.global_batch, options.micro_batch, 1, options.seed)
    first = plan.first_step(steps)
    batches = (blocks[order.global_indices(first + step)] for step in range(steps))
    return token_counts.count(batches, vocab)


# benchmarks/federation_probes.py's changes to the merge, which are no pipeline setting: an object with
# rows(table, counts, step) -> table and update(name, update, delta, state, by_row, optimizer) -> update
# (None: none).
MERGE_PROBE = None


def merge(start: dict, trained: dict, weights: dict, optimizer, state: dict, counts=None, rows=(), step=1.0):
    """aggregate: delta = sum_i w_i (site_i - start) per tensor, then the server optimizer's update.
    With `counts` (site -> token counts of the round; aggregate.vocab_rows: counts), the tensors with a
    row per token id take the aggregate's row weights, times `step` (aggregate.vocab_step)."""
    new, new_state = {}, {}
    slots = server_optimizers.slots(optimizer)
    table = None
    if counts is not None:
        site_counts = [counts[s] for s in weights]
        table = token_counts.row_weights(site_counts, list(weights.values())) * step
        if MERGE_PROBE is not None:
            table = MERGE_PROBE.rows(table, site_counts, step)
        vocab = table.shape[1]
    for name, base in start.items():
        if not base.is_floating_point():
            new[name] = base
            continue
        delta = torch.zeros_like(base, dtype=torch.float32)
        by_row = table is not None and name in rows and base.shape[0] == vocab
        for i, (site, w) in enumerate(weights.items()):
            if by_row:
                delta.add_((trained[site][name].float() - base.float()) * table[i][:, None])
            else:
                delta.add_(trained[site][name].float() - base.float(), alpha=w)
        out = {slot: torch.empty_like(delta) for slot in slots}
        old = {slot: state.get(name, {}).get(slot) for slot in slots}
        update = server_optimizers.step(optimizer, delta, old, out)
        if MERGE_PROBE is not None:
            update = MERGE_PROBE.update(name, update, delta, out, by_row, optimizer)
        new[name] = (base.float() + update).to(base.dtype)
        new_state[name] = out
    return new, new_state


def _fmt(values: dict) -> str:
    return " / ".join(f"{k} {v:.1f}" for k, v in values.items())


def run(args) -> int:
    torch.set_num_threads(args.threads)
    half_sets = sets.HALVES[args.half]
    names = args.sets or (list(half_sets) if args.regime == "scratch" else list(sets.FINETUNE[args.half]))
    candidate = json.loads(args.candidate) if args.candidate else None
    if args.server:
        candidate = fconfig.deep_merge(
            candidate or {}, {"aggregate": {"server_optimizer": json.loads(args.server)}}
        )
    strategies = list(args.strategies) + (["candidate"] if candidate is not None else [])
    exchange = None
    if args.exchange:  # validated as the pipeline does, with the config (build_run_config)
        exchange = json.loads(args.exchange)
        options = fconfig.ExchangeOptions.from_mapping(exchange, "--exchange")
        suffix = options.dtype + ("+ef" if options.keeps_residual else "")
    out = args.out / (
        f"{args.regime}-exchange-{args.half}.csv" if exchange else f"{args.regime}-{args.half}.csv"
    )
    frames = [pd.read_csv(out)] if out.is_file() else []
    for name in names:
        if name not in half_sets:
            raise SystemExit(f"error: set {name!r} is not in the {args.half} half ({sorted(half_sets)})")
        print(f"{args.regime} / {name}", flush=True)
        bench = Bench(args.regime, name, args.text, args.cache, args.rounds, args.steps)
        pooled = bench.pooled()
        for strategy in strategies:
            label = args.label if strategy == "candidate" and args.label else strategy
            config = strategy_config(bench.base_config, strategy, candidate)
            if args.scaffold:
                label = f"{label}+scaffold{args.scaffold:g}"
            if exchange is not None:
                config["federation"]["exchange"] = exchange
                label = f"{label}+{suffix}"
            with tempfile.TemporaryDirectory(prefix="fedbench-exchange-") as work:
                rows = pd.DataFrame(bench.federate(config, label, args.scaffold, Path(work)))
            if exchange is not None:  # bytes that crossed, both ways, against the models they stand for
                sent = pd.DataFrame(bench.exchange.bytes) if bench.exchange else None
                rows["sent_ratio"] = (
                    sent.update_bytes.sum() / sent.model_bytes.sum() if sent is not None else 1.0
                )
            rows["gap"] = [p / pooled[s] for p, s in zip(rows.perplexity, rows.site, strict=True)]
            rows["pooled"] = [pooled[s] for s in rows.site]
            rows.insert(0, "strategy", label)
            rows.insert(0, "set", name)
            final = rows[rows["round"] == rows["round"].max()]
            print(
                "    " + "  ".join(f"{s} {g:.2f}x" for s, g in zip(final.site, final.gap, strict=True)),
                flush=True,
            )
            frames = [f[~((f["set"] == name) & (f["strategy"] == label))] for f in frames] + [rows]
            args.out.mkdir(parents=True, exist_ok=True)
            pd.concat(frames).to_csv(out, index=False)
    table(pd.concat(frames))
    return 0


def bound(args) -> int:
    """What one model reaches in the federation's 60 sequential steps (docs/federation.md, "Where
    federation still falls short"): the pooled data trained for one site's steps with M times the batch (the federation's tokens in the
    federation's number of steps), the same with the plain batch, and each site alone on its own text,
    each as a gap to the pooled model."""
    import dataclasses

    torch.set_num_threads(args.threads)
    for name in args.sets or list(sets.HALVES[args.half]):
        bench = Bench(args.regime, name, args.text, args.cache, args.rounds, args.steps)
        pooled = bench.pooled()
        blocks = np.concatenate([bench.blocks[s] for s in bench.sites])
        site = bench.run.sites[bench.sites[0]].train
        steps = bench.run.rounds * site.max_steps
        batch = site.global_batch * len(bench.sites)
        for label, options in (
            (f"pooled data, {steps} steps of {batch}", dataclasses.replace(
                bench.run.pooled, global_batch=batch, micro_batch=site.micro_batch, max_steps=steps)),
            (f"pooled data, {steps} steps of {site.global_batch}", dataclasses.replace(
                bench.run.pooled, max_steps=steps)),
        ):  # fmt: skip
            ppl = bench.perplexity(bench.train(bench.base_state, blocks, options, RoundPlan(), steps))
            print(f"{name}: {label}: " + " ".join(f"{s} {ppl[s] / pooled[s]:.2f}x" for s in ppl), flush=True)
        for s in bench.sites:
            options = dataclasses.replace(bench.run.sites[s].train, max_steps=steps)
            ppl = bench.perplexity(
                bench.train(bench.base_state, bench.blocks[s], options, RoundPlan(), steps)
            )
            print(f"{name}: {s} alone, {steps} steps: {ppl[s] / pooled[s]:.2f}x", flush=True)
    return 0


def table(frame: pd.DataFrame) -> None:
    """Per strategy: the final gap on every site, the worst, and whether it is ever worse than FedAvg."""
    final = frame[frame.groupby(["set", "strategy"])["round"].transform("max") == frame["round"]]
    wide = final.pivot_table(index=["set", "site"], columns="strategy", values="gap")
    print(wide.round(2).to_markdown())
    print()
    print("worst gap per strategy:", wide.max().round(2).to_dict())
    print("geometric mean gap:", np.exp(np.log(wide).mean()).round(3).to_dict())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("command", choices=["prepare", "run", "table", "bound"])
    parser.add_argument("--regime", choices=["scratch", "finetune", "lora"], default="scratch")
    parser.add_argument("--half", choices=sorted(sets.HALVES), default="confirmation")
    parser.add_argument("--sets", nargs="*", help="a few sets of the half (default: all of the regime's)")
    parser.add_argument("--strategies", nargs="*", default=["fedavg", "default", "knob-half", "knob-double"])
    parser.add_argument("--server", help="a candidate server_optimizer section (JSON), as `candidate`")
    parser.add_argument(
        "--candidate",
        help="a config overlay (JSON) tried as `candidate`, e.g. "
        '\'{"federation": {"site_optimizer": "keep"}}\'',
    )
    parser.add_argument("--label", help="the candidate's name in the table")
    parser.add_argument(
        "--exchange",
        help="federation.exchange (JSON) for every strategy of the run, e.g. "
        '\'{"dtype": "int8", "error_feedback": true}\': each round\'s updates and aggregate cross through '
        "the product's codec, as files (benchmarks/federation_exchange.py); writes "
        "<regime>-exchange-<half>.csv, the strategy's name followed by +<dtype>[+ef]",
    )
    parser.add_argument("--text", type=Path, default=ROOT / ".cache" / "fedbench" / "text")
    parser.add_argument("--cache", type=Path, default=ROOT / ".cache" / "fedbench")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "federation")
    parser.add_argument("--rounds", type=int, help="rounds instead of the regime's")
    parser.add_argument("--steps", type=int, help="steps a round instead of the regime's")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--scaffold", type=float, default=0.0, metavar="BETA",
        help="prototype, no pipeline setting: SCAFFOLD's control variates in every strategy of the run (site "
        "optimizers reset each round, whatever the strategy says), each "
        "local gradient plus BETA (c - c_i) (docs/federation.md)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.command == "prepare":
        sets.prepare(args.text)
        return 0
    if args.command == "bound":
        return bound(args)
    if args.command == "table":
        table(pd.read_csv(args.out / f"{args.regime}-{args.half}.csv"))
        return 0
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
