"""Speculative decoding: TPOT and throughput with and without it, acceptance under control.

Random weights give random acceptance, so acceptance is set with the replay proposer
(`tandem.spec_decode.replay`): a run without speculation records each prompt's greedy
continuation, then engines with `{"method": "replay", "num_speculative_tokens": k,
"replay_acceptance": p}` propose it, each draft token kept with probability p. Every batch
size has its own prompts (so each prompt's record comes from the run of its batch size).
With a model that has a tokenizer, `--ngram` also runs n-gram speculation on prompts whose
answers copy their input, with the measured acceptance.

Proposers that run a model (`--draft-models`, `--eagle`): each named draft model (`self`: the
target drafting for itself, the p = 1 upper bound; e.g. `random:llama-3.2-1b` for the 8B,
its overhead) and the EAGLE head (e.g. `random:eagle-llama-3.1-8b`, its cost) run at every
batch size and k, paired with the baseline. The proposer's own time per engine step (the
device synchronized around it) is split into steps that drafted (`proposer_ms_per_drafting_
step`: its catch-up pass over the step's tokens and k draft steps) and steps that only kept
its KV in step (`proposer_ms_per_kv_only_step`: every request backing off). Random weights
reject a random draft's tokens and the scheduler backs requests off drafting
(tandem.core.scheduler), so TPOT there shows what speculation costs once it backs off; the
cost of drafting is the drafting-step figure.

Each replay engine runs per `--rules` (the speculative config's `speculation_rule`:
`measured`, the per-step rule of tandem.core.spec_decode_rule, or `always`) and per
`--async-modes` (the engine's async scheduling, on / off). Each row says how the engine ran
(`async_scheduling`) and, under the measured rule, its choices during the timed run
(`rule_steps_by_num_drafts`: steps by drafts per request, 0 = plain decode; `rule_probes`;
counted over the timed generate only, since session 10: before, they included the 4-token
warm-up at batch 1 that precedes it).
The measured rule learns per batch size: by default (`--warm-rule`) each speculative row is
timed after one untimed run of the same batch, so the figure is the rule's steady state (its
first probes in a bucket are the cost of learning it, paid once per engine). `--repeats N`
times N interleaved (no spec, spec) pairs per row and reports the medians: a ratio near 1
(p = 0) is then not one pair's drift.

Per batch size B (all requests greedy, ignore_eos, `--output-len` tokens each, started
together): `tpot_ms` = wall time / the longest output (the batch decodes in lockstep; prefill
included), `output_tokens_per_s` = output tokens / wall time; `same_tokens` = the outputs
equal the run without speculation; acceptance from the engine's stats.

    python -m benchmarks.speculative                        # CPU, embedded model
    python -m benchmarks.speculative --device cuda --model random:llama-3.1-8b \\
        --batch-sizes 1,8,32,128 --ks 2,4 --acceptances 1,0.7,0.4,0 --rules measured,always
    python -m benchmarks.speculative --device cuda --model random:llama-3.1-8b \\
        --batch-sizes 1,32,128 --ks 4 --acceptances 1,0 --async-modes on,off
    python -m benchmarks.speculative --device cuda --model random:llama-3.1-8b \\
        --batch-sizes 1,8,32 --ks 4 --acceptances '' \\
        --draft-models random:llama-3.2-1b,self --eagle random:eagle-llama-3.1-8b

Every engine flag applies (`tandem.config`); defaults here: --device cpu, --dtype float32 on
the CPU and bfloat16 on CUDA, --gpu-memory-utilization 0.4 (two engines are loaded at once:
the one without speculation stays, to time it right before each speculative run).
Writes JSON under benchmarks/results/.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# tandem first: it sets the OpenMP defaults (tandem/runtime_env.py) before torch loads.
import tandem  # noqa: F401

# isort: split
import torch

from benchmarks.forced_replay import ForceRecorded, forced_params
from tandem import LLM, SamplingParams
from tandem.config import add_engine_args, engine_kwargs_from, parse_device

RESULTS_DIR = Path(__file__).resolve().parent / "results"

COPY_PROMPTS = [
    "Fix the typo in this function and return the whole function:\n\n"
    "def mean(values):\n    total = 0\n    for v in values:\n        total += v\n"
    "    return totl / len(values)\n",
    "Extract every email address from this text, one per line:\n\n"
    "Contact alice@example.com or bob@example.org; billing: billing@example.net. "
    "Support is at help@example.com and sales@example.org.\n",
    "Rename the variable x to count in this code:\n\n"
    "x = 0\nfor item in items:\n    if item.ok:\n        x += 1\nprint(x)\n",
]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_engine_args(p)
    p.set_defaults(device="cpu", gpu_memory_utilization=0.4)
    w = p.add_argument_group("workload")
    w.add_argument("--batch-sizes", default="1,8", help="comma-separated")
    w.add_argument("--ks", default="2,4", help="num_speculative_tokens values")
    w.add_argument("--acceptances", default="1,0.7,0.4,0", help="replay keep probabilities p")
    w.add_argument("--input-len", type=int, default=64)
    w.add_argument("--output-len", type=int, default=64)
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--ngram", action="store_true", help="also n-gram on copy prompts")
    w.add_argument(
        "--draft-models",
        default="",
        help="comma-separated draft models (self: the target drafting for itself)",
    )
    w.add_argument("--eagle", default="", help="an EAGLE head (e.g. random:eagle-llama-3.1-8b)")
    w.add_argument("--rules", default="measured", help="speculation_rule values: measured, always")
    w.add_argument(
        "--async-modes",
        default="",
        help="async scheduling of the replay engines: on, off (default: --async-scheduling)",
    )
    w.add_argument(
        "--warm-rule",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="an untimed run of the batch before each speculative timing (rule steady state)",
    )
    w.add_argument(
        "--force-record",
        action="store_true",
        help="pin every sampled token to the recorded one (benchmarks/forced_replay.py), in the "
        "baseline and the replay engines alike, with synchronous steps: p is then the acceptance",
    )
    w.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="timed (no spec, spec) pairs per replay row, interleaved; the row reports the "
        "medians and each pair's ratio (a GPU's step times drift by a few percent run to run)",
    )
    p.add_argument("--out", default="", help="JSON path (default: benchmarks/results/...)")
    return p


def _prompts(batch_sizes: list[int], input_len: int, vocab: int, seed: int) -> dict[int, list]:
    rng = random.Random(seed)
    return {
        b: [[rng.randrange(100, vocab) for _ in range(input_len)] for _ in range(b)]
        for b in batch_sizes
    }


def _timed(
    llm: LLM,
    prompts: list,
    params: SamplingParams | list[SamplingParams],
    after_warmup: Callable[[], None] | None = None,
) -> tuple[float, list[list[int]]]:
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    if after_warmup is not None:
        after_warmup()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    return elapsed, [list(o.outputs[0].token_ids) for o in outs]


def _rule_counts(llm: LLM) -> tuple[list[int], int]:
    rule = llm.engine.stats().spec_decode_rule
    if rule is None:
        return [], 0
    return list(rule.steps_by_num_drafts), rule.num_probes


def _set_replay_acceptance(llm: LLM, p: float) -> None:
    """Set the in-process replay proposer's keep probability."""
    from tandem.spec_decode.replay import ReplayProposer

    proposer = llm.engine.model_runner.proposer
    assert isinstance(proposer, ReplayProposer), proposer
    proposer.acceptance = p


