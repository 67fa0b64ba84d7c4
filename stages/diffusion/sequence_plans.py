"""Where each DiT family's image tokens are split among a sequence-parallel group, and the attention that turns them
into heads (`stages.diffusion.sequence_parallel`): SD3, FLUX, Qwen-Image, Wan video.

Every plan does the same three things to its transformer for one call, and undoes them after:
- the image (or video) tokens, once embedded, cut to this worker's contiguous run;
- each attention replaced by the family's processor with its heads exchanged around the attention call
  (`Collectives.to_heads` / `to_tokens`): the text whole on every worker, each head rotated by the RoPE table one
  worker uses and attended over every token in one worker's order;
- the output projection's tokens gathered, in order, for the unpatchify.
Everything else (embedders, norms, modulation, feed-forwards, the output norm) works token by token and runs on the
worker's own tokens. The text stream is not split: each worker computes it whole, as one worker does.

FLUX's and Qwen-Image's packed calls (images of several sizes padded into one call) split their padded tokens; after
the exchange each row attends over its own real tokens with its own tables, as on one worker. A call whose image
tokens do not divide by the degree runs whole on one worker of each CFG part (the same bits, no collective).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers.transformer_wan import WanAttnProcessor

from stages.diffusers_private import wan_qkv_projections

from .engine.families import DiTFamily, FluxFamily, QwenImageFamily, WanFamily
from .engine.packing import (
    PackedFluxAttnProcessor,
    PackedQwenAttnProcessor,
    flux_joint_qkv,
    flux_outputs,
    qwen_outputs,
    qwen_streams_qkv,
)
from .sequence_parallel import Collectives, UlyssesJointAttention


@dataclass
class TextTokens:
    """The current call's text length (FLUX's single blocks see text and image as one stream: the text comes first)."""

    count: int = 0

    def record(self, module: Any, inputs: Any, output: torch.Tensor) -> None:
        self.count = output.shape[1]


class UlyssesFluxAttention(PackedFluxAttnProcessor):
    """FLUX's attention (the family's processor) over [text, this worker's image tokens]: each head rotated and
    attended over every token after the exchange, by the table one worker uses (a packed call's: each row's own)."""

    def __init__(self, comms: Collectives, text: TextTokens):
        super().__init__()
        self.comms, self.text = comms, text

    # Every parameter named: diffusers passes a processor only the keyword arguments its signature names.
    def __call__(
        self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None, packed=None
    ):
        comms, whole = self.comms, self.text.count
        query, key, value = comms.qkv_to_heads(flux_joint_qkv(attn, hidden_states, encoder_hidden_states), whole)
        if packed is not None:
            out = self._attend_rows(query, key, value, packed)
        else:
            if image_rotary_emb is not None:
                query, key = (apply_rotary_emb(x, image_rotary_emb, sequence_dim=1) for x in (query, key))
            out = dispatch_attention_fn(
                query, key, value, attn_mask=attention_mask, backend=self._attention_backend, parallel_config=None
            )
        return flux_outputs(attn, comms.to_tokens(out, whole).flatten(2, 3).to(query.dtype), encoder_hidden_states)


class UlyssesQwenAttention(PackedQwenAttnProcessor):
    """Qwen-Image's attention (the family's processor) over the text and this worker's image tokens: each head
    rotated, stream by stream, and attended over every token after the exchange, by the tables one worker uses (a
    packed call's: each row's own). Unmasked: the family passes no text mask (a packed call's rows attend their own)."""

    def __init__(self, comms: Collectives):
        super().__init__()
        self.comms = comms

    def __call__(
        self,
        attn,
        hidden_states,
        encoder_hidden_states=None,
        encoder_hidden_states_mask=None,
        attention_mask=None,
        image_rotary_emb=None,
        packed=None,
    ):
        if encoder_hidden_states_mask is not None or attention_mask is not None:
            raise ValueError("a sequence-parallel Qwen-Image call is unmasked")
        comms = self.comms
        image_qkv, text_qkv = qwen_streams_qkv(attn, hidden_states, encoder_hidden_states)
        image_qkv, text_qkv = list(comms.qkv_to_heads(tuple(image_qkv))), [comms.own_heads(x) for x in text_qkv]
        if packed is not None:
            image_out, text_out = self._attend_rows(image_qkv, text_qkv, packed)
        else:
            out = self._row_attention(text_qkv, image_qkv, image_rotary_emb)  # every row: one table
            whole = text_qkv[0].shape[1]
            image_out, text_out = out[:, whole:], out[:, :whole]
        text_out = comms.gather(text_out, comms.sp_group, comms.sp, dim=2)
        return qwen_outputs(attn, comms.to_tokens(image_out).flatten(2, 3), text_out.flatten(2, 3))


class UlyssesWanAttention(WanAttnProcessor):
    """WanAttnProcessor (text-to-video: no image context) on this worker's video tokens: self-attention's heads rotated
    and attended over every token after the exchange; cross-attention's queries exchanged too, so each head attends
    with one worker's query length (the attention kernel blocks its queries by their count), the text's keys and
    values whole."""

    def __init__(self, comms: Collectives):
        super().__init__()
        self.comms = comms

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        comms = self.comms
        query, key, value = wan_qkv_projections(attn, hidden_states, encoder_hidden_states)
        query, key = attn.norm_q(query), attn.norm_k(key)
        query, key, value = (x.unflatten(2, (attn.heads, -1)) for x in (query, key, value))
        if encoder_hidden_states is None:
            query, key, value = comms.qkv_to_heads((query, key, value))
        else:  # cross-attention: every key is the text's, whole here
            query, key, value = comms.to_heads(query), comms.own_heads(key), comms.own_heads(value)
        if rotary_emb is not None:
            query, key = (_wan_rotated(x, *rotary_emb) for x in (query, key))
        out = dispatch_attention_fn(
            query, key, value, attn_mask=attention_mask, dropout_p=0.0, is_causal=False, backend=self._attention_backend
        )
        return attn.to_out[1](attn.to_out[0](comms.to_tokens(out).flatten(2, 3).type_as(query)))


def _wan_rotated(tensor: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE as WanAttnProcessor applies it (its own function, local to its call)."""
    x1, x2 = tensor.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[..., 0::2], sin[..., 1::2]
    out = torch.empty_like(tensor)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(tensor)


@dataclass(frozen=True)
class SequencePlan:
    """A family's split: `tokens` (the call's image tokens, from its inputs; FLUX's and Qwen-Image's padded), `refusal`
    (why a transformer cannot be split by a degree, None where it can) and `install` (hooks and processors for one
    call; the hooks' handles returned, the processors restored by the caller)."""

    tokens: Callable[[Any, dict[str, Any]], int]
    refusal: Callable[[Any, int], str | None]
    install: Callable[[Any, Collectives], list[Any]]


def _heads(transformer: Any, sp: int) -> str | None:
    heads = transformer.config.num_attention_heads
    return f"the transformer's attention heads ({heads}) do not divide by it" if heads % sp else None


def _sd3_refusal(transformer: Any, sp: int) -> str | None:
    if any(block.use_dual_attention for block in transformer.transformer_blocks):
        return "a dual-attention block (SD3.5) is not split"
    return _heads(transformer, sp)


def _sd3(transformer: Any, comms: Collectives) -> list[Any]:
    processor = UlyssesJointAttention(comms)
    for block in transformer.transformer_blocks:
        block.attn.set_processor(processor)
    return [
        transformer.pos_embed.register_forward_hook(comms.own_tokens),
        transformer.proj_out.register_forward_hook(comms.all_tokens),
    ]


def _flux(transformer: Any, comms: Collectives) -> list[Any]:
    text = TextTokens()
    transformer.set_attn_processor(UlyssesFluxAttention(comms, text))
    return [
        transformer.x_embedder.register_forward_hook(comms.own_tokens),
        transformer.context_embedder.register_forward_hook(text.record),
        transformer.proj_out.register_forward_hook(comms.all_tokens),
    ]


def _qwen_refusal(transformer: Any, sp: int) -> str | None:
    if transformer.config.get("zero_cond_t", False):
        return "a Qwen-Image edit transformer (zero_cond_t: modulation by token) is not split"
    return _heads(transformer, sp)


def _qwen(transformer: Any, comms: Collectives) -> list[Any]:
    transformer.set_attn_processor(UlyssesQwenAttention(comms))
    return [
        transformer.img_in.register_forward_hook(comms.own_tokens),
        transformer.proj_out.register_forward_hook(comms.all_tokens),
    ]


def _wan_refusal(transformer: Any, sp: int) -> str | None:
    if transformer.config.get("image_dim") is not None:
        return "an image-to-video transformer (image context in its cross-attention) is not split"
    return _heads(transformer, sp)


def _wan(transformer: Any, comms: Collectives) -> list[Any]:
    def own_tokens(module: Any, args: tuple) -> tuple:
        return (comms.own_run(args[0]), *args[1:])  # the blocks take their inputs by position

    transformer.set_attn_processor(UlyssesWanAttention(comms))
    return [
        transformer.blocks[0].register_forward_pre_hook(own_tokens),  # the tokens are flattened in forward itself
        transformer.proj_out.register_forward_hook(comms.all_tokens),
    ]


def _grid_tokens(latents: torch.Tensor, patch: tuple[int, ...]) -> int:
    return math.prod(side // p for side, p in zip(latents.shape[2:], patch, strict=True))


PLANS: dict[type, SequencePlan] = {
    DiTFamily: SequencePlan(
        lambda t, inputs: _grid_tokens(inputs["hidden_states"], (t.config.patch_size,) * 2), _sd3_refusal, _sd3
    ),
    FluxFamily: SequencePlan(lambda t, inputs: inputs["hidden_states"].shape[1], _heads, _flux),  # padded: packed
    QwenImageFamily: SequencePlan(lambda t, inputs: inputs["hidden_states"].shape[1], _qwen_refusal, _qwen),
    WanFamily: SequencePlan(
        lambda t, inputs: _grid_tokens(inputs["hidden_states"], tuple(t.config.patch_size)), _wan_refusal, _wan
    ),
}


def plan_for(family: Any) -> SequencePlan | None:
    return PLANS.get(type(family))


def check(family: Any, sp: int) -> None:
    """Refuse, naming the field, a degree this family's transformer cannot be split by."""
    plan = plan_for(family)
    why = (
        f"sequence parallelism is served for SD3, FLUX, Qwen-Image and Wan text-to-video; not {type(family).__name__}"
        if plan is None
        else plan.refusal(family.denoiser, sp)
    )
    if why:
        raise ValueError(f"parallel.sp={sp}: {why}")


def splits(family: Any, inputs: dict[str, Any], sp: int) -> bool:
    """Whether a denoiser call on `inputs` splits its image tokens evenly over `sp` workers; one that does not runs
    whole on one worker of each part (the same bits, without the collectives)."""
    plan = plan_for(family)
    return plan is not None and plan.tokens(family.denoiser, inputs) % sp == 0


@contextlib.contextmanager
def sequence_parallel(family: Any, comms: Collectives) -> Iterator[None]:
    """The family's transformer on this worker's image tokens (a no-op for sp = 1); its own processors and no hooks
    after."""
    if comms.sp == 1:
        yield
        return
    plan = plan_for(family)
    assert plan is not None  # check() refused the group's start
    transformer = family.denoiser
    before = transformer.attn_processors
    hooks = plan.install(transformer, comms)
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()
        transformer.set_attn_processor(before)
