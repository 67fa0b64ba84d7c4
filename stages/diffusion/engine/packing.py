"""Images of different sizes in one FLUX or Qwen-Image denoiser call: token sequences padded to the longest, attention
per sample.

A FLUX transformer mixes tokens only in attention; every other layer (the embedders, the blocks' norms, modulation
and feed-forwards, the output projection) works token by token, with each sample's own modulation. So samples whose
image token counts differ can share one call: their tokens are padded with zeros to the longest sequence, every
token-wise layer runs on the padded batch (with the batch-invariant kernels, a token's row gives the bits it gives
alone, padding or not), and attention runs once per sample over that sample's own tokens (text, then its image,
no padding) with its own RoPE table, exactly the call a solo render makes. The padded rows are computed and
dropped; nothing reads them. xDiT and vLLM-Omni group by resolution instead; the padding costs compute, which
`omniserve bench --load mixed-sizes` weighs against waiting for a same-size partner.

Qwen-Image's MMDiT is built the same way, with two padded streams: its prompt embeddings have each prompt's own length
(FLUX pads T5 to a fixed 512), so its text is padded too, and a row's attention runs over its own text, then its own
image tokens, with the two RoPE tables (image, text) its solo call computes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch

# From its module: attention_dispatch is where FluxAttnProcessor's own call goes.
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers.transformer_flux import FluxAttnProcessor
from diffusers.models.transformers.transformer_qwenimage import QwenDoubleStreamAttnProcessor2_0, apply_rotary_emb_qwen

from stages.diffusers_private import flux_qkv_projections


@dataclass(frozen=True)
class PackedRows:
    """Per row of a padded call: how many of its tokens are real (text + its image) and its RoPE table (cos, sin)."""

    lengths: tuple[int, ...]
    rotary: tuple[tuple[torch.Tensor, torch.Tensor], ...]


class PackedFluxAttnProcessor(FluxAttnProcessor):
    """FluxAttnProcessor, with attention per row over its real tokens when the call is packed (`packed` given);
    without it, diffusers' own processor, unchanged."""

    def __call__(
        self,
        attn,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: torch.Tensor | None = None,
        packed: PackedRows | None = None,
    ):
        if packed is None:
            # cast: diffusers annotates the encoder states Tensor, with None as their default (single blocks pass none).
            encoder = cast(torch.Tensor, encoder_hidden_states)
            return super().__call__(attn, hidden_states, encoder, attention_mask, image_rotary_emb)
        # FluxAttnProcessor.__call__, line for line, but for the attention call (per row) and the RoPE table (its own).
        query, key, value = flux_joint_qkv(attn, hidden_states, encoder_hidden_states)
        out = self._attend_rows(query, key, value, packed)
        return flux_outputs(attn, out.flatten(2, 3).to(query.dtype), encoder_hidden_states)

    def _attend_rows(self, query, key, value, packed: PackedRows) -> torch.Tensor:
        """Each row's attention over its real tokens (B, S, heads, D), rotated by its own table; zeros in the padding."""
        out = torch.zeros_like(query)  # padded rows: zeros, dropped at the end
        for row, (length, rotary) in enumerate(zip(packed.lengths, packed.rotary, strict=True)):
            real = slice(row, row + 1), slice(0, length)
            out[real] = dispatch_attention_fn(
                _rotated(query[real], rotary),
                _rotated(key[real], rotary),
                value[real].contiguous(),  # laid out as a solo call's
                backend=self._attention_backend,
                parallel_config=self._parallel_config,
            )
        return out


def flux_joint_qkv(attn, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None):
    """FluxAttnProcessor's query, key and value (B, S, H, D), normed, not yet rotated: [text, image] in a block with a
    text stream (double blocks), the joint stream as given in the others (single blocks)."""
    query, key, value, encoder_query, encoder_key, encoder_value = flux_qkv_projections(
        attn, hidden_states, encoder_hidden_states
    )
    query = attn.norm_q(query.unflatten(-1, (-1, attn.head_dim)))
    key = attn.norm_k(key.unflatten(-1, (-1, attn.head_dim)))
    value = value.unflatten(-1, (-1, attn.head_dim))
    if attn.added_kv_proj_dim is not None:
        encoder_query = attn.norm_added_q(encoder_query.unflatten(-1, (-1, attn.head_dim)))
        encoder_key = attn.norm_added_k(encoder_key.unflatten(-1, (-1, attn.head_dim)))
        encoder_value = encoder_value.unflatten(-1, (-1, attn.head_dim))
        query = torch.cat([encoder_query, query], dim=1)
        key = torch.cat([encoder_key, key], dim=1)
        value = torch.cat([encoder_value, value], dim=1)
    return query, key, value


def flux_outputs(attn, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None):
    """FluxAttnProcessor's ending, from the attention's (B, S, H x D): the image's and the text's projections in a block
    with a text stream, the joint output as it is in the others."""
    if encoder_hidden_states is None:
        return hidden_states
    encoder_hidden_states, hidden_states = hidden_states.split_with_sizes(
        [encoder_hidden_states.shape[1], hidden_states.shape[1] - encoder_hidden_states.shape[1]], dim=1
    )
    hidden_states = attn.to_out[1](attn.to_out[0](hidden_states.contiguous()))
    return hidden_states, attn.to_add_out(encoder_hidden_states.contiguous())


