"""What the primary executor allocates on its GPU beyond its weights and KV cache, at the engine's
largest batch and prompt chunk. The placement reserves it (``config._budget_plan`` hands it to the
solver as ``ModelCosts.workspace_bytes``), so the VRAM budget holds at every batch size the engine
admits; a GPU test measures torch's peak allocation against the budget.

Upper bounds from the shapes the runtime allocates (their owners in parentheses):
  fixed    cuBLAS workspaces of the streams that multiply (the steps', the decode graphs' capture
           and warm-up streams), the rotary table, per-layer index, bias and counter vectors
           (weights.py, activity.py, cold.py), the streamed rows' two buffers (cold.RowStream)
  decode   per batch bucket: the decode step's buffers and the tensors of the graphs' memory pool
           (graphs.StepSegments)
  prefill  the activations of the largest eager step, a prompt chunk (eager.EagerStep): residual
           and partial outputs, the attention's projections and mask, the predictor's logits and
           masks, the FFN matrix products' temporaries (kernels.torch_ffn.sparse_ffn_gemm's row
           chunks), the logits of its sequences

Dimension legend: N tokens of the chunk, B sequences, D hidden, F n_ff, V vocab, S n_ctx, r the
widest predictor.
"""
from __future__ import annotations

from ..model.config import ModelConfig
from .cold import STREAM_BYTES
from .graphs import buckets

CUBLAS_BYTES = 32 << 20  # the cuBLAS workspace torch allocates per stream that multiplies (Hopper)
CUBLAS_STREAMS = 3
GEMM_CHUNK_BYTES = 16 << 20  # sparse_ffn_gemm's temporaries per row chunk (its chunk_bytes)
LAYER_VECTOR_BYTES = 40  # per neuron and layer: masks, row indices (int32, int64), bias, counters (int64)


def workspace_bytes(cfg: ModelConfig, max_batch: int, prefill_chunk: int, n_ctx: int, act_bytes: int = 2) -> int:
    """Bytes the primary allocates beside weights and KV cache (see the module docstring), for up to
    ``max_batch`` sequences, prompt chunks of ``prefill_chunk`` tokens, ``n_ctx`` positions and
    activations of ``act_bytes`` (the compute dtype's)."""
    return (fixed_bytes(cfg, n_ctx) + decode_bytes(cfg, max_batch)
            + prefill_bytes(cfg, max(prefill_chunk, max_batch), max_batch, n_ctx, act_bytes))


def fixed_bytes(cfg: ModelConfig, n_ctx: int) -> int:
    D, F = cfg.n_embd, cfg.n_ff
    streamed = min(2 * STREAM_BYTES, 2 * F * cfg.neuron_bytes)  # RowStream: at most a layer's rows a buffer
    return CUBLAS_STREAMS * CUBLAS_BYTES + n_ctx * cfg.rot_dims * 4 + cfg.n_layer * F * LAYER_VECTOR_BYTES + streamed \
        + 4 * D * 4


def decode_bytes(cfg: ModelConfig, max_batch: int) -> int:
    """Every bucket's step: [B, D] fp32 residual, norms, projections, partial outputs and answers;
    [B, F] predictor logits and splits; [B, V] logits (the head's and fp32); per layer split ids."""
    D, F, V = cfg.n_embd, cfg.n_ff, cfg.n_vocab
    return sum(B * (12 * D + 4 * F + 2 * V) * 4 + 16 * F for B in buckets(max_batch))


def prefill_bytes(cfg: ModelConfig, n_tok: int, n_seq: int, n_ctx: int, act_bytes: int) -> int:
    """An eager step of n_tok tokens of n_seq sequences."""
    D, F, V, S = cfg.n_embd, cfg.n_ff, cfg.n_vocab, n_ctx
    r = max(cfg.predictor_ranks or (0,))
    per_token = (6 * D * 4  # fp32 residual, its next value, the streamed rows' sums, the CPU's answer
                 + 10 * D * act_bytes  # norms, q / k / v, rotated q / k, attention output, partial outputs
                 + S * 5  # the attention mask of a sequence's tokens and its float bias
                 + F * (4 + 2) + r * (4 + act_bytes)  # predictor logits (fp32 from quantized predictors),
                 # active mask, the CPU's part; its hidden units (fp32, and cast for the next GEMM)
                 + 2 * F)  # the FFN products' keep masks (the GPU's rows, a streamed chunk's)
    return n_tok * per_token + 3 * GEMM_CHUNK_BYTES + n_seq * V * 8
