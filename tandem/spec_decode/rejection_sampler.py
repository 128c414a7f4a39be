"""The rejection sampler: verifies a step's draft tokens against the target, on the device.

Request b verified k_b drafts d_0..d_{k_b-1} in rows r_b .. r_b + k_b of the target's
distributions p (row r_b + j is the target's distribution for the token after j drafts)::

    greedy:  accept d_j while d_j == argmax p_j; then emit argmax p_a (a = accepted count;
             a == k_b: the bonus token from the last row)
    random:  accept d_j with probability min(1, p_j(d_j) / q_j(d_j)) (u_j * q_j(d_j) <= p_j(d_j));
             at the first rejection emit a token from normalize(max(p_a - q_a, 0)); after
             k_b acceptances emit the bonus token from p_{k_b}

which emits exactly the target's distribution at every position (Leviathan et al., 2023).
q is the draft's distribution; None means one-hot drafts (n-gram, replay), where
min(1, p/q) = p(d) and the residual is p with d removed.

Randomness comes in as tensors so seeded requests draw it from their own generators and the
reference sees the same draws: `uniform[D]` per draft and `noise[T, V]` Exp(1) per row; a
row's token is sampled by the exponential race argmax(w / noise) (w need not be normalised).

`rejection_sample` is the device version (batched tensor ops, no host sync); the per-request
loop `rejection_sample_reference` is its reference. Both return `[B, max_k + 1]` int64:
row b holds the a_b + 1 emitted tokens, then -1.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

PLACEHOLDER = -1


def rejection_sample(
    num_draft: Sequence[int],
    draft_token_ids: torch.Tensor,
    target_probs: torch.Tensor | None,
    target_argmax: torch.Tensor,
    is_greedy: torch.Tensor | None,
    uniform: torch.Tensor | None,
    noise: torch.Tensor | None,
    draft_probs: torch.Tensor | None = None,
) -> torch.Tensor:
    """See the module docstring. Shapes: `draft_token_ids [D]` (D = sum(num_draft)),
    `target_probs [T, V]` (T = D + B; None when every row is greedy), `target_argmax [T]`,
    `is_greedy [B]` bool (None: all greedy when target_probs is None, else none greedy),
    `uniform [D]`, `noise [T, V]`, `draft_probs [D, V]` or None (one-hot drafts)."""
    device = target_argmax.device
    num_reqs = len(num_draft)
    max_k = max(num_draft) if num_reqs else 0
    num_rows = sum(num_draft) + num_reqs
    assert draft_token_ids.shape == (num_rows - num_reqs,), "one draft id per draft"
    assert target_argmax.shape == (num_rows,), "one target row per draft, plus the bonus row"
    if num_reqs and min(num_draft) == max_k:
        if target_probs is None:
            return _greedy_uniform(num_reqs, max_k, draft_token_ids, target_argmax)
        if max_k:
            assert uniform is not None and noise is not None
            return _random_uniform(
                max_k, draft_token_ids, target_probs, target_argmax, is_greedy, uniform, noise,
                draft_probs,
            )  # fmt: skip
    k = torch.tensor(list(num_draft), dtype=torch.int64).to(device, non_blocking=True)
    row_start = torch.cumsum(k + 1, 0) - (k + 1)
    draft_start = row_start - torch.arange(num_reqs, device=device)
    pos = torch.arange(max_k, device=device)
    valid = pos.unsqueeze(0) < k.unsqueeze(1)  # [B, K]
    num_drafts_total = max(num_rows - num_reqs, 1)
    draft_idx = (draft_start.unsqueeze(1) + pos).clamp_max(num_drafts_total - 1)
    rows = row_start.unsqueeze(1) + pos  # [B, K], rows of the draft positions
    drafts = draft_token_ids[draft_idx] if draft_token_ids.numel() else torch.zeros_like(draft_idx)

    accepted = target_argmax[rows.clamp_max(num_rows - 1)] == drafts
    if target_probs is not None:
        assert uniform is not None and noise is not None
        p_d = target_probs[rows.clamp_max(num_rows - 1), drafts]
        q_d = draft_probs[draft_idx, drafts] if draft_probs is not None else torch.ones_like(p_d)
        u = uniform[draft_idx] if uniform.numel() else torch.ones_like(p_d)
        random_ok = u * q_d <= p_d
        accepted = (
            random_ok
            if is_greedy is None
            else torch.where(is_greedy.unsqueeze(1), accepted, random_ok)
        )
    accepted &= valid
    num_accepted = torch.cumprod(accepted.to(torch.int64), dim=1).sum(dim=1)  # [B]

    final_row = row_start + num_accepted
    final = target_argmax[final_row]
    if target_probs is not None:
        assert noise is not None
        p = target_probs[final_row]  # [B, V]
        rejected = num_accepted < k
        at = num_accepted.clamp_max(max(max_k - 1, 0)).unsqueeze(1)
        rejected_draft = drafts.gather(1, at).squeeze(1) if max_k else final
        if draft_probs is not None:
            q = draft_probs[(draft_start + num_accepted).clamp_max(num_drafts_total - 1)]
        else:
            q = torch.zeros_like(p).scatter_(1, rejected_draft.unsqueeze(1), 1.0)
        residual = (p - q).clamp_min_(0.0)
        # Rounding can leave no mass where p and q nearly agree: fall back to p.
        residual = torch.where(residual.sum(dim=1, keepdim=True) > 0, residual, p)
        weights = torch.where(rejected.unsqueeze(1), residual, p)
        sampled = (weights / noise[final_row].clamp_min(torch.finfo(noise.dtype).tiny)).argmax(1)
        final = sampled if is_greedy is None else torch.where(is_greedy, final, sampled)

    out = torch.where(pos.unsqueeze(0) < num_accepted.unsqueeze(1), drafts, PLACEHOLDER)
    out = torch.cat([out, torch.full((num_reqs, 1), PLACEHOLDER, device=device)], dim=1)
    out.scatter_(1, num_accepted.unsqueeze(1), final.unsqueeze(1))
    return out


def _greedy_uniform(
    num_reqs: int, k: int, draft_token_ids: torch.Tensor, target_argmax: torch.Tensor
) -> torch.Tensor:
    """`rejection_sample` where every row is greedy and every request has k drafts (a step
    the rule gave k drafts to all): the rows are a `[B, k + 1]` view, and since an accepted
    draft equals its row's argmax, request b emits its rows' argmaxes 0..a_b, then -1. A
    handful of device ops instead of the general path's index arithmetic."""
    target = target_argmax.view(num_reqs, k + 1)
    accepted = target[:, :k] == draft_token_ids.view(num_reqs, k)
    num_accepted = accepted.cumprod(dim=1).sum(dim=1, keepdim=True)
    cols = torch.arange(k + 1, device=target_argmax.device)
    return torch.where(cols <= num_accepted, target, PLACEHOLDER)


