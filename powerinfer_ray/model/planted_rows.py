"""The row generators of a planted model: each tensor's rows, a BLOCK_ROWS-row block at a time,
from the counter-based random integers and the layer plans (see ``planted`` for the design)."""
from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np
import torch

from . import gguf_keys as K
from .config import ModelConfig
from .planted_random import BLOCK_ROWS, VAR8, block_ints, row_norm, splitmix64, stream_key
from .planted_spec import PlantedSpec
from .planted_stats import ATTN_VAR, POS_VAR, LayerPlan
from .qtypes import row_bytes
from .quants import quantize

CHANNEL = 0  # the residual dim used as the constant bias channel
C_VALUE = 1.0  # its value in every embedding row (same scale as the other dims)
RANGE = 1  # with two token ranges: the range channel, +-C_VALUE by the token's range (``planted``)
RANGE_LOGIT = 20.0  # the output head's weight on it: a token's own range gains ~2 x 14 logits
SELF_SCORE = 10.0  # q_t . k_t / sqrt(hd): attention mostly attends to the token itself
LOGIT_STD = 2.5  # std of the output logits

Gen = Callable[[int, np.ndarray, torch.device], torch.Tensor]  # (layer, blocks, device) -> [nb*B, cols]


class RowGenerators:
    """Per-template block generators ``(layer, blocks, device) -> [len(blocks) * BLOCK_ROWS, cols]``
    float32 of a planted model; ``plan(l)`` gives the layer's statistics and scales."""

    def __init__(self, spec: PlantedSpec, config: ModelConfig, full_layers: int,
                 plan: Callable[[int], LayerPlan]) -> None:
        self.spec, self.config, self.full_layers, self.plan = spec, config, full_layers, plan
        self._sketch: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.two = spec.ranges == 2
        self.reserved = [CHANNEL, RANGE] if self.two else [CHANNEL]  # dims no layer reads or writes

    def _range_sign(self, blocks: np.ndarray, dev: torch.device) -> torch.Tensor:
        """[R] +1 for the rows (token ids) of the blocks in range A, -1 in range B."""
        rows = torch.as_tensor((blocks[:, None] * BLOCK_ROWS + np.arange(BLOCK_ROWS)).reshape(-1), device=dev)
        return torch.where(rows < self.config.n_vocab // 2, 1.0, -1.0)

    def table(self) -> dict[tuple, Gen]:
        """(template, bias) -> generator; templates absent here generate zeros (``zeros``)."""
        c = self.config
        g: dict[tuple, Gen] = {
            (K.TOKEN_EMBD, False): self._gen_embd,
            (K.ATTN_Q, False): self._gen_q, (K.ATTN_K, False): self._gen_k,
            (K.ATTN_V, False): self._gen_v, (K.ATTN_OUT, False): self._gen_o,
            (K.FFN_DOWN_T, False): self._gen_down, (K.FC1, False): self._gen_fc1,
            (K.FC2, False): self._gen_fc2, (K.OUTPUT, False): self._gen_output,
            (K.POS_EMBD, False): self._gen_pos,
            (K.OUTPUT_NORM, False): self._gen_output_norm,
        }
        if c.gated:
            g[(K.FFN_GATE, False)], g[(K.FFN_UP, False)] = self._gen_planted, self._gen_plain_up
        else:
            g[(K.FFN_UP, False)] = self._gen_planted
        ffn_norm = K.ATTN_NORM_2 if c.two_norms else (K.ATTN_NORM if c.parallel_attn else K.FFN_NORM)
        for tmpl in (K.ATTN_NORM, K.ATTN_NORM_2, K.FFN_NORM):
            g[(tmpl, False)] = self._gen_ffn_norm if tmpl == ffn_norm else ones
        return g

    def _ints(self, what: tuple, l: int, blocks: np.ndarray, cols: int, bits: int, dev: torch.device) -> torch.Tensor:
        return block_ints(self.spec.seed, what + (l,), blocks, cols, bits, dev)

    # embeddings and heads -----------------------------------------------------------------------
    def _gen_embd(self, l: int, blocks: np.ndarray, dev: torch.device) -> torch.Tensor:
        """token_embd rows: rest dims with rms exactly 1, the bias channel at C_VALUE."""
        x = self._ints((K.TOKEN_EMBD,), 0, blocks, self.config.n_embd, 8, dev)  # [R, D]
        x[:, self.reserved] = 0.0
        x.mul_((math.sqrt(self.config.n_embd - len(self.reserved)) / row_norm(x).clamp_min(1.0)).float()[:, None])
        x[:, CHANNEL] = C_VALUE
        if self.two:
            x[:, RANGE] = C_VALUE * self._range_sign(blocks, dev)
        return x

    def _gen_pos(self, l: int, blocks: np.ndarray, dev: torch.device) -> torch.Tensor:
        x = self._ints((K.POS_EMBD,), 0, blocks, self.config.n_embd, 8, dev)
        x[:, CHANNEL] = 0.0
        return x.mul_(math.sqrt(POS_VAR / VAR8))

    def _gen_output(self, l: int, blocks: np.ndarray, dev: torch.device) -> torch.Tensor:
        x = self._ints((K.OUTPUT,), 0, blocks, self.config.n_embd, 8, dev)
        x.mul_(LOGIT_STD / math.sqrt(self.config.n_embd * VAR8))
        if self.two:
            x[:, RANGE] = RANGE_LOGIT * self._range_sign(blocks, dev)
        return x

    def _gen_output_norm(self, l: int, blocks: np.ndarray, dev: torch.device) -> torch.Tensor:
        # tied heads reuse the embedding (rows of norm sqrt(D)): scale the logits down to LOGIT_STD
        w = LOGIT_STD / math.sqrt(self.config.n_embd) if self.config.tied_output else 1.0
        return torch.full((1, self.config.n_embd), w, device=dev)

    def _gen_ffn_norm(self, l: int, blocks: np.ndarray, dev: torch.device) -> torch.Tensor:
        """Norm feeding the FFN: 1, except the bias channel at r_ffn / C_VALUE (see module doc)."""
        w = torch.ones((1, self.config.n_embd), device=dev)
        w[0, self.reserved] = self.plan(l).r_ffn / C_VALUE
        return w

    # attention -----------------------------------------------------------------------------------
    def _k_scale(self) -> float:
        # k = Wk y with y of unit per-dim variance: var(k_i) = D s^2 VAR8 = SELF_SCORE / sqrt(hd),
        # so the self score q_t . k_t / sqrt(hd) ~ SELF_SCORE and attention mostly stays on the
        # token itself: the attention output's variance is predictable (~ that of v)
        c = self.config
        return math.sqrt(SELF_SCORE / math.sqrt(c.head_dim) / (c.n_embd * VAR8))

    def _gen_k(self, l: int, blocks: np.ndarray, dev: torch.device) -> torch.Tensor:
        x = self._ints((K.ATTN_K,), l, blocks, self.config.n_embd, 8, dev)
        x[:, self.reserved] = 0.0
        return x.mul_(self._k_scale())

    def _gen_q(self, l: int, blocks: np.ndarray, dev: torch.device) -> torch.Tensor:
        """q row of head h, dim t = k row of h's KV group, dim t, plus small integer noise."""
        c, D = self.config, self.config.n_embd
        if c.n_gqa == 1:  # q row i pairs with k row i: the same blocks
            k = self._ints((K.ATTN_K,), l, blocks, D, 8, dev)
        else:
            rows = (blocks[:, None] * BLOCK_ROWS + np.arange(BLOCK_ROWS)).reshape(-1)  # [R]
            rows = np.minimum(rows, c.n_head * c.head_dim - 1)
            krows = (rows // c.head_dim) // c.n_gqa * c.head_dim + rows % c.head_dim
            k = assemble(lambda b: self._ints((K.ATTN_K,), l, b, D, 8, dev),
                          (c.n_head_kv * c.head_dim, D), krows, torch.float32, dev)
        x = k.add_(self._ints((K.ATTN_Q,), l, blocks, D, 4, dev))
        x[:, self.reserved] = 0.0
        return x.mul_(self._k_scale())

    def _gen_v(self, l: int, blocks: np.ndarray, dev: torch.device) -> torch.Tensor:
        x = self._ints((K.ATTN_V,), l, blocks, self.config.n_embd, 8, dev)
        x[:, self.reserved] = 0.0
        return x.mul_(1.0 / math.sqrt(self.config.n_embd * VAR8))  # v components ~ unit variance

    def _gen_o(self, l: int, blocks: np.ndarray, dev: torch.device) -> torch.Tensor:
        c = self.config
        x = self._ints((K.ATTN_OUT,), l, blocks, c.n_head * c.head_dim, 8, dev)
        if blocks[0] == 0:  # blocks are sorted: only the first can hold them (dims 0 and 1)
            x[self.reserved] = 0.0  # attention never writes the reserved channels
        # attention output per dim: (H hd) unit-variance values * s^2 VAR8 = ATTN_VAR / L
        return x.mul_(math.sqrt(ATTN_VAR / self.full_layers / (c.n_head * c.head_dim * VAR8)))

    # FFN -------------------------------------------------------------------------------------------
    def _bucket(self, l: int, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The layer's CountSketch P [k, D]: (bucket [D] int64, sign [D] f32, bucket sizes [k])
        with balanced buckets over the rest dims; the bias channel's sign is 0. Cached."""
        if (l, dev) in self._sketch:
            return self._sketch[(l, dev)]
        D, k = self.config.n_embd, self.code_dim(l)
        keys = splitmix64(torch.tensor([stream_key(self.spec.seed, "sketch", l)]), 2 * D)[0]
        order = torch.from_numpy(np.argsort(keys[:D].numpy(), kind="stable"))  # [D]
        bucket = torch.empty(D, dtype=torch.int64)
        bucket[order] = torch.arange(D) % k
        sign = torch.where((keys[D:] & 1) == 1, 1.0, -1.0)
        bucket_rest = bucket.clone()
        bucket_rest[self.reserved] = k  # a bucket of their own, dropped
        sign[self.reserved] = 0.0
        sizes = torch.bincount(bucket_rest, minlength=k + 1)[:k].double()
        if len(self._sketch) > 8:
            self._sketch.clear()
        self._sketch[(l, dev)] = out = (bucket.to(dev), sign.to(dev), sizes.to(dev))
        return out

    def code_dim(self, l: int) -> int:
        """k: the predictor sees a k-dimensional sketch of the residual (fc1 = [P; -P; bias]; two
        ranges: and [range; -range])."""
        return (self.config.predictor_ranks[l] - (3 if self.two else 1)) // 2

    def _code(self, l: int, blocks: np.ndarray, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """u [R, k] (odd ints in [-15, 15]) and |u P| [R] float64 for the rows of the blocks."""
        u = self._ints(("code",), l, blocks, self.code_dim(l), 4, dev)  # [R, k]
        _, _, sizes = self._bucket(l, dev)
        norm = ((u.double() ** 2) * sizes[None, :]).sum(dim=1).sqrt()  # |u P|^2 = sum_i u_i^2 |P_i|^2
        return u, norm

    def _row_vals(self, values: np.ndarray, blocks: np.ndarray, dev: torch.device) -> torch.Tensor:
        """Per-row float64 values [n] -> [R] for the rows of the blocks (0 past the end)."""
        rows = (blocks[:, None] * BLOCK_ROWS + np.arange(BLOCK_ROWS)).reshape(-1)
        v = np.where(rows < len(values), values[np.minimum(rows, len(values) - 1)], 0.0)
        return torch.as_tensor(v, dtype=torch.float64, device=dev)

    def _gen_planted(self, l: int, blocks: np.ndarray, dev: torch.device) -> torch.Tensor:
        """Gate (ReGLU) / up (ReLU) rows: rho a_j + sqrt(1 - rho^2) e_j, and m_j |g_j| on dim c."""
        rho, D = self.spec.rho, self.config.n_embd
        u, u_norm = self._code(l, blocks, dev)
        bucket, sign, _ = self._bucket(l, dev)
        # a = u P in one gather from [u, -u, 0]: column d reads u[bucket_d] signed (channel: 0)
        signed = bucket + torch.where(sign < 0, u.shape[1], 0) + torch.where(sign == 0, 2 * u.shape[1] - bucket, 0)
        a = torch.index_select(torch.cat((u, -u, torch.zeros_like(u[:, :1])), dim=1), 1, signed)  # [R, D]
        e = self._ints(("planted",), l, blocks, D, 8, dev)
        e[:, self.reserved] = 0.0
        e_norm = row_norm(e)
        cos = (a * e).sum(dim=1, dtype=torch.float64) / (u_norm * e_norm)  # exact integer dot
        ca, ce = rho / u_norm, math.sqrt(1 - rho * rho) / e_norm  # [R] float64
        g = e.mul_(ce.float()[:, None]).add_(a.mul_(ca.float()[:, None]))  # [R, D]
        g_norm = (rho**2 + (1 - rho**2) + 2 * rho * math.sqrt(1 - rho**2) * cos).sqrt()
        plan = self.plan(l)
        m = self._row_vals(plan.m, blocks, dev)
        if self.two:  # the token's range picks m^A or m^B (module doc of ``planted``)
            m_b = self._row_vals(plan.m_b, blocks, dev)
            m, g[:, RANGE] = (m + m_b) / 2, ((m - m_b) / 2 * g_norm).float()
        g[:, CHANNEL] = (m * g_norm).float()
        return g

    def _gen_plain_up(self, l: int, blocks: np.ndarray, dev: torch.device) -> torch.Tensor:
        """ReGLU's up rows: random, unit expected norm, blind to the bias channel."""
        x = self._ints((K.FFN_UP,), l, blocks, self.config.n_embd, 8, dev)
        x[:, self.reserved] = 0.0
        return x.mul_(1.0 / math.sqrt((self.config.n_embd - 1) * VAR8))

    def _gen_down(self, l: int, blocks: np.ndarray, dev: torch.device) -> torch.Tensor:
        """ffn_down_t rows [F, D]; for plain ReLU each block's mean output sum_j E[h_j] d_j is
        projected out (exact: E[h_j] on a 2^-20 grid times small ints sums exactly in fp64)."""
        plan, D = self.plan(l), self.config.n_embd
        d = self._ints((K.FFN_DOWN_T,), l, blocks, D, 8, dev)
        d[:, self.reserved] = 0.0
        if self.config.gated:
            return d.mul_(plan.down_scale)
        e = self._row_vals(plan.relu_mean, blocks, dev).view(len(blocks), BLOCK_ROWS)  # [nb, B]
        d64 = d.double().view(len(blocks), BLOCK_ROWS, D)
        v = torch.einsum("nb,nbd->nd", e, d64)  # [nb, D] block mean direction (exact)
        coef = e / (e * e).sum(dim=1, keepdim=True).clamp_min(1e-300)  # [nb, B]
        d64 = d64 - coef[:, :, None] * v[:, None, :]
        return (d64 * plan.down_scale).float().view(-1, D)

    # predictor ---------------------------------------------------------------------------------
    def _gen_fc1(self, l: int, blocks: np.ndarray, dev: torch.device) -> torch.Tensor:
        """fc1 [r, D] = [P; -P; bias row; 0]: the bias row reads the channel scaled to r_ffn
        (minus the mean for LayerNorm models, whose norm subtracts it too)."""
        c, k, D = self.config, self.code_dim(l), self.config.n_embd
        r = c.predictor_ranks[l]
        bucket, sign, _ = self._bucket(l, dev)
        fc1 = torch.zeros((r, D), device=dev)
        fc1[bucket, torch.arange(D, device=dev)] = sign  # P (the channel's sign is 0)
        fc1[k: 2 * k] = -fc1[:k]
        bias = torch.full((D,), -1.0 / D if c.norm == "layer" else 0.0, device=dev)
        bias[CHANNEL] += 1.0
        fc1[2 * k] = bias * (self.plan(l).r_ffn / C_VALUE)
        if self.two:  # relu(x_r) - relu(-x_r) = x_r, the range channel (RMS norms only: no mean to subtract)
            fc1[2 * k + 1, RANGE], fc1[2 * k + 2, RANGE] = self.plan(l).r_ffn / C_VALUE, -self.plan(l).r_ffn / C_VALUE
        idx = torch.as_tensor((blocks[:, None] * BLOCK_ROWS + np.arange(BLOCK_ROWS)).reshape(-1), device=dev)
        return fc1[idx.clamp_max(r - 1)]  # rows past r are trimmed by the caller

    def _gen_fc2(self, l: int, blocks: np.ndarray, dev: torch.device) -> torch.Tensor:
        """fc2 [F, r]: rho u_j / |u_j P| on the +P half, its negative on the -P half, and
        rho Phi^-1(q_j) on the bias row: logit_j = rho (a_j . x_rest + Phi^-1(q_j) r_ffn)."""
        rho, k, r = self.spec.rho, self.code_dim(l), self.config.predictor_ranks[l]
        u, u_norm = self._code(l, blocks, dev)
        w = u * (rho / u_norm).float()[:, None]  # [R, k]
        out = torch.zeros((u.shape[0], r), device=dev)
        out[:, :k], out[:, k: 2 * k] = w, -w
        mq = self._row_vals(self.plan(l).mq, blocks, dev)
        if self.two:
            mq_b = self._row_vals(self.plan(l).mq_b, blocks, dev)
            mq, half = (mq + mq_b) / 2, (rho * (mq - mq_b) / 2).float()
            out[:, 2 * k + 1], out[:, 2 * k + 2] = half, -half
        out[:, 2 * k] = (rho * mq).float()
        return out



def zeros(l: int, blocks: np.ndarray, dev: torch.device) -> torch.Tensor:
    """Biases (OPT's linear layers, LayerNorm's beta): all zero, so only the bias channel shifts."""
    return torch.zeros((len(blocks) * BLOCK_ROWS, 1), device=dev).expand(-1, 1 << 20)


def ones(l: int, blocks: np.ndarray, dev: torch.device) -> torch.Tensor:
    """Norm weights that do not feed an FFN: all one."""
    return torch.ones((1, 1), device=dev).expand(1, 1 << 20)


def row_ids(rows: Any) -> np.ndarray:
    if isinstance(rows, torch.Tensor):
        rows = rows.cpu().numpy()
    return np.asarray(rows, dtype=np.int64).reshape(-1)


def assemble(gen: Callable[[np.ndarray], torch.Tensor], shape: tuple[int, ...], rows: Any,
             dtype: torch.dtype, dev: torch.device, qtype: str | None = None) -> torch.Tensor:
    """Rows of a [n, cols] tensor from its block generator: only the blocks holding the rows are
    generated, a few at a time (about 16 M elements per call). With ``qtype`` (q8_0 | q4_0) the
    generated floats are quantized per 32-weight block and the rows come as their blocks
    [len(rows), cols / 32 * block_bytes] uint8."""
    n, cols = shape
    want = np.arange(n) if rows is None else row_ids(rows)
    if want.size and (want.min() < 0 or want.max() >= n):
        raise IndexError(f"rows out of range 0..{n - 1}: min {want.min()}, max {want.max()}")
    blocks = np.unique(want // BLOCK_ROWS)
    per_call = max(1, (1 << (26 if dev.type == "cuda" else 22)) // (BLOCK_ROWS * cols))
    width, dtype = (row_bytes(qtype, cols), torch.uint8) if qtype else (cols, dtype)
    out = torch.empty((len(want), width), dtype=dtype, device=dev)
    for s in range(0, len(blocks), per_call):
        chunk = blocks[s: s + per_call]
        vals = gen(chunk)[:, :cols]  # [len(chunk) * B, cols]
        vals = quantize(vals, qtype) if qtype else vals
        lo, hi = chunk[0] * BLOCK_ROWS, min(n, (chunk[-1] + 1) * BLOCK_ROWS)
        if rows is None:  # whole tensor: the chunk is a contiguous slice
            out[lo:hi].copy_(vals[: hi - lo])
            continue
        sel = np.nonzero((want >= lo) & (want < hi))[0]
        pos = np.searchsorted(chunk, want[sel] // BLOCK_ROWS) * BLOCK_ROWS + want[sel] % BLOCK_ROWS
        out[torch.as_tensor(sel, device=dev)] = vals[torch.as_tensor(pos, device=dev)].to(dtype)
    return out

