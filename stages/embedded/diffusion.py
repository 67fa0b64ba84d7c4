"""Tiny diffusion pipelines: real diffusers classes and configs, small random weights, no download.

Three kinds, each a real architecture a serving stage meets in production:
  "unet": StableDiffusionPipeline   (UNet2DConditionModel, AutoencoderKL, CLIPTextModel, EulerDiscreteScheduler)
  "dit":  StableDiffusion3Pipeline  (SD3Transformer2DModel, AutoencoderKL with 16 latent channels,
                                     two CLIPTextModelWithProjection, no T5, FlowMatchEulerDiscreteScheduler)
  "sdxl": StableDiffusionXLPipeline (UNet2DConditionModel with SDXL's "text_time" added conditioning, AutoencoderKL,
                                     CLIPTextModel + CLIPTextModelWithProjection, EulerDiscreteScheduler)
  "flux": FluxPipeline              (FluxTransformer2DModel with the guidance embedding, AutoencoderKL with 4 latent
                                     channels packed 2x2, CLIPTextModel + a T5 encoder with a byte-level tokenizer,
                                     FlowMatchEulerDiscreteScheduler)
  "qwen": QwenImagePipeline         (QwenImageTransformer2DModel, the MMDiT with RoPE over text and image and RMSNorm'd
                                     text, AutoencoderKLQwenImage with causal 3-D convolutions and 4 latent channels
                                     packed 2x2, a Qwen2.5-VL text encoder with a byte-level BPE tokenizer whose chat
                                     template's system prefix is 34 tokens as in the real one, FlowMatchEulerDiscrete-
                                     Scheduler with Qwen-Image's exponential dynamic shift)
  "pixart": PixArtSigmaPipeline     (PixArtTransformer2DModel with adaLN-single and learned sigma, AutoencoderKL,
                                     a T5 encoder with a byte-level tokenizer, DPMSolverMultistepScheduler): a
                                     pipeline the step engine has no family for, served by whole-request batching
  "wan": WanPipeline                (WanTransformer3DModel, Wan 2.1's video DiT with 3-D RoPE and cross-attention,
                                     AutoencoderKLWan with causal 3-D convolutions: 8x in space, 4x in time, a UMT5
                                     encoder with a byte-level tokenizer, UniPCMultistepScheduler on flow sigmas):
                                     text to video, diffusers' fast-test shapes
Shapes follow diffusers' own fast-test dummy components, except that both VAEs have four levels and so
downsample 8x like the real ones: a 256x256 image stays cheap (32x32 latents), and any height/width that
is a multiple of 16 (VAE 8x times SD3's patch 2) works for both kinds.

The trained default (recipe "shapes", `training.shapes`) is not built here: its directory is
committed (TRAINED_PATH) and `load_tiny_pipeline` loads it the same way.

Their model ids come from the registry (`stages.embedded.EMBEDDED_MODELS`, recipe = kind).
`tiny_pipeline_path(kind)` builds a pipeline once from a fixed seed, saves it under `cache_root()` through
`stages.embedded.build_cached` (its marker records the seed, versions and a weights fingerprint) and returns
the directory; `load_tiny_pipeline(kind)` loads it from there with `from_pretrained`.
"""

from __future__ import annotations

import hashlib
import threading
from importlib.metadata import version
from pathlib import Path
from typing import Any, cast

import torch
from diffusers import (
    AutoencoderKL,
    AutoencoderKLQwenImage,
    DPMSolverMultistepScheduler,
    EulerDiscreteScheduler,
    FlowMatchEulerDiscreteScheduler,
    FluxPipeline,
    FluxTransformer2DModel,
    PixArtSigmaPipeline,
    PixArtTransformer2DModel,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
    StableDiffusionPipeline,
    StableDiffusionXLPipeline,
    UNet2DConditionModel,
    UniPCMultistepScheduler,
    WanPipeline,
    WanTransformer3DModel,
)
from diffusers.models.autoencoders.autoencoder_kl_wan import AutoencoderKLWan

# From its module, not the package: to a type checker the package's names are torch-less placeholders.
from diffusers.pipelines.pipeline_utils import DiffusionPipeline
from safetensors import safe_open
from transformers import (
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTextModelWithProjection,
    CLIPTokenizer,
    PreTrainedTokenizerFast,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2Tokenizer,
    T5Config,
    T5EncoderModel,
    UMT5Config,
    UMT5EncoderModel,
)