def _spec_counts(llm: LLM) -> tuple[int, int, list[int], dict[str, int]]:
    spec = llm.engine.stats().spec_decoding
    if spec is None:
        return 0, 0, [], {}
    return (
        spec.num_draft_tokens,
        spec.num_accepted_tokens,
        list(spec.num_accepted_tokens_per_pos),
        dict(spec.num_verify_steps),
    )


def _row(
    llm: LLM,
    prompts: list,
    params: SamplingParams | list[SamplingParams],
    ref: list | None,
    after_warmup: Callable[[], None] | None = None,
) -> tuple[dict[str, Any], list[list[int]]]:
    before: dict[str, Any] = {}

    def mark() -> None:  # the counts start after the untimed warm-up generate
        before["spec"], before["rule"] = _spec_counts(llm), _rule_counts(llm)
        if after_warmup is not None:
            after_warmup()

    elapsed, tokens = _timed(llm, prompts, params, mark)
    d0, a0, pos0, _ = before["spec"]
    steps0, probes0 = before["rule"]
    d1, a1, pos1, paths = _spec_counts(llm)
    steps1, probes1 = _rule_counts(llm)
    row: dict[str, Any] = {
        "batch": len(prompts),
        "async_scheduling": llm.engine.stats().async_scheduling,
        "elapsed_s": elapsed,
        # The batch decodes in lockstep: its longest output sets the pace.
        "tpot_ms": 1000 * elapsed / max(len(t) for t in tokens),
        "output_tokens_per_s": sum(len(t) for t in tokens) / elapsed,
    }
    if ref is not None:
        drafts, accepted = d1 - d0, a1 - a0
        row.update(
            same_tokens=tokens == ref,
            draft_tokens=drafts,
            accepted_tokens=accepted,
            acceptance_rate=accepted / drafts if drafts else 0.0,
            accepted_per_position=[
                b - (pos0[j] if j < len(pos0) else 0) for j, b in enumerate(pos1)
            ],
            verify_steps_by_path=paths,
        )
        if steps1:
            row.update(
                rule_steps_by_num_drafts=[b - a for a, b in zip(steps0, steps1, strict=True)],
                rule_probes=probes1 - probes0,
            )
    return row, tokens


