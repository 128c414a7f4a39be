"""The model runner: turns a `SchedulerOutput` into one flattened forward pass and samples.

Its parts live beside it: per-request state, block table and a step's host arrays in
`input_batch`, host -> device copies in `staging`, decode CUDA graphs in `cuda_graph`, mixed
steps' graphs in `piecewise_graph` (between eager attention) or `mixed_graph` (whole), and
sampling metadata, seeded generators and sampled ids in `sampling`. The `Worker` that owns
the runner picks the device, measures memory and sizes the KV cache; the runner runs the
model.

A step's tokens form one sequence (see `input_batch`); logits are computed only for the rows
that sample (the last query row of each request that reaches its token count; with
speculative decoding the last k + 1 rows of a request verifying k drafts, sampled by the
rejection sampler, after which the proposer drafts the next step's tokens: `tandem.spec_decode`).

Async scheduling: `execute_async` launches a step and returns a `PendingStep` whose
`result()` waits for that step's sampled ids only. The engine may plan and launch step N+1
before it calls step N's `result()`; a token of step N+1 whose id step N samples (at most one
per request: position `len(token_ids)`) is read on the device from step N's sampled ids.

The runner builds the model from a `ModelContext` and drives it through the `CausalLM`
protocol only (tandem.models.interface). Pipeline parallel (`parallel.pp`), one step on every
rank of a TP group of stages 0..P-1::

    stage 0      ids -> forward -> send(hidden_states, residual)
    stage p      recv -> forward -> send
    stage P-1    recv -> forward -> logits -> sample
    every stage  broadcast(sampled ids, src=P-1)

Every stage gets the step's sampled ids (one broadcast over the PP group from the last stage,
device to device): the first stage reads them for the next step's inputs, and every rank
appends them to its request states in `result()`, so all ranks' input batches agree. Only the
last stage computes logits and samples (all its TP ranks alike); only `parallel.is_driver`'s
result is what the engine reads. Steps under PP > 1 run eagerly (no CUDA graphs yet).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tandem.config import (
    ATTENTION_BACKEND_ALIASES,
    FP8_KV_CACHE_DTYPES,
    ConfigError,
    EngineConfig,
)
from tandem.core.kv_cache_spec import KVCacheSpec
from tandem.core.outputs import (
    GrammarBitmaskSource,
    Logprobs,
    ModelRunnerOutput,
    SchedulerOutput,
)
from tandem.distributed import ParallelState, single_rank_state
from tandem.layers.attention import (
    AttentionMetadata,
    AttentionShape,
    get_attention_backend,
    plan_step_metadata,
)
from tandem.layers.attention.layer import Attention
from tandem.layers.logits_processors import LogitsProcessors, load_logits_processors
from tandem.layers.quantization import resolve_quant_config
from tandem.layers.quantization.fp8 import check_fp8_device
from tandem.loader import build_model
from tandem.models.interface import CausalLM, IntermediateTensors, ModelContext
from tandem.spec_decode.factory import build_proposer
from tandem.spec_decode.model_proposer import ModelProposer
from tandem.spec_decode.proposer import Proposer, TargetInfo
from tandem.worker.cpu_threads import cpu_supports_bf16, default_cpu_backend
from tandem.worker.cuda_graph import DecodeCudaGraphs
from tandem.worker.input_batch import InputBatch, StepInputs
from tandem.worker.mixed_graph import MixedCudaGraphs
from tandem.worker.piecewise_graph import PiecewiseCudaGraphs
from tandem.worker.prompt_logprobs import (
    PromptLogprobRows,
    compute_prompt_logprobs,
    plan_prompt_logprobs,
)
from tandem.worker.sampling import PendingStep, SampledStep, StepSampler
from tandem.worker.staging import PinnedStaging

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_dtype(name: str, device: str) -> torch.dtype:
    """`auto`: bf16 on CUDA and on a CPU with native bf16 (avx512_bf16 / AMX:
    `cpu_supports_bf16`), where bf16 products run at about twice fp32's speed; fp32 on other
    CPUs, which would only emulate bf16. Parity and served-against-offline tests pin float32
    (`--dtype float32`, `TANDEM_DTYPE`): bf16 results depend on batch shapes."""
    if name == "auto":
        native = device == "cuda" or (device == "cpu" and cpu_supports_bf16())
        return torch.bfloat16 if native else torch.float32
    return _DTYPES[name]


# Attention backends without an FP8 KV cache (registered name -> vLLM's): FlashInfer 0.5.3's
# Hopper prefill does not compile for bf16 queries over e4m3 pages (one H200, session 29);
# FLASH_ATTN's varlen kernel is called on 16-bit caches only.
_NO_FP8_KV_BACKENDS = {"flashinfer": "FLASHINFER", "flash_attn": "FLASH_ATTN"}


def resolve_kv_cache_dtype(
    name: str, model_dtype: torch.dtype, device: torch.device, attention_backend: str
) -> torch.dtype:
    """The KV cache's torch dtype: the model's ("auto"), a named one, or e4m3 for "fp8" /
    "fp8_e4m3" (ConfigError where it cannot run: off a GPU of compute capability 8.9+, or
    with an attention backend that has no FP8 cache: cpu, FLASHINFER, FLASH_ATTN)."""
    if name == "auto":
        return model_dtype
    if name in FP8_KV_CACHE_DTYPES:
        backend = ATTENTION_BACKEND_ALIASES.get(attention_backend, attention_backend)
        if backend in _NO_FP8_KV_BACKENDS:
            raise ConfigError(
                f"--kv-cache-dtype {name}: attention backend {_NO_FP8_KV_BACKENDS[backend]} "
                "has no FP8 KV cache; use TRITON_ATTN"
            )
        check_fp8_device(device, f"--kv-cache-dtype {name}")
        if attention_backend == "cpu":
            raise ConfigError(f"--kv-cache-dtype {name}: the cpu attention backend has no FP8")
        return torch.float8_e4m3fn
    return resolve_dtype(name, device.type)


class ModelRunner:
    """Owns the model, the engine's KV cache views, the input batch and the CUDA graphs of one
    rank's device. Built on a device its `Worker` made current; not thread-safe.

    `parallel`: this rank's groups (None: one rank); the model holds this rank's TP share of
    this PP stage's layers."""

    def __init__(
        self,
        config: EngineConfig,
        device: torch.device,
        model_path: Path,
        hf_config: Any,
        max_model_len: int,
        eos_token_id: int | None,
        parallel: ParallelState | None = None,
    ) -> None:
        self.config = config
        self.device = device
        self.parallel = parallel if parallel is not None else single_rank_state(device)
        pp = self.parallel.pp
        self.is_first_stage = pp.is_first_rank
        self.is_last_stage = pp.is_last_rank
        self.dtype = resolve_dtype(config.model.dtype, device.type)
        self.block_size = config.cache.block_size
        self.max_model_len = max_model_len
        self.eos_token_id = eos_token_id
        backend_name = config.device.attention_backend
        if backend_name == "auto":
            backend_name = "triton" if device.type == "cuda" else default_cpu_backend()
        self.kv_dtype = resolve_kv_cache_dtype(
            config.cache.kv_cache_dtype, self.dtype, device, backend_name
        )
        self.attn_backend = get_attention_backend(backend_name)
        self.hf_config = hf_config
        self.model_context = ModelContext(
            dtype=self.dtype,
            device=device,
            attn_backend=self.attn_backend,
            parallel=self.parallel,
            # The checkpoint's scheme or --quantization's; ConfigError here, before any weight
            # is made, for a scheme not implemented or a device that cannot run it.
            quant_config=resolve_quant_config(config.quantization.quantization, hf_config, device),
            enable_expert_parallel=config.parallel.enable_expert_parallel,
            cpu_gemm=config.device.cpu_gemm,
            max_model_len=max_model_len,
        )
        torch.manual_seed(config.model.seed)
        self._model: CausalLM | None = build_model(
            model_path, self.model_context, seed=config.model.seed, hf_config=hf_config
        )
        self.vocab_size: int = self.model.vocab_size
        start, end = self.model.layer_range
        self.num_stage_layers = end - start
        # The cache's groups by attention kind, from the layers' sliding windows; each layer
        # learns its group and its slot of a block (see `kv_cache_shape`).
        self.kv_cache_spec = self._build_kv_cache_spec()
        self._layer_slots = [slot for _, slot in self.kv_cache_spec.layer_slots()]
        # What the backend's once-a-step plan reads besides the step (`_plan`).
        self.attention_shape = AttentionShape(
            num_heads=self.model.num_heads,
            num_kv_heads=self.model.num_kv_heads,
            head_size=self.model.head_size,
            block_size=self.block_size,
            dtype=self.dtype,
            kv_cache_dtype=self.kv_dtype,
            device=device,
        )
        self._group_windows = [g.sliding_window for g in self.kv_cache_spec.groups]
        max_num_seqs = config.scheduler.max_num_seqs
        self.sampler = StepSampler(
            device,
            self.vocab_size,
            max_num_seqs,
            cpu_kernels=self.model_context.cpu_kernels,
            logits_processors=LogitsProcessors(
                load_logits_processors(config.sampler.logits_processors),
                config,
                device,
                self.vocab_size,
            ),
        )
        self.input_batch = InputBatch(
            self.block_size, max_num_seqs, num_kv_groups=self.kv_cache_spec.num_groups
        )
        # Speculative decoding: the proposer drafting each step's next tokens (on the host,
        # after the step's tokens land). Decode graphs assume one token per request: verify
        # steps run as whole mixed graphs, piecewise graphs or eagerly, and each step's
        # output says which (`spec_verify_path`, counted in the engine's stats).
        if config.speculative.enabled and self.parallel.pp_size > 1:
            raise ConfigError("speculative decoding with pipeline parallel is not supported yet")
        if (
            config.speculative.method in ("draft_model", "eagle")
            and self.kv_cache_spec.num_groups > 1
        ):
            # A model proposer's cache follows the request's one block table; a hybrid cache
            # (sliding and full layers) interleaves one table per group.
            raise ConfigError(
                f"speculative method {config.speculative.method!r} with a model of several KV "
                "cache groups (sliding-window layers) is not supported yet; use ngram, or "
                "--disable-hybrid-kv-cache-manager"
            )
        self.proposer = build_proposer(
            config.speculative,
            self.vocab_size,
            TargetInfo(config, self.model, self.model_context, self.kv_dtype, max_model_len),
        )
        # EAGLE reads the target's hidden states of every step's token rows (kept from the
        # forward until the step's `result()`); decode graphs return logits only, so then
        # every step takes another path.
        self.proposer_needs_hidden = bool(getattr(self.proposer, "needs_hidden_states", False))
        self._step_hidden: torch.Tensor | None = None
        # Held requests asking for prompt logprobs; this step's plan and results for them.
        self._prompt_logprob_reqs: set[str] = set()
        self._prompt_plan: list[PromptLogprobRows] = []
        self._step_prompt_logprobs: dict[str, tuple[int, list[Logprobs]]] = {}
        self.staging = PinnedStaging(device)
        self.use_cuda_graphs = device.type == "cuda" and not config.device.enforce_eager
        if self.use_cuda_graphs and self.parallel.pp_size > 1:
            logger.info(
                "pipeline_parallel_size %d: steps run eagerly (CUDA graphs need one stage)",
                self.parallel.pp_size,
            )
            self.use_cuda_graphs = False
        num_kv_groups = self.kv_cache_spec.num_groups
        # What a stage hands the next (keys, dtype, width), learned from the model once.
        self._intermediate_template: IntermediateTensors | None = None
        decode_sizes = config.device.cuda_graph_sizes
        if not self.attn_backend.decode_cuda_graphs or self.proposer_needs_hidden:
            decode_sizes = ()
        self.cuda_graphs = DecodeCudaGraphs(decode_sizes, max_num_seqs, device, num_kv_groups)
        mode = config.device.cudagraph_mode
        full = mode == "full" and self.attn_backend.full_graph_mixed
        if mode == "full" and not full and self.use_cuda_graphs:
            logger.info(
                "cudagraph_mode full: the %s attention backend cannot run mixed steps in a "
                "whole graph; they run piecewise",
                self.attn_backend.name,
            )
        mixed_sizes = config.device.piecewise_cuda_graph_sizes
        max_tokens = config.scheduler.max_num_batched_tokens
        self.mixed_graphs = MixedCudaGraphs(
            mixed_sizes if full else (), max_tokens, max_num_seqs, device, num_kv_groups
        )
        piecewise = mode != "full_decode_only" and not full
        if piecewise and num_kv_groups > 1:
            # Piecewise graphs write K/V through one slot mapping: mixed steps run eagerly.
            logger.info(
                "%d KV cache groups: mixed steps run without piecewise graphs", num_kv_groups
            )
            piecewise = False
        self.piecewise_graphs = PiecewiseCudaGraphs(
            mixed_sizes if piecewise else (), max_tokens, device
        )
        # The engine's KV cache (one tensor) and its per-layer views; set by
        # `initialize_kv_cache`.
        self.kv_cache: torch.Tensor | None = None
        self.kv_caches: list[torch.Tensor] = []
        # The last launched step: its device ids feed the next step's inputs.
        self._last_step: PendingStep | None = None
        # Launched steps before the last one, resolved (if nobody did) before the next launch.
        self._older_steps: list[PendingStep] = []
        # Cache slots written by launched steps the device may not have finished (a step's
        # sampled ids arriving on the host proves it and every earlier step done), by launch
        # number: `may_write_blocks` reads them.
        self._unfinished_writes: list[tuple[int, np.ndarray]] = []
        self._num_launched = 0

    @property
    def max_num_sampled_rows(self) -> int:
        """The most logits rows one step samples: one per request, k + 1 under speculation."""
        return self.config.scheduler.max_num_seqs * (1 + self.config.speculative.k)

    @property
    def model(self) -> CausalLM:
        if self._model is None:
            raise RuntimeError("the model runner is shut down: it holds no model")
        return self._model

    # ----------------------------------------------------------------- KV cache

    def _build_kv_cache_spec(self) -> KVCacheSpec:
        """The groups of this stage's attention layers by kind (their `sliding_window`); one
        full group with `--disable-hybrid-kv-cache-manager`, or when the model's layers are
        not one `Attention` each. Tells each layer its group."""
        layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        if len(layers) != self.num_stage_layers:
            return KVCacheSpec.full(self.block_size, self.num_stage_layers)
        spec = KVCacheSpec.from_layer_windows(
            self.block_size,
            [layer.sliding_window for layer in layers],
            hybrid=not self.config.cache.disable_hybrid_kv_cache_manager,
        )
        if not spec.is_plain:
            if self.parallel.pp_size > 1:
                raise ConfigError(
                    "a model with sliding-window layers and pipeline_parallel_size > 1 is not "
                    "supported yet (--disable-hybrid-kv-cache-manager runs it keeping every "
                    "block)"
                )
            logger.info("%s", spec.describe())
        for layer, (group, _) in zip(layers, spec.layer_slots(), strict=True):
            layer.kv_cache_group = group
        return spec

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """`[num_blocks, layers, 2, block_size, num_kv_heads, head_size]`: this PP stage's
        layers (with several KV cache groups, `layers_per_group`: a block holds one group's
        layers, `tandem.core.kv_cache_spec`), this TP rank's KV heads."""
        m = self.model
        layers = self.kv_cache_spec.layers_per_group
        return (num_blocks, layers, 2, self.block_size, m.num_kv_heads, m.head_size)

    def kv_bytes_per_block(self) -> int:
        """Bytes of one block id over every cache it indexes: the target's, and a model
        proposer's (its KV shares the target's block ids, so the pool is sized on both)."""
        elem = torch.tensor([], dtype=self.kv_dtype).element_size()
        own = int(np.prod(self.kv_cache_shape(1))) * elem
        return own + self._proposer_call("kv_bytes_per_block", 0)

    def profile_steps(self) -> list[list[tuple[int, int]]]:
        """The eager steps of `profile_run`, each a list of requests as (query tokens, tokens
        already in the cache before them), decodes first as the input batch orders them.

        1. The largest step: `max_num_batched_tokens` fresh tokens in requests of at most 1,024
           and `max_model_len` (the prefill kernels time their paths on it): the memory peak.
        2. One fresh request past 1,024 tokens, when the limits allow one: the dense
           kernel's long-request tiles.
        3. A mixed step: a few decodes beside a chunk that continues a cached prefix (chunked
           prefill, prefix hits): the context kernel, the merge, decode rows in an eager step.

        2 and 3 compile on start-up the kernel variants that served traffic would otherwise
        compile inside its first requests' time to first token."""
        tokens = self.config.scheduler.max_num_batched_tokens
        max_len = self.max_model_len
        per_req = min(tokens, 1024, max_len)
        steps = [[(min(per_req, tokens - i), 0) for i in range(0, tokens, per_req)]]
        long_len = min(tokens, max_len, 2048)
        if long_len > 1024:
            steps.append([(long_len, 0)])
        num_decodes = min(4, self.config.scheduler.max_num_seqs - 1, tokens - 1)
        chunk = min(512, tokens - num_decodes, max_len // 2)
        context = min(1024, max_len - chunk)
        if chunk >= 1 and context >= 1:  # decodes see the chunk's context (< max_len)
            steps.append([(1, context)] * num_decodes + [(chunk, context)])
        return steps

    def profile_run(self, scratch_kv_cache: torch.Tensor) -> None:
        """The eager forwards of `profile_steps` through `scratch_kv_cache` (whatever it
        holds: the outputs are discarded), the first with the logits of
        `max_num_sampled_rows` rows: the largest step this engine runs. Inside the backend's
        `startup_tuning` (the prefill kernel may pick its path and tile config on the first).
        The caller measures the memory it takes."""
        m = self.model
        caches = [scratch_kv_cache[:, j] for j in self._layer_slots]
        with torch.inference_mode(), self.attn_backend.startup_tuning():
            for i, reqs in enumerate(self.profile_steps()):
                meta, positions = self._profile_metadata(reqs)
                tokens = meta.num_actual_tokens
                ids, intermediate = None, None
                if self.is_first_stage:
                    ids = torch.zeros(tokens, dtype=torch.long, device=self.device)
                else:
                    intermediate = m.make_empty_intermediate_tensors(tokens)
                out = m(ids, positions, caches, meta, intermediate)
                if self.is_last_stage and i == 0:
                    assert isinstance(out, torch.Tensor)
                    logits = m.compute_logits(out[: min(self.max_num_sampled_rows, tokens)])
                    del logits
                del out, intermediate

    def _profile_metadata(
        self, reqs: list[tuple[int, int]]
    ) -> tuple[AttentionMetadata, torch.Tensor]:
        """Planned metadata and positions of one `profile_steps` step over consecutive block
        ids from 0 (the scratch cache's)."""
        bs = self.block_size
        dev = self.device
        lens = [q for q, _ in reqs]
        seq_lens = [q + c for q, c in reqs]
        qsl = np.concatenate([[0], np.cumsum(lens)]).tolist()
        blocks = [-(-n // bs) for n in seq_lens]
        width = max(blocks)
        table = torch.zeros(len(reqs), width, dtype=torch.int32)
        first_block = 0
        for r, n in enumerate(blocks):
            table[r, :n] = torch.arange(first_block, first_block + n, dtype=torch.int32)
            first_block += n
        pos = torch.cat([torch.arange(c, c + q) for q, c in reqs])
        req = torch.repeat_interleave(torch.arange(len(reqs)), torch.tensor(lens))
        slots = table[req, pos // bs].long() * bs + pos % bs
        meta = AttentionMetadata(
            num_actual_tokens=int(qsl[-1]),
            num_reqs=len(reqs),
            max_query_len=max(lens),
            max_seq_len=max(seq_lens),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_table=table.to(dev),
            slot_mapping=slots.to(dev),
            query_start_loc_cpu=qsl,
            seq_lens_cpu=seq_lens,
            # A mixed step's leading one-token requests, as `execute_model` orders them.
            num_decodes=next((i for i, q in enumerate(lens) if q > 1), 0),
        )
        return self._plan(meta), pos.to(dev)

    def profile_num_blocks(self) -> int:
        """Blocks of the scratch cache `profile_run` needs: its largest step's."""
        bs = self.block_size
        return max(sum(-(-(q + c) // bs) for q, c in reqs) for reqs in self.profile_steps())

    def initialize_kv_cache(self, kv_cache: torch.Tensor) -> None:
        """Take the engine's KV cache (`kv_cache_shape`), tune the attention kernels on it
        (through the backend's `tune` hook), then capture the decode CUDA graphs.

        Each layer sees the view `kv_cache[:, i]`. On a GPU the cache is block-major: a
        block's KV over all layers is the contiguous span `kv_cache[b]` (a run of consecutive
        block ids moves as one copy) and each layer's view is strided. On the CPU it is
        layer-major (`tandem.worker.cpu_memory.layer_major_kv_cache`): each layer's view is
        contiguous, for the decode step's reads.
        """
        self.kv_cache = kv_cache
        self.kv_caches = [kv_cache[:, i] for i in self._layer_slots]
        self._proposer_call("initialize_kv_cache", None, kv_cache.shape[0])
        best = self.attn_backend.tune(
            self.kv_caches[0],
            num_heads=self.model.num_heads,
            max_num_reqs=self.config.scheduler.max_num_seqs,
            max_seq_len=self.max_model_len,
        )
        if best is not None:
            logger.info("decode attention config: %s", best)
        if self.use_cuda_graphs:
            self.cuda_graphs.capture(
                self.model, self.kv_caches, self.max_model_len, self.block_size
            )
            self.piecewise_graphs.capture(self.model, self.kv_caches)
            self.mixed_graphs.capture(
                self.model, self.kv_caches, self.max_model_len, self.block_size, plan=self._plan
            )

    # ----------------------------------------------------------------- state

    def _update_states(self, so: SchedulerOutput) -> None:
        batch = self.input_batch
        self.drop_requests(so.finished_req_ids | so.preempted_req_ids)
        for new in so.scheduled_new_reqs:
            generator = self.sampler.new_generator(new.sampling_params, len(new.output_token_ids))
            batch.add_request(new, self.eos_token_id, generator)
            if new.sampling_params.prompt_logprobs is not None:
                self._prompt_logprob_reqs.add(new.req_id)
        batch.update_cached(so.scheduled_cached_reqs)

    def drop_requests(self, req_ids: set[str]) -> None:
        """Forget finished or preempted requests (their states and block-table rows)."""
        self.input_batch.drop_requests(req_ids)
        if self._prompt_logprob_reqs:
            self._prompt_logprob_reqs -= req_ids

    def needs_prior_tokens(self, so: SchedulerOutput) -> bool:
        """True when a request of this step samples from its whole output (penalties,
        min_tokens): the previous step's tokens must be on the host before it launches."""
        return self.input_batch.needs_prior_tokens(so)

    # ----------------------------------------------------------------- step

    def _fill_from_previous(self, input_ids: torch.Tensor, inp: StepInputs) -> None:
        """Write the previous step's sampled ids into the rows `inp.fill_dst` (device op)."""
        if not inp.fill_dst:
            return
        assert self._last_step is not None and self._last_step.sampled is not None
        self._last_step.wait_sampled()
        prev = self._last_step.sampled
        k = len(inp.fill_dst)
        if inp.fill_dst == list(range(k)) and inp.fill_src == list(range(k)):
            input_ids[:k].copy_(prev[:k])
            return
        index = self.staging.to_device(
            np.array([inp.fill_dst, inp.fill_src], dtype=np.int64), torch.int64
        )
        input_ids.index_copy_(0, index[0], prev.index_select(0, index[1]))

    def _plan(self, metadata: AttentionMetadata) -> AttentionMetadata:
        """The step's metadata with the backend's per-step choices made, once for every
        layer (each KV cache group's with its window): `AttentionBackend.plan_step`."""
        return plan_step_metadata(
            self.attn_backend, metadata, self.attention_shape, self._group_windows
        )

    def _metadata(self, inp: StepInputs) -> AttentionMetadata:
        """The step's attention metadata, planned (`_plan`)."""
        to_device = self.staging.to_device
        tables: torch.Tensor | None = None
        slots: torch.Tensor | None = None
        if inp.group_block_tables is not None and inp.group_slot_mappings is not None:
            # Several KV cache groups: one copy each for every group's tables and slot
            # mappings; a group's are views, group 0's the top level's.
            tables = to_device(inp.group_block_tables, torch.int32)
            slots = to_device(inp.group_slot_mappings, torch.int64)
            block_table, slot_mapping = tables[0], slots[0]
        else:
            block_table = to_device(inp.block_table, torch.int32)
            slot_mapping = to_device(inp.slot_mapping, torch.int64)
        metadata = AttentionMetadata(
            num_actual_tokens=inp.total,
            num_reqs=inp.num_reqs,
            max_query_len=inp.max_query_len,
            # Decode steps cut their work as the captured graphs do (same results either way).
            max_seq_len=self.max_model_len
            if inp.is_decode_only and self.device.type == "cuda"
            else int(inp.seq_lens.max()),
            query_start_loc=to_device(inp.query_start_loc, torch.int32),
            seq_lens=to_device(inp.seq_lens, torch.int32),
            block_table=block_table,
            slot_mapping=slot_mapping,
            query_start_loc_cpu=inp.query_start_loc.tolist(),
            seq_lens_cpu=inp.seq_lens.tolist(),
            is_decode_only=inp.is_decode_only,
            num_decodes=inp.num_decodes,
        )
        if tables is None or slots is None:
            return self._plan(metadata)
        groups = tuple(
            dataclasses.replace(metadata, block_table=tables[g], slot_mapping=slots[g])
            for g in range(tables.shape[0])
        )
        return self._plan(dataclasses.replace(groups[0], kv_groups=groups))

    def _run_eager(self, inp: StepInputs, piecewise_size: int | None = None) -> torch.Tensor | None:
        """The step's forward eagerly, or (`piecewise_size`) through that bucket of piecewise
        graphs; the logits of its sampled rows. A stage that is not the last sends what it
        computed to the next stage and returns None; one that is not the first receives its
        input from the previous stage."""
        to_device = self.staging.to_device
        metadata = self._metadata(inp)
        positions = to_device(inp.positions, torch.int64)
        input_ids: torch.Tensor | None = None
        intermediate: IntermediateTensors | None = None
        if self.is_first_stage:
            input_ids = to_device(inp.input_ids, torch.int64)
            self._fill_from_previous(input_ids, inp)
        else:
            intermediate = self._recv_intermediate(inp.total)
        if piecewise_size is not None:
            assert input_ids is not None
            out = self.piecewise_graphs.replay(piecewise_size, input_ids, positions, metadata)
        else:
            out = self.model(input_ids, positions, self.kv_caches, metadata, intermediate)
        if not self.is_last_stage:
            assert isinstance(out, IntermediateTensors)
            self._send_intermediate(out)
            return None
        assert isinstance(out, torch.Tensor)
        return self._sampled_logits(out, inp)

    # ----------------------------------------------------------------- pipeline parallel

    def _intermediate_keys(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """(name, dtype, per-token shape) of what a stage hands the next, in send order."""
        if self._intermediate_template is None:
            self._intermediate_template = self.model.make_empty_intermediate_tensors(0)
        tensors = self._intermediate_template.tensors
        return [(k, tensors[k].dtype, tuple(tensors[k].shape[1:])) for k in sorted(tensors)]

    def _send_intermediate(self, out: IntermediateTensors) -> None:
        pp = self.parallel.pp
        for key, _, _ in self._intermediate_keys():
            pp.send(out[key], dst=pp.next_rank)

    def _recv_intermediate(self, num_tokens: int) -> IntermediateTensors:
        pp = self.parallel.pp
        return IntermediateTensors(
            {
                key: pp.recv((num_tokens, *shape), dtype, src=pp.prev_rank)
                for key, dtype, shape in self._intermediate_keys()
            }
        )

    def _share_sampled(self, sampled: SampledStep | None, num_rows: int) -> SampledStep:
        """The step's sampled ids on every stage: the last stage broadcasts its own over the
        PP group (each TP rank to its peers); the others receive them."""
        pp = self.parallel.pp
        last = pp.world_size - 1
        if self.is_last_stage:
            assert sampled is not None
            pp.broadcast(sampled.sampled, src=last)
            return sampled
        ids = torch.empty(num_rows, dtype=torch.int64, device=self.device)
        if self.device.type != "cpu":
            pp.broadcast(ids, src=last)
            return self.sampler.received(ids)
        # On the CPU (gloo) the ids arrive while this stage runs its next step: with the
        # scheduler's disjoint batches (`max_concurrent_batches`) that step needs none of
        # them, so the first stage starts it while the last one still runs this one. One
        # receive at a time: the previous step's completes first.
        if self._last_step is not None:
            self._last_step.wait_sampled()
        step = self.sampler.received(ids)
        step.wait = pp.broadcast_async(ids, src=last)
        return step

    def _sampled_logits(self, hidden: torch.Tensor, inp: StepInputs) -> torch.Tensor:
        """The logits of the step's sampled rows (the last query row of each; under
        speculation the last k + 1 rows of a request with k drafts)."""
        if self.proposer_needs_hidden:
            self._step_hidden = hidden
        if self._prompt_plan:
            self._step_prompt_logprobs = compute_prompt_logprobs(
                hidden, self._prompt_plan, self.model.compute_logits
            )
        if not inp.sampled_rows:
            return hidden[:0]
        idx = self.staging.to_device(inp.logits_indices, torch.int64)
        return self.model.compute_logits(hidden.index_select(0, idx))

    def take_expert_load(self) -> list[list[int]] | None:
        """Tokens routed to each expert of each of this stage's MoE layers since the last call
        (`[layers][experts]`, the counters reset; None without MoE layers). Reads the device:
        call it between steps."""
        from tandem.layers.moe import take_expert_load

        load = take_expert_load(self.model)
        return None if load is None else load.tolist()

    def synchronize(self) -> None:
        """Wait until every launched step has finished on the device."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._unfinished_writes.clear()

    def may_write_blocks(self, block_ids: list[int]) -> bool:
        """Whether a launched step not known to have finished writes K/V into any of
        `block_ids`. Such a block was freed after that step was planned (its request stopped
        or was aborted meanwhile); whoever hands it to another writer (a remote KV transfer,
        outside this runner's stream order) must `synchronize` first."""
        if not self._unfinished_writes or not block_ids:
            return False
        ids = np.asarray(block_ids, dtype=np.int64)
        for _, slots in self._unfinished_writes:
            if np.isin(ids, slots[slots >= 0] // self.block_size).any():
                return True
        return False

    def _writes_done(self, launch: int) -> None:
        """The device finished launch number `launch` and everything before it."""
        self._unfinished_writes = [w for w in self._unfinished_writes if w[0] > launch]

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and wait for its sampled ids."""
        return self.execute_async(so).result()

    @torch.inference_mode()
    def execute_async(
        self, so: SchedulerOutput, grammar_bitmask: GrammarBitmaskSource | None = None
    ) -> PendingStep:
        """Launch one step: inputs, forward, sampling; the host does not wait for the device.

        Every step launched before must have had `result()` called, except the last one.
        `grammar_bitmask` (a step with structured rows) is called after the forward is
        launched and before sampling: the bitmask's host work overlaps the forward."""
        if self.kv_cache is None:
            raise RuntimeError("the model runner has no KV cache (not initialized, or shut down)")
        self._resolve_older_steps()
        self._update_states(so)
        req_ids = [r.req_id for r in so.scheduled_new_reqs] + [
            r.req_id for r in so.scheduled_cached_reqs
        ]
        if not req_ids:
            return PendingStep.empty()
        num_decodes = 0
        if so.total_num_scheduled_tokens != len(req_ids):
            # Mixed step: one-token requests first, so attention can run them as decodes.
            counts = so.num_scheduled_tokens
            decodes = [r for r in req_ids if counts[r] == 1]
            if decodes:
                num_decodes = len(decodes)
                req_ids = decodes + [r for r in req_ids if counts[r] != 1]
        prev_row_of = self._last_step.row_of if self._last_step is not None else {}
        inp = self.input_batch.prepare(so, req_ids, prev_row_of)
        inp.num_decodes = num_decodes
        self._prompt_plan = plan_prompt_logprobs(inp) if self._prompt_logprob_reqs else []
        # A proposer reading the target's hidden states (EAGLE), and prompt logprobs, take
        # decode steps through the mixed-step graphs (or piecewise, or eager): the decode
        # graphs keep logits only.
        decode_path = (
            inp.is_decode_only and not self.proposer_needs_hidden and not self._prompt_plan
        )
        if decode_path:
            graph_size = self.cuda_graphs.size_for(inp.num_reqs)
            mixed_size = None
        else:
            graph_size = None
            mixed_size = self.mixed_graphs.size_for(inp.total, inp.num_reqs)
        if graph_size is not None:
            path = "decode_graph"
            logits = self.cuda_graphs.replay(
                inp, graph_size, self.staging, self._fill_from_previous
            )
        elif mixed_size is not None:
            path = "mixed_graph"
            hidden = self.mixed_graphs.replay(
                inp, mixed_size, self.staging, self._fill_from_previous
            )
            logits = self._sampled_logits(hidden, inp)
        else:
            piecewise_size = None if decode_path else self.piecewise_graphs.size_for(inp.total)
            path = "eager" if piecewise_size is None else "piecewise_graph"
            logits = self._run_eager(inp, piecewise_size)

        states = [inp.states[i] for i in inp.sampled_rows]
        sampled: SampledStep | None = None
        if self.is_last_stage and states:
            assert logits is not None
            grammar = grammar_bitmask() if grammar_bitmask is not None else None
            if inp.num_draft is not None:
                # Structured rows never carry drafts (the scheduler gives them none): one row.
                drafts = self.staging.to_device(
                    np.asarray(inp.draft_token_ids, dtype=np.int64), torch.int64
                )
                sampled = self.sampler.sample_speculative(
                    logits, states, inp.num_draft, drafts, grammar, inp.draft_token_ids
                )
            else:
                sampled = self.sampler.sample(logits, states, grammar)
        if self.parallel.pp_size > 1 and states:
            sampled = self._share_sampled(sampled, len(states))
        self._num_launched += 1
        launch = self._num_launched
        written = inp.slot_mapping if inp.group_slot_mappings is None else inp.group_slot_mappings
        self._unfinished_writes.append((launch, written.reshape(-1)))
        prompt_logprobs, self._step_prompt_logprobs = self._step_prompt_logprobs, {}
        step = PendingStep(
            req_ids,
            inp.sampled_rows,
            states,
            sampled,
            on_done=lambda: self._writes_done(launch),
            proposer=self._step_proposer(inp, so),
            spec_verify_path=path if inp.num_draft is not None else "",
            prompt_logprobs=prompt_logprobs,
        )
        if self._last_step is not None:
            self._older_steps.append(self._last_step)
        self._last_step = step
        if isinstance(self.proposer, ModelProposer):
            # Its drafts run forwards (collectives under TP): every rank runs them now, in
            # step order, also a rank whose result nobody reads (its steps never overlap).
            step.result()
        return step

    def _resolve_older_steps(self) -> None:
        """Take the results of launched steps before the last one that nobody asked for (a
        rank whose results the engine does not read): every rank's request states must hold
        the same tokens before the next step's inputs are built. `result()` is idempotent."""
        for step in self._older_steps:
            step.result()
        self._older_steps.clear()

    # ----------------------------------------------------------------- proposer seam

    def _proposer_call(self, name: str, default: Any, *args: Any) -> Any:
        """`name(*args)` of a proposer that runs a model (it keeps a KV cache beside the
        target's); `default` for host proposers and without speculation."""
        if not isinstance(self.proposer, ModelProposer):
            return default
        return getattr(self.proposer, name)(*args)

    def _step_proposer(self, inp: StepInputs, so: SchedulerOutput) -> Proposer | None:
        """The proposer `PendingStep.result()` asks for this step's drafts: a model proposer
        bound to the step's inputs (and the target's hidden states when it reads them)."""
        if not isinstance(self.proposer, ModelProposer):
            # A host proposer's drafts the next step would not take are not computed.
            return self.proposer if so.propose_drafts else None
        hidden = self._step_hidden if self.proposer.needs_hidden_states else None
        self._step_hidden = None
        return self.proposer.bind_step(inp, hidden, so)

    # ----------------------------------------------------------------- shutdown

    def shutdown(self) -> None:
        """Wait for the device, then drop the CUDA graphs, the KV cache, the weights and every
        buffer (idempotent). The runner cannot run steps afterwards."""
        if self.kv_cache is not None or self._model is not None:
            self.synchronize()
        self._last_step = None
        self._older_steps.clear()
        self._unfinished_writes.clear()
        self.cuda_graphs.clear()
        self.piecewise_graphs.clear()
        self.mixed_graphs.clear()
        self._proposer_call("shutdown", None)
        self.kv_caches = []
        self.kv_cache = None
        self._model = None
        self.input_batch.clear()
        self.staging.clear()
        self.sampler.clear()
