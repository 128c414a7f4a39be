"""Structured outputs: what a JSON schema costs the engine.

For each mix (0%, 50%, 100% of the batch's requests under a JSON schema): output tokens/s
and mean TPOT of one batch run through `EngineCore` (every request in at once, greedy), and
the host time of filling the grammar bitmask per step; then the compile time of a large
schema, cold and cached. Prints the figures and writes JSON under benchmarks/results/.

    python -m benchmarks.structured_outputs                       # CPU: embedded SmolLM2
    python -m benchmarks.structured_outputs --device cuda \\
        --random-shape llama-3.1-8b                               # H200: 8B shape, batch 256

`--random-shape` runs random weights of a preset's shape with SmolLM2's tokenizer (copied
into a random-weight folder) and the model's vocabulary set to the tokenizer's 49,152 tokens,
so the grammar masks are real ones. Unconstrained requests ignore EOS and run `--output-len`
tokens; structured ones stop where their JSON ends (at most `--output-len`).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import shutil
import time
from pathlib import Path
from typing import Any

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 100000},
        "name": {"type": "string", "minLength": 1, "maxLength": 24},
        "kind": {"enum": ["person", "company", "place"]},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "tags": {
            "type": "array",
            "items": {"type": "string", "maxLength": 12},
            "minItems": 1,
            "maxItems": 4,
        },
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
        },
    },
    "required": ["id", "name", "kind", "score", "tags", "address"],
}


def large_schema(num_props: int = 60) -> dict[str, Any]:
    """A wide, nested schema: the cold-compile case."""
    props: dict[str, Any] = {}
    for i in range(num_props):
        kind = i % 5
        if kind == 0:
            props[f"p{i}"] = {"type": "string", "minLength": 1, "maxLength": 40}
        elif kind == 1:
            props[f"p{i}"] = {"type": "integer", "minimum": -1000, "maximum": 1000}
        elif kind == 2:
            props[f"p{i}"] = {"enum": [f"v{j}" for j in range(8)]}
        elif kind == 3:
            props[f"p{i}"] = {"type": "array", "items": SCHEMA["properties"]["address"]}
        else:
            props[f"p{i}"] = {
                "type": "object",
                "properties": {"a": {"type": "boolean"}, "b": {"type": "number"}},
                "required": ["a"],
            }
    return {"type": "object", "properties": props, "required": sorted(props)[: num_props // 2]}


def random_model_with_tokenizer(shape: str, tokenizer_dir: Path, cache_dir: Path) -> Path:
    """A random-weight folder of `shape` whose vocabulary is the tokenizer's, with the
    tokenizer's files copied in."""
    from transformers import AutoConfig

    from tandem.models.presets import preset_config

    config = preset_config(shape)
    tok_config = AutoConfig.from_pretrained(str(tokenizer_dir), local_files_only=True)
    vocab = int(tok_config.vocab_size)
    folder = cache_dir / "random" / f"{shape}-vocab{vocab}"
    folder.mkdir(parents=True, exist_ok=True)
    config.update(
        vocab_size=vocab,
        bos_token_id=tok_config.bos_token_id,
        eos_token_id=tok_config.eos_token_id,
        torch_dtype="bfloat16",
    )
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    (folder / "RANDOM_WEIGHTS").write_text(f"{shape}-vocab{vocab}\n")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        src = tokenizer_dir / name
        if src.exists():
            shutil.copy(src, folder / name)
    return folder


def run_mix(engine: Any, prompts: list[list[int]], fraction: float, output_len: int) -> dict:
    """One batch through the engine; `fraction` of the requests under SCHEMA."""
    from tandem.request import EngineCoreRequest
    from tandem.sampling_params import SamplingParams, StructuredOutputsParams

    n = len(prompts)
    num_structured = round(n * fraction)
    spec = StructuredOutputsParams(json=SCHEMA)
    mgr = engine.structured
    fills0, fill_s0 = mgr.num_fills, mgr.fill_seconds
    t0 = time.perf_counter()
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    counts: dict[str, int] = {}
    for i, ids in enumerate(prompts):
        structured = i < num_structured
        params = SamplingParams(
            temperature=0.0,
            max_tokens=output_len,
            ignore_eos=not structured,
            structured_outputs=spec if structured else None,
        )
        engine.add_request(EngineCoreRequest(f"m{fraction}-{i}", ids, params))
    steps = 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        steps += 1
        now = time.perf_counter()
        for o in outs:
            if o.new_token_ids:
                first.setdefault(o.request_id, now)
                counts[o.request_id] = counts.get(o.request_id, 0) + len(o.new_token_ids)
            if o.finished:
                done[o.request_id] = now
    elapsed = time.perf_counter() - t0
    tokens = sum(counts.values())
    tpots = [(done[r] - first[r]) / (counts[r] - 1) for r in counts if counts[r] > 1 and r in done]
    fills = mgr.num_fills - fills0
    return {
        "structured_fraction": fraction,
        "num_requests": n,
        "num_structured": num_structured,
        "elapsed_s": elapsed,
        "steps": steps,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / elapsed,
        "mean_tpot_ms": 1e3 * sum(tpots) / max(len(tpots), 1),
        "mean_output_len": tokens / n,
        "bitmask_fills": fills,
        "bitmask_host_ms_per_fill": 1e3 * (mgr.fill_seconds - fill_s0) / max(fills, 1),
    }


