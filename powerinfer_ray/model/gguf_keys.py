"""Every GGUF metadata key and tensor name the project reads or writes, in one place.

Names follow llama.cpp / upstream PowerInfer so that files are exchangeable: FFN neuron j is
row j of ``ffn_up``, ``ffn_gate`` and ``ffn_down_t`` (the down projection stored transposed),
the predictor of layer N is ``blk.N.fc1`` [r, n_embd] -> ReLU -> ``blk.N.fc2`` [n_ff, r].

Shapes below are numpy shapes (rows, cols) as ``gguf.GGUFReader`` returns them; GGML's ``ne``
lists the same dimensions in reverse order.
"""
from __future__ import annotations

# --- file magic -------------------------------------------------------------------------------
GGUF_MAGIC = b"GGUF"
PWRI_MAGIC = b"PWRI"  # upstream PowerInfer stamps sparse models with this (gguf_init_empty_sparse)

# --- general ----------------------------------------------------------------------------------
ARCH = "general.architecture"
NAME = "general.name"
FILE_TYPE = "general.file_type"
ALIGNMENT = "general.alignment"

# --- per-architecture hyper-parameters ("{arch}." prefix) ---------------------------------------
CONTEXT_LENGTH = "{arch}.context_length"
EMBEDDING_LENGTH = "{arch}.embedding_length"
BLOCK_COUNT = "{arch}.block_count"
FEED_FORWARD_LENGTH = "{arch}.feed_forward_length"
HEAD_COUNT = "{arch}.attention.head_count"
HEAD_COUNT_KV = "{arch}.attention.head_count_kv"
LAYERNORM_EPS = "{arch}.attention.layer_norm_epsilon"
LAYERNORM_RMS_EPS = "{arch}.attention.layer_norm_rms_epsilon"
ROPE_DIMENSION_COUNT = "{arch}.rope.dimension_count"
ROPE_FREQ_BASE = "{arch}.rope.freq_base"
VOCAB_SIZE = "{arch}.vocab_size"

# --- our own keys (upstream has no way to say these) ------------------------------------------
FFN_ACT = "powerinfer_ray.ffn_act"  # relu | reglu | drelu | swiglu
PARALLEL_ATTN = "powerinfer_ray.parallel_attn"  # falcon: attention and FFN read the same input
FALCON_NEW_ARCH = "powerinfer_ray.falcon_new_decoder_architecture"  # separate ln_attn / ln_mlp
POS_OFFSET = "powerinfer_ray.position_offset"  # OPT's learned positions start at index 2
PLANTED_SPEC = "powerinfer_ray.planted_spec"  # a planted model written to a file: its spec (bench/planted_file.py)
# SwiGLU activation sparsity (``powerinfer-ray sparsify``): in layer l, FFN neuron j is active iff
# its criterion exceeds FFN_THRESHOLDS[l]; the criterion is |SiLU(gate_j)| (FFN_THRESHOLD_ON "gate")
# or |h_j| = |SiLU(gate_j) * up_j| ("h"). Inactive neurons contribute nothing (h_j := 0).
FFN_THRESHOLDS = "powerinfer_ray.ffn_thresholds"  # float32 array [n_layer]
FFN_THRESHOLD_ON = "powerinfer_ray.ffn_threshold_on"  # gate | h
FFN_TARGET_SPARSITY = "powerinfer_ray.ffn_target_sparsity"  # float32 [n_layer]: what was asked
FFN_CALIBRATION_SPARSITY = "powerinfer_ray.ffn_calibration_sparsity"  # float32 [n_layer]: measured
FFN_CALIBRATION_TOKENS = "powerinfer_ray.ffn_calibration_tokens"  # uint32
# which model the thresholds were calibrated on: per layer, the sums of the first
# FINGERPRINT_ROWS rows of ffn_gate (float32 [n_layer * FINGERPRINT_ROWS]; survives dtype changes)
FFN_THRESHOLD_FINGERPRINT = "powerinfer_ray.ffn_thresholds_fingerprint"
FINGERPRINT_ROWS = 16

# how the model's training text was fed (offline.stream): the separator between documents (bos |
# eos | eos+bos | blank-line | none) and whether each training window started with BOS; absent:
# as the tokenizer adds BOS (HF's convention)
STREAM_DOC_SEP = "powerinfer_ray.stream.doc_sep"
STREAM_WINDOW_BOS = "powerinfer_ray.stream.window_bos"

# --- PowerInfer ---------------------------------------------------------------------------------
SPARSE_THRESHOLD = "powerinfer.sparse_threshold"