from stages.diffusers_private import wan_in_one_dtype
from stages.embedded import EMBEDDED_MODELS, build_cached, cache_root

#: Recipe ("unet" | "dit" | "sdxl" | "flux") -> model id of the random-weight pipelines built here, from the registry.
MODEL_IDS = {m.recipe: m.id for m in EMBEDDED_MODELS.values() if m.stage == "diffusion" and not m.trained}
KINDS = tuple(MODEL_IDS)
#: The trained default's recipe: not built here but committed, made by `scripts/train_shapes.py` (training/shapes.py).
TRAINED_KIND = "shapes"
TRAINED_PATH = Path(__file__).resolve().parent / "tiny-shapes-sd"
#: Its adapters directory (`lora_dir`, as a replica reads one): "twins", trained by training/shapes_lora.py.
ADAPTERS_PATH = Path(__file__).resolve().parent / "tiny-shapes-sd-loras"

SEED = 0
# Bump when a recipe below changes: the cache directory name carries it, so old builds are never reused.
RECIPE_VERSION = 1
LIBRARIES = ("torch", "diffusers", "transformers", "tokenizers", "safetensors")
MAX_PROMPT_TOKENS = 77

# Seeding uses the process-wide RNG: one build at a time per process, whatever the threads.
_BUILD_LOCK = threading.Lock()
# from_pretrained rejects SD3's saved [null, null] T5 entries unless the absence is stated again at load.
_ABSENT_COMPONENTS = {
    "unet": {},
    "dit": {"text_encoder_3": None, "tokenizer_3": None},
    "sdxl": {},
    "flux": {},
    "qwen": {},
    "pixart": {},
    "wan": {},
    TRAINED_KIND: {},
}


def tiny_pipeline_path(kind: str) -> Path:
    """The directory holding the built `kind` pipeline; builds it on first use, reuses it after."""
    target = cache_root() / f"{MODEL_IDS[_checked(kind)].replace('/', '--')}-v{RECIPE_VERSION}"
    return build_cached(target, lambda directory: _save(kind, directory))


def load_tiny_pipeline(kind: str, dtype: torch.dtype = torch.float32) -> DiffusionPipeline:
    """The `kind` pipeline, loaded from its cache directory (the trained one: from the source tree), never the network."""
    path = TRAINED_PATH if kind == TRAINED_KIND else tiny_pipeline_path(kind)
    with wan_in_one_dtype():
        pipe = DiffusionPipeline.from_pretrained(path, dtype=dtype, local_files_only=True, **_ABSENT_COMPONENTS[kind])
    # Without `accelerate`, diffusers 0.42 keeps SD3's fp32 checkpoint tensors: its dtype check reads an fp32 buffer.
    pipe.to(dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _checked(kind: str) -> str:
    if kind not in KINDS:
        raise ValueError(f"unknown tiny pipeline kind {kind!r}; expected one of {KINDS}")
    return kind


def _save(kind: str, directory: Path) -> dict[str, Any]:
    """Build `kind` into `directory`; returns the record the cache keeps beside it (stages.embedded.MARKER)."""
    _build(kind).save_pretrained(directory)
    # transformers writes a model only on rank 0 of an initialized torch.distributed group: built in another rank (a
    # parallel render's worker), the text encoders' directories came out empty, and that build must not be cached.
    if empty := sorted(p.name for p in directory.iterdir() if p.is_dir() and not any(p.iterdir())):
        raise RuntimeError(f"building {MODEL_IDS[kind]} saved nothing for {', '.join(empty)}")
    return {
        "model_id": MODEL_IDS[kind],
        "kind": kind,
        "seed": SEED,
        "recipe_version": RECIPE_VERSION,
        "versions": {name: version(name) for name in LIBRARIES},
        "weights_sha256": weights_fingerprint(directory),
    }


def _build(kind: str) -> DiffusionPipeline:
    # fork_rng: seeding for the build must not move the caller's global RNG.
    with _BUILD_LOCK, torch.random.fork_rng(devices=[]):
        # The placeholders' types again: what is built is a DiffusionPipeline.
        builders = {
            "unet": _build_unet_pipeline,
            "dit": _build_dit_pipeline,
            "sdxl": _build_sdxl_pipeline,
            "flux": _build_flux_pipeline,
            "qwen": _build_qwen_pipeline,
            "pixart": _build_pixart_pipeline,
            "wan": _build_wan_pipeline,
        }
        return cast(DiffusionPipeline, builders[kind]())


def _seeded(component_index: int) -> None:
    """Seed before each component, so each one's weights depend on SEED and its own recipe only."""
    torch.manual_seed(SEED + component_index)


# The tiny UNet both UNet families share: two levels, one with cross-attention.
_TINY_UNET: dict[str, Any] = {
    "sample_size": 8,  # latent side of the default 64x64 image
    "in_channels": 4,
    "out_channels": 4,
    "down_block_types": ("DownBlock2D", "CrossAttnDownBlock2D"),
    "up_block_types": ("CrossAttnUpBlock2D", "UpBlock2D"),
    "block_out_channels": (32, 64),
    "layers_per_block": 2,
}


def _sd_scheduler() -> EulerDiscreteScheduler:
    """Stable Diffusion 1.x's own scheduler settings (SDXL's are the same)."""
    return EulerDiscreteScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        steps_offset=1,
        timestep_spacing="leading",
    )


