"""Child process of kernel_oracle.run_interpreted: runs Triton kernels under the interpreter.

usage: TRITON_INTERPRET=1 python tests/interp_worker.py JOBS.pt RESULTS.pt
Each job is {"kind": "kv_write" | "decode" | "prefill" | "publish_rows" | ROW_KERNELS,
"args": {...},
"opts": {...}};
decode / prefill write into an fp32 `out` so the parent sees the kernel's own error.
"""
from __future__ import annotations

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"  # before triton decorates any kernel

import torch  # noqa: E402


def _row_kernel(module: str, name: str):
    def load():
        import importlib
        return getattr(importlib.import_module(f"kvcompile.ops.{module}.triton_kernel"), name)
    return load


# the row ops' launchers (tests/test_kernels_rows.py, test_kernels_gemv.py), imported once
# the flag is set
ROW_KERNELS = {"rms_norm": _row_kernel("rms_norm", "rms_norm_triton"),
               "rope_rotate": _row_kernel("rope_rotate", "rope_rotate_triton"),
               "silu_mul": _row_kernel("silu_mul", "silu_mul_triton"),
               "gemv": _row_kernel("gemv", "gemv_triton"),
               "qlinear": _row_kernel("qlinear", "qlinear_triton"),
               "qembedding": _row_kernel("qlinear", "dequant_rows_triton"),
               "qlinear_dense": _row_kernel("qlinear", "qlinear_dense")}


def _clone_rows(pool: torch.Tensor) -> torch.Tensor:
    """A copy of a pool with its strides (clone() would make spaced pages contiguous)."""
    out = torch.empty_strided(pool.shape, pool.stride(), dtype=pool.dtype)
    out.copy_(pool)
    return out


def run(job: dict) -> dict:
    from kvcompile.ops.kv_write.triton_kernel import kv_write_triton
    from kvcompile.ops import kv_format as F
    from kvcompile.ops.span_attention.decode_blocks import launcher_for
    from kvcompile.ops.span_attention.prefill_kernel import span_attention_prefill

    a, opts = job["args"], job.get("opts", {})
    if job["kind"] in ROW_KERNELS:
        return {"out": ROW_KERNELS[job["kind"]]()(**a)}
    if job["kind"] == "publish_rows":
        from kvcompile.kv.row_publish_kernel import launch
        hosts = [h.clone() for h in a["hosts"]]
        launch(a["pools"], hosts, a["maps"], a["table"], a["positions"], a["page_size"],
               opts["block"])
        return {"hosts": hosts}
    if job["kind"] == "kv_write" and "kv_pool" in a:      # pools as views of page pairs
        from kvcompile.kv.kv_pages import PagePair
        kv = a["kv_pool"].clone()
        kp, vp = PagePair(a["k_pool"].shape[1], a["v_pool"].shape[1]).views(kv)
        kv_write_triton(kp, vp, a["k_new"], a["v_new"], a["slots"], a["k_type"], a["v_type"],
                        a["page_size"], a.get("page_table"))
        return {"kv_pool": kv}
    if job["kind"] == "kv_write":
        kp, vp = _clone_rows(a["k_pool"]), _clone_rows(a["v_pool"])
        kv_write_triton(kp, vp, a["k_new"], a["v_new"], a["slots"], a["k_type"], a["v_type"],
                        a["page_size"], a.get("page_table"))
        return {"k_pool": kp, "v_pool": vp}
    if job["kind"] == "decode":
        opts = dict(opts)
        n_kv = F.n_kv_heads_of(a["k_pool"], F.kv_type(a["k_type"]), a["page_size"],
                               a["q"].shape[2])
        fn = launcher_for(a["q"], n_kv, a["k_type"], a["v_type"], opts.pop("impl", None))
    else:
        fn = span_attention_prefill
    out = torch.empty(a["q"].shape, dtype=torch.float32)
    fn(a["q"], a["k_pool"], a["v_pool"], a["page_table"], a["q_pos"], a["k_type"],
       a["v_type"], a["page_size"], a["scale"], out=out, **opts)
    return {"out": out}


def main(inp: str, outp: str) -> None:
    jobs = torch.load(inp)
    torch.save([run(j) for j in jobs], outp)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