def _random_uniform(
    k: int,
    draft_token_ids: torch.Tensor,
    target_probs: torch.Tensor,
    target_argmax: torch.Tensor,
    is_greedy: torch.Tensor | None,
    uniform: torch.Tensor,
    noise: torch.Tensor,
    draft_probs: torch.Tensor | None,
) -> torch.Tensor:
    """`rejection_sample` with random rows where every request has k >= 1 drafts: the same
    rule on `[B, k + 1]` views, without the general path's index arithmetic."""
    num_reqs = draft_token_ids.shape[0] // k
    vocab = target_probs.shape[1]
    device = target_argmax.device
    drafts = draft_token_ids.view(num_reqs, k)
    at_drafts = drafts.unsqueeze(2)
    p_d = target_probs.view(num_reqs, k + 1, vocab)[:, :k].gather(2, at_drafts).squeeze(2)
    u = uniform.view(num_reqs, k)
    if draft_probs is not None:
        q_drafts = draft_probs.view(num_reqs, k, vocab)
        random_ok = u * q_drafts.gather(2, at_drafts).squeeze(2) <= p_d
    else:
        random_ok = u <= p_d  # one-hot drafts: q(d) = 1
    target = target_argmax.view(num_reqs, k + 1)
    accepted = (
        random_ok
        if is_greedy is None
        else torch.where(is_greedy.unsqueeze(1), target[:, :k] == drafts, random_ok)
    )
    num_accepted = accepted.cumprod(dim=1).sum(dim=1)  # [B]
    final_row = torch.arange(num_reqs, device=device) * (k + 1) + num_accepted
    p = target_probs[final_row]  # [B, V]
    # The first rejected draft (a request that accepted all k takes p: `rejected` below).
    at = num_accepted.clamp_max(k - 1).unsqueeze(1)
    if draft_probs is not None:
        q = q_drafts.gather(1, at.unsqueeze(2).expand(-1, 1, vocab)).squeeze(1)
    else:
        q = torch.zeros_like(p).scatter_(1, drafts.gather(1, at), 1.0)
    residual = (p - q).clamp_min_(0.0)
    # Rounding can leave no mass where p and q nearly agree: fall back to p.
    residual = torch.where(residual.sum(dim=1, keepdim=True) > 0, residual, p)
    weights = torch.where((num_accepted < k).unsqueeze(1), residual, p)
    sampled = (weights / noise[final_row].clamp_min(torch.finfo(noise.dtype).tiny)).argmax(1)
    final = (
        sampled if is_greedy is None else torch.where(is_greedy, target_argmax[final_row], sampled)
    )
    cols = torch.arange(k + 1, device=device)
    num_accepted = num_accepted.unsqueeze(1)
    out = torch.where(cols < num_accepted, torch.nn.functional.pad(drafts, (0, 1)), PLACEHOLDER)
    return out.scatter_(1, num_accepted, final.unsqueeze(1))


