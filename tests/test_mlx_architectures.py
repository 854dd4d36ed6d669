"""kvstore.mlx against every model architecture that mlx-lm ships.

Each `model_type` module in mlx_lm/models is built from a tiny config with
random float32 weights, prefilled with 40 token ids in two chunks, stored with
kvstore.mlx.save_prompt_cache and loaded back with load_prompt_cache.  The
restored cache must hold the same state bit for bit, and 4 greedy decode steps
through the original and the restored cache must give bit-identical logits.

ARCHITECTURES has one row per module that builds and runs here (Linux, MLX on
the CPU); LEFT_OUT names every other module with the reason.  A new mlx-lm
model type fails test_every_model_module_is_listed until it is added to one of
them.  The category is the feature that shapes the cache, the first that
applies of: "linear_attention" and "hybrid_ssm" (recurrent or conv state in
ArraysCache), "mla", "sliding" (RotatingKVCache / ChunkedKVCache), "moe",
"dense"; "other" for the rest.  Every model that runs here has a cache
kvstore.mlx can store (deepseek_v41 brings a cache class of its own).

Weights that a model initialises to all zeros are randomised (see
_random_weights), and each round trip checks that the decode logits depend on
the cache at all, so that the bit-exact comparison of logits is not vacuous.

The chain tests store the same architectures as chained checkpoints (blocks of
B tokens, docs/format.md §14).  Saved at every block boundary, each boundary
must restore the state it was saved with bit for bit, each block must be
written once, and decoding from the last one must match the live cache.  Saved
once, a cache with only positional slots must restore every boundary (the
first k tokens of each slot), and a cache with snapshot slots only the end.
"""

import importlib
import os
import pkgutil
import re

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

import backend  # noqa: E402

import mlx_lm.models  # noqa: E402
from mlx.utils import tree_flatten, tree_unflatten  # noqa: E402
from mlx_lm.models import cache as mlc  # noqa: E402

import kvstore  # noqa: E402
from kvstore import chain, files  # noqa: E402
from kvstore import mlx as kvmlx  # noqa: E402
from kvstore.mlx import canary  # noqa: E402

V = 256             # vocab of every tiny config (ids are drawn below 100)
N_IDS = 40          # prompt length
CHUNKS = (24, 16)   # prefill chunks
DECODE = 4          # greedy steps after the round trip
W = 16              # sliding window / chunk sizes smaller than the prompt, so they wrap

_ROPE_YARN = {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
              "original_max_position_embeddings": 4096, "type": "yarn"}


def _cfg(model_type, **kw):
    return {"model_type": model_type, **kw}


# Shapes shared by most rows: hidden 64, 4 query heads of 16, 2 KV heads, 2 layers.
_LLAMA = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
              num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=V)
_QWEN3 = dict(_LLAMA, head_dim=16, max_position_embeddings=1000, tie_word_embeddings=False,
              rope_theta=1000)
_QWEN3_MOE = dict(_QWEN3, decoder_sparse_step=1, mlp_only_layers=[], num_experts_per_tok=2,
                  num_experts=4, moe_intermediate_size=32, norm_topk_prob=True)
_LFM2 = dict(vocab_size=V, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=1000, norm_eps=1e-5, conv_bias=False,
             conv_L_cache=3, block_dim=64, block_ff_dim=128, block_multiple_of=4,
             block_ffn_dim_multiplier=2, block_auto_adjust_ff_dim=True,
             layer_types=["full_attention", "conv", "full_attention", "conv"], rope_theta=1000)
_DEEPSEEK_V3 = dict(vocab_size=V, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    n_routed_experts=4, n_group=2, topk_group=1, num_experts_per_tok=2,
                    n_shared_experts=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
                    v_head_dim=16, qk_nope_head_dim=16, first_k_dense_replace=1,
                    rope_scaling=_ROPE_YARN)
_QWEN3_NEXT = dict(hidden_size=64, num_hidden_layers=4, intermediate_size=128, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=V, linear_num_value_heads=4,
                   linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                   linear_conv_kernel_dim=3, rms_norm_eps=1e-5, head_dim=16, rope_theta=1000.0,
                   partial_rotary_factor=0.5, max_position_embeddings=1000,
                   full_attention_interval=2)
_LONGCAT = dict(attention_method="MLA", zero_expert_type="identity", hidden_size=64,
                ffn_hidden_size=128, moe_topk=2, expert_ffn_hidden_size=64, n_routed_experts=2,
                zero_expert_num=2, num_layers=2, num_hidden_layers=2, vocab_size=V,
                max_position_embeddings=1000, num_attention_heads=4, kv_lora_rank=16,
                q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                routed_scaling_factor=1.0, rms_norm_eps=1e-5, rope_theta=1000,
                mla_scale_q_lora=True, mla_scale_kv_lora=True, attention_bias=False)
# llama-4 attention scaling past original_max_position_embeddings=16, so
# it changes within the prompt; the yarn parameters serve mistral4's MLA rope.
_LLAMA4_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                "original_max_position_embeddings": 16, "llama_4_scaling_beta": 0.1,
                "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
_MINISTRAL3 = dict(_LLAMA, head_dim=16, max_position_embeddings=1000, rope_parameters=_LLAMA4_ROPE,
                   sliding_window=W, layer_types=["sliding_attention", "full_attention"])
_GEMMA3_TEXT = dict(hidden_size=64, num_hidden_layers=4, intermediate_size=128, num_attention_heads=4,
                    head_dim=16, rms_norm_eps=1e-5, vocab_size=V, num_key_value_heads=2,
                    sliding_window=W, sliding_window_pattern=2, query_pre_attn_scalar=16)
_GEMMA4_TEXT = dict(
    hidden_size=64, num_hidden_layers=4, intermediate_size=128, num_attention_heads=4, head_dim=16,
    global_head_dim=32, rms_norm_eps=1e-6, vocab_size=V, vocab_size_per_layer_input=V,
    num_key_value_heads=1, num_kv_shared_layers=2, hidden_size_per_layer_input=16,
    sliding_window=W, sliding_window_pattern=2, final_logit_softcapping=30.0,
    layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    rope_parameters={"full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1e6},
                     "sliding_attention": {"rope_theta": 1e4}})


