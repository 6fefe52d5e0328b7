"""Tiny random Whisper, ViT, CLIP, DINOv2 and other image-model checkpoints with their own processors, built from configs.

Each is made hard (``helpers.make_hard``) and saved with a feature extractor or image processor and,
where the family has one, a byte-level tokenizer built in memory, so that speech and vision
evaluation run through the same processor code as real checkpoints, with no download.
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers as T
from helpers import make_hard, save
from transformers.convert_slow_tokenizer import bytes_to_unicode

WHISPER_SPECIAL = ["<|endoftext|>", "<|startoftranscript|>", "<|en|>", "<|translate|>", "<|transcribe|>",
                   "<|notimestamps|>"]


def whisper_tokenizer():
    vocab = {c: i for i, c in enumerate(bytes_to_unicode().values())}
    tokenizer = T.WhisperTokenizer(vocab=vocab, merges=[])
    tokenizer.add_special_tokens({"additional_special_tokens": WHISPER_SPECIAL[1:]})
    tokenizer.set_prefix_tokens(language="en", task="transcribe", predict_timestamps=False)
    return tokenizer


def tiny_whisper(path: Path, seed: int = 0) -> Path:
    """A 2+2-layer Whisper (d=32) that reads standard 80-bin, 30 s log-mel features."""
    tokenizer = whisper_tokenizer()
    endoftext = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    config = T.WhisperConfig(
        d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
        encoder_ffn_dim=37, decoder_ffn_dim=37, num_mel_bins=80, max_source_positions=1500,
        max_target_positions=64, vocab_size=len(tokenizer), pad_token_id=endoftext, bos_token_id=endoftext,
        eos_token_id=endoftext, decoder_start_token_id=tokenizer.convert_tokens_to_ids("<|startoftranscript|>"),
    )
    torch.manual_seed(seed)
    model = make_hard(T.WhisperForConditionalGeneration(config), seed)
    save(model, path, tokenizer)
    T.WhisperFeatureExtractor(feature_size=80).save_pretrained(path)
    return path


def tiny_vit(path: Path, labels: tuple[str, ...] = ("circle", "square", "triangle"), seed: int = 0) -> Path:
    """A 2-layer ViT classifier on 16×16 images whose classes are ``labels``."""
    config = T.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
                         image_size=16, patch_size=8, id2label=dict(enumerate(labels)),
                         label2id={label: i for i, label in enumerate(labels)})
    torch.manual_seed(seed)
    save(make_hard(T.ViTForImageClassification(config), seed), path)
    T.ViTImageProcessor(size={"height": 16, "width": 16}).save_pretrained(path)
    return path


def tiny_image_model(path: Path, model_class, config, seed: int = 0) -> Path:
    """A tiny vision model on 16×16 images (``config`` gets the bundled images' classes as labels)."""
    labels = ("circle", "square", "triangle")
    config.id2label, config.label2id = dict(enumerate(labels)), {label: i for i, label in enumerate(labels)}
    torch.manual_seed(seed)
    save(make_hard(model_class(config), seed), path)
    T.ViTImageProcessor(size={"height": 16, "width": 16}).save_pretrained(path)
    return path


def clip_tokenizer():
    chars = list(bytes_to_unicode().values())
    vocab = {c: i for i, c in enumerate(chars)}
    vocab.update({c + "</w>": len(chars) + i for i, c in enumerate(chars)})
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    return T.CLIPTokenizer(vocab=vocab, merges=[])


def tiny_clip(path: Path, seed: int = 0) -> Path:
    """A CLIP with 2-layer text and vision towers (d=32) on 16×16 images."""
    tokenizer = clip_tokenizer()
    bos, eos = tokenizer.convert_tokens_to_ids("<|startoftext|>"), tokenizer.convert_tokens_to_ids("<|endoftext|>")
    text = dict(hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
                vocab_size=len(tokenizer), max_position_embeddings=32, bos_token_id=bos, eos_token_id=eos,
                pad_token_id=eos)
    vision = dict(hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4, image_size=16,
                  patch_size=8)
    config = T.CLIPConfig(text_config=text, vision_config=vision, projection_dim=24)
    torch.manual_seed(seed)
    save(make_hard(T.CLIPModel(config), seed), path, tokenizer)
    T.CLIPImageProcessor(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16}).save_pretrained(path)
    return path


def tiny_dinov2_hub(path: Path, seed: int = 0) -> Path:
    """A 2-layer DINOv2 backbone (no head) in the hub's layout, scaled down by its patch: the hub's
    ``facebook/dinov2-*`` configs say ``image_size`` 518 with 14-pixel patches (37x37 positions),
    and their processor (``BitImageProcessor``) resizes the shorter side to 256 and crops 224
    (16x16 patches). Here: image_size 74 with 2-pixel patches (37x37), shorter side to 36, crop 32
    (16x16), so the model resamples its position table for every image, as the hub's does."""
    config = T.Dinov2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, image_size=74, patch_size=2,
                            layerscale_value=0.3)
    torch.manual_seed(seed)
    save(make_hard(T.Dinov2Model(config), seed), path)
    processor = T.BitImageProcessorPil(size={"shortest_edge": 36}, crop_size={"height": 32, "width": 32},
                                       do_center_crop=True, resample=3, image_mean=[0.485, 0.456, 0.406],
                                       image_std=[0.229, 0.224, 0.225])
    processor.save_pretrained(path)
    return path