def rejection_sample_reference(
    num_draft: Sequence[int],
    draft_token_ids: torch.Tensor,
    target_probs: torch.Tensor | None,
    target_argmax: torch.Tensor,
    is_greedy: torch.Tensor | None,
    uniform: torch.Tensor | None,
    noise: torch.Tensor | None,
    draft_probs: torch.Tensor | None = None,
) -> torch.Tensor:
    """`rejection_sample`, one request and one position at a time (the reference)."""
    max_k = max(num_draft) if num_draft else 0
    out = torch.full((len(num_draft), max_k + 1), PLACEHOLDER, dtype=torch.int64)
    row = d = 0
    for b, k in enumerate(num_draft):
        greedy = target_probs is None if is_greedy is None else bool(is_greedy[b])
        emitted: list[int] = []
        for j in range(k + 1):
            if j == k:  # every draft accepted: the bonus token
                if greedy:
                    emitted.append(int(target_argmax[row + j]))
                else:
                    assert target_probs is not None and noise is not None
                    w = target_probs[row + j] / noise[row + j]
                    emitted.append(int(w.argmax()))
                break
            draft = int(draft_token_ids[d + j])
            if greedy:
                if draft == int(target_argmax[row + j]):
                    emitted.append(draft)
                    continue
                emitted.append(int(target_argmax[row + j]))
                break
            assert target_probs is not None and uniform is not None and noise is not None
            p = target_probs[row + j]
            if draft_probs is not None:
                q = draft_probs[d + j]
            else:
                q = torch.zeros_like(p)
                q[draft] = 1.0
            if float(uniform[d + j]) * float(q[draft]) <= float(p[draft]):
                emitted.append(draft)
                continue
            residual = (p - q).clamp_min(0.0)
            if float(residual.sum()) <= 0:
                residual = p
            emitted.append(int((residual / noise[row + j]).argmax()))
            break
        out[b, : len(emitted)] = torch.tensor(emitted)
        row += k + 1
        d += k
    return out