# model_type -> (category, config)
ARCHITECTURES = {
    # ---- dense -----------------------------------------------------------------------------------
    "afm7": ("dense", _cfg("afm7", vocab_size=V, hidden_dim=64, num_layers=4, num_kv_reuse_layers=2,
                           num_heads=4, num_kv_heads=2)),
    "apertus": ("dense", _cfg("apertus", **_LLAMA, mlp_bias=True, attention_bias=False,
                              max_position_embeddings=1000, rope_theta=1000, post_norm=True,
                              qk_norm=True, tie_word_embeddings=False)),
    "cohere": ("dense", _cfg("cohere", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                             num_attention_heads=4, num_key_value_heads=2, vocab_size=V)),
    "ernie4_5": ("dense", _cfg("ernie4_5", **_LLAMA, max_position_embeddings=1000, head_dim=None,
                               rope_theta=10000, use_bias=False, tie_word_embeddings=True)),
    "exaone": ("dense", _cfg("exaone", hidden_size=64, num_layers=2, intermediate_size=128,
                             num_attention_heads=4, num_key_value_heads=2, vocab_size=V,
                             layer_norm_epsilon=1e-5, rope_theta=10000)),
    "gemma": ("dense", _cfg("gemma", **_LLAMA, head_dim=16)),
    # mlx-lm's gemma2 keeps a plain KVCache on every layer.
    "gemma2": ("dense", _cfg("gemma2", **_LLAMA, head_dim=16, query_pre_attn_scalar=16.0)),
    "glm": ("dense", _cfg("glm", **_LLAMA, head_dim=16)),
    "glm4": ("dense", _cfg("glm4", **_LLAMA, attention_bias=False, head_dim=16,
                           partial_rotary_factor=0.5, rope_theta=1000)),
    "gpt2": ("dense", _cfg("gpt2", n_ctx=128, n_embd=64, n_head=4, n_layer=2, n_positions=128,
                           layer_norm_epsilon=1e-5, vocab_size=V)),
    "gpt_bigcode": ("dense", _cfg("gpt_bigcode", n_embd=64, n_layer=2, n_inner=128, n_head=4,
                                  n_positions=128, layer_norm_epsilon=1e-5, vocab_size=V)),
    "gpt_neox": ("dense", _cfg("gpt_neox", max_position_embeddings=128, hidden_size=64,
                               num_attention_heads=4, num_hidden_layers=2, layer_norm_eps=1e-5,
                               vocab_size=V, rotary_emb_base=10000, rotary_pct=0.25)),
    "gptj": ("dense", _cfg("gptj", n_embd=64, vocab_size=V, n_positions=128, n_head=4, rotary_dim=8,
                           n_layer=2)),
    "granite": ("dense", _cfg("granite", **_LLAMA, logits_scaling=1.0, attention_multiplier=1.0,
                              embedding_multiplier=1.0, residual_multiplier=1.0,
                              max_position_embeddings=1000, attention_bias=False, mlp_bias=False,
                              rope_theta=1000)),
    "helium": ("dense", _cfg("helium", **_LLAMA, attention_bias=False, head_dim=16,
                             max_position_embeddings=1000, mlp_bias=False, rope_theta=1000,
                             tie_word_embeddings=False)),
    "hunyuan_v1_dense": ("dense", _cfg("hunyuan_v1_dense", **_LLAMA, attention_bias=False,
                                       rope_theta=1000, use_qk_norm=True,
                                       max_position_embeddings=1000,
                                       rope_scaling={"alpha": 1000.0, "factor": 1.0,
                                                     "type": "dynamic"})),
    "internlm2": ("dense", _cfg("internlm2", **_LLAMA)),
    "internlm3": ("dense", _cfg("internlm3", **_LLAMA)),
    "lille-130m": ("dense", _cfg("lille-130m", block_size=128, n_layer=2, n_head=4, n_kv_heads=2,
                                 n_embd=64, vocab_size=V, rope_theta=1000, layer_norm_eps=1e-5)),
    "llama": ("dense", _cfg("llama", **_LLAMA)),
    "llama4_text": ("dense", _cfg("llama4_text", **_LLAMA | {"num_hidden_layers": 4},
                                  intermediate_size_mlp=128, rope_theta=1000.0, head_dim=16,
                                  tie_word_embeddings=False, no_rope_layers=[0, 1, 0, 1],
                                  use_qk_norm=True)),
    "mimo": ("dense", _cfg("mimo", **_LLAMA)),
    "minicpm": ("dense", _cfg("minicpm", **_LLAMA, dim_model_base=64, scale_depth=1.0,
                              scale_emb=1.0)),
    # mistral3 wraps ministral3 without forwarding make_cache: plain KVCache on every layer.
    "mistral3": ("dense", _cfg("mistral3", text_config=_cfg("ministral3", **_MINISTRAL3))),
    "nanbeige": ("dense", _cfg("nanbeige", **_LLAMA, num_loops=2)),
    "nanochat": ("dense", _cfg("nanochat", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=4, vocab_size=V, intermediate_size=128)),
    "nemotron": ("dense", _cfg("nemotron", hidden_size=64, hidden_act="relu2", num_hidden_layers=2,
                               intermediate_size=128, num_attention_heads=4, norm_eps=1e-5,
                               vocab_size=V, num_key_value_heads=2)),
    "nemotron-nas": ("dense", _cfg("nemotron-nas", hidden_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, rms_norm_eps=1e-5, vocab_size=V,
                                   block_configs=[{"attention": {"n_heads_in_group": 2, "no_op": False,
                                                                 "replace_with_linear": False},
                                                   "ffn": {"ffn_mult": 1.3125, "no_op": False,
                                                           "replace_with_linear": False}}] * 2)),
    "olmo2": ("dense", _cfg("olmo2", **_LLAMA, attention_bias=False, rope_theta=1000)),
    "openelm": ("dense", _cfg("openelm", ffn_dim_divisor=16, ffn_multipliers=[0.5, 1.0], head_dim=16,
                              model_dim=64, normalize_qk_projections=True, num_kv_heads=[2, 2],
                              num_query_heads=[4, 4], num_transformer_layers=2, vocab_size=V)),
    "phi": ("dense", _cfg("phi", max_position_embeddings=128, vocab_size=V, hidden_size=64,
                          num_attention_heads=4, num_hidden_layers=2, num_key_value_heads=2,
                          partial_rotary_factor=0.5, intermediate_size=128)),
    "phi3": ("dense", _cfg("phi3", **_LLAMA)),
    "pixtral": ("dense", _cfg("pixtral", text_config=_cfg("llama", **_LLAMA), vocab_size=V)),
    "plamo": ("dense", _cfg("plamo", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                            num_attention_heads=4, rms_norm_eps=1e-5, vocab_size=V, n_shared_head=2)),
    "qwen": ("dense", _cfg("qwen", hidden_size=64, num_attention_heads=4, num_hidden_layers=2,
                           kv_channels=16, max_position_embeddings=128, intermediate_size=256,
                           vocab_size=V)),
    "qwen2": ("dense", _cfg("qwen2", **_LLAMA)),
    "qwen2_vl": ("dense", _cfg("qwen2_vl", text_config=_cfg("qwen2", **_LLAMA))),
    "qwen3": ("dense", _cfg("qwen3", **_QWEN3)),
    "qwen3_vl": ("dense", _cfg("qwen3_vl", text_config=_cfg("qwen3", **_QWEN3), vocab_size=V)),
    "seed_oss": ("dense", _cfg("seed_oss", **_LLAMA, head_dim=16)),
    "smollm3": ("dense", _cfg("smollm3", **_LLAMA)),
    "stablelm": ("dense", _cfg("stablelm", vocab_size=V, hidden_size=64, num_attention_heads=4,
                               num_hidden_layers=2, num_key_value_heads=2, partial_rotary_factor=0.25,
                               intermediate_size=128, layer_norm_eps=1e-5, rope_theta=10000,
                               use_qkv_bias=True)),
    "starcoder2": ("dense", _cfg("starcoder2", hidden_size=64, num_hidden_layers=2,
                                 intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                                 vocab_size=V)),
    "talkie": ("dense", _cfg("talkie", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                             head_dim=16, intermediate_size=128, vocab_size=V,
                             max_position_embeddings=128)),
    "telechat3": ("dense", _cfg("telechat3", **_LLAMA, rope_theta=10000.0,
                                max_position_embeddings=1000)),

    # ---- mixture of experts (plain KV caches) ----------------------------------------------------
    "bailing_moe": ("moe", _cfg("bailing_moe", **_LLAMA, max_position_embeddings=1000,
                                moe_intermediate_size=32, num_experts=4, num_shared_experts=1,
                                norm_topk_prob=True, num_experts_per_tok=2, rope_theta=1000,
                                first_k_dense_replace=1)),
    "dbrx": ("moe", _cfg("dbrx", d_model=64, n_layers=2, n_heads=4, vocab_size=V,
                         ffn_config={"ffn_hidden_size": 64, "moe_num_experts": 4, "moe_top_k": 2},
                         attn_config={"kv_n_heads": 2, "clip_qkv": 8, "rope_theta": 10000})),
    "deepseek": ("moe", _cfg("deepseek", vocab_size=V, hidden_size=64, intermediate_size=128,
                             moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2,
                             n_shared_experts=1, first_k_dense_replace=1)),
    "dots1": ("moe", _cfg("dots1", **_LLAMA, max_position_embeddings=None, first_k_dense_replace=1,
                          moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1,
                          norm_topk_prob=True, num_experts_per_tok=2, rope_theta=1000,
                          routed_scaling_factor=1.0)),
    "ernie4_5_moe": ("moe", _cfg("ernie4_5_moe", **_LLAMA, max_position_embeddings=1000,
                                 rope_theta=1000, use_bias=False, tie_word_embeddings=False,
                                 moe_num_experts=4, moe_k=2, moe_intermediate_size=32,
                                 moe_layer_start_index=1)),
    "glm4_moe": ("moe", _cfg("glm4_moe", **_LLAMA, max_position_embeddings=1000,
                             moe_intermediate_size=32, norm_topk_prob=True, n_group=2, head_dim=16,
                             topk_group=1, n_shared_experts=1, n_routed_experts=4,
                             routed_scaling_factor=1.0, num_experts_per_tok=2, first_k_dense_replace=1,
                             rope_theta=1000, rope_scaling=None, use_qk_norm=True,
                             tie_word_embeddings=False, attention_bias=False,
                             partial_rotary_factor=0.5)),
    "granitemoe": ("moe", _cfg("granitemoe", **_LLAMA, logits_scaling=1.0, attention_multiplier=1.0,
                               embedding_multiplier=1.0, residual_multiplier=1.0,
                               max_position_embeddings=1000, attention_bias=False, rope_theta=1000,
                               num_local_experts=4, num_experts_per_tok=2)),
    "hunyuan": ("moe", _cfg("hunyuan", **_LLAMA, attention_bias=False, rope_theta=1000, moe_topk=2,
                            num_experts=2, num_shared_expert=1, use_mixed_mlp_moe=True,
                            use_qk_norm=True, use_cla=True, cla_share_factor=2,
                            rope_scaling={"alpha": 1000.0, "factor": 1.0, "type": "dynamic"})),
    "Klear": ("moe", _cfg("Klear", **_LLAMA, attention_bias=False, mlp_only_layers=[0], num_experts=4,
                          num_experts_per_tok=2, decoder_sparse_step=1, n_shared_experts=1,
                          moe_intermediate_size=32, rope_theta=1000.0, max_position_embeddings=1000,
                          norm_topk_prob=True)),
    # mlx-lm's minimax is MiniMax-M2 (full attention), not the lightning-attention MiniMax-01.
    "minimax": ("moe", _cfg("minimax", **_LLAMA, max_position_embeddings=1000,
                                         num_experts_per_tok=2, num_local_experts=4,
                                         shared_intermediate_size=64, rope_theta=1000,
                                         rotary_dim=8)),
    "minimax_m3_vl": ("moe", _cfg("minimax_m3_vl", text_config=dict(
        hidden_size=64, intermediate_size=32, dense_intermediate_size=128, shared_intermediate_size=32,
        num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=1000, head_dim=16, vocab_size=V,
        mlp_layer_types=["dense", "sparse"], layer_types=["full_attention", "sparse_attention"],
        index_n_heads=2, index_head_dim=16, index_block_size=4, index_topk_blocks=2))),
    "mixtral": ("moe", _cfg("mixtral", **_LLAMA, num_experts_per_tok=2, num_local_experts=4)),
    "olmoe": ("moe", _cfg("olmoe", **_LLAMA, num_experts=4, num_experts_per_tok=2)),
    "phimoe": ("moe", _cfg("phimoe", **_LLAMA, num_local_experts=4, num_experts_per_tok=2,
                           rope_scaling={"long_factor": [1.0] * 8, "long_mscale": 1.243,
                                         "original_max_position_embeddings": 4096,
                                         "short_factor": [1.0] * 8, "short_mscale": 1.243,
                                         "type": "longrope"})),
    "phixtral": ("moe", _cfg("phixtral", num_vocab=V, model_dim=64, num_heads=4, num_layers=2,
                             rotary_dim=8, num_experts_per_tok=2, num_local_experts=4)),
    "qwen2_moe": ("moe", _cfg("qwen2_moe", **_LLAMA, num_experts_per_tok=2, num_experts=4,
                              moe_intermediate_size=32, shared_expert_intermediate_size=64)),
    "qwen3_moe": ("moe", _cfg("qwen3_moe", **_QWEN3_MOE)),
    "qwen3_vl_moe": ("moe", _cfg("qwen3_vl_moe", text_config=_cfg("qwen3_moe", **_QWEN3_MOE),
                                 vocab_size=V)),
    "solar_open": ("moe", _cfg("solar_open", **_LLAMA, moe_intermediate_size=32, head_dim=16,
                               n_shared_experts=1, n_routed_experts=4, routed_scaling_factor=1.0,
                               num_experts_per_tok=2, first_k_dense_replace=1, norm_topk_prob=True,
                               max_position_embeddings=1000, rope_theta=1000.0,
                               tie_word_embeddings=False, partial_rotary_factor=1.0)),

    # ---- sliding window / chunked attention (RotatingKVCache, ChunkedKVCache) --------------------
    "afmoe": ("sliding", _cfg("afmoe", **_LLAMA | {"num_hidden_layers": 4}, head_dim=16,
                              rope_theta=100.0, sliding_window=W,
                              layer_types=["full_attention", "sliding_attention",
                                           "sliding_attention", "full_attention"],
                              num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)),
    "cohere2": ("sliding", _cfg("cohere2", hidden_size=64, head_dim=16, num_hidden_layers=4,
                                intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                                vocab_size=V, sliding_window=W, sliding_window_pattern=2)),
    "exaone4": ("sliding", _cfg("exaone4", **_LLAMA | {"num_hidden_layers": 4},
                                max_position_embeddings=1000, rope_theta=10000, head_dim=16,
                                tie_word_embeddings=False, rope_scaling=None, sliding_window=W,
                                sliding_window_pattern="LLGL")),
    "exaone_moe": ("sliding", _cfg("exaone_moe", **_LLAMA | {"num_hidden_layers": 4}, head_dim=16,
                                   moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                                   num_shared_experts=1, n_group=1, topk_group=1,
                                   routed_scaling_factor=2.5, norm_topk_prob=True, sliding_window=W,
                                   max_position_embeddings=1000, rope_theta=1000.0,
                                   layer_types=["sliding_attention", "sliding_attention",
                                                "sliding_attention", "full_attention"],
                                   is_moe_layer=[False, True, True, True],
                                   tie_word_embeddings=False)),
    "gemma3": ("sliding", _cfg("gemma3", text_config=_cfg("gemma3_text", **_GEMMA3_TEXT),
                               vocab_size=V)),
    "gemma3_text": ("sliding", _cfg("gemma3_text", **_GEMMA3_TEXT)),
    "gemma3n": ("sliding", _cfg("gemma3n", vocab_size=V, text_config=_cfg(
        "gemma3n", hidden_size=64, num_hidden_layers=4, intermediate_size=128, num_attention_heads=4,
        head_dim=16, rms_norm_eps=1e-5, vocab_size=V, num_key_value_heads=2, num_kv_shared_layers=2,
        vocab_size_per_layer_input=V, sliding_window=W, max_position_embeddings=1000,
        rope_local_base_freq=1.0, rope_theta=1000.0, final_logit_softcapping=1.0,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        activation_sparsity_pattern=[0.5, 0.5, 0.0, 0.0], hidden_size_per_layer_input=16,
        altup_num_inputs=4, altup_coef_clip=1.0, altup_correct_scale=True, altup_active_idx=0,
        laurel_rank=8))),
    "gemma4": ("sliding", _cfg("gemma4", vocab_size=V,
                               text_config=_cfg("gemma4_text", **_GEMMA4_TEXT))),
    "gemma4_text": ("sliding", _cfg("gemma4_text", **_GEMMA4_TEXT)),
    "gpt_oss": ("sliding", _cfg("gpt_oss", **_LLAMA, num_local_experts=4, num_experts_per_tok=2,
                                head_dim=16, sliding_window=W, rope_theta=10000,
                                layer_types=["sliding_attention", "full_attention"])),
    "iquestloopcoder": ("sliding", _cfg("iquestloopcoder", **_LLAMA, head_dim=16, rope_theta=1000.0,
                                      tie_word_embeddings=False, loop_num=2, loop_window_size=W)),
    "laguna": ("sliding", _cfg("laguna", vocab_size=V, hidden_size=64, intermediate_size=128,
                               num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                               head_dim=16, rms_norm_eps=1e-6, sliding_window=W,
                               partial_rotary_factor=0.5, num_experts=4, num_experts_per_tok=2,
                               moe_intermediate_size=32, shared_expert_intermediate_size=32,
                               moe_routed_scaling_factor=2.5, moe_router_score_func="sqrtsoftplus",
                               layer_types=["full_attention", "sliding_attention",
                                            "sliding_attention", "sliding_attention"],
                               mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
                               num_attention_heads_per_layer=[4, 4, 4, 4],
                               rope_parameters={
                                   "full_attention": {"rope_type": "yarn", "rope_theta": 500000.0,
                                                      "factor": 8.0,
                                                      "original_max_position_embeddings": 4096,
                                                      "beta_slow": 1.0, "beta_fast": 32.0,
                                                      "partial_rotary_factor": 0.5},
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 1e4,
                                                         "partial_rotary_factor": 1.0}})),
    "llama4": ("sliding", _cfg("llama4", vocab_size=V, text_config=dict(
        attention_bias=False, attention_chunk_size=W // 2, head_dim=16, hidden_size=64,
        interleave_moe_layer_step=2, intermediate_size=64, intermediate_size_mlp=128,
        max_position_embeddings=1000, model_type="llama4", num_attention_heads=4,
        num_experts_per_tok=1, num_hidden_layers=4, num_key_value_heads=2, num_local_experts=2,
        rms_norm_eps=1e-4, rope_scaling=None, rope_theta=1000, use_qk_norm=True, vocab_size=V))),
    "mellum": ("sliding", _cfg("mellum", **_LLAMA | {"num_hidden_layers": 4}, num_experts=4,
                               num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16,
                               tie_word_embeddings=False, max_position_embeddings=1000,
                               norm_topk_prob=True, sliding_window=W,
                               layer_types=["sliding_attention", "full_attention",
                                            "sliding_attention", "full_attention"],
                               rope_parameters={"full_attention": {"rope_theta": 1e6},
                                                "sliding_attention": {"rope_theta": 1e4}})),
    "mimo_v2_flash": ("sliding", _cfg("mimo_v2_flash", num_experts_per_tok=2,
                                      hybrid_layer_pattern=[0, 1], moe_layer_freq=[0, 1],
                                      add_swa_attention_sink_bias=True,
                                      add_full_attention_sink_bias=False, sliding_window_size=W,
                                      vocab_size=V, hidden_size=64, intermediate_size=128,
                                      moe_intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      n_shared_experts=1, n_routed_experts=4,
                                      routed_scaling_factor=None, topk_method="noaux_tc",
                                      scoring_func="sigmoid", norm_topk_prob=True, n_group=2,
                                      topk_group=1, max_position_embeddings=1000,
                                      layernorm_epsilon=1e-5, rope_theta=1000.0,
                                      swa_rope_theta=1000.0, swa_num_attention_heads=4,
                                      swa_num_key_value_heads=2, head_dim=16, v_head_dim=8,
                                      swa_head_dim=16, swa_v_head_dim=8, partial_rotary_factor=0.5)),
    "ministral3": ("sliding", _cfg("ministral3", **_MINISTRAL3)),
    "muse_glimmer": ("sliding", _cfg("muse_glimmer", hidden_size=64, num_hidden_layers=4,
                                     intermediate_size=128, num_attention_heads=4,
                                     num_key_value_heads=2, head_dim=16, vocab_size=V,
                                     sliding_window=W, max_position_embeddings=1000)),
    "olmo3": ("sliding", _cfg("olmo3", **_LLAMA | {"num_hidden_layers": 4}, head_dim=16,
                              rope_theta=1000, sliding_window=W, tie_word_embeddings=True,
                              max_position_embeddings=1000)),
    "plamo3": ("sliding", _cfg("plamo3", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=16, max_position_embeddings=1000,
                               sliding_window=W, sliding_window_pattern=2, intermediate_size=128,
                               vocab_size=V)),
    "spark2_5": ("sliding", _cfg("spark2_5", hidden_size=64, intermediate_size=128,
                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                 head_dim=16, vocab_size=V, sliding_window=W,
                                 layer_types=["sliding_attention", "full_attention"],
                                 rope_parameters={"sliding_attention": {"rope_theta": 1e4},
                                                  "full_attention": {"rope_theta": 1e6}})),
    "step3p5": ("sliding", _cfg("step3p5", hidden_size=64, num_hidden_layers=4, vocab_size=V,
                                num_attention_heads=4, num_attention_groups=2, head_dim=16,
                                intermediate_size=128, rms_norm_eps=1e-5,
                                rope_theta=[10000.0] * 4, sliding_window=W,
                                layer_types=["full_attention", "sliding_attention",
                                             "sliding_attention", "full_attention"],
                                partial_rotary_factors=[0.5, 1.0, 1.0, 0.5],
                                attention_other_setting={"num_attention_heads": 8,
                                                         "num_attention_groups": 2},
                                use_head_wise_attn_gate=True, moe_num_experts=4, moe_top_k=2,
                                moe_intermediate_size=32, share_expert_dim=32,
                                moe_layers_enum="1,2,3")),

    # ---- SSM / short-conv / recurrent state (ArraysCache) + attention ----------------------------
    "baichuan_m1": ("hybrid_ssm", _cfg("baichuan_m1", **_LLAMA, rope_theta=1000, sliding_window=W,
                                    sliding_window_layers=[0], conv_window=2)),
    "falcon_h1": ("hybrid_ssm", _cfg("falcon_h1", hidden_size=64, head_dim=16, intermediate_size=128,
                                     mamba_d_conv=4, mamba_d_head=16, mamba_d_ssm=64,
                                     mamba_d_state=16, mamba_n_groups=1, mamba_n_heads=4,
                                     mamba_chunk_size=16, num_attention_heads=4,
                                     num_key_value_heads=2, num_hidden_layers=2, vocab_size=V)),
    "gear": ("hybrid_ssm", _cfg("gear", vocab_size=V, hidden_size=64, intermediate_size=128,
                                num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                head_dim=16, rms_norm_eps=1e-6, sliding_window=W,
                                layer_types=["conv_mixer", "sliding_attention", "full_attention"])),
    "granitemoehybrid": ("hybrid_ssm", _cfg(
        "granitemoehybrid", vocab_size=V, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        max_position_embeddings=1000, num_attention_heads=4, num_key_value_heads=2,
        attention_bias=False, embedding_multiplier=1.0, attention_multiplier=1.0, logits_scaling=1.0,
        residual_multiplier=1.0, num_local_experts=4, num_experts_per_tok=2,
        shared_intermediate_size=64, mamba_n_heads=4, mamba_d_head=16, mamba_proj_bias=False,
        mamba_d_state=16, mamba_d_conv=4, mamba_n_groups=1, mamba_conv_bias=False,
        layer_types=["mamba", "attention"], rms_norm_eps=1e-5, rope_theta=1000.0)),
    "jamba": ("hybrid_ssm", _cfg("jamba", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, attn_layer_offset=1,
                                 attn_layer_period=2, expert_layer_offset=1, expert_layer_period=2,
                                 mamba_d_conv=4, mamba_d_state=16, mamba_expand=2, num_experts=4,
                                 num_experts_per_tok=2, rms_norm_eps=1e-5,
                                 max_position_embeddings=1000, vocab_size=V)),
    "lfm2": ("hybrid_ssm", _cfg("lfm2", **_LFM2)),
    "lfm2-vl": ("hybrid_ssm", _cfg("lfm2-vl", vocab_size=V, text_config=_cfg("lfm2", **_LFM2))),
    "lfm2_moe": ("hybrid_ssm", _cfg("lfm2_moe", **_LFM2, intermediate_size=128,
                                    moe_intermediate_size=32, num_dense_layers=2, num_experts=4,
                                    num_experts_per_tok=2, norm_topk_prob=True,
                                    use_expert_bias=True, full_attn_idxs=[0, 2])),
    "mamba": ("hybrid_ssm", _cfg("mamba", vocab_size=V, use_bias=False, use_conv_bias=True,
                                 conv_kernel=4, hidden_size=64, num_hidden_layers=2, state_size=16,
                                 intermediate_size=128, time_step_rank=8)),
    "mamba2": ("hybrid_ssm", _cfg("mamba2", num_heads=8, head_dim=16, vocab_size=V, hidden_size=64,
                                  intermediate_size=128, state_size=16, num_hidden_layers=2,
                                  layer_norm_epsilon=1e-5, conv_kernel=3, n_groups=2,
                                  use_bias=False, use_conv_bias=False, tie_word_embeddings=True,
                                  time_step_limit=(0.01, 10), time_step_rank="auto")),
    "nemotron_h": ("hybrid_ssm", _cfg("nemotron_h", vocab_size=V, hidden_size=64,
                                      intermediate_size=128, num_hidden_layers=4,
                                      max_position_embeddings=1000, num_attention_heads=4,
                                      num_key_value_heads=2, attention_bias=False, mamba_num_heads=4,
                                      mamba_head_dim=16, mamba_proj_bias=False, ssm_state_size=16,
                                      conv_kernel=3, n_groups=2, time_step_limit=[0.0, float("inf")],
                                      mlp_bias=False, layer_norm_epsilon=1e-5, rms_norm_eps=1e-5,
                                      use_bias=False, use_conv_bias=True, residual_in_fp32=True,
                                      hybrid_override_pattern=["M", "*", "M", "-"])),
    "plamo2": ("hybrid_ssm", _cfg("plamo2", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, hidden_size_per_head=16,
                                  max_position_embeddings=1000, attention_window_size=W,
                                  mamba_d_state=16, mamba_d_conv=4, mamba_num_heads=4,
                                  mamba_step=2, mamba_chunk_size=16, intermediate_size=128,
                                  vocab_size=V)),
    "recurrent_gemma": ("hybrid_ssm", _cfg("recurrent_gemma", hidden_size=64, attention_bias=False,
                                           conv1d_width=3, intermediate_size=128, logits_soft_cap=1.0,
                                           num_attention_heads=4, num_hidden_layers=3,
                                           num_key_value_heads=1, rms_norm_eps=1e-5, rope_theta=1000,
                                           attention_window_size=W, vocab_size=V,
                                           block_types=["recurrent", "recurrent", "attention"])),

    # ---- linear attention (ArraysCache) + attention ----------------------------------------------
    "bailing_hybrid": ("linear_attention", _cfg(
        "bailing_hybrid", hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, num_experts=4,
        num_experts_per_tok=2, num_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1,
        layer_group_size=2, group_norm_size=1, vocab_size=V, rms_norm_eps=1e-5, rope_theta=1000.0,
        max_position_embeddings=1000, routed_scaling_factor=1.0, head_dim=16, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, q_lora_rank=16)),
    "bailing_moe_linear": ("linear_attention", _cfg(
        "bailing_moe_linear", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
        moe_intermediate_size=32, num_experts_per_tok=2, num_experts=4, norm_topk_prob=True,
        num_shared_experts=1, num_attention_heads=4, num_key_value_heads=4, rms_norm_eps=1e-5,
        vocab_size=V, rope_theta=1000, first_k_dense_replace=0, layer_group_size=2,
        group_norm_size=1, max_position_embeddings=1000)),
    "bailing_moe_v3": ("linear_attention", _cfg(
        "bailing_moe_v3", vocab_size=V, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_experts=4, num_experts_per_tok=2, num_shared_experts=1, first_k_dense_replace=1, n_group=1,
        topk_group=1, layer_group_size=2, head_dim=16, q_lora_rank=16, kv_lora_rank=16,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, max_position_embeddings=1000)),
    "kimi_k3": ("linear_attention", _cfg("kimi_k3", text_config=dict(
        model_type="kimi_linear", vocab_size=V, hidden_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, intermediate_size=128,
        linear_attn_config={"num_heads": 4, "head_dim": 16, "kda_layers": [1], "short_conv_kernel_size": 4},
        q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        num_experts=4, num_experts_per_token=2, moe_intermediate_size=32,
        max_position_embeddings=1000))),
    "kimi_linear": ("linear_attention", _cfg(
        "kimi_linear", vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, intermediate_size=128, head_dim=16, rope_theta=100.0, rms_norm_eps=1e-6,
        linear_attn_config={"num_heads": 4, "head_dim": 16, "kda_layers": [1]},
        model_max_length=1000, num_experts=2, moe_intermediate_size=32, kv_lora_rank=8,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)),
    "olmo_hybrid": ("linear_attention", _cfg(
        "olmo_hybrid", **_LLAMA | {"num_hidden_layers": 4}, max_position_embeddings=1000,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=3, linear_allow_neg_eigval=True,
        tie_word_embeddings=False, attention_bias=False)),
    # A 2-bit Hadamard-rotated pack of qwen3_5: one packed linear (zero weights
    # until a pack is loaded) with a 512-wide rotation block.
    "prism_hadamard_qwen35": ("linear_attention", _cfg(
        "prism_hadamard_qwen35", text_config=_cfg("qwen3_5", **_QWEN3_NEXT | {"intermediate_size": 512}),
        schema_version=1,
        tensor_namespace="mlx-lm-text", quantization={"bits": 2, "group_size": 128, "mode": "affine"},
        modules=[{"path": "model.layers.0.mlp.down_proj", "embedding": False, "dtype": "float16",
                  "block": 512}])),
    "qwen3_5": ("linear_attention", _cfg("qwen3_5", **_QWEN3_NEXT)),
    "qwen3_5_moe": ("linear_attention", _cfg("qwen3_5_moe", **_QWEN3_NEXT, num_experts=4,
                                             num_experts_per_tok=2, shared_expert_intermediate_size=32,
                                             moe_intermediate_size=32)),
    "qwen3_next": ("linear_attention", _cfg("qwen3_next", **_QWEN3_NEXT, num_experts=4,
                                            num_experts_per_tok=2, decoder_sparse_step=1,
                                            shared_expert_intermediate_size=32, mlp_only_layers=[0],
                                            moe_intermediate_size=32)),
    "rwkv7": ("linear_attention", _cfg("rwkv7", vocab_size=V, hidden_size=64, intermediate_size=128,
                                       norm_eps=1e-5, head_dim=16, num_hidden_layers=2,
                                       a_low_rank_dim=8, v_low_rank_dim=8, gate_low_rank_dim=8,
                                       decay_low_rank_dim=8)),

    # ---- multi-head latent attention -------------------------------------------------------------
    "deepseek_v2": ("mla", _cfg("deepseek_v2", **_DEEPSEEK_V3)),
    "deepseek_v3": ("mla", _cfg("deepseek_v3", **_DEEPSEEK_V3)),
    "deepseek_v32": ("mla", _cfg("deepseek_v32", **_DEEPSEEK_V3, index_head_dim=16, index_n_heads=2,
                                 index_topk=8)),
    "glm4_moe_lite": ("mla", _cfg("glm4_moe_lite", vocab_size=V, hidden_size=64, intermediate_size=128,
                                  moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4,
                                  routed_scaling_factor=1.0, kv_lora_rank=8, q_lora_rank=8,
                                  qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=8,
                                  topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True,
                                  n_group=1, topk_group=1, num_experts_per_tok=2, moe_layer_freq=1,
                                  first_k_dense_replace=1, max_position_embeddings=256,
                                  rms_norm_eps=1e-5, rope_theta=1000, rope_scaling=None,
                                  attention_bias=False, partial_rotary_factor=1.0,
                                  tie_word_embeddings=False, num_nextn_predict_layers=1)),
    "glm_moe_dsa": ("mla", _cfg("glm_moe_dsa", vocab_size=V, hidden_size=64, index_head_dim=16,
                                index_n_heads=2, index_topk=8, intermediate_size=128,
                                moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4,
                                routed_scaling_factor=1.0, kv_lora_rank=16, q_lora_rank=16,
                                qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16,
                                topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True,
                                n_group=1, topk_group=1, num_experts_per_tok=2, moe_layer_freq=1,
                                first_k_dense_replace=1, max_position_embeddings=1000,
                                rms_norm_eps=1e-5, rope_parameters={"rope_theta": 1000.0},
                                attention_bias=False)),
    "kimi_k25": ("mla", _cfg("kimi_k25", text_config=_cfg("deepseek_v3", **_DEEPSEEK_V3))),
    "kimi_vl": ("mla", _cfg("kimi_vl", text_config=dict(
        vocab_size=V, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, n_shared_experts=1,
        n_routed_experts=4, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, v_head_dim=16,
        qk_nope_head_dim=16), vocab_size=V)),
    "longcat_flash": ("mla", _cfg("longcat_flash", **_LONGCAT)),
    "longcat_flash_ngram": ("mla", _cfg("longcat_flash_ngram", **_LONGCAT)),
    "minicpm3": ("mla", _cfg("minicpm3", hidden_size=64, dim_model_base=64, num_hidden_layers=2,
                             intermediate_size=128, num_attention_heads=4, rms_norm_eps=1e-5,
                             vocab_size=V, num_key_value_heads=4, q_lora_rank=16, qk_nope_head_dim=16,
                             qk_rope_head_dim=8, kv_lora_rank=16, scale_depth=1.0, scale_emb=1.0,
                             max_position_embeddings=1000,
                             rope_scaling={"type": "longrope", "long_factor": [1.0] * 4,
                                           "short_factor": [1.0] * 4,
                                           "original_max_position_embeddings": 1000})),
    "mistral4": ("mla", _cfg("mistral4", vocab_size=V, hidden_size=64, intermediate_size=128,
                             moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4,
                             routed_scaling_factor=1.0, kv_lora_rank=16, q_lora_rank=16,
                             norm_topk_prob=True, max_position_embeddings=1000, rms_norm_eps=1e-5,
                             topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1, n_group=1,
                             qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                             rope_parameters=_LLAMA4_ROPE)),
    "youtu_llm": ("mla", _cfg("youtu_llm", vocab_size=V, hidden_size=64, intermediate_size=128,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                              kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16,
                              qk_nope_head_dim=16)),

    # ---- other -----------------------------------------------------------------------------------
    # Block-sparse attention (blocks of 32, 64 are the only sizes it takes).  Its
    # Model writes -inf into the logits of ids 100256..100351 unchecked (a
    # smaller vocab is an out-of-bounds scatter: a segfault on the CPU), so the
    # vocab is full size.
    "phi3small": ("other", _cfg("phi3small", hidden_size=64, dense_attention_every_n_layers=2,
                                ff_intermediate_size=128, gegelu_limit=1.0, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2,
                                layer_norm_epsilon=1e-5, vocab_size=100352, blocksparse_block_size=32,
                                blocksparse_num_local_blocks=1, blocksparse_vert_stride=2)),
    # Its own cache class, deepseek_v41.LayerCache (window, compressed groups, index keys): all snapshots.
    "deepseek_v41": ("mla", _cfg("deepseek_v41", vocab_size=V, hidden_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, head_dim=32, q_lora_rank=16,
                                 qk_rope_head_dim=8, o_groups=2, o_lora_rank=16,
                                 moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
                                 sliding_window=W, index_n_heads=2, index_head_dim=16, index_topk=4,
                                 hc_mult=2, hc_sinkhorn_iters=3)),
}

