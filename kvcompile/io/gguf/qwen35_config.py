"""GGUF metadata of a `qwen35` file -> ModelConfig (the qwen35 family's, models/families/).

Keys as llama.cpp reads them: `qwen35.block_count` counts the NextN/MTP layers too (they
are stored as the last blocks), `qwen35.ssm.*` give the Gated DeltaNet geometry (state_size
is the head dim of both keys and values, group_count the key heads, time_step_rank the
value heads), and attention uses NEOX rope over `rope.dimension_count` dims.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Mapping

from kvcompile.models.config import ModelConfig
from kvcompile.errors import ModelFileError, UnsupportedModelError
from kvcompile.io.gguf.config_fields import base_fields, int_field, require

ARCH = "qwen35"


def build_qwen35_config(md: Mapping, tensors: Mapping, path: str = "the model file") -> ModelConfig:
    p = f"{ARCH}."
    base = base_fields(ARCH, md, tensors, rope_neox=True, path=path)
    nextn = int(md.get(p + "nextn_predict_layers", 0))
    if nextn > 1:
        raise UnsupportedModelError(
            f"{path} has {nextn} NextN/MTP layers; kvcompile supports at most one (as "
            f"llama.cpp does): re-convert the model keeping a single MTP layer")
    n_layers = base["n_layers"] - nextn
    if n_layers <= 0:
        raise ModelFileError(f"{path}: block_count {base['n_layers']} leaves no main layers "
                             f"besides {nextn} NextN layers; the metadata is corrupt")
    ssm = {k: int_field(md, p + "ssm." + k, path)
           for k in ("conv_kernel", "state_size", "group_count", "time_step_rank", "inner_size")}
    if ssm["inner_size"] != ssm["state_size"] * ssm["time_step_rank"]:
        raise ModelFileError(
            f"{path}: ssm.inner_size {ssm['inner_size']} is not ssm.state_size "
            f"{ssm['state_size']} x ssm.time_step_rank {ssm['time_step_rank']}; re-convert it")
    if ssm["time_step_rank"] % ssm["group_count"]:
        raise ModelFileError(f"{path}: {ssm['time_step_rank']} GDN value heads cannot share "
                             f"{ssm['group_count']} key heads; the metadata is corrupt")
    sections = list(require(md, p + "rope.dimension_sections", path))
    rotary = base["rope_dim"] or base["head_dim"]
    if sum(sections[:3]) * 2 != rotary or any(sections[3:]):
        # text positions are equal in the first three M-RoPE sections; a 4th section (or
        # sections not covering the rotated dims) would need vision-style positions
        raise UnsupportedModelError(
            f"{path}: rope sections {sections} with {rotary} rotated dims are not text-only "
            f"NEOX rope; only models whose first three sections cover the rotary dims are "
            f"supported")
    return replace(
        ModelConfig(**base), n_layers=n_layers, nextn_layers=nextn,
        full_attention_interval=int(md.get(p + "full_attention_interval", 4)),
        ssm_conv_kernel=ssm["conv_kernel"], ssm_k_heads=ssm["group_count"],
        ssm_v_heads=ssm["time_step_rank"], ssm_head_dim=ssm["state_size"])