def compile_times(engine: Any) -> dict[str, float]:
    """Cold and cached compile of `large_schema()` (the tokenizer info is built first)."""
    from tandem.core.structured import GrammarStatus
    from tandem.request import Request
    from tandem.sampling_params import SamplingParams, StructuredOutputsParams

    mgr = engine.structured
    t0 = time.perf_counter()
    mgr.compiler()
    tokenizer_info_s = time.perf_counter() - t0
    spec = StructuredOutputsParams(json=large_schema())
    result: dict[str, float] = {"tokenizer_info_s": tokenizer_info_s}
    for label in ("cold", "cached"):
        request = Request(label, [1], SamplingParams(structured_outputs=spec))
        t0 = time.perf_counter()
        grammar = mgr.grammar_for(request)
        while (status := grammar.poll()) == GrammarStatus.COMPILING:
            time.sleep(0.0005)
        assert status == GrammarStatus.READY, grammar.error
        result[f"large_schema_{label}_s"] = time.perf_counter() - t0
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--model", default="default", help="model (ignored with --random-shape)")
    parser.add_argument("--random-shape", default="", help="e.g. llama-3.1-8b (random weights)")
    parser.add_argument(
        "--tokenizer", default="default", help="tokenizer folder for --random-shape"
    )
    parser.add_argument("--batch", type=int, default=0, help="requests (0: 256 GPU, 8 CPU)")
    parser.add_argument("--input-len", type=int, default=0, help="prompt tokens (0: 64 / 16)")
    parser.add_argument("--output-len", type=int, default=0, help="(0: 256 GPU / 48 CPU)")
    parser.add_argument("--mixes", default="0,50,100", help="percent structured, per run")
    parser.add_argument("--threads", type=int, default=0, help="CPU torch threads (0: torch's)")
    parser.add_argument("--out", default="", help="JSON path (default: benchmarks/results/)")
    ns = parser.parse_args()

    from tandem.engine.core import EngineCore
    from tandem.engine_args import EngineArgs
    from tandem.loader import load_tokenizer, resolve_model_path

    gpu = ns.device == "cuda"
    batch = ns.batch or (256 if gpu else 8)
    input_len = ns.input_len or (64 if gpu else 16)
    output_len = ns.output_len or (256 if gpu else 48)
    cache_dir = Path.home() / ".cache" / "tandem"
    if ns.random_shape:
        tok_dir = resolve_model_path(ns.tokenizer, None)
        model = str(random_model_with_tokenizer(ns.random_shape, tok_dir, cache_dir))
    else:
        model = str(resolve_model_path(ns.model, None))
    tokenizer = load_tokenizer(model)
    text = "Describe one record of a catalogue as JSON, with an id, a name and tags. " * 8
    base = tokenizer(text, add_special_tokens=False).input_ids
    prompts = [[i % 1000 + 5, *base][:input_len] for i in range(batch)]
    kwargs: dict[str, Any] = dict(
        model=model,
        device=ns.device,
        max_num_seqs=batch,
        max_num_batched_tokens=max(2048, batch * 2),
        max_model_len=input_len + output_len + 16,
        compile_timeout_s=0,  # measure the compile, however long it takes
    )
    if not gpu:
        kwargs.update(dtype="float32", num_threads=ns.threads)
    engine = EngineCore(EngineArgs(**kwargs).create_engine_config())
    result: dict[str, Any] = {
        "benchmark": "structured_outputs",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if gpu else platform.processor() or "cpu",
        "torch": torch.__version__,
        "model": Path(model).name,
        "vocab_size": engine.vocab_size,
        "async_scheduling": engine.async_scheduling,
        "workload": {"batch": batch, "input_len": input_len, "output_len": output_len},
        "schema": SCHEMA,
    }
    result["compile"] = compile_times(engine)
    # Warm-up: kernels, graphs, the schema's compile, and the prompts' KV in the prefix cache
    # (every timed mix sends the same prompts: without it the first mix alone would prefill
    # them, about 12% of its time on the H200 at batch 256).
    run_mix(engine, prompts, 0.5, 8)
    result["mixes"] = []
    for pct in (int(x) for x in ns.mixes.split(",")):
        mix = run_mix(engine, prompts, pct / 100, output_len)
        result["mixes"].append(mix)
        print(
            f"{pct:3d}% structured: {mix['output_tokens_per_s']:8.1f} tok/s, "
            f"TPOT {mix['mean_tpot_ms']:7.2f} ms, mean output {mix['mean_output_len']:.0f} "
            f"tokens, bitmask {mix['bitmask_host_ms_per_fill']:.3f} ms/step host",
            flush=True,
        )
    c = result["compile"]
    print(
        f"tokenizer info {c['tokenizer_info_s']:.2f} s; large schema compile cold "
        f"{1e3 * c['large_schema_cold_s']:.1f} ms, cached {1e3 * c['large_schema_cached_s']:.3f} ms"
    )
    engine.shutdown()
    out = (
        Path(ns.out)
        if ns.out
        else RESULTS_DIR
        / (f"structured_outputs_{ns.device}_{dt.datetime.now(dt.UTC):%Y%m%dT%H%M%S}.json")
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