# model_type -> why it is not in ARCHITECTURES.
LEFT_OUT = {
    "bitnet": "BitLinear runs a Metal kernel (mx.fast.metal_kernel) with no CPU path",
    "muse_spark": "its attention, norms and expert routing run mlx_lm.kernels Metal kernels "
                  "with no CPU path",
    "olmo": "imports the ai2-olmo package (hf_olmo), not installed; without it the module calls "
            "sys.exit(1) on import",
}

_MODELS_DIR = os.path.dirname(mlx_lm.models.__file__)
# A model module defines `class Model` or re-exports one (solar_open: from .glm4_moe import Model).
_DEFINES_MODEL = re.compile(r"^(class Model\b|Model\s*=|from\s+\S+\s+import\s+.*\bModel\b)", re.MULTILINE)


def model_modules():
    """Every model_type module in mlx_lm/models (read, not imported: olmo exits on import).

    Helper modules (base, cache, rope_utils, switch_layers, ssm, ...) have no Model.
    """
    names = []
    for info in pkgutil.iter_modules([_MODELS_DIR]):
        if info.ispkg:
            continue
        with open(os.path.join(_MODELS_DIR, info.name + ".py"), encoding="utf-8") as f:
            if _DEFINES_MODEL.search(f.read()):
                names.append(info.name)
    return sorted(names)