def _paired_row(
    base_llm: LLM,
    llm: LLM,
    prompts: list,
    params: SamplingParams | list[SamplingParams],
    ref: list,
    repeats: int,
) -> dict[str, Any]:
    """`repeats` timings of the engine without speculation, each right before one of `llm`:
    the speculative row of the last pair with every pair's figures (`pairs`), the medians of
    the TPOTs and throughputs, and the ratios as the median of the pairs' ratios. Counts
    (drafts, acceptance, the rule's steps) are the last pair's."""
    pairs: list[dict[str, float]] = []
    row: dict[str, Any] = {}
    for _ in range(max(repeats, 1)):
        base, _ = _row(base_llm, prompts, params, None)
        row, _ = _row(llm, prompts, params, ref)
        pairs.append(
            {
                "no_spec_tpot_ms": base["tpot_ms"],
                "tpot_ms": row["tpot_ms"],
                "tpot_vs_no_spec": row["tpot_ms"] / base["tpot_ms"],
                "throughput_vs_no_spec": row["output_tokens_per_s"] / base["output_tokens_per_s"],
                "output_tokens_per_s": row["output_tokens_per_s"],
            }
        )
    for key in pairs[0]:
        row[key] = statistics.median(p[key] for p in pairs)
    if len(pairs) > 1:
        row["pairs"] = pairs
    return row


