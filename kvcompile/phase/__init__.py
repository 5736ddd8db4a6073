"""Phase programs (a forward shape captured as a CUDA graph) and the phase manager (prefill
and decode as two layouts of one arena). docs/phases.md describes both."""
from kvcompile.phase.layouts import (BUCKETS, Layout, activation_bytes, attention_scratch_bytes,
                                     bucket_for, plan_layouts, workspace_bytes)
from kvcompile.phase.manager import PhaseManager
from kvcompile.phase.programs import PhaseProgram

__all__ = ["BUCKETS", "Layout", "activation_bytes", "attention_scratch_bytes", "bucket_for",
           "plan_layouts", "workspace_bytes", "PhaseManager", "PhaseProgram"]