# ---- helpers other tests in this file can reuse ------------------------------

def _random_weights(model):
    """float32 weights; the ones a model initialises to all zeros get small random values.

    A checkpoint always overwrites those (rwkv7's token-shift mixes and group
    norm, talkie's lm_head, biases, gemma-style norm offsets): left at zero
    they can cut the cached state off from the logits, and the decode check
    would then compare nothing.
    """
    params = tree_flatten(model.parameters())
    floats = [(k, p) for k, p in params if mx.issubdtype(p.dtype, mx.floating)]
    zero = [mx.all(p == 0) for _, p in floats]
    mx.eval(zero)
    new = [(k, 0.1 * mx.random.normal(p.shape) if z.item() else p.astype(mx.float32))
           for (k, p), z in zip(floats, zero)]
    model.update(tree_unflatten(new))


def build(arch, seed=0):
    """(model, config) for a model_type in ARCHITECTURES.

    Instantiated as mlx_lm.utils does (ModelArgs.from_dict, Model), after
    mx.random.seed(seed), with random float32 weights (see _random_weights).
    """
    _, config = ARCHITECTURES[arch]
    mx.random.seed(seed)
    module = importlib.import_module(f"mlx_lm.models.{arch}")
    args = module.ModelArgs.from_dict(config)
    model = module.Model(args)
    _random_weights(model)
    mx.eval(model.parameters())
    return model, config


