"""Real architectures exported from PyTorch, differentiated by revgraph and compared with torch.autograd.

Models come from ``transformers`` with tiny random configurations (built from configs: no downloads) and from
``torch.nn``; each is exported with the dynamo exporter (``optimize=False``: with ``optimize=True`` it folds
BatchNorm into convolution weights and pre-transposes linear weights, so the initializers are other tensors than
the parameters) or the legacy TorchScript exporter (``do_constant_folding=False`` for the same reason). The
gradient of ``sum(u * output)`` for a random ``u`` is compared, parameter by parameter, with PyTorch autograd:
norm-relative error, and absolute error for a parameter whose gradient is zero.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnx
import torch
from torch.overrides import TorchFunctionMode

import revgraph as rg
from revgraph.errors import RevgraphError


@dataclass(frozen=True)
class Case:
    """A model to export: ``build()`` returns ``(module, example inputs)``; the module returns one tensor."""

    name: str
    build: Callable[[], tuple[torch.nn.Module, tuple]]


class _First(torch.nn.Module):
    """The first output of a transformers model (``last_hidden_state``, ``logits``) as a plain tensor."""

    def __init__(self, model: torch.nn.Module, key: str, names: tuple[str, ...] = ()):
        super().__init__()
        self.m, self.key, self.names = model, key, names

    def forward(self, *args):
        out = self.m(**dict(zip(self.names, args, strict=True))) if self.names else self.m(*args)
        return out[self.key] if isinstance(out, dict) or hasattr(out, "keys") else out[0]


def _tf(cls_name: str, config_name: str, key: str, inputs: Callable[[], tuple], names: tuple[str, ...] = (),
        attn: str = "sdpa", **config) -> Callable:
    def build():
        import transformers as tf

        torch.manual_seed(0)
        cfg = getattr(tf, config_name)(**config)
        # PyTorch's SDPA: exported at opset 23 as ONNX Attention, decomposed at older opsets
        cls = getattr(tf, cls_name)
        if attn != "sdpa" or getattr(cls, "_supports_sdpa", False):  # convolutional models have no attention
            cfg._attn_implementation = attn
        model = cls(cfg).eval()
        return _First(model, key, names), inputs()

    return build


def _ids(vocab: int = 64, shape=(2, 7)) -> Callable[[], tuple]:
    return lambda: (torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(1)),)


def _image(shape=(1, 3, 32, 32)) -> Callable[[], tuple]:
    return lambda: (torch.randn(*shape, generator=torch.Generator().manual_seed(1)),)


class _RMSNormMLP(torch.nn.Module):
    """Linear -> nn.RMSNorm -> SiLU -> Linear: RMSNormalization at opset 23."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.norm, self.b = torch.nn.Linear(6, 8), torch.nn.RMSNorm(8, eps=1e-5), torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.b(torch.nn.functional.silu(self.norm(self.a(x))))


class _LSTM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lstm = torch.nn.LSTM(5, 8, num_layers=2, batch_first=True)
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.lstm(x)[0])


TEXT = {"vocab_size": 64, "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 32,
        "max_position_embeddings": 32}