@dataclass(frozen=True)
class PackedStreams:
    """Per row of a padded two-stream call (Qwen-Image): its real text and image token counts and its RoPE tables
    (image, text), as `QwenEmbedRope` gives them for its solo call."""

    text: tuple[int, ...]
    image: tuple[int, ...]
    rotary: tuple[tuple[torch.Tensor, torch.Tensor], ...]


class PackedQwenAttnProcessor(QwenDoubleStreamAttnProcessor2_0):
    """QwenDoubleStreamAttnProcessor2_0, with attention per row over its own text and image tokens when the call is
    packed (`packed` given); without it, diffusers' own processor, unchanged."""

    def __call__(
        self,
        attn,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_hidden_states_mask: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: torch.Tensor | None = None,
        packed: PackedStreams | None = None,
    ):
        if packed is None:
            # cast: diffusers annotates these FloatTensor, with None defaults.
            return super().__call__(
                attn,
                hidden_states,
                cast(Any, encoder_hidden_states),
                cast(Any, encoder_hidden_states_mask),
                attention_mask,
                image_rotary_emb,
            )
        text = cast(torch.Tensor, encoder_hidden_states)
        # QwenDoubleStreamAttnProcessor2_0.__call__, line for line, but for the attention call and RoPE (per row).
        image_qkv, text_qkv = qwen_streams_qkv(attn, hidden_states, text)
        image_out, text_out = self._attend_rows(image_qkv, text_qkv, packed)
        return qwen_outputs(attn, image_out.flatten(2, 3), text_out.flatten(2, 3))

    def _attend_rows(self, image_qkv: list, text_qkv: list, packed: PackedStreams) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's joint attention over its own text and image tokens (B, S, heads, D): the image's and the text's
        outputs, zeros in the padding."""
        image_out, text_out = torch.zeros_like(image_qkv[0]), torch.zeros_like(text_qkv[0])  # padding: zeros, dropped
        for row, (texts, images, tables) in enumerate(zip(packed.text, packed.image, packed.rotary, strict=True)):
            at = slice(row, row + 1)
            out = self._row_attention([t[at, :texts] for t in text_qkv], [t[at, :images] for t in image_qkv], tables)
            text_out[at, :texts], image_out[at, :images] = out[:, :texts], out[:, texts:]
        return image_out, text_out

    def _row_attention(self, text: list[torch.Tensor], image: list[torch.Tensor], tables) -> torch.Tensor:
        """One row's joint attention, as its solo call computes it: query and key rotated, each stream by its own
        table (image, text), then [text, image]."""
        image_freqs, text_freqs = tables
        query, key = (
            torch.cat(
                [
                    apply_rotary_emb_qwen(text[i], text_freqs, use_real=False),
                    apply_rotary_emb_qwen(image[i], image_freqs, use_real=False),
                ],
                dim=1,
            )
            for i in (0, 1)
        )
        value = torch.cat([text[2], image[2]], dim=1)
        return dispatch_attention_fn(
            query,
            key,
            value,
            attn_mask=None,
            dropout_p=0.0,
            is_causal=False,
            backend=self._attention_backend,
            parallel_config=self._parallel_config,
        ).to(query.dtype)


def qwen_streams_qkv(attn, hidden_states: torch.Tensor, text: torch.Tensor) -> tuple[list, list]:
    """QwenDoubleStreamAttnProcessor2_0's queries, keys and values (B, S, H, D) of each stream (image, text), normed,
    not yet rotated."""
    head_dim = attn.inner_dim // attn.heads
    image_qkv = [proj(hidden_states).unflatten(-1, (-1, head_dim)) for proj in (attn.to_q, attn.to_k, attn.to_v)]
    text_qkv = [
        proj(text).unflatten(-1, (-1, head_dim)) for proj in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)
    ]
    for qkv, norms in ((image_qkv, (attn.norm_q, attn.norm_k)), (text_qkv, (attn.norm_added_q, attn.norm_added_k))):
        for i, norm in enumerate(norms):
            if norm is not None:
                qkv[i] = norm(qkv[i])
    return image_qkv, text_qkv


def qwen_outputs(attn, image: torch.Tensor, text: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """QwenDoubleStreamAttnProcessor2_0's ending, from each stream's attention output (B, S, H x D): its projections."""
    image_attn = attn.to_out[0](image.contiguous())
    if len(attn.to_out) > 1:
        image_attn = attn.to_out[1](image_attn)  # dropout
    return image_attn, attn.to_add_out(text.contiguous())


def _rotated(x: torch.Tensor, table: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """RoPE as FluxAttnProcessor applies it (diffusers annotates the table and the result as other types)."""
    return cast(torch.Tensor, apply_rotary_emb(x, cast(Any, table), sequence_dim=1))


def padded(tokens: torch.Tensor, length: int) -> torch.Tensor:
    """(1, n, C) -> (1, length, C), zeros after the n real tokens."""
    return torch.nn.functional.pad(tokens, (0, 0, 0, length - tokens.shape[1]))
