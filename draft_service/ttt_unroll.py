"""The training-time-test (TTT) unroll of an EAGLE-3 head, and its loss against the target's soft labels.

The head is unrolled ``ttt_steps`` times: step 0 reads fc(feature[t]) with token t+1 and
predicts the target's distribution at t+1 (its guess for token t+2); step k reads its own step
k-1 output at t with token t+1+k. At step k position t attends to the step-0 keys at positions
<= t plus its own keys of steps 1..k, the mask of EAGLE-3's reference trainer and what a
depth-k tree node sees at inference (context keys plus its own ancestors). With a working set the step-0 keys a
position sees are those serving's salience rule gives it instead (``ttt_working_set``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from diffspec.errors import InvalidRequest
from draft_service.eagle3_head import Eagle3Head
from draft_service.ttt_working_set import (
    choose_block_working_sets,
    gather_block_context,
    working_set_attention,
)
from draft_service.working_set import WorkingSetConfig


def ttt_attention(
    q: torch.Tensor,  # [B, L, heads, hd] queries of positions 0..L-1
    k0: torch.Tensor,  # [B, L, kv_heads, hd] step-0 keys, seen causally
    v0: torch.Tensor,  # [B, L, kv_heads, hd]
    diag_k: torch.Tensor,  # [B, L, n, kv_heads, hd] each position's own keys of steps 1..n (n may be 0)
    diag_v: torch.Tensor,  # [B, L, n, kv_heads, hd]
    scale: float,
) -> torch.Tensor:
    """One unrolled step's attention -> [B, L, heads, hd]; GQA by grouping query heads per kv head."""
    length, kv_heads = q.shape[1], k0.shape[2]
    qg = q.unflatten(2, (kv_heads, -1))  # [B, L, kv_heads, group, hd]
    causal = torch.einsum("bqngd,bknd->bngqk", qg, k0) * scale  # [B, kv_heads, group, L, L]
    future = torch.ones(length, length, dtype=torch.bool, device=q.device).triu(1)
    causal = causal.masked_fill(future, float("-inf"))
    diagonal = torch.einsum("bqngd,bqjnd->bngqj", qg, diag_k) * scale  # [B, kv_heads, group, L, n]
    probs = torch.softmax(torch.cat([causal, diagonal], dim=-1).float(), dim=-1).to(v0.dtype)
    out = torch.einsum("bngqk,bknd->bqngd", probs[..., :length], v0)
    out = out + torch.einsum("bngqj,bqjnd->bqngd", probs[..., length:], diag_v)
    return out.flatten(2, 3)


def ttt_forward(
    head: Eagle3Head,
    token_ids: torch.Tensor,
    features: torch.Tensor,
    ttt_steps: int,
    working_set: WorkingSetConfig | None = None,
) -> list[torch.Tensor]:
    """token_ids [B, S], target features [B, S, 3h] -> draft output of each unrolled step k, [B, S-1-k, h].

    Output k at position t has read tokens t+1..t+1+k and predicts the target's distribution at
    t+1+k. It runs at position t+k, as a depth-k tree node sits k past its root (the reference's
    ``position_ids + lck``). Positions whose token t+1+k lies past the window are dropped. One decoder
    layer only: a deeper head's upper layers would need their own unroll, so it is refused, not half trained.
    ``working_set``: each position attends to serving's salience working set of the step-0 keys, chosen from
    step 0's keys and queries (``ttt_working_set``); None: to every step-0 key up to it.
    """
    if head.config.num_layers != 1:
        raise InvalidRequest(f"the TTT unroll trains one-layer heads; this head has {head.config.num_layers} layers")
    seq = token_ids.shape[1]
    positions = torch.arange(seq - 1, device=token_ids.device).expand(token_ids.shape[0], -1)
    hidden = head.fuse(features[:, :-1])
    outputs: list[torch.Tensor] = []
    own_k: list[torch.Tensor] = []
    own_v: list[torch.Tensor] = []
    context = None  # with a working set, the step-0 keys each block of positions sees
    for k in range(ttt_steps):
        length = seq - 1 - k
        hidden = hidden[:, :length]
        q, key, value = head.attention_inputs(token_ids[:, 1 + k :], hidden, head.rope(positions[:, :length] + k))
        if k == 0:
            k0, v0 = key, value
            if working_set is not None:
                context = gather_block_context(key, value, choose_block_working_sets(q, key, working_set), head.rope)
        else:
            own_k.append(key)
            own_v.append(value)
        diag_k, diag_v = (_stack_steps(xs, length, key) for xs in (own_k, own_v))
        if context is None:
            attn = ttt_attention(q, k0[:, :length], v0[:, :length], diag_k, diag_v, head.scale)
        else:
            attn = working_set_attention(q, context, diag_k, diag_v, head.scale)
        hidden = head.attention_outputs(attn, hidden)
        outputs.append(hidden)
    return outputs


def _stack_steps(per_step: list[torch.Tensor], length: int, like: torch.Tensor) -> torch.Tensor:
    """[B, >=L, kv_heads, hd] per step -> [B, L, steps, kv_heads, hd] (steps may be 0)."""
    if not per_step:
        return like.unsqueeze(2)[:, :, :0]
    return torch.stack([x[:, :length] for x in per_step], dim=2)


@dataclass
class SoftLabels:
    probs: torch.Tensor  # [B, S, draft_vocab] float32 target softmax restricted to the draft vocab
    draft_ids: torch.Tensor  # [B, S] int64 draft id of the target's argmax, -1 outside the draft vocab


def soft_labels(target_logits: torch.Tensor, used_ids: torch.Tensor, target_to_draft: torch.Tensor) -> SoftLabels:
    """target_logits [B, S, vocab] float32; used_ids [draft_vocab] target ids; target_to_draft [vocab]."""
    probs = torch.softmax(target_logits.index_select(-1, used_ids), dim=-1)
    return SoftLabels(probs=probs, draft_ids=target_to_draft[target_logits.argmax(-1)])


def ttt_loss(
    head: Eagle3Head, outputs: list[torch.Tensor], labels: SoftLabels, decay: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (sum_k decay**k * soft CE_k, top-1 accuracy [ttt_steps]).

    CE_k averages over step k's positions with positions whose target argmax is outside the
    draft vocab contributing zero (as the reference); accuracy counts those as misses.
    """
    losses, accuracy = [], []
    for k, output in enumerate(outputs):
        length = output.shape[1]
        log_probs = F.log_softmax(head.draft_logits(output), dim=-1)  # [B, L, draft_vocab]
        probs = labels.probs[:, 1 + k : 1 + k + length]
        draft_ids = labels.draft_ids[:, 1 + k : 1 + k + length]
        cross_entropy = -(probs * log_probs).sum(-1)  # [B, L]
        losses.append((cross_entropy * (draft_ids >= 0)).mean())
        accuracy.append((log_probs.argmax(-1) == draft_ids).float().mean())
    total = torch.stack([decay**k * loss for k, loss in enumerate(losses)]).sum()
    return total, torch.stack(accuracy).detach()
