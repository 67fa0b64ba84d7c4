"""Ulysses sequence parallelism: one call's image tokens split across workers, the same bits (the collectives, and
SD3's attention; the other families' plans: `stages.diffusion.sequence_plans`).

The image tokens in `sp` contiguous runs, one per worker: every token-wise layer (linear, norms, MLP, adaLN
modulation) runs on the worker's own tokens; around attention an all-to-all turns "all heads of my tokens" into "all
tokens of my heads", each head attends whole on one worker, and a second all-to-all turns it back. SD3's joint
attention's text tokens are replicated, not split: every worker runs the whole text stream (the rows one worker
runs), attends its heads over every text key, and gathers the text's attention output by heads. The patch embedding
runs on the whole latent on every worker; the output projection's tokens are gathered for the unpatchify, so every
worker of a sequence-parallel group ends the call with the whole prediction.

Why the bits can be the same: with the batch-invariant kernels a row's result does not depend on how many rows share
the call, and the attention kernel computes each head on its own (F.scaled_dot_product_attention's bits for a head do
not follow how many heads or samples share the call, measured with stock kernels), so each worker computes exactly
the values one worker computes, and the collectives only move them: gloo's all_gather and all_to_all_single, never an
all_reduce or any sum whose order follows the topology.

Served by a replica's parallel group (`stages.diffusion.group`) and rendered by the audit's prototype
(`evidence/parallel_render.py`); both join the workers into one torch.distributed world first.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F


@dataclass(frozen=True)
class Rendezvous:
    """Where a group's workers meet: rank 0's TCP store (host, port), and how long a collective may wait for a peer."""

    host: str
    port: int
    world: int
    timeout_s: float
    backend: str = "gloo"

    def join(self, rank: int, store: Any = None) -> None:
        """This process as `rank` of the group's world (returns once every rank joined); rank 0 passes its own store."""
        timeout = timedelta(seconds=self.timeout_s)
        if store is None:
            store = dist.TCPStore(self.host, self.port, self.world, is_master=False, timeout=timeout)
        dist.init_process_group(self.backend, store=store, rank=rank, world_size=self.world, timeout=timeout)


def backend_for(device: str) -> str:
    """The collectives' library for the group's device: gloo on CPU, NCCL on CUDA (each worker its own GPU, which Ray
    makes its cuda:0). Both move data only: all_gather and all_to_all_single, no reduction. NCCL is written, not run:
    this project's machines have no GPU yet (docs/gpu.md)."""
    return "nccl" if str(device).startswith("cuda") else "gloo"


def serve_rendezvous(host: str, world: int, timeout_s: float, device: str = "cpu") -> tuple[Rendezvous, Any]:
    """Rank 0's store on `host` (a port the system picks), not waiting for the others: the address to send them, and
    the store (rank 0 joins through it)."""
    store = dist.TCPStore(host, 0, world, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))
    return Rendezvous(host, store.port, world, timeout_s, backend_for(device)), store


def _group(ranks: list[int]) -> Any:
    """A process group over `ranks`; None for one rank (nothing to move). Every rank creates every group, in one order:
    `new_group` is itself collective."""
    group = dist.new_group(ranks)
    return group if len(ranks) > 1 else None