# --- tokenizer -----------------------------------------------------------------------------------
TOK_MODEL = "tokenizer.ggml.model"  # "llama" (SentencePiece-style) or "gpt2" (byte-level BPE)
TOK_TOKENS = "tokenizer.ggml.tokens"
TOK_SCORES = "tokenizer.ggml.scores"
TOK_TYPES = "tokenizer.ggml.token_type"
TOK_MERGES = "tokenizer.ggml.merges"
TOK_BOS = "tokenizer.ggml.bos_token_id"
TOK_EOS = "tokenizer.ggml.eos_token_id"
TOK_UNK = "tokenizer.ggml.unknown_token_id"
TOK_PAD = "tokenizer.ggml.padding_token_id"
TOK_ADD_BOS = "tokenizer.ggml.add_bos_token"
TOK_ADD_EOS = "tokenizer.ggml.add_eos_token"
TOK_HF_JSON = "tokenizer.huggingface.json"
TOK_PRE = "tokenizer.ggml.pre"  # llama.cpp pre-tokenizer name ("default": GPT-2's regex)
TOK_ADD_SPACE_PREFIX = "tokenizer.ggml.add_space_prefix"  # llama.cpp: prepend a space ("▁")
# our own: how an SPM-style HF tokenizer prepends "▁" (legacy | first | always | never) and whether
# it splits on it; upstream's keys cannot say these
TOK_SPM_PREPEND = "powerinfer_ray.tokenizer.prepend_scheme"
TOK_SPM_SPLIT = "powerinfer_ray.tokenizer.metaspace_split"
CHAT_TEMPLATE = "tokenizer.chat_template"

# --- split file (<model>.generated.gpuidx); the names live in placement.gpuidx ---------------

# --- tensors --------------------------------------------------------------------------------------
TOKEN_EMBD = "token_embd"  # [n_vocab, n_embd]
POS_EMBD = "position_embd"  # [n_ctx + offset, n_embd]  (opt)
OUTPUT_NORM = "output_norm"  # [n_embd]
OUTPUT = "output"  # [n_vocab, n_embd]; absent -> tied to token_embd

ATTN_NORM = "blk.{bid}.attn_norm"  # [n_embd]
ATTN_NORM_2 = "blk.{bid}.attn_norm_2"  # [n_embd] (falcon new architecture: ln_mlp)
ATTN_Q = "blk.{bid}.attn_q"  # [n_head * hd, n_embd]
ATTN_K = "blk.{bid}.attn_k"  # [n_head_kv * hd, n_embd]
ATTN_V = "blk.{bid}.attn_v"  # [n_head_kv * hd, n_embd]
ATTN_QKV = "blk.{bid}.attn_qkv"  # [(n_head + 2 n_head_kv) * hd, n_embd], read only (llama.cpp falcon)
ATTN_OUT = "blk.{bid}.attn_output"  # [n_embd, n_head * hd]
FFN_NORM = "blk.{bid}.ffn_norm"  # [n_embd]
FFN_UP = "blk.{bid}.ffn_up"  # [n_ff, n_embd]
FFN_GATE = "blk.{bid}.ffn_gate"  # [n_ff, n_embd]
FFN_DOWN = "blk.{bid}.ffn_down"  # [n_embd, n_ff], read only (standard llama.cpp layout)
FFN_DOWN_T = "blk.{bid}.ffn_down_t"  # [n_ff, n_embd]
FC1 = "blk.{bid}.fc1"  # [r, n_embd]
FC2 = "blk.{bid}.fc2"  # [n_ff, r]

BIAS = "{name}.bias"
WEIGHT = "{name}.weight"

# every per-layer tensor our writer may emit, in writing order
LAYER_TENSORS = (ATTN_NORM, ATTN_NORM_2, ATTN_Q, ATTN_K, ATTN_V, ATTN_OUT, FFN_NORM,
                 FFN_UP, FFN_GATE, FFN_DOWN_T, FC1, FC2)


def key(template: str, arch: str) -> str:
    """A per-architecture key, e.g. ``key(BLOCK_COUNT, "llama") == "llama.block_count"``."""
    return template.format(arch=arch)


def tensor(template: str, bid: int, bias: bool = False) -> str:
    """A per-layer tensor name, e.g. ``tensor(FFN_UP, 3) == "blk.3.ffn_up.weight"``."""
    name = template.format(bid=bid)
    return BIAS.format(name=name) if bias else WEIGHT.format(name=name)


def global_tensor(name: str, bias: bool = False) -> str:
    """A model-level tensor name, e.g. ``global_tensor(TOKEN_EMBD) == "token_embd.weight"``."""
    return BIAS.format(name=name) if bias else WEIGHT.format(name=name)