def _choices(row: dict[str, Any]) -> str:
    steps = row.get("rule_steps_by_num_drafts")
    if not steps:
        return ""
    return f"  rule steps by drafts {steps} ({row['rule_probes']} probes)"


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    kind, _ = parse_device(ns.device)
    on_cuda = kind == "cuda" or (kind == "auto" and torch.cuda.is_available())
    if ns.dtype == "auto":
        ns.dtype = "bfloat16" if on_cuda else "float32"
    engine_kwargs = engine_kwargs_from(ns)
    batch_sizes = [int(x) for x in ns.batch_sizes.split(",")]
    ks = [int(x) for x in ns.ks.split(",")]
    acceptances = [float(x) for x in ns.acceptances.split(",") if x.strip()]
    params = SamplingParams(temperature=0.0, max_tokens=ns.output_len, ignore_eos=True)
    result: dict[str, Any] = {
        "model": ns.model,
        "device": "cuda" if on_cuda else "cpu",
        "dtype": ns.dtype,
        "input_len": ns.input_len,
        "output_len": ns.output_len,
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "tpot_definition": "wall time of the batch / its longest output (lockstep, prefill in)",
        "runs": [],
    }

    # The engine without speculation stays loaded: each speculative timing is paired with a
    # baseline timing taken just before it, so a busy machine slows both alike.
    if ns.force_record:
        engine_kwargs = {
            **engine_kwargs,
            "logits_processors": [ForceRecorded],
            "async_scheduling": "off",
        }
        result["forced_record"] = True
    base_llm = LLM(model=ns.model, **engine_kwargs)
    prompts = _prompts(batch_sizes, ns.input_len, base_llm.engine.vocab_size, ns.seed)
    baseline: dict[int, list] = {}
    for b in batch_sizes:
        row, baseline[b] = _row(base_llm, prompts[b], params, None)
        result["runs"].append({"speculation": None, **row})
        print(
            f"no spec      B={b:4d}  TPOT {row['tpot_ms']:8.2f} ms  "
            f"{row['output_tokens_per_s']:9.1f} tok/s",
            flush=True,
        )

    with tempfile.TemporaryDirectory() as tmp:
        record = Path(tmp) / "replay.json"
        record.write_text(
            json.dumps(
                [
                    {"prompt_token_ids": p, "output_token_ids": o}
                    for b in batch_sizes
                    for p, o in zip(prompts[b], baseline[b], strict=True)
                ]
            )
        )
        rules = [r for r in ns.rules.split(",") if r.strip()]
        async_modes = [m for m in ns.async_modes.split(",") if m.strip()] or [None]
        if ns.force_record:
            async_modes = [None]  # engine_kwargs holds async off
        run_params = {
            b: forced_params(params, baseline[b]) if ns.force_record else params
            for b in batch_sizes
        }
        # One engine per (k, rule, async mode); the replay's p is set between runs (the
        # proposer is the benchmark's own), so the rule carries its step times over and
        # relearns the acceptance in the warm-up run.
        engines = [(k, r, m) for k in ks for r in rules for m in async_modes if acceptances]
        for k, rule, mode in engines:
            spec = {
                "method": "replay",
                "num_speculative_tokens": k,
                "replay_path": str(record),
                "replay_acceptance": acceptances[0],
                "speculation_rule": rule,
            }
            kwargs = {**engine_kwargs, "speculative_config": spec}
            if mode is not None:
                kwargs["async_scheduling"] = mode
            with LLM(model=ns.model, **kwargs) as llm:
                for p in acceptances:
                    _set_replay_acceptance(llm, p)
                    for b in batch_sizes:
                        if ns.warm_rule:
                            llm.generate(prompts[b], run_params[b], use_tqdm=False)
                        row = _paired_row(
                            base_llm, llm, prompts[b], run_params[b], baseline[b], ns.repeats
                        )
                        result["runs"].append(
                            {"speculation": {"k": k, "p": p, "speculation_rule": rule}, **row}
                        )
                        on = "on " if row["async_scheduling"] else "off"
                        print(
                            f"k={k} p={p:.1f} {rule:8s} async {on}"
                            f"  B={b:4d}  TPOT {row['tpot_ms']:8.2f} ms "
                            f"({row['tpot_vs_no_spec']:.2f}x)  "
                            f"{row['output_tokens_per_s']:9.1f} tok/s "
                            f"({row['throughput_vs_no_spec']:.2f}x)  "
                            f"acc {row['acceptance_rate']:.2f}  same {row['same_tokens']}"
                            + _choices(row),
                            flush=True,
                        )
        model_specs = [
            {"method": "draft_model", "model": ns.model if m == "self" else m}
            for m in ns.draft_models.split(",")
            if m.strip()
        ]
        if ns.eagle:
            model_specs.append({"method": "eagle", "model": ns.eagle})
        for k in ks:
            for spec in model_specs:
                spec = {**spec, "num_speculative_tokens": k}
                with (
                    LLM(model=ns.model, **{**engine_kwargs, "speculative_config": spec}) as llm,
                    ProposerClock() as clock,
                ):
                    for b in batch_sizes:
                        base, _ = _row(base_llm, prompts[b], run_params[b], None)
                        row, _ = _row(llm, prompts[b], run_params[b], baseline[b], clock.reset)
                        row.update(clock.figures())
                        row["no_spec_tpot_ms"] = base["tpot_ms"]
                        row["tpot_vs_no_spec"] = row["tpot_ms"] / base["tpot_ms"]
                        row["throughput_vs_no_spec"] = (
                            row["output_tokens_per_s"] / base["output_tokens_per_s"]
                        )
                        result["runs"].append({"speculation": spec, **row})
                        print(
                            f"{spec['method']} {spec['model']} k={k}  B={b:4d}  "
                            f"TPOT {row['tpot_ms']:8.2f} ms ({row['tpot_vs_no_spec']:.2f}x)  "
                            f"{row['output_tokens_per_s']:9.1f} tok/s "
                            f"({row['throughput_vs_no_spec']:.2f}x)  "
                            f"proposer {row['proposer_ms_per_drafting_step']:.2f} ms/drafting "
                            f"step ({row['proposer_drafting_steps']}), "
                            f"{row['proposer_ms_per_kv_only_step']:.2f} ms/KV-only step "
                            f"({row['proposer_steps'] - row['proposer_drafting_steps']})  "
                            f"acc {row['acceptance_rate']:.2f}  same {row['same_tokens']}",
                            flush=True,
                        )
    base_llm.shutdown()

    if ns.ngram:
        result["ngram_copy"] = _ngram_copy(ns, engine_kwargs, ks)
    out = (
        Path(ns.out)
        if ns.out
        else RESULTS_DIR
        / f"speculative_{'cuda' if on_cuda else 'cpu'}_{dt.date.today().isoformat()}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


class ProposerClock:
    """Times every `ModelProposer.propose_step` while active (the device synchronized before
    and after each call, so the figure is the proposer's own time per engine step)."""

    def __init__(self) -> None:
        # Steps that drafted for some request, and steps that only kept the KV in step.
        self.seconds = {True: 0.0, False: 0.0}
        self.steps = {True: 0, False: 0}
        self._original: Any = None

    def __enter__(self) -> ProposerClock:
        from tandem.spec_decode.model_proposer import ModelProposer

        original = ModelProposer.propose_step
        clock = self

        def timed(proposer: Any, *args: Any) -> list[list[int]]:
            _sync()
            t0 = time.perf_counter()
            drafts = original(proposer, *args)
            _sync()
            drafted = any(drafts)
            clock.seconds[drafted] += time.perf_counter() - t0
            clock.steps[drafted] += 1
            return drafts

        self._original = original
        ModelProposer.propose_step = timed  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        from tandem.spec_decode.model_proposer import ModelProposer

        ModelProposer.propose_step = self._original  # type: ignore[method-assign]

    def reset(self) -> None:
        self.seconds = {True: 0.0, False: 0.0}
        self.steps = {True: 0, False: 0}

    def figures(self) -> dict[str, Any]:
        def ms(seconds: float, steps: int) -> float:
            return 1000 * seconds / steps if steps else 0.0

        s, n = self.seconds, self.steps
        return {
            "proposer_ms_per_step": ms(s[True] + s[False], n[True] + n[False]),
            "proposer_steps": n[True] + n[False],
            "proposer_ms_per_drafting_step": ms(s[True], n[True]),
            "proposer_drafting_steps": n[True],
            "proposer_ms_per_kv_only_step": ms(s[False], n[False]),
        }


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _ngram_copy(ns: argparse.Namespace, engine_kwargs: dict[str, Any], ks: list[int]) -> list:
    """N-gram speculation on prompts whose answers copy their input (needs a tokenizer);
    each timing paired with the engine without speculation's, taken just before (`--repeats`
    pairs, medians; after one untimed run with `--warm-rule`, as the replay rows)."""
    params = SamplingParams(temperature=0.0, max_tokens=ns.output_len)
    rows: list[dict[str, Any]] = []
    with LLM(model=ns.model, **engine_kwargs) as base_llm:
        tokenizer = base_llm.tokenizer
        if tokenizer is None:
            print("n-gram: the model has no tokenizer; skipped")
            return rows
        prompts = [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
            )
            for text in COPY_PROMPTS
        ]
        for k in ks:
            spec = {
                "method": "ngram",
                "num_speculative_tokens": k,
                "prompt_lookup_max": 4,
                "prompt_lookup_min": 2,
            }
            _, ref = _row(base_llm, prompts, params, None)
            with LLM(model=ns.model, **{**engine_kwargs, "speculative_config": spec}) as llm:
                if ns.warm_rule:
                    llm.generate(prompts, params, use_tqdm=False)
                row = _paired_row(base_llm, llm, prompts, params, ref, ns.repeats)
            rows.append({"speculation": spec, **row})
            print(
                f"n-gram k={k}  TPOT {row['tpot_ms']:8.2f} ms ({row['tpot_vs_no_spec']:.2f}x)  "
                f"acc {row['acceptance_rate']:.2f}  same {row['same_tokens']}",
                flush=True,
            )
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