CASES = [
    Case("bert", _tf("BertModel", "BertConfig", "last_hidden_state", _ids(), **TEXT)),
    Case("gpt2", _tf("GPT2Model", "GPT2Config", "last_hidden_state", _ids(),
                     vocab_size=64, n_embd=16, n_layer=2, n_head=2, n_positions=32)),
    Case("llama", _tf("LlamaModel", "LlamaConfig", "last_hidden_state", _ids(), num_key_value_heads=1, **{
        **TEXT, "num_attention_heads": 4})),
    Case("bart", _tf("BartModel", "BartConfig", "last_hidden_state", _ids(), vocab_size=64, d_model=16,
                     encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
                     encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32)),
    Case("whisper", _tf("WhisperModel", "WhisperConfig", "last_hidden_state",
                        lambda: (torch.randn(1, 16, 20, generator=torch.Generator().manual_seed(1)),
                                 torch.tensor([[1, 2, 3]])), ("input_features", "decoder_input_ids"),
                        vocab_size=64, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
                        num_mel_bins=16, d_model=16, encoder_layers=1, decoder_layers=1,
                        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
                        max_source_positions=10, max_target_positions=16)),
    Case("vit", _tf("ViTModel", "ViTConfig", "last_hidden_state", _image((1, 3, 16, 16)), hidden_size=16,
                    num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, image_size=16, patch_size=4)),
    Case("resnet", _tf("ResNetModel", "ResNetConfig", "last_hidden_state", _image(), embedding_size=8,
                       hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic")),
    Case("mobilenet_v2", _tf("MobileNetV2Model", "MobileNetV2Config", "last_hidden_state", _image(),
                             depth_multiplier=0.25, image_size=32)),
    Case("efficientnet", _tf("EfficientNetModel", "EfficientNetConfig", "last_hidden_state", _image(),
                             width_coefficient=0.1, depth_coefficient=0.1, image_size=32, hidden_dim=128)),
    Case("convnext", _tf("ConvNextModel", "ConvNextConfig", "last_hidden_state", _image(), hidden_sizes=[8, 16],
                         depths=[1, 1], num_stages=2)),
    Case("swin", _tf("SwinModel", "SwinConfig", "last_hidden_state", _image(), image_size=32, patch_size=4,
                     embed_dim=8, depths=[1, 1], num_heads=[1, 2], window_size=2)),
    Case("lstm", lambda: (_LSTM().eval(), (torch.randn(2, 6, 5, generator=torch.Generator().manual_seed(1)),))),
    Case("rmsnorm_mlp",
         lambda: (_RMSNormMLP().eval(), (torch.randn(4, 6, generator=torch.Generator().manual_seed(1)),))),
]
BY_NAME = {c.name: c for c in CASES}


# The wide sweep (issue 15, section 6): one tiny random configuration per transformers architecture, the first
# output of the base model (last_hidden_state), inputs as the model's own processor would shape them.
def _seq2seq(vocab: int = 64) -> Callable[[], tuple]:
    return lambda: (_ids(vocab)()[0], _ids(vocab, (2, 5))()[0].flip(1))


def _audio(samples: int = 400) -> Callable[[], tuple]:
    return lambda: (torch.randn(2, samples, generator=torch.Generator().manual_seed(1)),)


def _mel(bins: int, frames: int) -> Callable[[], tuple]:
    return lambda: (torch.randn(2, frames, bins, generator=torch.Generator().manual_seed(1)),)


# Batches of two: with one image, the gradient flowing back from `flatten(2).transpose(1, 2)` into a BatchNorm has
# strides (C, 1, W*C, C), and PyTorch 2.13's CPU batch_norm backward gets the weight and bias gradients wrong for it
# (LeViT, CvT: torch.autograd disagrees with torch's own finite differences)
IMAGE, IMAGE16 = _image((2, 3, 32, 32)), _image((2, 3, 16, 16))


H = "last_hidden_state"
S2S = ("input_ids", "decoder_input_ids")
TOK = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
DEC = {**TEXT, **TOK}  # decoders whose default special tokens lie outside the tiny vocabulary
KV = {**DEC, "num_attention_heads": 4, "num_key_value_heads": 2}  # grouped-query attention, head size 4
ENC_DEC = {"vocab_size": 64, "d_model": 16, "encoder_layers": 1, "decoder_layers": 1, "encoder_attention_heads": 2,
           "decoder_attention_heads": 2, "encoder_ffn_dim": 32, "decoder_ffn_dim": 32, "max_position_embeddings": 32,
           "decoder_start_token_id": 2, **TOK}
T5 = {"vocab_size": 64, "d_model": 16, "d_kv": 8, "d_ff": 32, "num_layers": 1, "num_decoder_layers": 1, "num_heads": 2,
      "relative_attention_num_buckets": 8, "relative_attention_max_distance": 16, "decoder_start_token_id": 0,
      "pad_token_id": 0, "eos_token_id": 1}
WAV = {"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 32,
       "conv_dim": (8, 8), "conv_stride": (5, 2), "conv_kernel": (10, 3), "num_conv_pos_embeddings": 4,
       "num_conv_pos_embedding_groups": 2}
VIT = {"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 32, "image_size": 16,
       "patch_size": 4}
STAGES = {"hidden_sizes": [8, 16], "depths": [1, 1]}

SWEEP = [
    # text encoders
    Case("bert", _tf("BertModel", "BertConfig", H, _ids(), **TEXT)),
    Case("roberta", _tf("RobertaModel", "RobertaConfig", H, _ids(), **TEXT)),
    Case("xlm_roberta", _tf("XLMRobertaModel", "XLMRobertaConfig", H, _ids(), **TEXT)),
    Case("distilbert", _tf("DistilBertModel", "DistilBertConfig", H, _ids(), vocab_size=64, dim=16, n_layers=2,
                           n_heads=2, hidden_dim=32, max_position_embeddings=32)),
    Case("albert", _tf("AlbertModel", "AlbertConfig", H, _ids(), embedding_size=8, **TEXT)),
    Case("electra", _tf("ElectraModel", "ElectraConfig", H, _ids(), embedding_size=8, **TEXT)),
    Case("deberta", _tf("DebertaModel", "DebertaConfig", H, _ids(), relative_attention=True,
                        pos_att_type=["c2p", "p2c"], max_relative_positions=8, **TEXT)),
    Case("deberta_v2", _tf("DebertaV2Model", "DebertaV2Config", H, _ids(), relative_attention=True,
                           pos_att_type=["c2p", "p2c"], position_buckets=4, norm_rel_ebd="layer_norm",
                           share_att_key=True, position_biased_input=False, **TEXT)),
    Case("mpnet", _tf("MPNetModel", "MPNetConfig", H, _ids(), **TEXT)),
    Case("funnel", _tf("FunnelModel", "FunnelConfig", H, _ids(shape=(2, 8)), vocab_size=64, block_sizes=[1, 1],
                       num_decoder_layers=1, d_model=16, n_head=2, d_head=8, d_inner=32)),
    Case("roformer", _tf("RoFormerModel", "RoFormerConfig", H, _ids(), **TEXT)),
    Case("squeezebert", _tf("SqueezeBertModel", "SqueezeBertConfig", H, _ids(), embedding_size=16, **TEXT)),
    Case("convbert", _tf("ConvBertModel", "ConvBertConfig", H, _ids(), embedding_size=16, conv_kernel_size=3,
                         **TEXT)),
    Case("ernie", _tf("ErnieModel", "ErnieConfig", H, _ids(), **TEXT)),
    Case("megatron_bert", _tf("MegatronBertModel", "MegatronBertConfig", H, _ids(), **TEXT)),
    Case("mobilebert", _tf("MobileBertModel", "MobileBertConfig", H, _ids(), embedding_size=8,
                           intra_bottleneck_size=16, true_hidden_size=16, num_feedforward_networks=2, **TEXT)),
    Case("modernbert", _tf("ModernBertModel", "ModernBertConfig", H, _ids(), vocab_size=64, hidden_size=16,
                           intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                           max_position_embeddings=32, global_attn_every_n_layers=2, local_attention=4,
                           cls_token_id=3, sep_token_id=4, **TOK)),
    Case("data2vec_text", _tf("Data2VecTextModel", "Data2VecTextConfig", H, _ids(), **TEXT)),
    Case("esm", _tf("EsmModel", "EsmConfig", H, _ids(), position_embedding_type="rotary", pad_token_id=1,
                    mask_token_id=2, **TEXT)),
    Case("big_bird", _tf("BigBirdModel", "BigBirdConfig", H, _ids(), attention_type="original_full", **TEXT)),
    Case("rembert", _tf("RemBertModel", "RemBertConfig", H, _ids(), input_embedding_size=8,
                        output_embedding_size=8, **TEXT)),
    Case("nystromformer", _tf("NystromformerModel", "NystromformerConfig", H, _ids(shape=(2, 8)), num_landmarks=4,
                              segment_means_seq_len=8, conv_kernel_size=3, **TEXT)),
    Case("xlm", _tf("XLMModel", "XLMConfig", H, _ids(), vocab_size=64, emb_dim=16, n_layers=2, n_heads=2,
                    max_position_embeddings=32)),
    Case("luke", _tf("LukeModel", "LukeConfig", H, _ids(), entity_vocab_size=16, entity_emb_size=8, **TEXT)),
    Case("longformer", _tf("LongformerModel", "LongformerConfig", H, _ids(shape=(2, 8)), attention_window=4,
                           **TEXT)),
    # (canine: its float64 attention mask is (1 - mask.float()) * finfo(float64).min in float32, inf * 0: NaN)
    # decoders
    Case("gpt2", _tf("GPT2Model", "GPT2Config", H, _ids(), vocab_size=64, n_embd=16, n_layer=2, n_head=2,
                     n_positions=32)),
    Case("openai_gpt", _tf("OpenAIGPTModel", "OpenAIGPTConfig", H, _ids(), vocab_size=64, n_embd=16, n_layer=2,
                           n_head=2, n_positions=32)),
    Case("gpt_neo", _tf("GPTNeoModel", "GPTNeoConfig", H, _ids(), vocab_size=64, max_position_embeddings=32,
                        hidden_size=16, num_layers=2, attention_types=[[["global", "local"], 1]], num_heads=2,
                        intermediate_size=32, window_size=4)),
    Case("gpt_neox", _tf("GPTNeoXModel", "GPTNeoXConfig", H, _ids(), **DEC)),
    Case("gptj", _tf("GPTJModel", "GPTJConfig", H, _ids(), vocab_size=64, n_positions=32, n_embd=16, n_layer=2,
                     n_head=2, rotary_dim=4, n_inner=32)),
    Case("codegen", _tf("CodeGenModel", "CodeGenConfig", H, _ids(), vocab_size=64, n_positions=32, n_ctx=32,
                        n_embd=16, n_layer=2, n_head=4, rotary_dim=2, n_inner=32)),
    Case("gpt_bigcode", _tf("GPTBigCodeModel", "GPTBigCodeConfig", H, _ids(), vocab_size=64, n_positions=32,
                            n_embd=16, n_layer=2, n_head=2, n_inner=32, multi_query=True)),
    Case("opt", _tf("OPTModel", "OPTConfig", H, _ids(), vocab_size=64, hidden_size=16, num_hidden_layers=2,
                    ffn_dim=32, num_attention_heads=2, max_position_embeddings=32, word_embed_proj_dim=16)),
    Case("bloom", _tf("BloomModel", "BloomConfig", H, _ids(), vocab_size=64, hidden_size=16, n_layer=2,
                      n_head=2)),
    Case("falcon", _tf("FalconModel", "FalconConfig", H, _ids(), vocab_size=64, hidden_size=16,
                       num_hidden_layers=2, num_attention_heads=2, **TOK)),
    Case("mpt", _tf("MptModel", "MptConfig", H, _ids(), vocab_size=64, d_model=16, n_heads=2, n_layers=2,
                    expansion_ratio=2, max_seq_len=32)),
    Case("phi", _tf("PhiModel", "PhiConfig", H, _ids(), partial_rotary_factor=0.5, **DEC)),
    Case("phi3", _tf("Phi3Model", "Phi3Config", H, _ids(), **KV)),
    Case("llama", _tf("LlamaModel", "LlamaConfig", H, _ids(), **KV)),
    Case("mistral", _tf("MistralModel", "MistralConfig", H, _ids(), sliding_window=4, **KV)),
    # mixture of experts: transformers' default grouped_mm is a custom operator no exporter knows; batched_mm is
    # plain gathers and batched matmuls
    Case("mixtral", _tf("MixtralModel", "MixtralConfig", H, _ids(), num_local_experts=4, num_experts_per_tok=2,
                        experts_implementation="batched_mm", **KV)),
    Case("qwen2_moe", _tf("Qwen2MoeModel", "Qwen2MoeConfig", H, _ids(), num_experts=4, num_experts_per_tok=2,
                          moe_intermediate_size=16, shared_expert_intermediate_size=32,
                          experts_implementation="batched_mm", **KV)),
    Case("qwen2", _tf("Qwen2Model", "Qwen2Config", H, _ids(), **KV)),
    Case("qwen3", _tf("Qwen3Model", "Qwen3Config", H, _ids(), head_dim=4, **KV)),
    Case("gemma", _tf("GemmaModel", "GemmaConfig", H, _ids(), head_dim=4, **KV)),
    Case("gemma2", _tf("Gemma2Model", "Gemma2Config", H, _ids(), head_dim=4, sliding_window=4,
                       query_pre_attn_scalar=4, **KV)),
    Case("gemma3_text", _tf("Gemma3TextModel", "Gemma3TextConfig", H, _ids(), head_dim=4, sliding_window=4,
                            query_pre_attn_scalar=4, **KV)),
    Case("stablelm", _tf("StableLmModel", "StableLmConfig", H, _ids(), **KV)),
    Case("starcoder2", _tf("Starcoder2Model", "Starcoder2Config", H, _ids(), **KV)),
    Case("olmo", _tf("OlmoModel", "OlmoConfig", H, _ids(), **KV)),
    Case("olmo2", _tf("Olmo2Model", "Olmo2Config", H, _ids(), **KV)),
    Case("cohere", _tf("CohereModel", "CohereConfig", H, _ids(), **KV)),
    Case("granite", _tf("GraniteModel", "GraniteConfig", H, _ids(), residual_multiplier=0.5,
                        embedding_multiplier=2.0, attention_multiplier=0.3, **KV)),
    Case("persimmon", _tf("PersimmonModel", "PersimmonConfig", H, _ids(), **DEC)),
    Case("biogpt", _tf("BioGptModel", "BioGptConfig", H, _ids(), **DEC)),
    # (xglm: its eager attention clamps with torch.full((), finfo(float64).min) in the default float32: overflow)
    Case("mamba", _tf("MambaModel", "MambaConfig", H, _ids(), vocab_size=64, hidden_size=16, state_size=4,
                      num_hidden_layers=2, conv_kernel=4, time_step_rank=4, **TOK)),
    # encoder-decoders. T5s, BEiTs and Swin (below) with eager attention: with SDPA (and their relative position
    # bias as its float mask) the dynamo exporter fails to decompose its own graph, "Cannot view a tensor with shape
    # [2, 7, 2, 8] and strides (112, 8, 56, 1) as a tensor with shape (2, 7, 16)" at the reshape after attention
    Case("t5", _tf("T5Model", "T5Config", H, _seq2seq(), S2S, attn="eager", **T5)),
    Case("mt5", _tf("MT5Model", "MT5Config", H, _seq2seq(), S2S, attn="eager", **T5)),
    Case("umt5", _tf("UMT5Model", "UMT5Config", H, _seq2seq(), S2S, attn="eager", **T5)),
    Case("bart", _tf("BartModel", "BartConfig", H, _seq2seq(), S2S, **ENC_DEC)),
    Case("mbart", _tf("MBartModel", "MBartConfig", H, _seq2seq(), S2S, **ENC_DEC)),
    Case("plbart", _tf("PLBartModel", "PLBartConfig", H, _seq2seq(), S2S, **ENC_DEC)),
    Case("pegasus", _tf("PegasusModel", "PegasusConfig", H, _seq2seq(), S2S, **ENC_DEC)),
    Case("marian", _tf("MarianModel", "MarianConfig", H, _seq2seq(), S2S, **ENC_DEC)),
    Case("blenderbot", _tf("BlenderbotModel", "BlenderbotConfig", H, _seq2seq(), S2S, **ENC_DEC)),
    Case("blenderbot_small", _tf("BlenderbotSmallModel", "BlenderbotSmallConfig", H, _seq2seq(), S2S, **ENC_DEC)),
    Case("m2m100", _tf("M2M100Model", "M2M100Config", H, _seq2seq(), S2S, **ENC_DEC)),
    # vision
    Case("vit", _tf("ViTModel", "ViTConfig", H, IMAGE16, **VIT)),
    Case("deit", _tf("DeiTModel", "DeiTConfig", H, IMAGE16, **VIT)),
    Case("beit", _tf("BeitModel", "BeitConfig", H, IMAGE16, attn="eager",
                     use_relative_position_bias=True, **VIT)),
    Case("data2vec_vision", _tf("Data2VecVisionModel", "Data2VecVisionConfig", H, IMAGE16,
                                attn="eager", use_relative_position_bias=True, **VIT)),
    Case("vit_msn", _tf("ViTMSNModel", "ViTMSNConfig", H, IMAGE16, **VIT)),
    Case("dinov2", _tf("Dinov2Model", "Dinov2Config", H, IMAGE16, **{
        **VIT, "intermediate_size": None}, mlp_ratio=2)),
    Case("dinov2_with_registers", _tf("Dinov2WithRegistersModel", "Dinov2WithRegistersConfig", H,
                                      IMAGE16, num_register_tokens=2, mlp_ratio=2, **{
                                          **VIT, "intermediate_size": None})),
    Case("yolos", _tf("YolosModel", "YolosConfig", H, IMAGE16, num_detection_tokens=3, **{
        **VIT, "image_size": [16, 16]})),
    Case("clip_vision", _tf("CLIPVisionModel", "CLIPVisionConfig", H, IMAGE16, **VIT)),
    Case("siglip_vision", _tf("SiglipVisionModel", "SiglipVisionConfig", H, IMAGE16, **VIT)),
    Case("swin", _tf("SwinModel", "SwinConfig", H, IMAGE, attn="eager", image_size=32, patch_size=4, embed_dim=8,
                     depths=[1, 1], num_heads=[1, 2], window_size=2)),
    Case("swinv2", _tf("Swinv2Model", "Swinv2Config", H, IMAGE, image_size=32, patch_size=4, embed_dim=8,
                       depths=[1, 1], num_heads=[1, 2], window_size=2)),
    Case("focalnet", _tf("FocalNetModel", "FocalNetConfig", H, IMAGE, embed_dim=8, depths=[1, 1],
                         hidden_sizes=[16, 32], focal_levels=[2, 2], focal_windows=[3, 3])),
    Case("convnext", _tf("ConvNextModel", "ConvNextConfig", H, IMAGE, num_stages=2, **STAGES)),
    Case("convnextv2", _tf("ConvNextV2Model", "ConvNextV2Config", H, IMAGE, num_stages=2, **STAGES)),
    Case("resnet", _tf("ResNetModel", "ResNetConfig", H, IMAGE, embedding_size=8, layer_type="basic",
                       **STAGES)),
    Case("regnet", _tf("RegNetModel", "RegNetConfig", H, IMAGE, embedding_size=8, groups_width=8, **STAGES)),
    Case("bit", _tf("BitModel", "BitConfig", H, IMAGE, embedding_size=8, num_groups=4, **STAGES)),
    Case("mobilenet_v1", _tf("MobileNetV1Model", "MobileNetV1Config", H, IMAGE, depth_multiplier=0.25,
                             image_size=32)),
    Case("mobilenet_v2", _tf("MobileNetV2Model", "MobileNetV2Config", H, IMAGE, depth_multiplier=0.25,
                             image_size=32)),
    Case("efficientnet", _tf("EfficientNetModel", "EfficientNetConfig", H, IMAGE, width_coefficient=0.1,
                             depth_coefficient=0.1, image_size=32, hidden_dim=128)),
    Case("mobilevit", _tf("MobileViTModel", "MobileViTConfig", H, IMAGE, image_size=32,
                          hidden_sizes=[16, 16, 16], neck_hidden_sizes=[8, 8, 8, 8, 8, 8, 16],
                          num_attention_heads=2, expand_ratio=2.0)),
    Case("mobilevitv2", _tf("MobileViTV2Model", "MobileViTV2Config", H, _image((2, 3, 64, 64)), image_size=64,
                            width_multiplier=0.25, n_attn_blocks=[1, 1, 1])),
    Case("segformer", _tf("SegformerModel", "SegformerConfig", H, IMAGE, num_encoder_blocks=2, sr_ratios=[2, 1],
                          patch_sizes=[7, 3], strides=[4, 2], num_attention_heads=[1, 2], mlp_ratios=[2, 2],
                          **STAGES)),
    Case("pvt", _tf("PvtModel", "PvtConfig", H, IMAGE, image_size=32, num_encoder_blocks=2,
                    sequence_reduction_ratios=[2, 1], patch_sizes=[4, 2], strides=[4, 2], num_attention_heads=[1, 2],
                    mlp_ratios=[2, 2], **STAGES)),
    Case("pvt_v2", _tf("PvtV2Model", "PvtV2Config", H, IMAGE, image_size=32, num_encoder_blocks=2,
                       sr_ratios=[2, 1], patch_sizes=[7, 3], strides=[4, 2], num_attention_heads=[1, 2],
                       mlp_ratios=[2, 2], **STAGES)),
    Case("poolformer", _tf("PoolFormerModel", "PoolFormerConfig", H, IMAGE, num_encoder_blocks=2,
                           patch_sizes=[7, 3], strides=[4, 2], padding=[2, 1], mlp_ratio=2.0, **STAGES)),
    Case("cvt", _tf("CvtModel", "CvtConfig", H, IMAGE, patch_sizes=[7, 3], patch_stride=[4, 2],
                    patch_padding=[2, 1], embed_dim=[8, 16], num_heads=[1, 2], depth=[1, 2], mlp_ratio=[2.0, 2.0],
                    attention_drop_rate=[0.0, 0.0], drop_rate=[0.0, 0.0], drop_path_rate=[0.0, 0.0],
                    qkv_bias=[True, True], cls_token=[False, True], qkv_projection_method=["dw_bn", "dw_bn"],
                    kernel_qkv=[3, 3], padding_kv=[1, 1], stride_kv=[2, 2], padding_q=[1, 1], stride_q=[1, 1])),
    Case("levit", _tf("LevitModel", "LevitConfig", H, IMAGE, image_size=32, hidden_sizes=[16, 24],
                      num_attention_heads=[2, 2], depths=[1, 1], key_dim=[4, 4], mlp_ratio=[2, 2],
                      attention_ratio=[2, 2], down_ops=[["Subsample", 4, 2, 2, 2, 2]])),
    Case("hiera", _tf("HieraModel", "HieraConfig", H, IMAGE, embed_dim=8, image_size=[32, 32], patch_size=[3, 3],
                      patch_stride=[2, 2], patch_padding=[1, 1], depths=[1, 1], num_heads=[1, 2], num_query_pool=1,
                      masked_unit_size=[4, 4], masked_unit_attention=[True, False], mlp_ratio=2.0)),
    # audio
    BY_NAME["whisper"],  # the same configuration as in CASES
    Case("speech_to_text", _tf("Speech2TextModel", "Speech2TextConfig", H,
                               lambda: (_mel(8, 16)()[0], torch.tensor([[1, 2, 3], [3, 1, 2]])),
                               ("input_features", "decoder_input_ids"), input_feat_per_channel=8, conv_channels=16,
                               max_source_positions=32, max_target_positions=32, **ENC_DEC)),
    Case("wav2vec2", _tf("Wav2Vec2Model", "Wav2Vec2Config", H, _audio(), **WAV)),
    Case("wav2vec2_layer_norm", _tf("Wav2Vec2Model", "Wav2Vec2Config", H, _audio(), feat_extract_norm="layer",
                                    do_stable_layer_norm=True, **WAV)),
    Case("hubert", _tf("HubertModel", "HubertConfig", H, _audio(), **WAV)),
    Case("wavlm", _tf("WavLMModel", "WavLMConfig", H, _audio(), num_buckets=16, max_bucket_distance=32, **WAV)),
    Case("unispeech", _tf("UniSpeechModel", "UniSpeechConfig", H, _audio(), **WAV)),
    Case("sew", _tf("SEWModel", "SEWConfig", H, _audio(), squeeze_factor=2, **WAV)),
    Case("data2vec_audio", _tf("Data2VecAudioModel", "Data2VecAudioConfig", H, _audio(), conv_pos_kernel_size=3,
                               num_conv_pos_embeddings=4, **{k: v for k, v in WAV.items()
                                                            if k != "num_conv_pos_embeddings"})),
    Case("audio_spectrogram_transformer", _tf("ASTModel", "ASTConfig", H, _mel(16, 32), hidden_size=16,
                                              num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                                              patch_size=8, frequency_stride=4, time_stride=8, max_length=32,
                                              num_mel_bins=16)),
    # multimodal towers
    Case("clip_text", _tf("CLIPTextModel", "CLIPTextConfig", H, _ids(), **DEC)),
    Case("siglip_text", _tf("SiglipTextModel", "SiglipTextConfig", H, _ids(), **DEC)),
]
SWEEP_BY_NAME = {c.name: c for c in SWEEP}
assert len(SWEEP_BY_NAME) == len(SWEEP)


class Float64(TorchFunctionMode):
    """Inside a float64 model, the float32 a model asks for (``x.float()``, ``.to(torch.float32)``,
    ``softmax(dtype=torch.float32)``: the upcasts of RMSNorm, rotary embeddings, attention) is float64 too, in torch
    and in the exported graph alike. Otherwise those parts round at float32 on both sides, by different kernels,
    and the comparison measures float32 noise (up to ~1e-6 in RMSNorm weights, and norm-relative noise on
    mathematically zero gradients) instead of revgraph. Casts of integers stay as they are: under the dynamo
    exporter they are asserted against their traced dtype."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(isinstance(a, torch.Tensor) and a.dtype == torch.float64 for a in args):
            if func is torch.Tensor.float:
                return args[0]
            if kwargs.get("dtype") is torch.float32:
                kwargs = {**kwargs, "dtype": torch.float64}
            args = tuple(torch.float64 if a is torch.float32 else a for a in args)
        return func(*args, **kwargs)


def export(case: Case, exporter: str, opset: int) -> tuple[bytes, torch.nn.Module, tuple]:
    """The ONNX bytes of ``case`` in float64 (run the module under ``Float64()`` to get the same function), with the
    module and the inputs it was exported with."""
    module, inputs = case.build()
    module = module.double()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():  # distinct values: the legacy exporter merges equal initializers (zero biases, unit scales)
        for p in module.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    inputs = tuple(t.double() if t.is_floating_point() else t for t in inputs)
    with warnings.catch_warnings(), Float64():
        warnings.simplefilter("ignore")
        if exporter == "dynamo":
            program = torch.onnx.export(module, inputs, dynamo=True, optimize=False, opset_version=opset, verbose=False)
            return _float64_statistics(program.model_proto).SerializeToString(), module.eval(), inputs
        buf = io.BytesIO()
        torch.onnx.export(module, inputs, buf, dynamo=False, opset_version=opset, do_constant_folding=False,
                          training=torch.onnx.TrainingMode.EVAL)
        return _float64_statistics(onnx.load_from_string(buf.getvalue())).SerializeToString(), module.eval(), inputs


#: normalizations whose statistics are float32 by default (``stash_type=1``) whatever the input's type (both
#: backends compute LayerNormalization's in float64 for a float64 input, and the reference one knows no other)
_STASHED = {"GroupNormalization": 21, "RMSNormalization": 23}


def _float64_statistics(model: onnx.ModelProto) -> onnx.ModelProto:
    """The exporters leave ``stash_type`` at its default, float32, in float64 models: set it to float64, as torch
    computes them (float32 statistics put ~1e-7 rounding in the forward, ~1e-6 in a GroupNorm model's gradients)."""
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    for node in [*model.graph.node, *(n for f in model.functions for n in f.node)]:
        if node.domain in ("", "ai.onnx") and opset >= _STASHED.get(node.op_type, 1 << 30):
            kept = [a for a in node.attribute if a.name != "stash_type"]
            del node.attribute[:]
            node.attribute.extend([*kept, onnx.helper.make_attribute("stash_type", onnx.TensorProto.DOUBLE)])
    return model


def compare(case: Case, exporter: str, opset: int, rtol: float = 1e-6, memory=None) -> dict[str, float]:
    """Differentiate the exported model with revgraph and with torch; return the norm-relative error per
    parameter (raise AssertionError naming the worst one beyond ``rtol``). ``memory``: revgraph's residual
    budget (``rg.gradient(memory=)``)."""
    data, module, inputs = export(case, exporter, opset)
    g = rg.load(data)
    out = g.output_names[0]
    params = {n: p for n, p in module.named_parameters() if p.requires_grad}
    matched = match_parameters(g, params)
    gg = rg.gradient(g, loss=out, wrt=sorted(matched), seed="input", memory=memory)
    feeds = {vi.name: t.numpy() for vi, t in zip(g.inputs, inputs, strict=True)}
    with Float64():
        fwd = torch_out = module(*inputs)
    u = np.random.default_rng(7).standard_normal(tuple(torch_out.shape))
    feeds[f"{out}_grad"] = u
    got = run(gg, feeds)
    module.zero_grad()
    (fwd * torch.tensor(u)).sum().backward()
    padding = {f"{n}.weight": m.padding_idx for n, m in module.named_modules()
               if isinstance(m, torch.nn.Embedding) and m.padding_idx is not None}
    wants = {name: params[name].grad.numpy() if params[name].grad is not None else np.zeros(tuple(params[name].shape))
             for name in matched.values()}
    total = max([float(np.linalg.norm(w)) for w in wants.values()] + [1.0])
    errors = {}
    for init, name in matched.items():
        want, have = wants[name], got[f"{init}_grad"].copy()
        if name in padding:  # torch's Embedding(padding_idx=i) never updates row i; ONNX's Gather has no such row
            have[padding[name]] = 0.0
        scale = float(np.linalg.norm(want))
        # a gradient that is mathematically zero (a key bias under softmax) is rounding noise: compare it absolutely
        errors[name] = float(np.linalg.norm(have - want)) / (scale if scale > 1e-9 * total else total)
    unmatched = [n for n, p in params.items() if n not in matched.values() and p.grad is not None
                 and float(p.grad.abs().max()) > 0]
    assert not unmatched, (f"{case.name}/{exporter}/{opset}: parameters with gradients not found in the model: "
                           f"{unmatched}")
    worst = max(errors, key=errors.get)
    assert errors[worst] <= rtol, f"{case.name}/{exporter}/{opset}: {worst} off by {errors[worst]:.2e} (norm-relative)"
    return errors


def run(g: rg.Graph, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``g`` on onnxruntime, or on the reference evaluator where onnxruntime has no float64 kernel."""
    try:
        return rg.Session(g).run(feeds)
    except RevgraphError as exc:
        if "float64" not in str(exc):
            raise
        return rg.Session(g, backend="reference").run(feeds)


def match_parameters(g: rg.Graph, params: dict[str, torch.nn.Parameter]) -> dict[str, str]:
    """ONNX initializer -> torch parameter: by name (the exporter may prefix it), else by equal value."""
    matched = {}
    by_value = {}
    for name, p in params.items():
        by_value.setdefault(p.detach().numpy().tobytes(), []).append(name)
    for init, arr in g.initializers.items():
        names = [n for n in params if init == n or init.endswith("." + n) or n.endswith("." + init) or init == "m." + n]
        if len(names) == 1:
            matched[init] = names[0]
            continue
        same = by_value.get(np.asarray(arr).tobytes(), [])
        if len(same) == 1 and np.asarray(arr).dtype == np.float64:
            matched[init] = same[0]
    return matched