def cache_arrays(cache):
    """Every array a prompt cache holds (CacheList children included), for mx.eval."""
    out = []

    def walk(x):
        if isinstance(x, mx.array):
            out.append(x)
        elif isinstance(x, (list, tuple)):
            for y in x:
                walk(y)
        elif isinstance(x, mlc.CacheList):
            walk(list(x.caches))
        elif hasattr(x, "state"):
            walk(x.state)
    walk(list(cache))
    return out


def prefill(model, cache, ids, chunks=CHUNKS):
    """Feeds ids through model in chunks of the given sizes; returns the last logits (evaluated)."""
    assert sum(chunks) == len(ids)
    at, logits = 0, None
    for n in chunks:
        logits = model(mx.array([ids[at:at + n]]), cache=cache)
        mx.eval(logits, cache_arrays(cache))
        at += n
    return logits


def token_ids(arch, n=N_IDS):
    rng = np.random.default_rng(sum(arch.encode()))
    return [int(i) for i in rng.integers(1, 100, n)]


# ---- comparisons -----------------------------------------------------------

# Filled length along the token axis of each KV-like cache class: mlx-lm's
# state can carry spare buffer space past it, which kvstore does not store.
def _filled(c):
    name = type(c).__name__
    if name == "ChunkedKVCache":
        return c.offset - c.start_position
    if name == "RotatingKVCache":
        return None if c.keys is None else min(c.offset, c.keys.shape[2])
    if name in ("KVCache", "QuantizedKVCache"):
        return c.offset
    return None