class Collectives:
    """This worker's place in the (cfg, sp) grid (rank = cfg_rank * sp + sp_rank), its two groups, and the bytes it
    sends to other workers (what it moves)."""

    def __init__(self, rank: int, cfg: int, sp: int):
        self.rank, self.cfg, self.sp = rank, cfg, sp
        self.member = rank < cfg * sp  # a grid smaller than the world: the workers past it wait
        self.cfg_rank, self.sp_rank = divmod(rank, sp) if self.member else (-1, -1)
        sp_groups = [_group([c * sp + s for s in range(sp)]) for c in range(cfg)]
        cfg_groups = [_group([c * sp + s for c in range(cfg)]) for s in range(sp)]
        self.sp_group = sp_groups[self.cfg_rank] if self.member else None
        self.cfg_group = cfg_groups[self.sp_rank] if self.member else None
        self.sent = 0
        self.calls: Counter[str] = Counter()

    def gather(self, tensor: torch.Tensor, group: Any, size: int, dim: int) -> torch.Tensor:
        """`tensor` of every worker of `group`, concatenated along `dim` in rank order (no arithmetic)."""
        if size == 1:
            return tensor
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(size)]
        dist.all_gather(parts, tensor, group=group)
        self._count("all_gather", tensor.nbytes * (size - 1))
        return torch.cat(parts, dim=dim)

    def exchange(self, chunks: torch.Tensor, group: Any) -> torch.Tensor:
        """All-to-all over dim 0: chunk i goes to the group's worker i; returns (size, ...), chunk j from worker j."""
        size = chunks.shape[0]
        chunks = chunks.contiguous()
        received = torch.empty_like(chunks)
        dist.all_to_all_single(received, chunks, group=group)
        self._count("all_to_all", chunks.nbytes * (size - 1) // size)  # its own chunk stays
        return received

    def _count(self, kind: str, sent: int) -> None:
        self.sent += sent
        self.calls[kind] += 1

    def own_run(self, tensor: torch.Tensor) -> torch.Tensor:
        """This worker's contiguous run of a sequence's tokens (B, N, ...) -> (B, N / sp, ...)."""
        if tensor.shape[1] % self.sp:
            raise ValueError(f"{tensor.shape[1]} image tokens do not split evenly over {self.sp} workers")
        share = tensor.shape[1] // self.sp
        return tensor.narrow(1, self.sp_rank * share, share)

    def own_tokens(self, module: Any, inputs: Any, output: torch.Tensor) -> torch.Tensor:
        """A hook on the patch embedding: its tokens (B, N, D) -> this worker's contiguous run of N / sp."""
        return self.own_run(output)

    def all_tokens(self, module: Any, inputs: Any, output: torch.Tensor) -> torch.Tensor:
        """A hook on the output projection: the rows of this worker's tokens -> every token, in order (the unpatchify
        takes them all)."""
        return self.gather(output, self.sp_group, self.sp, dim=1)

    def tokens_to_heads(self, tensor: torch.Tensor) -> torch.Tensor:
        """(B, n, H, D), every head of this worker's n tokens -> (B, sp x n, H / sp, D), every token of its heads."""
        batch, local, heads, dim = tensor.shape
        chunks = tensor.reshape(batch, local, self.sp, heads // self.sp, dim).permute(2, 0, 1, 3, 4)
        received = self.exchange(chunks, self.sp_group)  # (whose tokens, B, n, H/sp, D)
        return received.permute(1, 0, 2, 3, 4).reshape(batch, self.sp * local, heads // self.sp, dim)

    def heads_to_tokens(self, tensor: torch.Tensor) -> torch.Tensor:
        """The way back: (B, N, H / sp, D), every token of this worker's heads -> (B, N / sp, H, D)."""
        batch, tokens, share, dim = tensor.shape
        chunks = tensor.reshape(batch, self.sp, tokens // self.sp, share, dim).permute(1, 0, 2, 3, 4)
        received = self.exchange(chunks, self.sp_group)  # (whose heads, B, n, H/sp, D)
        return received.permute(1, 2, 0, 3, 4).reshape(batch, tokens // self.sp, self.sp * share, dim)

    def own_heads(self, tensor: torch.Tensor) -> torch.Tensor:
        """(B, T, H, D) whole on every worker -> (B, T, H / sp, D), this worker's heads."""
        share = tensor.shape[2] // self.sp
        return tensor[:, :, self.sp_rank * share : (self.sp_rank + 1) * share]

    def to_heads(self, tensor: torch.Tensor, whole: int = 0) -> torch.Tensor:
        """An attention input (B, whole + n, H, D) whose first `whole` tokens are whole on every worker (the text) and
        the rest this worker's run of the split tokens -> (B, whole + N, H / sp, D): this worker's heads of every
        token, in one worker's order (a cross-attention's keys, text only, have nothing to exchange)."""
        parts = [self.own_heads(tensor[:, :whole])]
        if tensor.shape[1] > whole:
            parts.append(self.tokens_to_heads(tensor[:, whole:]))
        return torch.cat(parts, dim=1)

    def qkv_to_heads(self, qkv: tuple[torch.Tensor, ...], whole: int = 0) -> tuple[torch.Tensor, ...]:
        """`to_heads` of an attention's query, key and value (the same shape) in one exchange, not three."""
        return self.to_heads(torch.cat(qkv), whole).chunk(len(qkv))

    def to_tokens(self, tensor: torch.Tensor, whole: int = 0) -> torch.Tensor:
        """The way back for an attention's output (B, whole + N, H / sp, D): the split tokens' rows to their workers,
        the whole ones' gathered by heads -> (B, whole + n, H, D)."""
        split = self.heads_to_tokens(tensor[:, whole:])
        if not whole:
            return split
        return torch.cat([self.gather(tensor[:, :whole], self.sp_group, self.sp, dim=2), split], dim=1)


def _projected(attn: Any, rows: torch.Tensor, projections: tuple, norms: tuple) -> tuple[torch.Tensor, ...]:
    """One stream's query, key and value (B, n, H, d) as SD3's processor computes them: projected, the query and key
    normed by head."""
    query, key, value = (project(rows).unflatten(2, (attn.heads, -1)) for project in projections)
    query, key = (x if norm is None else norm(x) for x, norm in zip((query, key), norms, strict=True))
    return query, key, value


class UlyssesJointAttention:
    """SD3's joint attention (diffusers' JointAttnProcessor2_0: the same layers and attention call) over image tokens
    split across the sequence-parallel group, text tokens whole on every worker. Head-parallel inside: `heads / sp`
    heads per worker, each over all N image + T text tokens (the image first, as diffusers joins them)."""

    def __init__(self, comms: Collectives):
        self.comms = comms

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, *args, **kwargs):
        comms = self.comms
        image = comms.qkv_to_heads(
            _projected(attn, hidden_states, (attn.to_q, attn.to_k, attn.to_v), (attn.norm_q, attn.norm_k))
        )
        text = _projected(
            attn,
            encoder_hidden_states,
            (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj),
            (attn.norm_added_q, attn.norm_added_k),
        )
        joined = (torch.cat([i, comms.own_heads(t)], dim=1) for i, t in zip(image, text, strict=True))
        query, key, value = (x.transpose(1, 2) for x in joined)  # (B, H / sp, N + T, d)
        attended = F.scaled_dot_product_attention(query, key, value, dropout_p=0.0, is_causal=False).transpose(1, 2)
        tokens = image[0].shape[1]  # every image token of this worker's heads
        hidden_states = comms.to_tokens(attended[:, :tokens]).flatten(2, 3).to(query.dtype)
        hidden_states = attn.to_out[1](attn.to_out[0](hidden_states))
        if attn.context_pre_only:  # the last block drops its text stream: nothing to gather
            return hidden_states, None
        text_out = comms.gather(attended[:, tokens:], comms.sp_group, comms.sp, dim=2).flatten(2, 3).to(query.dtype)
        return hidden_states, attn.to_add_out(text_out)
