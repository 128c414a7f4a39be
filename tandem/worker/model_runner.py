"""The model runner: turns a `SchedulerOutput` into one flattened forward pass and samples.

All tokens scheduled in a step form one sequence (no padding). For request r with
`num_computed_tokens` c and `num_scheduled_tokens` n::

    input_ids[qsl[r]:qsl[r+1]]   = token_ids[c : c + n]
    positions[qsl[r]:qsl[r+1]]   = c, c+1, ..., c+n-1
    slot_mapping[...]            = block_table[pos // block_size] * block_size + pos % block_size
    seq_lens[r]                  = c + n

A request is sampled when c + n reaches its token count; logits are computed only for
those rows (the last query row of each sampled request).

The runner keeps its own per-request state (token ids, block table) so a running request
costs only its new block ids in each step's message.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from tandem.config import EngineConfig
from tandem.core.outputs import ModelRunnerOutput, SchedulerOutput
from tandem.layers.attention import AttentionMetadata, get_attention_backend
from tandem.layers.sampler import Sampler, SamplingMetadata, to_logprobs_lists
from tandem.loader import build_model, load_hf_config
from tandem.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_dtype(name: str, device: str) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device == "cuda" else torch.float32
    return _DTYPES[name]


@dataclass
class CachedRequestState:
    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    eos_token_id: int | None
    generator: torch.Generator | None = None
    output_token_ids: list[int] = field(default_factory=list)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]


class ModelRunner:
    """Owns the model, the KV cache tensor and the sampler of one engine."""

    def __init__(self, config: EngineConfig, model_path: Path, eos_token_id: int | None) -> None:
        self.config = config
        self.device = torch.device(config.device.resolved_device())
        self.dtype = resolve_dtype(config.model.dtype, self.device.type)
        self.kv_dtype = (
            self.dtype
            if config.cache.kv_cache_dtype == "auto"
            else resolve_dtype(config.cache.kv_cache_dtype, self.device.type)
        )
        self.block_size = config.cache.block_size
        self.eos_token_id = eos_token_id
        backend_name = config.device.attention_backend
        if backend_name == "auto":
            backend_name = "triton" if self.device.type == "cuda" else "torch"
        self.attn_backend = get_attention_backend(backend_name)
        self.hf_config = load_hf_config(model_path)
        torch.manual_seed(config.model.seed)
        self.model = build_model(model_path, self.dtype, self.device, self.attn_backend)
        self.vocab_size: int = self.model.vocab_size
        self.sampler = Sampler()
        self.requests: dict[str, CachedRequestState] = {}
        self.kv_cache: torch.Tensor | None = None
        self.kv_caches: list[torch.Tensor] = []

    # ----------------------------------------------------------------- KV cache

    def kv_bytes_per_block(self) -> int:
        m = self.model
        elem = torch.tensor([], dtype=self.kv_dtype).element_size()
        return m.num_layers * 2 * self.block_size * m.num_kv_heads * m.head_size * elem

    def determine_num_blocks(self) -> int:
        cache = self.config.cache
        if cache.num_gpu_blocks:
            return cache.num_gpu_blocks
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info(self.device)
            used_by_others = total - free
            budget = total * cache.gpu_memory_utilization - used_by_others
            # Leave room for activations of the largest step (measured by a profiling pass).
            budget -= self.profile_activation_bytes()
            return max(int(budget // self.kv_bytes_per_block()), 1)
        return max(int(cache.kv_cache_memory_gb * (1 << 30) // self.kv_bytes_per_block()), 1)

    def profile_activation_bytes(self) -> int:
        """Peak memory of one forward of `max_num_batched_tokens` tokens (CUDA only)."""
        return 0

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """One tensor `[num_blocks, num_layers, 2, block_size, num_kv_heads, head_size]`.

        A block's KV over all layers is the contiguous span `kv_cache[b]`, so a run of
        consecutive block ids moves as one copy; each layer sees a strided view.
        """
        m = self.model
        self.kv_cache = torch.zeros(
            (num_blocks, m.num_layers, 2, self.block_size, m.num_kv_heads, m.head_size),
            dtype=self.kv_dtype,
            device=self.device,
        )
        self.kv_caches = [self.kv_cache[:, i] for i in range(m.num_layers)]

    # ----------------------------------------------------------------- state

    def _update_states(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            self.requests.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            params = new.sampling_params
            generator = None
            if params.seed is not None:
                generator = torch.Generator(device=self.device)
                generator.manual_seed(params.seed)
            state = CachedRequestState(
                req_id=new.req_id,
                token_ids=list(new.prompt_token_ids) + list(new.output_token_ids),
                num_prompt_tokens=len(new.prompt_token_ids),
                sampling_params=params,
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                eos_token_id=self.eos_token_id,
                generator=generator,
                output_token_ids=list(new.output_token_ids),
            )
            if generator is not None and not params.is_greedy and new.output_token_ids:
                # Resumed after preemption: advance the stream past the draws already made.
                for _ in range(len(new.output_token_ids)):
                    torch.empty(self.vocab_size, device=self.device).exponential_(
                        generator=generator
                    )
            self.requests[new.req_id] = state
        for cached in so.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    # ----------------------------------------------------------------- step

    def _prepare_inputs(
        self, so: SchedulerOutput, req_ids: list[str]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int], list[int]]:
        bs = self.block_size
        num_reqs = len(req_ids)
        query_lens = np.empty(num_reqs, dtype=np.int64)
        starts = np.empty(num_reqs, dtype=np.int64)
        token_chunks: list[list[int]] = []
        max_blocks = 1
        for i, req_id in enumerate(req_ids):
            state = self.requests[req_id]
            n = so.num_scheduled_tokens[req_id]
            c = state.num_computed_tokens
            query_lens[i] = n
            starts[i] = c
            token_chunks.append(state.token_ids[c : c + n])
            max_blocks = max(max_blocks, len(state.block_ids))
        seq_lens = starts + query_lens
        query_start_loc = np.zeros(num_reqs + 1, dtype=np.int64)
        np.cumsum(query_lens, out=query_start_loc[1:])
        total = int(query_start_loc[-1])

        block_table = np.zeros((num_reqs, max_blocks), dtype=np.int32)
        for i, req_id in enumerate(req_ids):
            ids = self.requests[req_id].block_ids
            block_table[i, : len(ids)] = ids

        # positions = start of the request + offset inside its chunk, without a token loop.
        req_index = np.repeat(np.arange(num_reqs), query_lens)
        offsets = np.arange(total) - np.repeat(query_start_loc[:-1], query_lens)
        positions = starts[req_index] + offsets
        slot_mapping = (
            block_table[req_index, positions // bs].astype(np.int64) * bs + positions % bs
        )

        input_ids = np.fromiter(
            (t for chunk in token_chunks for t in chunk), dtype=np.int64, count=total
        )
        sampled_rows = [
            i
            for i, req_id in enumerate(req_ids)
            if seq_lens[i] >= len(self.requests[req_id].token_ids)
        ]
        logits_indices = [int(query_start_loc[i + 1]) - 1 for i in sampled_rows]

        dev = self.device
        metadata = AttentionMetadata(
            num_actual_tokens=total,
            num_reqs=num_reqs,
            max_query_len=int(query_lens.max()),
            max_seq_len=int(seq_lens.max()),
            query_start_loc=torch.from_numpy(query_start_loc.astype(np.int32)).to(dev),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(dev),
            block_table=torch.from_numpy(block_table).to(dev),
            slot_mapping=torch.from_numpy(slot_mapping).to(dev),
            query_start_loc_cpu=query_start_loc.tolist(),
            seq_lens_cpu=seq_lens.tolist(),
            is_decode_only=bool(total == num_reqs),
        )
        return (
            torch.from_numpy(input_ids).to(dev),
            torch.from_numpy(positions).to(dev),
            metadata,
            sampled_rows,
            logits_indices,
        )

    @torch.inference_mode()
    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(so)
        req_ids = [r.req_id for r in so.scheduled_new_reqs] + [
            r.req_id for r in so.scheduled_cached_reqs
        ]
        if not req_ids:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[], logprobs=[])
        input_ids, positions, metadata, sampled_rows, logits_indices = self._prepare_inputs(
            so, req_ids
        )
        hidden = self.model(input_ids, positions, self.kv_caches, metadata)

        sampled: list[list[int]] = [[] for _ in req_ids]
        logprobs: list = [None] * len(req_ids)
        if sampled_rows:
            idx = torch.tensor(logits_indices, dtype=torch.long, device=self.device)
            logits = self.model.compute_logits(hidden[idx])
            states = [self.requests[req_ids[i]] for i in sampled_rows]
            meta = SamplingMetadata.build(
                params=[s.sampling_params for s in states],
                prompt_token_ids=[s.prompt_token_ids for s in states],
                output_token_ids=[s.output_token_ids for s in states],
                eos_token_ids=[s.eos_token_id for s in states],
                generators=[s.generator for s in states],
                vocab_size=self.vocab_size,
                device=self.device,
            )
            out = self.sampler(logits, meta)
            tokens = out.sampled_token_ids.tolist()
            lp_lists = to_logprobs_lists(out, [s.sampling_params.logprobs for s in states])
            for row, state, token, lp in zip(sampled_rows, states, tokens, lp_lists, strict=True):
                sampled[row] = [token]
                logprobs[row] = lp
                state.token_ids.append(token)
                state.output_token_ids.append(token)
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled, logprobs=logprobs)