def flat_state(cache):
    """[(path, value)] of mlx-lm's own `state` of every layer, the token axis cut to the filled part."""
    out = []

    def walk(x, path, n):
        if isinstance(x, mx.array):
            if n is not None and x.ndim == 4 and x.shape[2] > n:
                x = x[..., :n, :]
            out.append((path, x))
        elif isinstance(x, (list, tuple)):
            for i, y in enumerate(x):
                walk(y, f"{path}.{i}", n)
        else:
            out.append((path, x))          # offsets, sizes, None, class names

    def layer(c, path):
        out.append((path + ".class", type(c).__name__))
        if isinstance(c, mlc.CacheList):
            for j, sub in enumerate(c.caches):
                layer(sub, f"{path}.{j}")
        else:
            walk(c.state, path, _filled(c))

    for li, c in enumerate(cache):
        layer(c, str(li))
    return out


_same_array = backend.same_array


def _diff(a, b):
    """What differs between two arrays, for a failure message."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return f"{a.dtype}{a.shape} vs {b.dtype}{b.shape}"
    ne = mx.not_equal(a, b)
    first = np.argwhere(np.array(ne))[0].tolist()
    delta = mx.max(mx.abs(a.astype(mx.float32) - b.astype(mx.float32))).item()
    return f"{mx.sum(ne).item()} of {a.size} values differ, first at {first}, max |diff| {delta}"


def assert_same_state(original, restored):
    """Bit-identical state, seen through mlx-lm's `state` and through kvstore's cache_to_tensors."""
    a, b = flat_state(original), flat_state(restored)
    assert [p for p, _ in a] == [p for p, _ in b]
    for (path, x), (_, y) in zip(a, b):
        if isinstance(x, mx.array) or isinstance(y, mx.array):
            assert isinstance(x, mx.array) and isinstance(y, mx.array), f"state {path}: {x!r} vs {y!r}"
            assert _same_array(x, y), f"state {path}: {_diff(x, y)}"
        else:
            assert x == y, f"state {path}: {x!r} vs {y!r}"
    ta, ma = kvmlx.cache_to_tensors(original)
    tb, mb = kvmlx.cache_to_tensors(restored)
    assert ma == mb
    assert sorted(ta) == sorted(tb)
    for k in ta:
        assert _same_array(ta[k], tb[k]), f"cache_to_tensors {k}: {_diff(ta[k], tb[k])}"


def model_store(path, model, **kw):
    """A store of model's state (its fingerprint), min_tokens=1, no fsync;
    the layout and codec of CI's passes (kvhelpers.make_store)."""
    if kw.get("settings") is None:
        kw.setdefault("min_tokens", 1)
        kw.setdefault("layout", os.environ.get("KVSTORE_TEST_LAYOUT", "chain"))
    if kw.get("key") is None:
        kw.setdefault("kv_codec", os.environ.get("KVSTORE_TEST_KV_CODEC", "raw"))
    return kvstore.KVStore(path, durable=False, model_identity=kvmlx.model_fingerprint(model), **kw)