def _build_unet_pipeline() -> StableDiffusionPipeline:
    _seeded(0)
    unet = UNet2DConditionModel(
        **_TINY_UNET,
        cross_attention_dim=32,
        norm_num_groups=8,
    )
    _seeded(1)
    vae = _tiny_vae(latent_channels=4, scaling_factor=0.18215)
    _seeded(2)
    text_encoder = CLIPTextModel(_clip_config())
    scheduler = _sd_scheduler()
    return StableDiffusionPipeline(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=_byte_level_clip_tokenizer(),
        unet=unet,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )


def _build_dit_pipeline() -> StableDiffusion3Pipeline:
    clip_width, clip_projection = 32, 32
    _seeded(0)
    transformer = SD3Transformer2DModel(
        sample_size=8,  # latent side of the default 64x64 image
        patch_size=2,
        in_channels=16,
        out_channels=16,
        num_layers=2,
        attention_head_dim=8,
        num_attention_heads=4,
        caption_projection_dim=32,
        joint_attention_dim=2 * clip_width,  # the two CLIP hidden states side by side (T5 would be padded to it)
        pooled_projection_dim=2 * clip_projection,  # the two pooled CLIP projections, concatenated
        pos_embed_max_size=32,  # up to 32x32 patches: images up to 512x512
    )
    _seeded(1)
    vae = _tiny_vae(
        latent_channels=16,  # what the SD3 transformer takes
        use_quant_conv=False,
        use_post_quant_conv=False,
        shift_factor=0.0609,  # the SD3 VAE's latent normalisation
        scaling_factor=1.5035,
    )
    _seeded(2)
    text_encoder = CLIPTextModelWithProjection(_clip_config(projection_dim=clip_projection))
    _seeded(3)
    text_encoder_2 = CLIPTextModelWithProjection(_clip_config(projection_dim=clip_projection))
    return StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),  # SD3's own shift
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=_byte_level_clip_tokenizer(),
        text_encoder_2=text_encoder_2,
        tokenizer_2=_byte_level_clip_tokenizer(),
        text_encoder_3=None,
        tokenizer_3=None,
    )


