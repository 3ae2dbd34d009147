"""Compiles the Triton kernels for an H100/H200 (sm_90) on a machine without a GPU: a script that
test_triton_compile.py runs in its own process. A stand-in driver names the target and every
launch compiles only (JITFunction.run with warmup=True), through the kernels' own wrappers and
their default tiles, from CPU tensors of the runtime's shapes and types. Prints the compiled
kernels' names, one a line. What the kernels compute is the interpreter's and the GPU's tests'."""
from __future__ import annotations

import math

import torch
from triton.backends.compiler import GPUTarget
from triton.runtime import driver
from triton.runtime.jit import JITFunction


class CompileOnlyDriver:
    """What JITFunction.run asks the active driver before a launch, for sm_90."""

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")

    def is_active(self) -> bool:
        return True


def main() -> None:
    driver.set_active(CompileOnlyDriver())
    compiled: set[str] = set()
    run = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):  # noqa: ANN001, ANN202
        compiled.add(self.fn.__name__)
        if "FENCE" in kwargs:  # the fused FFN's GPU-scope fence, which its wrapper sets for CUDA tensors
            kwargs["FENCE"] = True
        return run(self, *args, grid=grid, warmup=True, **kwargs)

    JITFunction.run = compile_only

    from powerinfer_ray.kernels import triton_ffn, triton_split, triton_signal
    from powerinfer_ray.kernels.triton_attention import decode_attention_triton, rope_cache_triton
    from powerinfer_ray.kernels.triton_linear import linear_triton
    from powerinfer_ray.kernels.triton_predictor import predictor_hidden
    from powerinfer_ray.kernels.triton_qgemv import qgemv_triton
    from powerinfer_ray.kernels.quant import REPACKED, repack
    from powerinfer_ray.kernels.triton_norm import add_rms_norm_triton, rms_norm_triton
    from gguf import GGMLQuantizationType as GQ
    from gguf.quants import quantize

    D, N, K = 256, 512, 64
    f16 = torch.float16
    idx = torch.arange(K, dtype=torch.int32)
    nact = torch.tensor([K // 2], dtype=torch.int32)
    rows = {None: torch.randn(N, D).to(f16)}
    rows.update({q: torch.from_numpy(quantize(torch.randn(N, D).numpy(), t)) for q, t in (("q4_0", GQ.Q4_0), ("q8_0", GQ.Q8_0))})
    for qtype, w in rows.items():
        for T in (1, 8, triton_ffn.MAX_T + 3):
            x = torch.randn(T, D).to(f16)
            bits = torch.zeros(K, dtype=torch.int32)
            triton_ffn.sparse_ffn_triton(x, w, w, w, idx, bits, "reglu", None, None, nact, qtype=qtype)
            triton_ffn.sparse_ffn_triton(x, w, None, w, idx, bits, "swiglu", None, None, nact, qtype=qtype,
                                         act_threshold=0.1, act_on="gate", gate_pre=torch.randn(T, N))
        # T == 1 on rows in host memory (zero-copy): float rows' tiles are the GPU's, quantized ones' fused
        triton_ffn.sparse_ffn_triton(torch.randn(1, D).to(f16), w, w, w, idx, None, "reglu", None, None, nact,
                                     qtype=qtype, host=True)
        for T in (1, 5):
            if qtype is not None:
                linear_triton(torch.randn(T, D), w, qtype, torch.randn(N))
                if qtype in REPACKED:
                    qgemv_triton(torch.randn(T, D).to(f16), repack(w, qtype), REPACKED[qtype], torch.randn(N))
                    qgemv_triton(torch.randn(T, D), repack(w, qtype), REPACKED[qtype])
    H, G, hd, S, L = 8, 2, 64, 4, 128
    q = torch.randn(3, H, hd).to(f16)
    kc, vc = torch.randn(S, G, L, hd).to(f16), torch.randn(S, G, L, hd).to(f16)
    slots, pos = torch.tensor([2, 0, 3]), torch.tensor([5, 17, 0])
    decode_attention_triton(q, kc, vc, slots, pos, 1.0 / math.sqrt(hd))
    qkv = torch.randn(3, (H + 2 * G) * hd).to(f16)
    cos, sin = torch.randn(3, hd // 2), torch.randn(3, hd // 2)
    for style in ("norm", "neox", None):
        rope_cache_triton(qkv, cos if style else None, sin if style else None, style, hd, kc, vc, slots, pos, H, G)
    h = torch.randn(3, D)
    rms_norm_triton(h, torch.rand(D), 1e-5, f16)
    add_rms_norm_triton(h, [torch.randn(3, D).to(f16), torch.randn(3, D)], torch.randn(D), torch.rand(D), 1e-5, f16)
    for T in (1, 9):
        logits = torch.randn(T, N).to(f16)
        gpu = torch.rand(N) < 0.3
        ng = int(gpu.sum())
        triton_split.split_pack(logits, 0.0, gpu, None, ng, N - ng, activity=torch.zeros(N, dtype=torch.int64),
                                stats=torch.zeros(2, dtype=torch.int64))
        triton_split.split_pack(logits.float(), 0.4, torch.ones(N, dtype=torch.bool), None, N, 0, silu=True)
        triton_split.pack_bits(logits, 0.1, 100, 300, torch.rand(300) < 0.4)
    seq, stamp = torch.zeros(1, dtype=torch.int64), torch.zeros(2, dtype=torch.int64)
    triton_signal.post_request(seq, torch.zeros(6, dtype=torch.int64), torch.ones(6, dtype=torch.int64), stamp)
    triton_signal.await_answer(seq, torch.zeros(1, dtype=torch.int64), stamp)
    triton_signal.stamp(stamp)
    predictor_hidden(torch.randn(1, D), torch.randn(N, D).to(f16), f16)
    triton_signal.store_rows(torch.randn(3, D).to(f16), torch.empty(3, D, dtype=f16))
    print("\n".join(sorted(compiled)))


if __name__ == "__main__":
    main()