def round_trip(store, arch, ids, cache, model):
    """save_prompt_cache then load_prompt_cache without the canary: the state exactly as stored."""
    text = b"arch " + arch.encode() + b" " + bytes(ids)
    entry = kvmlx.save_prompt_cache(store, text, ids, cache, model)
    assert entry is not None and entry.tokens == len(ids)
    got = kvmlx.load_prompt_cache(store, text, model, check=False)
    assert got is not None
    restored, tokens, text_bytes = got
    assert text_bytes == text
    assert tokens.tolist() == list(ids)
    return restored


# ---- tests -----------------------------------------------------------------

@pytest.mark.parametrize("module", model_modules())
def test_every_model_module_is_listed(module):
    assert (module in ARCHITECTURES) != (module in LEFT_OUT), \
        f"mlx_lm.models.{module}: add it to ARCHITECTURES (with a tiny config) or to LEFT_OUT"


def test_tables_name_only_model_modules():
    modules = set(model_modules())
    assert set(ARCHITECTURES) <= modules and set(LEFT_OUT) <= modules
    assert {cat for cat, _ in ARCHITECTURES.values()} <= {
        "dense", "moe", "sliding", "hybrid_ssm", "linear_attention", "mla", "other"}
    for arch, (_, config) in ARCHITECTURES.items():
        assert config["model_type"] == arch


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_state_round_trips_bit_exact(arch, tmp_path):
    model, _ = build(arch)
    ids = token_ids(arch)
    cache = mlc.make_prompt_cache(model)
    logits = prefill(model, cache, ids)
    store = model_store(tmp_path / "kv", model)
    try:
        restored = round_trip(store, arch, ids, cache, model)
    finally:
        store.close()
    assert_same_state(cache, restored)
    x = mx.argmax(logits[:, -1:, :], axis=-1)
    # The decode check below has teeth only if the logits depend on the cache.
    blank = model(x, cache=mlc.make_prompt_cache(model))
    for step in range(DECODE):
        logits = model(x, cache=cache)
        other = model(x, cache=restored)
        mx.eval(logits, other)
        if step == 0:
            assert not mx.array_equal(logits, blank).item(), "decode logits do not depend on the cache"
        assert _same_array(logits, other), f"decode step {step} logits: {_diff(logits, other)}"
        x = mx.argmax(logits[:, -1:, :], axis=-1)


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_canary_passes_the_models_own_state_and_fails_another_models(arch, tmp_path):
    """The canary (kvstore.mlx.canary) on every architecture: a state restored
    into the model that made it passes; the same file restored into a model of
    the same architecture and config with other weights fails.  It applies
    wherever the cache has floating positional rows (attention K/V, MLA
    latents), by the tail where the cache can be trimmed, else by the head."""
    model, _ = build(arch)
    other, _ = build(arch, seed=1)
    ids = token_ids(arch)
    cache = mlc.make_prompt_cache(model)
    prefill(model, cache, ids)
    tensors, _, positional = kvmlx.codecs.cache_state(cache)
    has_rows = any(mx.issubdtype(tensors[k].dtype, mx.floating) for k in positional)
    with model_store(tmp_path / "kv", model) as store:
        round_trip(store, arch, ids, cache, model)
        text = b"arch " + arch.encode() + b" " + bytes(ids)
        own = canary.check(model, kvmlx.load_prompt_cache(store, text, model, check=False)[0], ids)
        theirs = canary.check(other, kvmlx.load_prompt_cache(store, text, model, check=False)[0], ids)
    assert own.applies == theirs.applies == has_rows, (own, theirs)
    if not has_rows:
        return
    expect = "tail" if mlc.can_trim_prompt_cache(cache) else "head"
    assert own.kind == theirs.kind == expect, (own, theirs)
    # float32 weights: rounding stays far below the tolerance, other weights far above.
    tol = canary.TOLERANCE["float32"]
    assert own.ok and own.distance <= tol / 10, own
    assert not theirs.ok and theirs.distance > 100 * tol, theirs


@pytest.mark.parametrize("arch", ["llama", "mixtral", "deepseek_v3", "jamba", "qwen3_next"])
def test_a_checkpoint_rewritten_with_another_models_state_is_caught_by_the_canary(arch, tmp_path):
    """A file rewritten by someone with write access: the right name, model tag
    and manifest, valid CRCs, the tensors another model's (same architecture,
    other weights).  Every check of the bytes passes; the canary does not: the
    load is a miss, the file is quarantined and the directory counts it.  A
    dense, an MoE, an MLA, a hybrid (SSM beside attention: the head canary)
    and a linear-attention hybrid model."""
    model, _ = build(arch)
    other, _ = build(arch, seed=1)
    ids = token_ids(arch)
    text = b"arch " + arch.encode() + b" " + bytes(ids)
    theirs = mlc.make_prompt_cache(other)
    prefill(other, theirs, ids)
    ours = mlc.make_prompt_cache(model)
    prefill(model, ours, ids)
    d = tmp_path / "kv"
    with model_store(d, model) as store:
        # The forger opens the directory as this model's store and saves the other model's state.
        assert kvmlx.save_prompt_cache(store, text, ids, theirs, model) is not None
    with model_store(d, model) as store:
        assert all(files.verify_file(str(d / n)) is None for n in os.listdir(d) if n.endswith(".kv"))
        assert kvmlx.load_prompt_cache(store, text + b"|", model) is None
        assert store.counters()["canary_failures"] == 1 and store.counters()["canary_checks"] == 1
        assert store.entries() == []
        assert len(os.listdir(d / ".quarantine")) >= 1
        # The honest state passes, and loads.
        assert kvmlx.save_prompt_cache(store, text, ids, ours, model) is not None
        got = kvmlx.load_prompt_cache(store, text + b"|", model)
        assert got is not None and store.counters()["canary_checks"] == 2
        assert store.counters()["canary_failures"] == 1


def test_comparison_notices_one_changed_value(tmp_path):
    """assert_same_state is not blind: one value changed in a KV buffer or a recurrent state fails it."""
    model, _ = build("qwen3_next")
    ids = token_ids("qwen3_next")
    cache = mlc.make_prompt_cache(model)
    prefill(model, cache, ids)
    with model_store(tmp_path / "kv", model) as store:
        restored = round_trip(store, "qwen3_next", ids, cache, model)
    assert_same_state(cache, restored)
    kv = next(i for i, c in enumerate(restored) if type(c) is mlc.KVCache)
    arrays = next(i for i, c in enumerate(restored) if type(c) is mlc.ArraysCache)

    def bump(a):
        hot = mx.arange(a.size).reshape(a.shape) == a.size // 2
        return mx.where(hot, a * (1 + 2.0 ** -20), a)

    for layer, get, put in [
        (kv, lambda c: c.keys, lambda c, a: setattr(c, "keys", a)),
        (arrays, lambda c: c.cache[1], lambda c, a: c.cache.__setitem__(1, a)),
    ]:
        c = restored[layer]
        good = get(c)
        put(c, bump(good))
        with pytest.raises(AssertionError):
            assert_same_state(cache, restored)
        put(c, good)
    assert_same_state(cache, restored)


# ---- chained checkpoints (storage v2) ----------------------------------------
#
# A chained store (layout="chain") cuts a save into blocks of B tokens.  Slots
# that hold one row per token along axis 2 (KVCache, QuantizedKVCache, MLA
# latents, a filled ConcatenateKVCache) are positional: each block keeps its
# slice.  Every other slot (a RotatingKVCache window, a ChunkedKVCache chunk,
# ArraysCache recurrent state) is a snapshot, kept only by the last block of a
# save, so with snapshots only that block is restorable.

B = 8                       # block_tokens of the chain tests
CHAIN_IDS = 5 * B + 3       # five whole blocks and a 3-token tail
CHAIN_DECODE = 3            # greedy steps after the restore at the last boundary
TEXT_WIDTH = 6              # bytes each token renders to


def chain_text(ids):
    """(text, offsets): token i renders to TEXT_WIDTH bytes; offsets are the len(ids) + 1 byte offsets."""
    text = b"".join(b"%06d" % t for t in ids)
    offsets = [TEXT_WIDTH * i for i in range(len(ids) + 1)]
    assert len(text) == offsets[-1]
    return text, offsets


def chain_store(path, model):
    return model_store(path, model, layout="chain", block_tokens=B)