def _build_sdxl_pipeline() -> StableDiffusionXLPipeline:
    """diffusers' own SDXL fast-test components (tests/pipelines/stable_diffusion_xl), with this module's VAE and
    tokenizers: the UNet takes both encoders' hidden states side by side (cross-attention 2 x 32) and, added to its
    time embedding, the second encoder's pooled projection and the six size/crop ids (6 x 8 + 32 = 80)."""
    clip_width, clip_projection, time_ids_width = 32, 32, 8
    _seeded(0)
    unet = UNet2DConditionModel(
        **_TINY_UNET,
        attention_head_dim=(2, 4),
        use_linear_projection=True,
        addition_embed_type="text_time",
        addition_time_embed_dim=time_ids_width,
        transformer_layers_per_block=(1, 2),
        projection_class_embeddings_input_dim=6 * time_ids_width + clip_projection,
        cross_attention_dim=2 * clip_width,
        norm_num_groups=8,
    )
    _seeded(1)
    # SDXL's VAE scale; no forced float32 upcast (the tiny VAE is exact enough in bfloat16, and an upcast would
    # change the shared VAE's dtype while an edit is prepared).
    vae = _tiny_vae(latent_channels=4, scaling_factor=0.13025, force_upcast=False)
    _seeded(2)
    text_encoder = CLIPTextModel(_clip_config())
    _seeded(3)
    text_encoder_2 = CLIPTextModelWithProjection(_clip_config(projection_dim=clip_projection))
    scheduler = _sd_scheduler()  # SDXL keeps SD 1.x's
    return StableDiffusionXLPipeline(
        vae=vae,
        text_encoder=text_encoder,
        text_encoder_2=text_encoder_2,
        tokenizer=_byte_level_clip_tokenizer(),
        tokenizer_2=_byte_level_clip_tokenizer(),
        unet=unet,
        scheduler=scheduler,
        force_zeros_for_empty_prompt=True,  # SDXL's default: no negative prompt means zero negative embeddings
        add_watermarker=False,
    )


def _build_flux_pipeline() -> FluxPipeline:
    """diffusers' FLUX fast-test transformer (one double and one single block, 2 heads of 16, RoPE axes 4+6+6) with the
    guidance embedding of FLUX.1-dev, on a four-level VAE whose 4 latent channels pack 2x2 into 16 per token."""
    clip_width, t5_width = 32, 32
    _seeded(0)
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,  # 4 latent channels x 2 x 2 packed
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=t5_width,
        pooled_projection_dim=clip_width,  # CLIP's pooled output
        guidance_embeds=True,
        axes_dims_rope=(4, 6, 6),
    )
    _seeded(1)
    vae = _tiny_vae(
        latent_channels=4,
        use_quant_conv=False,
        use_post_quant_conv=False,
        shift_factor=0.0609,
        scaling_factor=1.5035,
    )
    _seeded(2)
    text_encoder = CLIPTextModel(_clip_config())
    _seeded(3)
    t5_tokenizer = _byte_level_t5_tokenizer()
    text_encoder_2 = _tiny_t5(t5_tokenizer, t5_width)
    return FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=_byte_level_clip_tokenizer(),
        text_encoder_2=text_encoder_2,
        tokenizer_2=t5_tokenizer,
        transformer=transformer,
    )


def _build_qwen_pipeline() -> QwenImagePipeline:
    """diffusers' Qwen-Image fast-test shapes (a 2-layer MMDiT, 2 heads of 16, RoPE axes 8+4+4; a Qwen2.5-VL text encoder
    with multimodal RoPE) widened to a 32-wide text encoder with grouped-query attention like the real one, and a
    four-level causal-3-D VAE that downsamples 8x like the real one (4 latent channels packed 2x2 into 16 per token)."""
    text_width = 32
    _seeded(0)
    transformer = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=16,  # 4 latent channels x 2 x 2 packed
        out_channels=4,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=text_width,
        guidance_embeds=False,  # Qwen-Image is not guidance-distilled: true CFG only
        axes_dims_rope=(8, 4, 4),
    )
    _seeded(1)
    vae = AutoencoderKLQwenImage(
        base_dim=24,
        z_dim=4,
        dim_mult=[1, 2, 4, 4],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],  # the real VAE's: 8x spatially, 4x in time
        latents_mean=[-0.7571, -0.7089, -0.9113, 0.1075],  # the real VAE's first four channels' statistics
        latents_std=[2.8184, 1.4541, 2.3275, 2.6558],
    )
    _seeded(2)
    tokenizer = _qwen_tokenizer()
    text_encoder = Qwen2_5_VLForConditionalGeneration(_qwen_vl_config(len(tokenizer), text_width, tokenizer))
    return QwenImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(
            # Qwen-Image's own schedule: the resolution shift (exponential), its range, and the terminal sigma.
            base_image_seq_len=256,
            max_image_seq_len=8192,
            base_shift=0.5,
            max_shift=0.9,
            shift=1.0,
            shift_terminal=0.02,
            time_shift_type="exponential",
            use_dynamic_shifting=True,
        ),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
    )


#: QwenImagePipeline's chat template (`prompt_template_encode`): it drops the first 34 tokens of the encoded text, the
#: system prefix as the real tokenizer splits it. Each of these words is one token here, so the prefix is 34 too.
_QWEN_TEMPLATE_WORDS = (
    "system user assistant Describe Ġthe Ġimage Ġby Ġdetailing Ġcolor Ġshape Ġsize Ġtexture Ġquantity Ġtext "
    "Ġspatial Ġrelationships Ġof Ġobjects Ġand Ġbackground"
).split()
_QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def _qwen_tokenizer() -> Qwen2Tokenizer:
    """Qwen2's tokenizer (its pre-tokenizer and byte-level BPE) over the 256 byte symbols plus the chat template's
    words, each merged left to right: any text tokenizes, and the template's system prefix is 34 tokens."""
    from tokenizers import pre_tokenizers

    vocab = {symbol: i for i, symbol in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    merges: list[tuple[str, str]] = []
    for word in _QWEN_TEMPLATE_WORDS:
        for end in range(2, len(word) + 1):
            left, right = word[: end - 1], word[end - 1]
            if word[:end] not in vocab:
                merges.append((left, right))
                vocab[word[:end]] = len(vocab)
    for special in _QWEN_SPECIALS:
        vocab[special] = len(vocab)
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges, model_max_length=32768)
    tokenizer.add_special_tokens({"additional_special_tokens": list(_QWEN_SPECIALS[1:])})
    return tokenizer


def _qwen_vl_config(vocab_size: int, width: int, tokenizer: Qwen2Tokenizer) -> Qwen2_5_VLConfig:
    """A 2-layer Qwen2.5-VL: 4 query heads of 8 sharing 2 key/value heads, multimodal RoPE split 1+1+2 (time,
    height, width), a 2-block vision tower the text-to-image pipeline never calls."""
    end = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    return Qwen2_5_VLConfig(
        text_config={
            "vocab_size": vocab_size,
            "hidden_size": width,
            "intermediate_size": 37,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 4096,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [1, 1, 2]},
            "bos_token_id": end,
            "eos_token_id": tokenizer.convert_tokens_to_ids("<|im_end|>"),
            "pad_token_id": end,
        },
        vision_config={
            "depth": 2,
            "hidden_size": 16,
            "intermediate_size": 16,
            "num_heads": 2,
            "out_hidden_size": width,
            "fullatt_block_indexes": [1],
        },
        # Image/video ids past the vocabulary: a text prompt never holds them.
        image_token_id=vocab_size,
        video_token_id=vocab_size + 1,
        vision_start_token_id=vocab_size + 2,
        vision_end_token_id=vocab_size + 3,
    )


def _build_pixart_pipeline() -> PixArtSigmaPipeline:
    """diffusers' PixArt fast-test transformer (2 layers, 3 heads of 8, adaLN-single, learned sigma: 8 output
    channels for 4 latent ones) on this module's four-level VAE and byte-level T5. The step engine has no family
    for it: it is the whole-request fallback's model."""
    t5_width = 32
    _seeded(0)
    transformer = PixArtTransformer2DModel(
        sample_size=8,  # latent side of the default 64x64 image
        num_layers=2,
        patch_size=2,
        attention_head_dim=8,
        num_attention_heads=3,
        caption_channels=t5_width,
        in_channels=4,
        cross_attention_dim=24,
        out_channels=8,
        attention_bias=True,
        activation_fn="gelu-approximate",
        num_embeds_ada_norm=1000,
        norm_type="ada_norm_single",
        norm_elementwise_affine=False,
        norm_eps=1e-6,
    )
    _seeded(1)
    vae = _tiny_vae(latent_channels=4, scaling_factor=0.13025)
    _seeded(2)
    tokenizer = _byte_level_t5_tokenizer()
    text_encoder = _tiny_t5(tokenizer, t5_width)
    return PixArtSigmaPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=vae,
        transformer=transformer,
        scheduler=DPMSolverMultistepScheduler(),
    )


def _build_wan_pipeline() -> WanPipeline:
    """diffusers' Wan fast-test components (tests/pipelines/wan), with a VAE 8 channels wide at its base."""
    tokenizer, text_width = _byte_level_t5_tokenizer(), 32
    _seeded(0)
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=16,
        out_channels=16,
        text_dim=text_width,
        freq_dim=256,
        ffn_dim=32,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
    )
    _seeded(1)
    vae = AutoencoderKLWan(
        base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]
    )
    _seeded(2)
    text_encoder = UMT5EncoderModel(UMT5Config(**_tiny_t5_shape(tokenizer, text_width)))  # Wan's T5 variant
    # Wan 2.1's own sampler: UniPC on flow-matching sigmas, shifted (3.0: its 480p setting).
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    return WanPipeline(
        tokenizer=tokenizer, text_encoder=text_encoder, transformer=transformer, vae=vae, scheduler=scheduler
    )