def boundaries(n):
    """Every block boundary of a save of n tokens: B, 2B, ... and n."""
    return sorted({*range(B, n, B), n})


def all_positional(cache):
    """True when every tensor of the cache is positional (no snapshot slot)."""
    tensors, _, positional = kvmlx.codecs.cache_state(cache)
    return set(positional) == set(tensors)


def frozen_tensors(cache):
    """cache_to_tensors(cache) as evaluated copies that later in-place cache updates cannot reach."""
    tensors, meta = kvmlx.cache_to_tensors(cache)
    copies = {k: mx.array(v) for k, v in tensors.items()}
    mx.eval(copies)
    return copies, meta


def leaf_caches(cache):
    """[(path, cache object)] of every layer, CacheList children included."""
    out = []

    def walk(c, path):
        if isinstance(c, mlc.CacheList):
            for j, sub in enumerate(c.caches):
                walk(sub, f"{path}.{j}")
        else:
            out.append((path, c))
    for li, c in enumerate(cache):
        walk(c, str(li))
    return out


def slot_class(meta, name):
    """The cache class that tensor "{layer}.{i}" belongs to (a CacheList child's own class)."""
    li, i = (int(x) for x in name.split("."))
    lm = meta["layers"][li]
    while lm["class"] == "CacheList":
        for child in lm["meta_state"]["children"]:
            if i < child["n_state"]:
                lm = child
                break
            i -= child["n_state"]
    return lm["class"]


def without_offsets(meta):
    """The meta with every per-layer "offset" left out (CacheList children included)."""
    def strip(lm):
        lm = {k: v for k, v in lm.items() if k != "offset"}
        if lm["class"] == "CacheList":
            lm["meta_state"] = {"children": [strip(m) for m in lm["meta_state"]["children"]]}
        return lm
    return {**meta, "layers": [strip(lm) for lm in meta["layers"]]}


def assert_same_tensors(want, got, meta, what):
    assert sorted(want) == sorted(got), f"{what}: tensor names {sorted(want)} vs {sorted(got)}"
    for name in want:
        assert _same_array(want[name], got[name]), \
            f"{what}: {slot_class(meta, name)} slot {name}: {_diff(want[name], got[name])}"


def assert_offsets(cache, k, what):
    for path, c in leaf_caches(cache):
        if hasattr(c, "offset"):
            assert c.offset == k, f"{what}: layer {path} ({type(c).__name__}) offset {c.offset}, expected {k}"


def kv_files(path):
    """{name: (inode, mtime_ns, size)} of every .kv file in the store directory."""
    out = {}
    for p in path.iterdir():
        if p.suffix == ".kv":
            st = p.stat()
            out[p.name] = (st.st_ino, st.st_mtime_ns, st.st_size)
    return out


def load_at(store, text, offsets, ids, k, model):
    """load_prompt_cache for a prompt that continues after boundary k; asserts a k-token hit."""
    got = kvmlx.load_prompt_cache(store, text[:offsets[k]] + b"|", model, check=False)
    assert got is not None, f"boundary {k}: no hit"
    restored, tokens, text_bytes = got
    assert len(tokens) == k, f"boundary {k}: hit of {len(tokens)} tokens"
    assert tokens.tolist() == ids[:k]
    assert text_bytes == text[:offsets[k]]
    return restored


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_chain_restores_bit_exact_at_every_loadable_block(arch, tmp_path):
    """A save at every block boundary (as PromptCache does when snapshots are small):
    each boundary restores the state it was saved with, bit for bit, and decoding
    from the last one matches the live cache."""
    model, _ = build(arch)
    ids = token_ids(arch, CHAIN_IDS)
    n = len(ids)
    text, offsets = chain_text(ids)
    cache = mlc.make_prompt_cache(model)
    path = tmp_path / "kv"
    refs, logits, files_before, at = {}, None, {}, 0
    with chain_store(path, model) as store:
        for k in boundaries(n):
            logits = model(mx.array([ids[at:k]]), cache=cache)
            mx.eval(logits, cache_arrays(cache))
            at = k
            entry = kvmlx.save_prompt_cache(store, text[:offsets[k]], ids[:k], cache, model,
                                            text_offsets=offsets[:k + 1])
            assert entry is not None and entry.tokens == k and entry.restorable
            refs[k] = frozen_tensors(cache)
            # Blocks are written once: one new file per save, the older ones untouched.
            files = kv_files(path)
            assert len(files) == len(files_before) + 1, f"save at {k}: {len(files)} files"
            assert {f: files[f] for f in files_before} == files_before, f"save at {k} rewrote a block"
            files_before = files
        positional = all_positional(cache)

        entries = store.entries()
        assert len(entries) == len(boundaries(n)) == 6
        assert sorted(e.tokens for e in entries) == boundaries(n)
        # Every block was the end of a save, so every block is restorable
        # (whether or not the cache has snapshot slots).
        assert all(e.restorable for e in entries), (positional, [(e.tokens, e.restorable) for e in entries])

        restored = None
        for k in boundaries(n):
            restored = load_at(store, text, offsets, ids, k, model)
            want, want_meta = refs[k]
            got, got_meta = kvmlx.cache_to_tensors(restored)
            assert_same_tensors(want, got, want_meta, f"{arch} boundary {k}")
            assert without_offsets(got_meta) == without_offsets(want_meta), f"{arch} boundary {k}: meta"
            assert got_meta == want_meta, f"{arch} boundary {k}: meta offsets"
            assert_offsets(restored, k, f"{arch} boundary {k}")
        assert len(kv_files(path)) == 6

    # Decode from the restore at n and from the live cache: bit-identical logits.
    x = mx.argmax(logits[:, -1:, :], axis=-1)
    blank = model(x, cache=mlc.make_prompt_cache(model))
    for step in range(CHAIN_DECODE):
        live = model(x, cache=cache)
        other = model(x, cache=restored)
        mx.eval(live, other)
        if step == 0:
            assert not mx.array_equal(live, blank).item(), "decode logits do not depend on the cache"
        assert _same_array(live, other), f"{arch} decode step {step} logits: {_diff(live, other)}"
        x = mx.argmax(live[:, -1:, :], axis=-1)


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_chain_from_one_save_restores_every_block_of_positional_models(arch, tmp_path):
    """One save of n tokens (prefilled in chunks that do not fall on blocks): with
    only positional slots every block boundary restores the first k tokens of the
    state; with snapshot slots only the save's last block is restorable."""
    model, _ = build(arch)
    ids = token_ids(arch, CHAIN_IDS)
    n = len(ids)
    text, offsets = chain_text(ids)
    cache = mlc.make_prompt_cache(model)
    prefill(model, cache, ids, chunks=(2 * B + 5, n - 2 * B - 5))
    tensors, meta, positional = kvmlx.codecs.cache_state(cache)
    snapshots = sorted(set(tensors) - set(positional))
    path = tmp_path / "kv"
    with chain_store(path, model) as store:
        entry = kvmlx.save_prompt_cache(store, text, ids, cache, model, text_offsets=offsets)
        assert entry is not None and entry.tokens == n and entry.restorable
        entries = store.entries()
        assert len(kv_files(path)) == len(entries) == len(boundaries(n)) == 6
        assert sorted(e.tokens for e in entries) == boundaries(n)
        restorable = sorted(e.tokens for e in entries if e.restorable)
        if snapshots:
            assert restorable == [n], f"{arch}: snapshot slots {snapshots[:4]}"
            for k in boundaries(n)[:-1]:
                assert kvmlx.load_prompt_cache(store, text[:offsets[k]] + b"|", model, check=False) is None, \
                    f"{arch} boundary {k}: a block without the snapshots loaded"
            restored = load_at(store, text, offsets, ids, n, model)
            got, got_meta = kvmlx.cache_to_tensors(restored)
            assert_same_tensors(tensors, got, meta, f"{arch} boundary {n}")
            assert got_meta == meta
            assert_offsets(restored, n, f"{arch} boundary {n}")
            return
        assert restorable == boundaries(n)
        for k in boundaries(n):
            restored = load_at(store, text, offsets, ids, k, model)
            want = {name: chain.slice_along(a, positional[name], 0, k) for name, a in tensors.items()}
            got, got_meta = kvmlx.cache_to_tensors(restored)
            assert_same_tensors(want, got, meta, f"{arch} boundary {k}")
            assert without_offsets(got_meta) == without_offsets(meta), f"{arch} boundary {k}: meta"
            assert_offsets(restored, k, f"{arch} boundary {k}")