def _tiny_t5(tokenizer: PreTrainedTokenizerFast, width: int) -> T5EncoderModel:
    return T5EncoderModel(T5Config(**_tiny_t5_shape(tokenizer, width)))


def _tiny_t5_shape(tokenizer: PreTrainedTokenizerFast, width: int) -> dict[str, Any]:
    """diffusers' tiny-random-t5 shape (2 layers, 4 heads of 8) over `tokenizer`'s vocabulary."""
    return {
        "vocab_size": len(tokenizer),
        "d_model": width,
        "d_kv": 8,
        "d_ff": 37,
        "num_layers": 2,
        "num_heads": 4,
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "decoder_start_token_id": tokenizer.pad_token_id,
    }


def _byte_level_t5_tokenizer() -> PreTrainedTokenizerFast:
    """T5's special tokens (<pad> 0, </s> 1, <unk> 2, and </s> after every text) over byte-level symbols without
    merges: every UTF-8 byte one token, so any text tokenizes (the real T5's SentencePiece model is a download)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    specials = {"<pad>": 0, "</s>": 1, "<unk>": 2}
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {**specials, **{symbol: len(specials) + i for i, symbol in enumerate(alphabet)}}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", eos_token="</s>", unk_token="<unk>", model_max_length=512
    )


def _tiny_vae(**latent_layout: Any) -> AutoencoderKL:
    """Both kinds' VAE: four levels, the 8x downsampling of the real SD VAEs; the latent layout differs."""
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(32, 64, 64, 64),
        layers_per_block=1,
        norm_num_groups=8,
        **latent_layout,
    )


def byte_level_vocab() -> dict[str, int]:
    """CLIP's vocabulary layout without learned merges: 256 byte symbols, their end-of-word forms, then specials."""
    # GPT-2/CLIP byte-to-unicode table: printable bytes map to themselves, the rest to code points from 256 up.
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    unprintable = [b for b in range(256) if b not in printable]
    symbols = [chr(b) for b in printable] + [chr(256 + i) for i in range(len(unprintable))]
    tokens = symbols + [s + "</w>" for s in symbols] + ["<|startoftext|>", "<|endoftext|>"]
    return {token: index for index, token in enumerate(tokens)}


def _byte_level_clip_tokenizer() -> CLIPTokenizer:
    # No merges: every character is one token; any text tokenizes, long prompts truncate to 77.
    return CLIPTokenizer(vocab=byte_level_vocab(), merges=[], model_max_length=MAX_PROMPT_TOKENS)


def _clip_config(projection_dim: int | None = None) -> CLIPTextConfig:
    vocab = byte_level_vocab()
    extra: dict[str, Any] = {} if projection_dim is None else {"projection_dim": projection_dim}
    return CLIPTextConfig(
        vocab_size=len(vocab),
        hidden_size=32,
        intermediate_size=37,
        num_hidden_layers=5,
        num_attention_heads=4,
        max_position_embeddings=MAX_PROMPT_TOKENS,
        layer_norm_eps=1e-5,
        hidden_act="gelu",
        # The tokenizer's real ids: pooling reads the hidden state at the first end-of-text token.
        bos_token_id=vocab["<|startoftext|>"],
        eos_token_id=vocab["<|endoftext|>"],
        pad_token_id=vocab["<|endoftext|>"],
        **extra,
    )


def weights_fingerprint(directory: Path) -> str:
    """sha256 over every saved tensor (file, name, dtype, shape, bytes) in a stable order."""
    digest = hashlib.sha256()
    for path in sorted(directory.rglob("*.safetensors")):
        with safe_open(path, framework="np") as weights:
            for name in sorted(weights.keys()):
                array = weights.get_tensor(name)
                digest.update(f"{path.relative_to(directory)}:{name}:{array.dtype}:{array.shape}\n".encode())
                digest.update(array.tobytes())
    return digest.hexdigest()
